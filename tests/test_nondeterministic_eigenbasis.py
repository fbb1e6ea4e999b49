"""SOAP and KL-Shampoo with deterministic=False: activation may pass over finished bases, and the state
kept in eigen-coordinates must then follow the composed column orders of the versions passed over."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import regression_data, small_mlp, train

import asteria
from asteria.testing import engine_blocks

SIZES = (8, 16, 4)


def make(cls, model, staleness=3, workers=1, sync_refreshes=1):
    """The optimizer under test; by default only the bootstrap is a sync version, so that version 2 follows
    the newest-finished rule (most tests here pause it). Versions may queue behind each other up to the bound
    (``in_flight``), which is what activation passing over a version needs. No express workers: the tests hold
    the workers with paused jobs, and express ones would refresh the small blocks beside them."""
    runtime = asteria.RuntimeConfig(mode="async", staleness=staleness, workers=workers, deterministic=False,
                                    stagger=False, sync_refreshes=sync_refreshes, timeout_s=60.0,
                                    in_flight=staleness + 1, device_refresh=False, express_workers=0)
    start = {"start_preconditioning_step": 1} if cls is asteria.SOAP else {}  # a bootstrap at step 1, as KL-Shampoo's
    return cls(model.parameters(), lr=0.01, precondition_frequency=2, runtime=runtime, **start)


def one_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def engine_blocks_of(cls, model) -> list:
    """The engine blocks the optimizer will have (one per factor block), from a throwaway instance."""
    with make(cls, model) as probe:
        return engine_blocks(probe)


@pytest.mark.parametrize("cls", [asteria.SOAP, asteria.KLShampoo])
def test_activation_passing_over_a_version_composes_the_orders(cls):
    torch.manual_seed(0)
    model = small_mlp(sizes=SIZES)
    x, y = regression_data(sizes=SIZES)
    with make(cls, model, workers=len(engine_blocks_of(cls, model))) as opt:
        refresher, engine = opt._refresher, opt._refresher.engine
        blocks = engine_blocks(opt)
        for block in blocks:  # version 2 starts, then finishes only after version 3 is snapshotted
            engine.inject_fault(block.id, 2, "pause")
        for _ in range(3):  # refreshes at steps 1 (bootstrap) and 3: versions 1 and 2
            one_step(model, opt, x[:32], y[:32])
        engine.wait_paused(len(blocks), 30.0)  # every version-2 job has started (a latch, no sleep)
        for _ in range(2):  # step 5 snapshots version 3
            one_step(model, opt, x[:32], y[:32])
        assert [min(fset.versions) for fset in refresher.sets] == [1] * len(refresher.sets)
        engine.release_pauses()
        engine.drain(30.0)
        # The raw orders, each relative to the version before it, read before activation rewrites them.
        depth = refresher.depth
        n_plus_1 = [fset.dim + 1 for fset in refresher.sets]
        orders = {v: [r[v % depth, :, n].long().clone() for r, n in zip(refresher.results, n_plus_1, strict=True)]
                  for v in (2, 3)}
        snapshot = lambda: {(id(g), name): t.clone() for g in opt._groups for name, t in g.state.items()}  # noqa: E731
        states = snapshot()
        opt.prefetch()  # activates step 5's versions: the newest finished is 3, passing over 2
        refresher.ready()
        assert [min(fset.versions) for fset in refresher.sets] == [3] * len(refresher.sets)
        assert opt.runtime_stats()["skipped_versions"] >= len(refresher.sets)
        after = snapshot()

        # Expected: the state before, reordered once by o2[o3] through the optimizer's own permutation
        # (the bases themselves are the install's copies, compared separately below).
        nontrivial = False
        for group in opt._groups:
            for name, t in group.state.items():
                if not name.startswith(("basis_", "has_basis_")):
                    t.copy_(states[id(group), name])
        for index, fset in enumerate(refresher.sets):
            o2, o3 = orders[2][index], orders[3][index]
            composed = torch.gather(o2, 1, o3)
            nontrivial |= not torch.equal(composed, o3)
            fset.permute(torch.arange(fset.batch), composed)
        assert nontrivial, "version 2's orders were identities: the check would not see a missing composition"
        for group in opt._groups:
            for name, t in group.state.items():
                assert torch.equal(t, after[id(group), name]), (group.name, name)
        for index, fset in enumerate(refresher.sets):  # and the bases installed are version 3's
            assert torch.equal(fset.preconditioners, refresher.results[index][3 % depth, :, :fset.dim])


@pytest.mark.parametrize("cls", [asteria.SOAP, asteria.KLShampoo])
def test_nondeterministic_training_keeps_the_bound_and_tracks_sync(cls):
    data = regression_data(sizes=SIZES)
    seen = []
    model = small_mlp(sizes=SIZES)
    with make(cls, model, staleness=1) as opt:
        losses = train(model, opt, 60, data=data, hook=lambda _, o: seen.append(o.staleness()))
        stats = opt.runtime_stats()
    sync_model = small_mlp(sizes=SIZES)
    sync = cls(sync_model.parameters(), lr=0.01, precondition_frequency=2, runtime=asteria.RuntimeConfig(mode="sync"))
    sync_losses = train(sync_model, sync, 60, data=data)
    assert max(seen) <= 1 and stats["max_staleness_seen"] <= 1
    final, sync_final = sum(losses[-5:]) / 5, sum(sync_losses[-5:]) / 5
    assert final < 0.7 * sum(losses[:5]) / 5
    assert abs(final - sync_final) < 0.1 * sync_final


@pytest.mark.parametrize("cls", [asteria.Shampoo, asteria.SOAP])
def test_jobs_queued_behind_a_newer_version_are_superseded(cls):
    """One worker held on one block's version 2 while version 3 is snapshotted: the other blocks'
    version-2 jobs start after that and do not compute; every block still reaches version 3."""
    torch.manual_seed(0)
    model = small_mlp(sizes=SIZES)
    x, y = regression_data(sizes=SIZES)
    with make(cls, model) as opt:
        engine, refresher = opt._refresher.engine, opt._refresher
        blocks = engine_blocks(opt)
        engine.inject_fault(blocks[0].id, 2, "pause")
        step = 0
        while opt.refresh_version(step) < 2:  # up to the snapshot of version 2
            one_step(model, opt, x[:32], y[:32])
            step += 1
        engine.wait_paused(1, 30.0)
        while opt.refresh_version(step) < 3:
            one_step(model, opt, x[:32], y[:32])
            step += 1
        engine.release_pauses()
        engine.drain(30.0)
        opt.prefetch()
        stats = opt.runtime_stats()
        assert stats["refreshes_superseded"] == len(blocks) - 1
        assert stats["refresh_failures"] == 0
        assert [min(fset.versions) for fset in refresher.sets] == [3] * len(refresher.sets)
        one_step(model, opt, x[:32], y[:32])
        assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("cls", [asteria.Shampoo, asteria.SOAP])
def test_versions_finished_after_the_prefetch_are_used_by_that_step(cls):
    """The hooks' prefetch activates a step at the end of its forward pass; a version that finishes
    during the backward pass is then activated again by step() itself, not a step later."""
    torch.manual_seed(0)
    model = small_mlp(sizes=SIZES)
    x, y = regression_data(sizes=SIZES)
    with make(cls, model, workers=len(engine_blocks_of(cls, model))) as opt:
        engine, refresher = opt._refresher.engine, opt._refresher
        blocks = engine_blocks(opt)
        for block in blocks:
            engine.inject_fault(block.id, 2, "pause")
        step = 0
        while opt.refresh_version(step) < 2:  # up to the snapshot of version 2 (its jobs pause)
            one_step(model, opt, x[:32], y[:32])
            step += 1
        engine.wait_paused(len(blocks), 30.0)
        before = opt.runtime_stats()["staleness_histogram"]
        opt.prefetch()  # what the forward hook does: version 2 is not finished, 1 stays
        assert [min(fset.versions) for fset in refresher.sets] == [1] * len(refresher.sets)
        engine.release_pauses()
        engine.drain(30.0)  # version 2 finishes "during the backward pass"
        one_step(model, opt, x[:32], y[:32])
        assert [min(fset.versions) for fset in refresher.sets] == [2] * len(refresher.sets)
        after = opt.runtime_stats()["staleness_histogram"]
        # The step activated twice counts once per block, at the staleness it used (0: its newest snapshot).
        assert sum(after) - sum(before) == len(blocks) and after[0] - before[0] == len(blocks)


@pytest.mark.parametrize("cls", [asteria.Shampoo, asteria.SOAP, asteria.KLShampoo])
def test_sync_refreshes_are_waited_for_at_their_own_step(cls):
    """With sync_refreshes=2 the first refresh after the bootstrap is used at once, as at staleness 0, even
    when its jobs are slow; with sync_refreshes=1 a step passes it over (the tests above)."""
    torch.manual_seed(0)
    model = small_mlp(sizes=SIZES)
    x, y = regression_data(sizes=SIZES)
    with make(cls, model, workers=len(engine_blocks_of(cls, model)), sync_refreshes=2) as opt:
        engine, refresher = opt._refresher.engine, opt._refresher
        blocks = engine_blocks(opt)
        for block in blocks:
            engine.inject_fault(block.id, 2, "pause")
        step = 0
        while opt.refresh_version(step) < 1:  # up to the bootstrap
            one_step(model, opt, x[:32], y[:32])
            step += 1
        waits = engine.stats()["registry"]["waits"]

        def release_once_activation_waits() -> None:
            engine.wait_paused(len(blocks), 30.0)  # a latch on the jobs, no sleep
            deadline = time.monotonic() + 30.0
            # The registry counts a wait when it starts blocking: then the jobs may go on.
            while engine.stats()["registry"]["waits"] == waits and time.monotonic() < deadline:
                time.sleep(0)  # a yield
            engine.release_pauses()

        releaser = threading.Thread(target=release_once_activation_waits)
        releaser.start()
        while opt.refresh_version(step) < 2:  # up to the snapshot of version 2
            one_step(model, opt, x[:32], y[:32])
            step += 1
        opt.prefetch()  # the next step's activation (Shampoo's step used its root already): must wait
        releaser.join()
        assert [min(fset.versions) for fset in refresher.sets] == [2] * len(refresher.sets)
        assert engine.stats()["registry"]["waits"] == waits + 1
