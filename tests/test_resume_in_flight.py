"""Single-process resume with refreshes genuinely in flight (issue 8, item 1): the refresh job of the
scheduled version is held running by an injected delay while ``state_dict()`` is taken, and the resumed
run (which recomputes it from the saved snapshot) continues bit for bit, for all three optimizers.
Plain resume in sync and async mode is pinned by each optimizer's reference test (``resume_is_exact``)."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import regression_data, small_mlp, train

import asteria
from asteria import testing

SIZES = (8, 8, 8)


def make(name: str):
    model = small_mlp(sizes=SIZES)
    runtime = asteria.RuntimeConfig(mode="async", staleness=2, workers=2, deterministic=True, stagger=False)
    common = dict(lr=0.01, precondition_frequency=2, runtime=runtime)
    if name == "shampoo":
        return model, asteria.Shampoo(list(model.named_parameters()), eps=1e-6, **common)
    if name == "soap":
        return model, asteria.SOAP(list(model.named_parameters()), **common)
    return model, asteria.KLShampoo(list(model.named_parameters()), **common)


def running(opt) -> list[dict]:
    """Engine blocks whose newest snapshot's job has not ended."""
    return [s for s in testing.block_status(opt, "0.weight") if s["newest_finished"] < s["newest_snapshot"]]


@pytest.mark.parametrize("name", ["shampoo", "soap", "kl"])
def test_resume_with_a_refresh_running_is_bit_for_bit(name):
    data = regression_data(sizes=SIZES)
    model, opt = make(name)
    with opt:
        train(model, opt, 5, data=data)
        # The next refresh's jobs are held running for a while: the checkpoint below sees them in flight.
        step = next(s for s in range(6, 20) if opt.is_refresh_step(s))
        testing.inject_fault(opt, "0.weight", "delay", version=opt.refresh_version(step), seconds=0.5)
        train(model, opt, step - 5, data=data)
        assert running(opt), "the refresh should still be running at the checkpoint"
        saved = opt.state_dict()
        assert saved["refresher"]["scheduled"], "a scheduled version travels in the checkpoint"
        params = [p.detach().clone() for p in model.parameters()]
        continued = train(model, opt, 9, data=data)
        reference = [p.detach().clone() for p in model.parameters()]

    model2, opt2 = make(name)
    with opt2:
        with torch.no_grad():
            for p, q in zip(model2.parameters(), params, strict=True):
                p.copy_(q)
        opt2.load_state_dict(saved)
        resumed = train(model2, opt2, 9, data=data)
        assert opt2.runtime_stats()["refresh_failures"] == 0
    assert resumed == continued
    assert all(torch.equal(a, b) for a, b in zip(reference, model2.parameters(), strict=True))


@pytest.mark.parametrize("name", ["shampoo", "soap", "kl"])
def test_resume_from_a_resumed_run_is_bit_for_bit(name):
    """Checkpoint, resume, checkpoint the resumed run mid-interval, resume again: same bits as one run."""
    data = regression_data(sizes=SIZES)
    model, opt = make(name)
    with opt:
        train(model, opt, 16, data=data)
        reference = [p.detach().clone() for p in model.parameters()]
    current, state = None, None
    for start, stop in ((0, 5), (5, 11), (11, 16)):
        model2, opt2 = make(name)
        with opt2:
            if state is not None:
                with torch.no_grad():
                    for p, q in zip(model2.parameters(), current, strict=True):
                        p.copy_(q)
                opt2.load_state_dict(state)
            # train() picks batches by its own step counter: replay the same batches as the single run.
            x, y = data
            for step in range(start, stop):
                idx = slice((step * 32) % x.shape[0], (step * 32) % x.shape[0] + 32)
                opt2.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model2(x[idx]), y[idx]).backward()
                opt2.step()
            state = opt2.state_dict()
            current = [p.detach().clone() for p in model2.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(reference, current, strict=True))


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_resumed_run_counts_staleness_from_the_versions_in_use(deterministic):
    """The resumed engine starts each block at the version it uses (``RefreshEngine.resume_at``): its
    staleness statistics stay within S from the first step on, and a block's first activation after
    the resume is no special case (before, every block counted from version 0 until its next one)."""
    data = regression_data(sizes=SIZES)
    runtime = asteria.RuntimeConfig(mode="async", staleness=2, workers=2, deterministic=deterministic)
    model = small_mlp(sizes=SIZES)
    with asteria.SOAP(list(model.named_parameters()), lr=0.01, precondition_frequency=2, runtime=runtime) as opt:
        train(model, opt, 30, data=data)
        saved = opt.state_dict()
        params = [p.detach().clone() for p in model.parameters()]
    assert min(v for versions in saved["versions"] for v in versions) > 3
    model2 = small_mlp(sizes=SIZES)
    with torch.no_grad():
        for p, q in zip(model2.parameters(), params, strict=True):
            p.copy_(q)
    with asteria.SOAP(list(model2.named_parameters()), lr=0.01, precondition_frequency=2, runtime=runtime) as opt2:
        opt2.load_state_dict(saved)
        seen = []
        train(model2, opt2, 6, data=data, hook=lambda step, o: seen.append(o.runtime_stats()["max_staleness_seen"]))
        status = testing.block_status(opt2, "0.weight")
    assert max(seen) <= 2, seen
    assert all(s["active_version"] >= min(saved["versions"][0]) for s in status)


def test_a_block_already_using_a_pending_version_resumes_with_the_versions_after_it():
    """Under deterministic=False with in_flight=2, a set's blocks may split at a checkpoint: one already uses
    version v (its job finished) while another's job of v still runs, and v + 1 is pending too. The resumed
    engine starts each block at the first pending version after the one it uses; starting the first block after
    the newest snapshot, as it did, retired v + 1 there, and the load was refused."""
    data = regression_data(sizes=SIZES)
    runtime = asteria.RuntimeConfig(mode="async", staleness=5, workers=2, deterministic=False, in_flight=2,
                                    stagger=False)

    def make_soap(model):
        return asteria.SOAP(list(model.named_parameters()), lr=0.01, precondition_frequency=2, runtime=runtime)

    model = small_mlp(sizes=SIZES)
    with make_soap(model) as opt:
        train(model, opt, 5, data=data)
        step = next(s for s in range(6, 20) if opt.is_refresh_step(s))
        version = opt.refresh_version(step)
        # 0.weight's first factor holds its job of `version` (and one worker); 2.weight's, in the same set, not.
        testing.inject_fault(opt, "0.weight", "pause", version=version, mode=0)
        train(model, opt, step - 5, data=data)
        engine = opt._refresher.engine
        engine.wait_paused(1, 30.0)
        deadline = time.monotonic() + 30.0
        while not all(s["newest_finished"] >= version for s in testing.block_status(opt, "2.weight")):
            assert time.monotonic() < deadline, "2.weight's refresh did not finish"
            time.sleep(0.01)
        train(model, opt, 2, data=data)  # 2.weight takes `version`; the next refresh step snapshots version + 1
        saved = opt.state_dict()
        params = [p.detach().clone() for p in model.parameters()]
        engine.release_pauses()
    pending = sorted(entry["version"] for entry in saved["refresher"]["scheduled"])
    assert version in pending and version + 1 in pending, pending
    assert any(v == version for versions in saved["versions"] for v in versions), f"no block uses version {version}"
    model2 = small_mlp(sizes=SIZES)
    with torch.no_grad():
        for p, q in zip(model2.parameters(), params, strict=True):
            p.copy_(q)
    with make_soap(model2) as opt2:
        opt2.load_state_dict(saved)
        train(model2, opt2, 8, data=data)
        assert opt2.runtime_stats()["refresh_failures"] == 0
        assert all(s["active_version"] > version for s in testing.block_status(opt2, "0.weight"))
