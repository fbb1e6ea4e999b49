"""Bad input and failures: clear errors naming the argument, nothing lost."""

from __future__ import annotations

import pytest
import torch
from conftest import small_mlp, train

import asteria


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, "Invalid lr=-1.0"),
        ({"betas": (0.9, 1.0)}, r"Invalid betas\[1\]=1.0"),
        ({"betas": (0.9,)}, r"Invalid betas=\(0.9,\)"),
        ({"eps": 0.0}, "Invalid eps=0.0"),
        ({"weight_decay": float("nan")}, "Invalid weight_decay=nan"),
        ({"max_preconditioner_dim": 0}, "Invalid max_preconditioner_dim=0"),
        ({"precondition_frequency": 2.5}, "Invalid precondition_frequency=2.5"),
        ({"start_preconditioning_step": 0}, "Invalid start_preconditioning_step=0"),
        ({"grafting": "sgd"}, "Invalid grafting='sgd'"),
        ({"grafting_eps": -1e-8}, "Invalid grafting_eps=-1e-08"),
        ({"runtime": "async"}, "Invalid runtime='async'"),
    ],
)
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        asteria.Shampoo(small_mlp().parameters(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "fast"}, "Invalid mode='fast'"),
        ({"staleness": -1}, "Invalid staleness=-1"),
        ({"staleness": 10**6}, r"Invalid staleness=1000000: must be an int in \[0, 1000\]"),
        ({"workers": 0}, "Invalid workers=0"),
        ({"timeout_s": 0}, "Invalid timeout_s=0"),
        ({"max_consecutive_failures": 0}, "Invalid max_consecutive_failures=0"),
        ({"nonfinite_grad_policy": "ignore"}, "Invalid nonfinite_grad_policy='ignore'"),
        ({"memory": {}}, "Invalid memory={}"),
    ],
)
def test_invalid_runtime_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        asteria.RuntimeConfig(**kwargs)


def test_budget_too_small_lists_the_bytes():
    with pytest.raises(ValueError, match=r"Invalid host_budget=10: too small .* host needs \d+ bytes"):
        asteria.Shampoo(small_mlp().parameters(),
                        runtime=asteria.RuntimeConfig(memory=asteria.MemoryConfig(host_budget=10)))


def make(mode: str, **runtime):
    model = small_mlp()
    named = list(model.named_parameters())
    opt = asteria.Shampoo(named, lr=0.01, eps=1e-6, precondition_frequency=2, max_preconditioner_dim=16,
                          runtime=asteria.RuntimeConfig(mode=mode, staleness=0, workers=1, **runtime))
    return model, opt


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_nan_gradient_does_not_poison_state(mode):
    model, opt = make(mode)
    with opt:
        train(model, opt, 6)
        roots_before = [t.clone() for g in opt._groups for k, t in g.state.items() if k.startswith("root")]
        params_before = [p.detach().clone() for p in model.parameters()]
        # One step whose gradient of the first weight holds a NaN.
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        model[0].weight.grad[0, 0] = float("nan")
        opt.step()
        assert torch.equal(model[0].weight, params_before[0])  # the poisoned block was skipped
        assert not torch.equal(model[2].weight, params_before[2])  # the others stepped
        assert opt.runtime_stats()["nonfinite_grad_skips"] == 1
        train(model, opt, 6)
        for group in opt._groups:
            for tensor in group.state.values():
                if tensor.is_floating_point():
                    assert torch.isfinite(tensor).all()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert len(roots_before) > 0


def test_nonfinite_gradient_policy_raise_names_the_parameter():
    model, opt = make("sync", nonfinite_grad_policy="raise")
    with opt:
        train(model, opt, 2)
        before = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        model[2].bias.grad[1] = float("inf")
        with pytest.raises(asteria.NonFiniteGradientError, match="'2.bias'"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failing_refresh_keeps_last_good_root_then_raises_naming_the_parameter(mode):
    model, opt = make(mode, max_consecutive_failures=2)
    with opt:
        train(model, opt, 4)  # refreshes at steps 2 and 4 succeed
        group = next(g for g in opt._groups if g.shape == (16, 8))
        good = group.state["root_0"].clone()
        # A factor turned non-finite (e.g. a bit flip): its refreshes fail from now on.
        group.state["factor_0"][0, 0, 0] = float("nan")
        train(model, opt, 2)  # refresh at step 6 fails: the last good root stays in use
        assert torch.equal(group.state["root_0"], good)
        stats = opt.runtime_stats()
        assert stats["refresh_failures"] >= 1
        # The failed block, named as RefreshError would name it, and why (no RefreshError yet: one failure).
        assert list(stats["refresh_errors"]) == ["block 0 of param group 0, blocks (16, 8), mode 0"]
        assert "non-finite" in stats["refresh_errors"]["block 0 of param group 0, blocks (16, 8), mode 0"]
        assert all(torch.isfinite(p).all() for p in model.parameters())
        with pytest.raises(asteria.RefreshError, match=r"parameter '0.weight'.*non-finite") as info:
            train(model, opt, 2)  # second failure in a row
        assert info.value.param == "0.weight"


@pytest.mark.parametrize("mode, staleness, workers",
                         [("sync", 0, 1), ("async", 0, 1), ("async", 2, 1), ("async", 2, 3)])
def test_state_dict_round_trip_resumes_training(mode, staleness, workers):
    def make(mode):
        model = small_mlp()
        runtime = asteria.RuntimeConfig(mode=mode, staleness=staleness, workers=workers, deterministic=True)
        return model, asteria.Shampoo(model.parameters(), lr=0.01, eps=1e-6, precondition_frequency=2,
                                      max_preconditioner_dim=16, runtime=runtime)

    model, opt = make(mode)
    with opt:
        train(model, opt, 5)
        saved = opt.state_dict()
        params = [p.detach().clone() for p in model.parameters()]
        continued = train(model, opt, 4)
    model2, opt2 = make(mode)
    with opt2:
        with torch.no_grad():
            for p, q in zip(model2.parameters(), params, strict=True):
                p.copy_(q)
        opt2.load_state_dict(saved)
        resumed = train(model2, opt2, 4)
        assert opt2.runtime_stats()["step"] == 9
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters(), strict=True))
    assert resumed == continued  # bit for bit, refreshes in flight included


def test_load_state_dict_rejects_a_different_model():
    _, opt = make("sync")
    other = asteria.Shampoo(small_mlp(sizes=(8, 12, 4)).parameters(), runtime=asteria.RuntimeConfig(mode="sync"))
    with opt, other:
        with pytest.raises(ValueError, match="Invalid state_dict: its blocks"):
            other.load_state_dict(opt.state_dict())
        with pytest.raises(ValueError, match="Invalid state_dict='dict'"):
            other.load_state_dict({"state": {}})
