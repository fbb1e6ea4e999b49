"""Standard torch.optim behaviour: param groups, schedulers, unused parameters, low-precision weights."""

from __future__ import annotations

import pytest
import torch
from conftest import regression_data, small_mlp, train

import asteria

RUNTIMES = [asteria.RuntimeConfig(mode="sync"), asteria.RuntimeConfig(staleness=1, workers=1)]


@pytest.mark.parametrize("runtime", RUNTIMES, ids=["sync", "async"])
def test_param_groups_use_their_own_hyperparameters(runtime):
    model = small_mlp()
    frozen_like = [model[0].weight, model[0].bias]
    groups = [{"params": frozen_like, "lr": 0.0}, {"params": [model[2].weight, model[2].bias], "lr": 0.05}]
    before = [p.detach().clone() for p in model.parameters()]
    with asteria.Shampoo(groups, precondition_frequency=2, runtime=runtime) as opt:
        train(model, opt, 6)
    after = list(model.parameters())
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])  # lr 0: untouched
    assert not torch.equal(after[2], before[2])


@pytest.mark.parametrize("runtime", RUNTIMES, ids=["sync", "async"])
def test_lr_scheduler_drives_the_step_size(runtime):
    model = small_mlp()
    with asteria.Shampoo(model.parameters(), lr=0.05, precondition_frequency=2, runtime=runtime) as opt:
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 3 else 0.0)
        x, y = regression_data()
        for step in range(6):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[:32]), y[:32]).backward()
            if step == 3:
                frozen = [p.detach().clone() for p in model.parameters()]
            opt.step()
            scheduler.step()
        assert all(torch.equal(a, b) for a, b in zip(frozen, model.parameters(), strict=True))


@pytest.mark.parametrize("optimizer", [asteria.Shampoo, asteria.SOAP, asteria.KLShampoo])
def test_step_with_a_closure_returns_its_loss_and_steps_as_without_one(optimizer):
    """torch.optim's closure protocol: step(closure) evaluates the closure with autograd on (even under
    no_grad), returns its loss, and takes the same step as a backward pass outside the call."""
    x, y = regression_data()
    runs = []
    for with_closure in (False, True):
        torch.manual_seed(0)
        model = small_mlp()
        losses = []
        with optimizer(model.parameters(), lr=0.01, precondition_frequency=2,
                       runtime=asteria.RuntimeConfig(mode="sync")) as opt:
            for _ in range(5):
                def closure() -> torch.Tensor:
                    opt.zero_grad()
                    loss = torch.nn.functional.mse_loss(model(x[:32]), y[:32])
                    loss.backward()
                    return loss
                if with_closure:
                    with torch.no_grad():
                        losses.append(opt.step(closure))
                else:
                    losses.append(closure())
                    assert opt.step() is None
        runs.append(([loss.detach().item() for loss in losses], [p.detach().clone() for p in model.parameters()]))
    (plain_losses, plain_params), (closure_losses, closure_params) = runs
    assert closure_losses == plain_losses and plain_losses[-1] < plain_losses[0]
    assert all(torch.equal(a, b) for a, b in zip(plain_params, closure_params, strict=True))


@pytest.mark.parametrize("runtime", RUNTIMES, ids=["sync", "async"])
def test_parameters_without_gradient_are_left_alone(runtime):
    model = small_mlp()
    unused = torch.nn.Parameter(torch.randn(6, 5))
    params = list(model.parameters()) + [unused]
    before = unused.detach().clone()
    with asteria.Shampoo(params, lr=0.02, precondition_frequency=2, weight_decay=0.1, runtime=runtime) as opt:
        losses = train(model, opt, 8)
        stats = opt.runtime_stats()
    assert torch.equal(unused, before)  # no gradient: no decay, no update
    assert losses[-1] < losses[0]
    assert stats["nonfinite_grad_skips"] == 0


def test_bfloat16_parameters_train_with_float32_state():
    model = small_mlp().to(torch.bfloat16)
    x, y = (t.to(torch.bfloat16) for t in regression_data())
    with asteria.Shampoo(model.parameters(), lr=0.02, precondition_frequency=2,
                         runtime=asteria.RuntimeConfig(staleness=1, workers=1)) as opt:
        losses = train(model, opt, 20, data=(x, y))
        assert all(t.dtype in (torch.float32, torch.bool, torch.int32, torch.int64)
                   for g in opt._groups for t in g.state.values())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert losses[-1] < losses[0]


def test_memory_report_counts_state_per_tier_and_kind():
    model = small_mlp()
    with asteria.Shampoo(model.parameters(), max_preconditioner_dim=16,
                         runtime=asteria.RuntimeConfig(staleness=2, workers=1)) as opt:
        report = opt.memory_report()
        deterministic = opt.runtime.deterministic
    # (16, 8) and (4, 16) weights keep two factors each; the biases none (precondition_1d=False: Adam's step).
    factor_floats = 16 * 16 + 8 * 8 + 4 * 4 + 16 * 16
    assert report["device"]["factor"] == 4 * factor_floats
    # CPU parameters: the roots in use live in host memory, the tier that host_budget and the NVMe tier govern.
    assert report["host"]["root"] == 4 * factor_floats and "root" not in report["device"]
    assert report["placement"] == "device" and report["nvme"] == {"total": 0}
    # One version in flight per set (the newest-finished rule, the default here): a packed snapshot (the lower
    # triangle) and a result per block.
    assert not deterministic
    packed = sum(n * (n + 1) // 2 for n in (16, 8, 4, 16))
    assert report["host"]["refresh_buffers"] == 4 * (packed + factor_floats)


def test_import_asteria_needs_torch_and_numpy_alone():
    """The library itself imports none of the command's extras (the train extra: transformers, tqdm,
    matplotlib, TensorBoard) beyond what torch imports itself (torch.hub imports tqdm where it is installed)."""
    import subprocess
    import sys

    code = ("import sys, torch; before = set(sys.modules); import asteria; "
            "extras = ('transformers', 'tqdm', 'matplotlib', 'tensorboard'); "
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in extras))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
