"""Async mode: determinism across worker counts, the staleness bound, the bounded barrier, the GIL."""

from __future__ import annotations

import re
import sys
import threading

import numpy as np
import pytest
import torch
from conftest import regression_data, small_mlp, train, worker_threads

import asteria
from asteria import _core


def run(runtime: asteria.RuntimeConfig, steps: int = 24, sizes=(8, 16, 4), hook=None, **kwargs):
    model = small_mlp(sizes=sizes)
    kwargs = {"lr": 0.02, "eps": 1e-6, "precondition_frequency": 2, "max_preconditioner_dim": 16} | kwargs
    with asteria.Shampoo(model.parameters(), runtime=runtime, **kwargs) as opt:
        train(model, opt, steps, data=regression_data(sizes=sizes), hook=hook)
        stats = opt.runtime_stats()
    return [p.detach().clone() for p in model.parameters()], stats


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_worker_count_does_not_change_bits(staleness):
    one, _ = run(asteria.RuntimeConfig(staleness=staleness, workers=1, deterministic=True))
    four, _ = run(asteria.RuntimeConfig(staleness=staleness, workers=4, deterministic=True))
    for a, b in zip(one, four, strict=True):
        assert torch.equal(a, b)


def test_staleness_changes_the_trajectory():
    """The determinism test above is not vacuous: a different schedule gives different bits."""
    fresh, _ = run(asteria.RuntimeConfig(staleness=0, workers=1, deterministic=True))
    stale, _ = run(asteria.RuntimeConfig(staleness=3, workers=1, deterministic=True, lag_steps=6))
    assert any(not torch.equal(a, b) for a, b in zip(fresh, stale, strict=True))


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("staleness", [1, 2])
def test_staleness_bound_holds_every_step_with_slow_workers(deterministic, staleness):
    # 96-wide blocks on one worker take far longer than a training step of this tiny model, so
    # the bounded barrier must wait to keep the bound.
    seen = []
    # Under the deterministic rule each version waits the whole bound (f = 2): the schedule's own lag.
    runtime = asteria.RuntimeConfig(staleness=staleness, workers=1, deterministic=deterministic,
                                    lag_steps=2 * staleness if deterministic else None)
    _, stats = run(runtime, steps=30, sizes=(96, 96, 96), max_preconditioner_dim=96,
                   hook=lambda step, opt: seen.append(opt.staleness()))
    assert max(seen) <= staleness
    assert stats["max_staleness_seen"] <= staleness
    assert sum(stats["staleness_histogram"]) > 0
    if deterministic:
        assert max(seen) == staleness  # the schedule uses exactly S intervals of slack
    assert stats["refreshes"] > 0


def test_bootstrap_waits_and_counts():
    _, stats = run(asteria.RuntimeConfig(staleness=2, workers=1), steps=6, sizes=(96, 96, 96),
                   max_preconditioner_dim=96)
    assert stats["waits"] >= 1
    assert stats["wait_seconds"] > 0


def test_a_block_whose_buffers_would_need_a_converted_copy_is_refused():
    """The engine reads the caller's snapshots and writes its results in place: a float64 array would be
    converted to a hidden float32 copy, whose results the caller would never see."""
    engine = _core.RefreshEngine(workers=1, staleness=0)
    try:
        with pytest.raises(TypeError, match="add_block"):
            engine.add_block(torch.zeros(1, 4, 4, dtype=torch.float64), torch.zeros(1, 4, 4))
        with pytest.raises(TypeError, match="add_block"):
            engine.add_block(torch.zeros(1, 4, 4), torch.zeros(1, 4, 4, dtype=torch.float64))
        with pytest.raises(ValueError, match="Invalid first_basis='power': must be 'eigh' or 'qr'"):
            engine.add_block(torch.zeros(1, 4, 4), torch.zeros(1, 6, 4), kind="eigenbasis", first_basis="power")
        with pytest.raises(ValueError, match="Invalid first_basis='qr' for kind='root': only an eigenbasis block"):
            engine.add_block(torch.zeros(1, 4, 4), torch.zeros(1, 4, 4), first_basis="qr")
        assert engine.num_blocks == 0
    finally:
        engine.close()


def test_the_engine_keeps_a_blocks_arrays_alive_and_refuses_bad_calls_before_any_change():
    """The workers write a block's arrays until the engine is gone, so the engine holds them; a wait beyond 1e9 s
    (the core counts int64 nanoseconds from now) is refused by name rather than wrapping to an instant timeout;
    a submit, skip or release refused leaves the block as it was (a refused submit left its snapshot pinned, and the
    buffer's next version waited for it until its timeout)."""
    engine = _core.RefreshEngine(workers=1, staleness=0)
    try:
        snapshots, results = np.zeros((1, 4, 4), np.float32), np.zeros((1, 4, 4), np.float32)
        held = sys.getrefcount(snapshots), sys.getrefcount(results)
        engine.add_block(snapshots, results)
        assert (sys.getrefcount(snapshots), sys.getrefcount(results)) == (held[0] + 1, held[1] + 1)
        deep = np.zeros((2**20 + 1, 1, 1), np.float32)  # (the engine counts n and depth in int)
        with pytest.raises(ValueError, match=r"Invalid results shape \(1048577, 1, 1\): n and depth must be <= "
                                             "1048576"):
            engine.add_block(deep, deep.copy())
        for call in (lambda: engine.activate(1, 1e10), lambda: engine.drain(float("inf")),
                     lambda: engine.begin_snapshot([0], 1, 2e9)):
            with pytest.raises(ValueError, match=r"Invalid timeout_s=.*: must be a number of seconds in \(0, 1e9\]"):
                call()
        with pytest.raises(ValueError, match=r"Invalid max_delay_s=1e\+10|Invalid max_delay_s=10000000000"):
            engine.set_random_delay(1e10)
        # A refused call changes nothing: no snapshot pinned or published, no version marked released.
        engine.begin_snapshot([0], 1, 5.0)
        with pytest.raises(ValueError, match="block 0: Invalid version=1: the block is listed twice"):
            engine.submit([0, 0], 1, 1, -0.25, 1e-12)
        with pytest.raises(ValueError, match="block 0: Invalid version=2: must be > the newest snapshot, version 0, "
                                             "and written since begin_snapshot"):
            engine.submit([0], 2, 2, -0.25, 1e-12)
        engine.submit([0], 1, 1, -0.25, 1e-12)
        assert engine.activate(1, 30.0) == [(0, 1)]
        with pytest.raises(ValueError, match="version 3 is not acquired"):
            engine.release(0, 3)
        engine.release(0, 1)
        with pytest.raises(ValueError, match="Invalid blocks: block 0 is listed twice"):
            engine.skip([0, 0], 2)
        engine.skip([0], 2)  # (the refused call skipped nothing)
        assert np.array_equal(results[0], np.eye(4, dtype=np.float32))  # a zero factor's root: the identity
    finally:
        engine.close()
    with pytest.raises(ValueError, match=r"Invalid slot_timeout_s=nan"):
        _core.RefreshEngine(workers=1, slot_timeout_s=float("nan"))


def test_blocking_calls_release_the_gil():
    """activate() waits for a job that can only finish once another Python thread has run."""
    engine = _core.RefreshEngine(workers=1, staleness=0)
    snapshots = torch.zeros(1, 4, 4)
    results = torch.zeros(1, 4, 4)
    block = engine.add_block(snapshots, results)
    for version in (1, 2):
        engine.begin_snapshot([block], version, 5.0)
        snapshots[0] = torch.eye(4) * version
        engine.submit([block], version, version, -0.5, 1e-12)
        if version == 1:
            assert engine.activate(1, 5.0) == [(block, 1)]
            assert torch.allclose(results[0], torch.eye(4))
    # Version 2 needs the result buffer that version 1 still pins: only release() frees it, and
    # release() runs in a Python thread, so activate() can only return if it released the GIL.
    go = threading.Event()
    releaser = threading.Thread(target=lambda: (go.wait(), engine.release(block, 1)))
    releaser.start()
    go.set()
    assert engine.activate(2, 10.0) == [(block, 2)]
    releaser.join()
    assert torch.allclose(results[0], torch.eye(4) / 2**0.5, atol=1e-6)
    engine.close()


def test_close_stops_the_worker_threads():
    """The workers, counted by their thread name ("asteria-worker"), start with the optimizer and end at
    close(). (A count of all threads also saw torch's and OpenMP's pools, started or grown lazily.)"""
    model = small_mlp()
    before = worker_threads()
    opt = asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(workers=3))
    assert worker_threads() == before + 3
    train(model, opt, 3)
    opt.close()
    assert worker_threads() == before
    opt.close()  # idempotent


def test_staleness_histogram_counts_steps():
    _, stats = run(asteria.RuntimeConfig(staleness=1, workers=2), steps=20)
    histogram = np.array(stats["staleness_histogram"])
    assert histogram.sum() > 0 and histogram[2:].sum() == 0


def test_workers_behind_the_schedule_warn_once_with_what_to_change():
    """Refresh jobs slower than the interval (an injected delay per job, one worker, a refresh every
    step): under the deterministic rule step() waits at the staleness bound, and the optimizer says so once,
    with the numbers."""
    from asteria import testing

    model = small_mlp()
    runtime = asteria.RuntimeConfig(staleness=1, workers=1, deterministic=True)
    with asteria.Shampoo(model.parameters(), precondition_frequency=1, runtime=runtime) as opt:
        train(model, opt, 1)
        testing.set_random_worker_delay(opt, 0.05)
        with pytest.warns(asteria.RefreshBacklogWarning, match=r"waited \d+ times .* Raise precondition_frequency "
                                                               r"\(now 1; about (\d+) would keep up\), staleness "
                                                               r"\(now 1\)") as caught:
            train(model, opt, 12)
        message = str(next(w.message for w in caught if issubclass(w.category, asteria.RefreshBacklogWarning)))
        assert int(re.search(r"about (\d+) would keep up", message).group(1)) >= 2  # more than the f = 1 that failed
        assert len([w for w in caught if issubclass(w.category, asteria.RefreshBacklogWarning)]) == 1
        assert opt.runtime_stats()["waits"] >= 3


def test_backlog_advice_names_lag_steps_when_the_workers_keep_up():
    from asteria.pipeline.backlog import backlog_advice

    short = asteria.RuntimeConfig(staleness=2, lag_steps=1)
    # The work of an interval fits the workers' time: the lag is shorter than a job.
    text = backlog_advice(short, 5, work=0.5, capacity=2.0)
    assert "jobs take longer than lag_steps=1 steps: raise RuntimeConfig.lag_steps (at most staleness x " \
           "precondition_frequency = 10)" in text
    # It does not: the workers are short of time, whatever the lag.
    text = backlog_advice(short, 5, work=3.0, capacity=2.0)
    assert "Raise precondition_frequency (now 5; about 10 would keep up), lag_steps (now 1), staleness (now 2)" in text
    assert "or deterministic=False" in text
    text = backlog_advice(asteria.RuntimeConfig(staleness=2, deterministic=False), 5, work=3.0, capacity=2.0)
    assert "staleness (now 2), RuntimeConfig.workers, RuntimeConfig.device_share (now 1.0), or" in text
    assert "lag_steps" not in text
    # The workers keep up, and the deterministic rule's default lag (one interval) is shorter than a job.
    text = backlog_advice(asteria.RuntimeConfig(staleness=2, deterministic=True), 5, work=0.5, capacity=2.0)
    assert "jobs take longer than the default lag of 5 steps: raise RuntimeConfig.lag_steps (at most" in text
    # The workers keep up under the newest-finished rule: the deferrals come from versions on their way longer than
    # an interval (a single long refresh, or the device lane's), not from the work.
    text = backlog_advice(asteria.RuntimeConfig(staleness=2, deterministic=False, in_flight=2), 5, work=0.5,
                          capacity=2.0)
    assert "They keep up with the refresh work (about 0.5 CPU-seconds an interval against 2 worker-seconds" in text
    assert "single refreshes stay on their way longer than an interval of 5 steps: raise RuntimeConfig.in_flight " \
           "(now 2) or precondition_frequency." in text
    assert "takes longer than the interval" not in text


def test_with_a_device_lane_the_backlog_warning_takes_the_work_from_the_balancers_plan():
    """The workers' measured mean job averages their seconds with the lane's (GPU seconds), so with a lane the
    warning reads the balancer's plan: the work the lane could not take, as a share of the workers' time. The same
    counters without a plan read as work the workers keep up with."""
    from asteria.pipeline.backlog import BacklogMonitor

    def engine(seconds: float, jobs: int) -> dict:
        return {"registry": {"waits": 0, "wait_seconds": 0.0}, "snapshot_waits": 0, "snapshot_wait_seconds": 0.0,
                "refresh_seconds": seconds, "refreshes_ok": jobs, "refreshes_failed": 0,
                "pool": {"workers": 14, "busy_fraction": 0.5}}

    def warning(planned: tuple[float, float] | None) -> str:
        """Two intervals of 10 s that deferred refreshes: 800 jobs (the lane's among them) in 200 worker-seconds
        and 10 lane-seconds, 100 deferred; the workers have 14 x 10 worker-seconds an interval."""
        monitor = BacklogMonitor(asteria.RuntimeConfig(deterministic=False), 10)
        monitor.check(0, engine(0.0, 0), 0, 0.0, planned, now=0.0)
        monitor.check(10, engine(100.0, 400), 50, 5.0, planned, now=10.0)
        with pytest.warns(asteria.RefreshBacklogWarning) as caught:
            monitor.check(20, engine(200.0, 800), 100, 10.0, planned, now=20.0)
        return str(caught[0].message)

    text = warning((1.81, 0.98))
    assert "100 block refreshes were deferred between the first interval and step 20" in text
    assert "The balancer's last plan left the workers 1.81x their time in an interval and the device lane 0.98x " \
           "its share." in text
    # 1.81 x 140 worker-seconds; f = 10 x 1.25 x 1.81 rounded up
    assert "about 253 CPU-seconds against 140 worker-seconds of training. Raise precondition_frequency (now 10; " \
           "about 23 would keep up)" in text
    # (210 s / 800 jobs) x (800 + 100) / 2 intervals = 118 < 140
    assert "They keep up with the refresh work (about 118 CPU-seconds" in warning(None)


def test_workers_behind_under_the_newest_finished_rule_defer_and_warn_once():
    """The same slow jobs under the newest-finished rule (the default on one process): the refreshes that come
    due while their set's previous one is on its way are deferred, never queued behind it (nothing superseded),
    and the optimizer says once that the executor falls behind, with the interval's work at its full demand
    (the jobs done and deferred). Jobs of about 25 steps under S = 5 also reach the bound: step() waits there."""
    from asteria import testing

    model = small_mlp()
    runtime = asteria.RuntimeConfig(workers=1, device_refresh=False)
    with asteria.Shampoo(model.parameters(), precondition_frequency=1, runtime=runtime) as opt:
        train(model, opt, 3)
        testing.set_random_worker_delay(opt, 0.05)
        pattern = r"(waited|deferred) .* Raise precondition_frequency \(now 1; about (\d+) would"
        with pytest.warns(asteria.RefreshBacklogWarning, match=pattern) as caught:
            train(model, opt, 100)
        message = str(next(w.message for w in caught if issubclass(w.category, asteria.RefreshBacklogWarning)))
        assert int(re.search(r"about (\d+) would keep up", message).group(1)) >= 2
        assert len([w for w in caught if issubclass(w.category, asteria.RefreshBacklogWarning)]) == 1
        stats = opt.runtime_stats()
    assert stats["refreshes_deferred"] > 0 and stats["refreshes_superseded"] == 0
    assert stats["max_staleness_seen"] <= 5
    # The latest deferrals say which set's version gave way to which version of it still on its way.
    recent = stats["recent_deferrals"]
    names = {fset.name for fset in opt._refresher.sets}
    assert 0 < len(recent) <= 32 and [d["step"] for d in recent] == sorted(d["step"] for d in recent)
    assert all(d["set"] in names and d["side"] == "cpu" and d["reason"] == "in_flight" and d["in_flight"]
               for d in recent)
    assert all(v < d["version"] and side == "cpu" for d in recent for v, side in d["in_flight"])


class Reached:
    """A CUDA event's stand-in for the accounting of ``BackwardMarks`` (no GPU here): reached at ``at`` ms."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:  # (reached already)
        pass

    def elapsed_time(self, end: Reached) -> float:
        return end.at - self.at


def test_the_late_activation_wait_is_accounted_step_by_step():
    """``BackwardMarks.stats()``: per step that waited and whose end the GPU reached, the host's and the GPU's
    time after the wait; a step whose GPU time exceeds the host's by less than a millisecond ran out of work.
    On the CPU nothing is marked, so nothing waits and nothing is counted."""
    from asteria.pipeline.streams import BackwardMarks

    marks = BackwardMarks()
    marks.mark(torch.device("cpu"))
    marks.wait()
    marks.clear()
    assert marks.stats() == {"late_activation_steps": 0, "late_activation_wait_seconds": None,
                             "late_activation_host_seconds": None, "late_activation_gpu_seconds": None,
                             "late_activation_tight_steps": 0}
    # a mark the GPU has passed: the wait is counted (the mean over the waits), its step once the GPU ends it
    marks._events.append(Reached(0.0))
    marks.wait()
    assert marks.stats()["late_activation_wait_seconds"] >= 0 and marks._waits == 1
    marks.clear()
    # host 4 ms, GPU 10 ms (6 to spare); host 8 ms, GPU 8.5 ms (tight)
    marks._pending.extend([(Reached(0.0), Reached(10.0), 0.004), (Reached(5.0), Reached(13.5), 0.008)])
    stats = marks.stats()
    assert stats["late_activation_steps"] == 2 and stats["late_activation_tight_steps"] == 1
    assert stats["late_activation_host_seconds"] == pytest.approx(0.006)
    assert stats["late_activation_gpu_seconds"] == pytest.approx(0.00925)
