"""The engine's hold on the host memory it is handed: blocks on disjoint buffers only, and snapshot claims that
are all or nothing, so that a staging that failed (a timeout, a copy that raised) can be made again."""

from __future__ import annotations

import numpy as np
import pytest

from asteria import _core
from asteria.pipeline.worker_refresh import claimed


def diagonal_block(engine, n=4, depth=1):
    snapshots, results = np.zeros((depth, n, n), np.float32), np.zeros((depth, n, n), np.float32)
    return engine.add_block(snapshots, results), snapshots, results


def test_blocks_on_shared_memory_are_refused_by_name():
    """Two blocks over the same bytes would read each other's snapshots and overwrite each other's results."""
    engine = _core.RefreshEngine(workers=1, staleness=0)
    try:
        block, snapshots, results = diagonal_block(engine, depth=2)
        with pytest.raises(ValueError, match=r"Invalid block memory: block 1's snapshot buffer 0 \[.*\) overlaps "
                                             r"block 0's snapshot buffer 0"):
            engine.add_block(snapshots, np.zeros_like(results))
        slab = np.zeros((2, 3, 4, 4), np.float32)  # (depth, blocks, n, n): one ring per block, interleaved
        with pytest.raises(ValueError, match=r"block 1's result buffer 0 .* overlaps block 1's snapshot buffer 0"):
            engine.add_block(slab[:, 0], slab[:, 0])
        assert engine.num_blocks == 1
        assert [engine.add_block(slab[:, b], np.zeros((2, 4, 4), np.float32)) for b in range(3)] == [1, 2, 3]
    finally:
        engine.close()


def test_a_claim_that_times_out_gives_back_the_claims_before_it():
    engine = _core.RefreshEngine(workers=2, staleness=5)
    try:
        (a, a_snap, a_res), (b, b_snap, _) = diagonal_block(engine), diagonal_block(engine)
        engine.inject_fault(b, 1, "pause")  # b's job holds b's only snapshot buffer
        engine.begin_snapshot([a, b], 1, 5.0)
        a_snap[0], b_snap[0] = np.eye(4) * 4, np.eye(4) * 4
        engine.submit([a], 1, 1, -0.5, 1e-12)
        engine.submit([b], 1, 2, -0.5, 1e-12)
        engine.wait_paused(1, 5.0)
        assert engine.activate(1, 5.0) == [(a, 1)]
        engine.release(a, 1)
        with pytest.raises(TimeoutError, match="block 1 snapshots"):
            engine.begin_snapshot([a, b], 2, 0.02)
        engine.release_pauses()
        assert engine.activate(2, 5.0) == [(b, 1)]
        engine.release(b, 1)
        engine.begin_snapshot([a, b], 2, 5.0)  # the same claim again (before, a's buffer stayed claimed)
        a_snap[0], b_snap[0] = np.eye(4) * 16, np.eye(4) * 16
        engine.submit([a, b], 2, 3, -0.5, 1e-12)
        assert sorted(engine.activate(3, 5.0)) == [(a, 2), (b, 2)]
        np.testing.assert_allclose(a_res[0], np.eye(4) / 4, atol=1e-6)
    finally:
        engine.close()


def test_a_staging_that_raises_gives_its_claims_back():
    engine = _core.RefreshEngine(workers=1, staleness=0)
    try:
        block, snapshots, results = diagonal_block(engine)
        with pytest.raises(OSError, match="the copy failed"), claimed(engine, [block], 1, 5.0):
            raise OSError("the copy failed")
        with claimed(engine, [block], 1, 5.0):  # claimed again, filled and submitted
            snapshots[0] = np.eye(4) * 9
            engine.submit([block], 1, 1, -0.5, 1e-12)
        assert engine.activate(1, 5.0) == [(block, 1)]
        np.testing.assert_allclose(results[0], np.eye(4) / 3, atol=1e-6)
        with pytest.raises(ValueError, match=r"abandon_snapshot\] block 0: Invalid version=1: must be claimed by "
                                             "begin_snapshot and not submitted"):
            engine.abandon_snapshot([block], 1)
    finally:
        engine.close()
