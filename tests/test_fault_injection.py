"""Faults injected into the real refresh jobs of Shampoo, SOAP and KL-Shampoo in async mode (issue 8,
item 3): each gives a clear error and loses nothing. Bad arguments across the public API are in
tests/test_api_validation.py; the gradient policies' basic cases in tests/test_failures.py."""

from __future__ import annotations

import gc
import re
import time

import pytest
import torch
from conftest import small_mlp, train, worker_threads

import asteria
from asteria import testing

NAMES = ["shampoo", "soap", "kl"]
PARAM = "0.weight"  # (16, 8): two factors, one engine block per mode


def make(name: str, **runtime):
    model = small_mlp()
    # Unstaggered: every set refreshes on the same steps, so one version number names a step's refresh.
    config = asteria.RuntimeConfig(mode=runtime.pop("mode", "async"), staleness=runtime.pop("staleness", 0),
                                   stagger=runtime.pop("stagger", False),
                                   workers=1, **runtime)
    params = list(model.named_parameters())
    common = dict(lr=0.01, precondition_frequency=2, max_preconditioner_dim=16, runtime=config)
    if name == "shampoo":
        opt = asteria.Shampoo(params, eps=1e-6, **common)
    elif name == "soap":
        opt = asteria.SOAP(params, start_preconditioning_step=1, **common)  # a bootstrap, as KL-Shampoo's
    else:
        opt = asteria.KLShampoo(params, **common)
    return model, opt


def next_refreshes(opt, count: int = 2) -> list[int]:
    """The next `count` refresh steps after the current one."""
    step = opt.runtime_stats()["step"]
    steps = [s for s in range(step + 1, step + 100) if opt.is_refresh_step(s)]
    return steps[:count]


def preconditioners(opt, param: str) -> list[torch.Tensor]:
    """Copies of the preconditioners (roots or eigenbases) in use for the blocks of `param`."""
    return [fset.preconditioners[b].clone() for fset in opt._refresher.sets
            for b, name in enumerate(fset.block_params) if name == param]


def factors(opt) -> list[torch.Tensor]:
    return [fset.factors for fset in opt._refresher.sets]


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def all_state_finite(opt) -> bool:
    return all(torch.isfinite(t).all() for g in opt._groups for t in g.state.values() if t.is_floating_point())


def run_to(model, opt, step: int) -> None:
    """Trains until the optimizer has done `step` steps."""
    train(model, opt, step - opt.runtime_stats()["step"])


def run_past(model, opt, step: int) -> None:
    """Trains until the activation of `step` has run: at step `step` itself for Shampoo, at the start of
    the next step for SOAP and KL-Shampoo (ACTIVATION_LAG = 1: their step reads the bases of the step
    before)."""
    run_to(model, opt, step + opt.ACTIVATION_LAG)


@pytest.mark.parametrize("name", NAMES)
def test_worker_exception_keeps_last_good_then_raises_naming_block_param_and_cause(name):
    model, opt = make(name, max_consecutive_failures=2)
    with opt:
        train(model, opt, 4)
        first, second = next_refreshes(opt)
        for step in (first, second):
            blocks = testing.inject_fault(opt, PARAM, "throw", version=opt.refresh_version(step))
        good = preconditioners(opt, PARAM)
        run_past(model, opt, first)  # the first failing refresh: the last good preconditioners stay in use
        assert all(torch.equal(a, b) for a, b in zip(preconditioners(opt, PARAM), good, strict=True))
        stats = opt.runtime_stats()
        assert stats["refresh_failures"] == len(blocks) == 2
        for status in testing.block_status(opt, PARAM):  # counted per block
            assert status["consecutive_failures"] == 1 and status["total_failures"] == 1
            assert "injected worker exception" in status["last_error"]
        assert all(s["consecutive_failures"] == 0 for s in testing.block_status(opt, "2.weight"))
        run_past(model, opt, second - 1)
        before = params_of(model)
        with pytest.raises(asteria.RefreshError) as info:
            train(model, opt, 1)  # the second failure in a row reaches max_consecutive_failures=2
        assert info.value.param == PARAM
        assert info.value.version == opt.refresh_version(second)
        # (either mode's block: the one whose failure the activation met first, which the threads' timing decides)
        assert f"parameter '{PARAM}'" in str(info.value) and re.search(r"mode [01] ", str(info.value))
        assert "injected worker exception" in info.value.cause
        # the raising step changed none
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert all(torch.equal(a, b) for a, b in zip(preconditioners(opt, PARAM), good, strict=True))
        assert all_state_finite(opt)


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_refresh_result_is_rejected_by_the_quality_gate(name):
    model, opt = make(name)
    with opt:
        train(model, opt, 4)
        step = next_refreshes(opt, 1)[0]
        testing.inject_fault(opt, PARAM, "nonfinite", version=opt.refresh_version(step), mode=1)
        good = preconditioners(opt, PARAM)
        run_past(model, opt, step)
        assert opt.runtime_stats()["refresh_failures"] == 1
        statuses = testing.block_status(opt, PARAM)
        assert statuses[1]["total_failures"] == 1 and "not finite (quality gate)" in statuses[1]["last_error"]
        assert statuses[0]["total_failures"] == 0
        assert torch.equal(preconditioners(opt, PARAM)[1], good[1])  # mode 1 kept its last good version
        assert not torch.equal(preconditioners(opt, PARAM)[0], good[0])  # mode 0 moved on
        assert all_state_finite(opt) and all(torch.isfinite(p).all() for p in model.parameters())
        # The fault fired once: the next refresh of the block succeeds and is used.
        run_past(model, opt, next_refreshes(opt, 1)[0])
        assert testing.block_status(opt, PARAM)[1]["consecutive_failures"] == 0
        assert not torch.equal(preconditioners(opt, PARAM)[1], good[1])


@pytest.mark.parametrize("name", ["soap", "kl"])  # Shampoo: tests/test_failures.py
def test_nonfinite_factor_is_rejected_counted_and_corrupts_nothing(name):
    model, opt = make(name)
    with opt:
        train(model, opt, 4)
        good = preconditioners(opt, PARAM)
        group = next(g for g in opt._groups if g.shape == (16, 8))
        group.state["factor_0"][0, 3, 3] = float("inf")  # a factor turned non-finite (e.g. a bit flip)
        run_past(model, opt, next_refreshes(opt, 1)[0])
        status = testing.block_status(opt, PARAM)[0]
        assert status["total_failures"] == 1 and "non-finite" in status["last_error"]
        assert opt.runtime_stats()["refresh_failures"] == 1
        assert torch.equal(preconditioners(opt, PARAM)[0], good[0])
        basis = preconditioners(opt, PARAM)[0]
        assert torch.allclose(basis.mT @ basis, torch.eye(16), atol=1e-4)  # still an orthonormal basis
        assert all(torch.isfinite(p).all() for p in model.parameters())
        others = [t for g in opt._groups for k, t in g.state.items() if t.is_floating_point() and k != "factor_0"]
        assert all(torch.isfinite(t).all() for t in others)


def one_step_with_grads(model, opt, poison) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    poison(model)
    opt.step()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [float("nan"), float("-inf"), 1e20])
def test_bad_gradient_under_skip_never_reaches_the_factors(name, value):
    """1e20 is finite but its square overflows float32: it must be skipped like a NaN."""
    model, opt = make(name)
    with opt:
        train(model, opt, 3)
        before = params_of(model)
        group = next(g for g in opt._groups if g.shape == (16, 8))
        factors_before = [group.state["factor_0"].clone()]
        one_step_with_grads(model, opt, lambda m: m[0].weight.grad.__setitem__((2, 1), value))
        assert torch.equal(model[0].weight, before[0])  # the block was skipped
        assert not torch.equal(model[2].weight, before[2])  # the others stepped
        assert opt.runtime_stats()["nonfinite_grad_skips"] == 1
        assert torch.equal(group.state["factor_0"], factors_before[0])
        train(model, opt, 6)
        assert all(torch.isfinite(f).all() for f in factors(opt))
        assert all_state_finite(opt) and opt.runtime_stats()["refresh_failures"] == 0


@pytest.mark.parametrize("name", NAMES)
def test_bad_gradient_under_raise_names_the_parameter_and_changes_nothing(name):
    model, opt = make(name, nonfinite_grad_policy="raise")
    with opt:
        train(model, opt, 3)
        before, state = params_of(model), [t.clone() for g in opt._groups for t in g.state.values()]
        with pytest.raises(asteria.NonFiniteGradientError, match="'2.bias'") as info:
            one_step_with_grads(model, opt, lambda m: m[2].bias.grad.__setitem__(1, float("inf")))
        assert info.value.param == "2.bias"
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        now = [t for g in opt._groups for t in g.state.values()]
        assert all(torch.equal(a, b) for a, b in zip(state, now, strict=True))
        train(model, opt, 2)  # a good gradient afterwards trains on
        assert opt.runtime_stats()["step"] == 5


@pytest.mark.parametrize("name", NAMES)
def test_too_many_skipped_gradients_in_a_row_raise(name):
    model, opt = make(name, max_nonfinite_grad_steps=3)
    with opt:
        train(model, opt, 2)
        with pytest.raises(asteria.NonFiniteGradientError, match=r"'0.bias'.*max_nonfinite_grad_steps=3"):
            for _ in range(10):
                one_step_with_grads(model, opt, lambda m: m[0].bias.grad.fill_(float("nan")))
        assert 3 <= opt.runtime_stats()["nonfinite_grad_skips"] <= 5  # raised at the first refresh step past 3
        assert all(c == opt._step for g in opt._groups for c in g.steps.counts)  # the step that raised counts nothing
        with make(name)[1] as fresh:
            fresh.load_state_dict(opt.state_dict())  # its checkpoint stays consistent


@pytest.mark.parametrize("name", NAMES)
def test_hung_refresh_times_out_clearly_and_close_returns_promptly(name):
    model, opt = make(name, timeout_s=2.0)
    train(model, opt, 4)
    step = next_refreshes(opt, 1)[0]
    version = opt.refresh_version(step)
    testing.inject_fault(opt, PARAM, "hang", version=version, mode=0)
    run_past(model, opt, step - 1)
    before = params_of(model)
    with pytest.raises(TimeoutError, match=rf"mode 0 of parameter '{PARAM}' \(version {version}\) not done within "
                                           r"timeout_s=2.0: .* needs version \d+, still running after waiting"):
        train(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(c == opt._step for g in opt._groups for c in g.steps.counts)  # the step that raised counts nothing
    started = time.monotonic()
    opt.close()  # ends the hung job instead of waiting for it
    assert time.monotonic() - started < 5.0
    status = testing.block_status(opt, PARAM)[0]
    assert "injected hang ended by close()" in status["last_error"]


@pytest.mark.parametrize("name", NAMES)
def test_a_refresh_that_times_out_loses_nothing_and_training_goes_on(name):
    """A refresh that is not done in time raises TimeoutError without changing the parameters; once it
    finishes, the next steps use it. Shampoo's step reads the refresh it snapshots itself, so its step
    raises after its gradients reached the statistics: it counts as a step without a parameter update
    (as a reference run whose parameters are put back after that step shows). SOAP and KL-Shampoo wait
    for it at the start of the step after, before the statistics change: that step counts nothing."""
    def run(fault: bool):
        torch.manual_seed(0)
        model, opt = make(name, timeout_s=2.0)
        train(model, opt, 4)
        step = next_refreshes(opt, 1)[0]
        version = opt.refresh_version(step)
        engine = opt._refresher.engine
        blocks = testing.inject_fault(opt, PARAM, "pause", version=version, mode=0) if fault else []
        run_past(model, opt, step - 1)
        waits = step + opt.ACTIVATION_LAG  # the step that needs the paused version
        if fault:
            before = params_of(model)
            with pytest.raises(TimeoutError, match=rf"'{PARAM}' \(version {version}\) not done within timeout_s=2.0"):
                train(model, opt, 1)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            counted = opt.runtime_stats()["step"]
            assert counted == (waits if not opt.ACTIVATION_LAG else waits - 1)
            assert all(c == counted for g in opt._groups for c in g.steps.counts)
            engine.wait_paused(len(blocks), 30.0)  # the job started and waits (a latch): it was not lost
            engine.release_pauses()
        elif not opt.ACTIVATION_LAG:  # the reference of a step without a parameter update
            before = params_of(model)
            train(model, opt, 1)
            with torch.no_grad():
                for p, b in zip(model.parameters(), before, strict=True):
                    p.copy_(b)
        train(model, opt, 3)
        status = testing.block_status(opt, PARAM)
        assert [s["total_failures"] for s in status] == [0, 0]
        state = {k: v.clone() for g in opt._groups for k, v in g.state.items()}
        result = params_of(model), state, opt.runtime_stats()["step"], min(s["active_version"] for s in status)
        opt.close()
        return result, version

    (params, state, steps, newest), version = run(fault=True)
    (ref_params, ref_state, ref_steps, _), _ = run(fault=False)
    assert newest >= version  # the refresh that timed out came into use
    assert steps == ref_steps
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("budget", ["host_budget", "gpu_budget"])
def test_budget_too_small_fails_before_training_and_leaks_no_workers(name, budget):
    _, warm = make(name)  # torch and OpenBLAS start their own thread pools lazily
    warm.close()
    gc.collect()
    before = worker_threads()
    with pytest.raises(ValueError, match=rf"Invalid {budget}=64: too small for this model's state "
                                         r"\(placement 'device': device needs \d+ bytes, host needs \d+ bytes; "
                                         r"per kind: host \{.*\}, nvme "):
        make(name, memory=asteria.MemoryConfig(**{budget: 64}))
    gc.collect()
    assert worker_threads() == before
