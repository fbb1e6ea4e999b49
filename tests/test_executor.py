"""The refresh executor of one process: host buffers sized by the work in flight, the newest-finished rule's
deferred refreshes, the device lane beside the workers, and the balancer that splits the sets between them.
The device lane runs on the CPU here (``device_refresh=True``): the same torch code as on a GPU, on a thread
beside the workers."""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import pytest
import torch
from conftest import hold_plan, regression_data, small_mlp, train

import asteria
from asteria.pipeline import packing
from asteria.pipeline.balance import WORKER_UTILIZATION, LaneBalancer, cover
from asteria.pipeline.factors import FactorSet
from asteria.pipeline.refresh_math import refresh_set

OPTIMIZERS = {
    "shampoo": lambda params, runtime: asteria.Shampoo(params, lr=1e-2, eps=1e-4, precondition_frequency=2,
                                                       start_preconditioning_step=2, runtime=runtime),
    "soap": lambda params, runtime: asteria.SOAP(params, lr=1e-2, precondition_frequency=2, runtime=runtime),
    "kl-shampoo": lambda params, runtime: asteria.KLShampoo(params, lr=1e-2, precondition_frequency=2,
                                                            runtime=runtime),
}


def factor_bytes(opt) -> int:
    return sum(fset.factors.numel() * 4 for fset, _ in opt._placement.home_sets)


def test_the_pack_keeps_every_entry_of_a_symmetric_block():
    g = torch.randn(3, 5, 5)
    sym = g + g.mT
    packed = packing.pack(sym)
    assert packed.shape == (3, 15)
    assert torch.equal(packing.unpack(packed, 5), sym)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_refresh_buffers_are_at_most_twice_the_factors_at_the_defaults(name):
    with OPTIMIZERS[name](small_mlp(sizes=(8, 32, 16)).parameters(), None) as opt:
        report = opt.memory_report()
        assert not opt.runtime.deterministic  # one process: the newest-finished rule
        assert report["host"]["refresh_buffers"] <= 2 * factor_bytes(opt)
        assert report["host"]["refresh_buffers"] == opt._refresher.host_bytes()


def test_a_long_deterministic_lag_keeps_a_buffer_per_version_it_waits_for():
    params = list(small_mlp(sizes=(8, 32, 16)).parameters())
    sizes = {}
    for lag in (2, 10):  # f = 2: versions wait 1 and 5 intervals
        runtime = asteria.RuntimeConfig(staleness=5, lag_steps=lag)
        with OPTIMIZERS["shampoo"](params, runtime) as opt:
            assert opt.runtime.deterministic and opt._refresher.depth == lag // 2 + 1
            sizes[lag] = opt.memory_report()["host"]["refresh_buffers"]
    assert sizes[10] == 3 * sizes[2]  # 6 buffers against 2


def test_deterministic_defaults_to_the_newest_finished_rule_on_one_process():
    params = list(small_mlp().parameters())
    for runtime, expected in ((None, False), (asteria.RuntimeConfig(lag_steps=3), True),
                              (asteria.RuntimeConfig(deterministic=True), True)):
        with OPTIMIZERS["soap"](params, runtime) as opt:
            assert opt.runtime.deterministic is expected
    with pytest.raises(ValueError, match="deterministic=False"):
        asteria.RuntimeConfig(deterministic=False, lag_steps=3)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_refresh_due_while_its_previous_one_is_on_its_way_is_deferred_without_a_wait(name):
    """A paused job holds its set's version in flight: that set's next turn is deferred (counted), no step
    waits, and once the job goes on, the set is refreshed again at its next turn."""
    model = small_mlp()
    runtime = asteria.RuntimeConfig(workers=2, stagger=False, device_refresh=False)
    data = regression_data()
    with OPTIMIZERS[name](model.parameters(), runtime) as opt:
        train(model, opt, 5, data=data)  # f = 2: the start-up versions 1 and 2 and version 3
        engine = opt._refresher.engine
        block = opt._refresher.ids[0][0]
        paused = opt._refresher._newest_versions[0] + 1
        engine.inject_fault(block, paused, "pause")
        while opt._refresher._newest_versions[0] < paused:  # the next version is snapshotted, its job paused
            train(model, opt, 1, data=data)
        engine.wait_paused(1, 30.0)
        before = opt.runtime_stats()
        train(model, opt, 4, data=data)  # versions 4 and 5 of set 0 come due while 3 is paused
        during = opt.runtime_stats()
        engine.release_pauses()
        engine.drain(30.0)
        train(model, opt, 4, data=data)  # the set's next turn is snapshotted again
        engine.drain(30.0)  # (the newest-finished rule uses a result at the first step after it is done)
        train(model, opt, 1, data=data)
        after = opt.runtime_stats()
    deferred = opt._refresher.sets[0].batch * 2
    assert during["refreshes_deferred"] - before["refreshes_deferred"] >= deferred
    assert during["waits"] == before["waits"]
    assert after["refreshes_superseded"] == 0
    assert min(opt._refresher.sets[0].versions) > paused  # refreshed again once it went on


def lane_sets(kind: str) -> tuple[list[FactorSet], torch.Tensor]:
    torch.manual_seed(1)
    g = torch.randn(2, 6, 9)
    factors = g @ g.mT / 9
    fset = FactorSet(name="set", factors=factors.clone(), preconditioners=torch.eye(6).repeat(2, 1, 1),
                     installed=torch.zeros(2, dtype=torch.bool), exponent=-0.25, block_params=["a", "b"], kind=kind)
    return [fset], factors


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
@pytest.mark.parametrize("kind", ["root", "eigenbasis"])
def test_the_device_lane_computes_what_native_mode_computes(kind, process):
    """The lane's thread refreshes a set from its snapshot with native mode's torch code, itself or in the lane's
    child process: the same bits, and the registry activates the version once the lane reports it."""
    from asteria import _core
    from asteria.pipeline.device_lane import DeviceLane
    from asteria.pipeline.factors import RootRequest

    sets, factors = lane_sets(kind)
    engine = _core.RefreshEngine(workers=1, deterministic=True)
    rings = [(torch.zeros(1, 21), torch.zeros(1, 8 if kind == "eigenbasis" else 6, 6)) for _ in range(2)]
    ids = [[engine.add_block(s, r, kind=kind) for s, r in rings]]
    lane = DeviceLane(engine, sets, ids, timeout_s=30.0, process=process)
    try:
        request = RootRequest(scale=1.0, eps=1e-6)
        lane.start(0, 1, 1, request, lambda fset: (fset.factors.clone(), None))
        sets[0].factors.add_(1.0)  # the factors move on; the lane works from its snapshot
        changes = engine.activate(1, 30.0)  # waits for the lane's report
        assert sorted(version for _, version in changes) == [1, 1]
        expected = refresh_set(sets[0], factors, request, sets[0].preconditioners, sets[0].installed)
        got = lane.take(0, 1)
        assert torch.equal(got.new, expected.new) and torch.equal(got.usable, expected.usable)
        assert lane.seconds_by_dim()[6][1] == 2
    finally:
        lane.close()
        engine.close()


def costs(balancer: LaneBalancer, cpu: dict[int, float], device: dict[int, float], step_seconds: float) -> None:
    balancer.observe_costs({n: (s, 1) for n, s in cpu.items()}, {n: (s, 1) for n, s in device.items()})
    balancer.step_seconds = step_seconds


def balancer_sets(dims: list[int]) -> list[FactorSet]:
    return [FactorSet(name=f"set {i}", factors=torch.zeros(1, n, n), preconditioners=torch.zeros(1, n, n),
                      installed=torch.zeros(1, dtype=torch.bool), exponent=-0.25, block_params=["p"])
            for i, n in enumerate(dims)]


def test_the_balancer_gives_the_device_the_large_blocks_the_workers_cannot_finish():
    sets = balancer_sets([64, 64, 64, 256, 256])
    balancer = LaneBalancer(sets, interval=10, workers=2, device_share=1.0, cpu_prior={64: 1.0, 256: 1.0})
    # Per interval (10 steps of 0.1 s): the workers have 2 x 1 = 2 s; the sets need 3 x 0.1 + 2 x 1.85 =
    # 4 s of them. The device takes a 256 block in 0.2 s: one large set goes there, and for the 0.15 s the
    # workers still lack two small sets (0.04 s of the device) rather than the other large one (0.2 s).
    assert WORKER_UTILIZATION == 1.0
    costs(balancer, {64: 0.1, 256: 1.85}, {64: 0.02, 256: 0.2}, 0.1)
    plan = balancer.replan()
    assert plan[3] + plan[4] == 1 and sum(plan[:3]) == 2
    assert balancer.load[0] <= 1.0 and balancer.load[1] == pytest.approx(0.24)
    # Where the small sets cannot make up what the workers lack, both large ones go.
    costs(balancer, {64: 0.1, 256: 2.1}, {64: 0.02, 256: 0.2}, 0.1)
    assert balancer.replan() == [False, False, False, True, True]
    assert balancer.load[0] <= 1.0 and balancer.load[1] == pytest.approx(0.4)
    # A small share of the device caps it: one large set fits (0.2 s of 0.25 s), and beside it the small sets
    # that the remaining 0.05 s holds.
    costs(balancer, {64: 0.1, 256: 1.85}, {64: 0.02, 256: 0.2}, 0.1)
    balancer.device_share = 0.25
    plan = balancer.replan()
    assert plan[3] + plan[4] == 1 and sum(plan[:3]) == 2 and max(balancer.load) <= 1.0
    # A smaller one fits only the large set: the workers stay over capacity, and the rest is deferred.
    balancer.device_share = 0.2
    plan = balancer.replan()
    assert plan == [False, False, False, True, False] and balancer.load[0] > 1.0
    # Workers that keep up keep everything.
    costs(balancer, {64: 0.05, 256: 0.1}, {64: 0.02, 256: 0.2}, 0.1)
    balancer.device_share = 1.0
    assert balancer.replan() == [False] * 5


@pytest.mark.parametrize(("items", "need", "room", "expected"), [
    ([(4.5, 0.27), (4.5, 0.27), (0.3, 0.03), (0.3, 0.03)], 5.0, 10.0, [0, 2, 3]),  # two small sets for the rest
    ([(4.5, 0.27), (4.5, 0.27), (0.3, 0.03), (0.3, 0.03)], 5.5, 10.0, [0, 1]),  # they cannot make it up
    ([(4.5, 0.27), (4.5, 0.27), (0.3, 0.2), (0.3, 0.2)], 5.0, 10.0, [0, 1]),  # they would take more of the device
    ([(4.5, 0.27), (4.5, 0.27), (0.3, 0.03)], 5.0, 0.31, [0, 2]),  # the cap leaves room for small sets only
    ([(4.5, 0.27), (0.3, 0.03)], 9.0, 0.2, [1]),  # short of the need: the rest is deferred
    ([(4.5, 0.27), (0.3, 0.03)], 0.0, 1.0, []),  # the workers keep up
    ([(1.0, 0.1)] * 3 + [(0.4, 0.04)] * 3, 2.5, 10.0, [0, 1, 3, 4]),  # the overshoot is judged at each level
    ([(1.0, 0.1)] * 5000, 0.5, 1e9, [0]),  # one level per equal set, none of which makes up the need alone
])
def test_the_device_covers_what_the_workers_lack_at_little_device_time(items, need, room, expected):
    """``cover`` against the plans it should make, written out by hand: (worker s, device s) per set, by the
    device's advantage."""
    assert cover(items, need, room) == expected


def test_the_balancer_keeps_everything_on_the_workers_until_it_has_measured():
    sets = balancer_sets([64, 256])
    balancer = LaneBalancer(sets, interval=10, workers=1, device_share=1.0, cpu_prior={64: 1.0, 256: 100.0})
    assert balancer.replan() == [False, False]  # no step time yet
    costs(balancer, {}, {64: 0.01}, 0.1)
    assert balancer.replan() == [False, False]  # no device figure for 256 yet
    costs(balancer, {}, {64: 0.01, 256: 0.05}, 0.1)
    assert balancer.replan()[1]  # the prior says the workers need 100 s for a 256 block


def test_the_device_lanes_drain_waits_for_every_queued_job():
    """``drain`` returns once the lane's thread has ended every job started before it, and names what is left
    when its time runs out (jobs of 8 eigendecompositions of 512 x 512 are still running right after start);
    its busy fraction is that of its life, which ``close`` ends."""
    from asteria import _core
    from asteria.pipeline.device_lane import DeviceLane
    from asteria.pipeline.factors import RootRequest

    g = torch.randn(8, 512, 600, generator=torch.Generator().manual_seed(2))
    fset = FactorSet(name="set", factors=g @ g.mT / 600, preconditioners=torch.eye(512).repeat(8, 1, 1),
                     installed=torch.zeros(8, dtype=torch.bool), exponent=-0.25, block_params=["p"] * 8)
    engine = _core.RefreshEngine(workers=1, deterministic=True)
    ids = [[engine.add_block(torch.zeros(3, 512 * 513 // 2), torch.zeros(3, 512, 512), kind="root")
            for _ in range(8)]]
    lane = DeviceLane(engine, [fset], ids, timeout_s=60.0)
    try:
        for version in (1, 2, 3):
            lane.start(0, version, version, RootRequest(scale=1.0, eps=1e-6), lambda f: (f.factors.clone(), None))
        with pytest.raises(TimeoutError, match=r"device lane did not finish its [1-3] job\(s\) within timeout_s=0"):
            lane.drain(0.0)
        lane.drain(60.0)
        assert lane.stats()["device_jobs_queued"] == 0
        assert [lane.take(0, version).new.shape for version in (1, 2, 3)] == [(8, 512, 512)] * 3
        lane.close()  # the lane's life ends here: its busy fraction holds from now on
        closed = lane.stats()
        until = time.monotonic() + 0.002
        while time.monotonic() < until:  # the clock moves on
            pass
        assert closed["device_refresh_seconds"] > 0 and lane.stats() == closed
    finally:
        lane.close()
        engine.close()


def test_the_workers_prior_times_each_block_size_up_to_its_cap(monkeypatch):
    """Each size up to PRIOR_MAX_TIMED is timed on its own (BLAS's rate per flop grows with n, so a small
    block scaled by n^3 overstates a large one); above the cap the largest timed size scales by n^3."""
    from asteria.pipeline import async_refresh

    monkeypatch.setattr(async_refresh, "PRIOR_MAX_TIMED", 64)
    prior = async_refresh.cpu_prior([256, 16, 64, 16])
    assert sorted(prior) == [16, 64, 256]
    assert all(0 < seconds < 10 for seconds in prior.values())
    assert prior[256] == prior[64] * 4**3  # scaled from the cap's own timing
    assert prior[16] != prior[64] * (16 / 64) ** 3  # timed, not scaled


def test_the_balancers_step_time_leaves_out_the_start_up_refresh_steps():
    """The interval's time is the median of its last steps: a start-up refresh step (2.5 s here, waited for)
    does not stretch it, and a lasting change of pace takes over within an interval."""
    balancer = LaneBalancer(balancer_sets([64]), interval=10, workers=1, device_share=1.0, cpu_prior={64: 1.0})
    now = 100.0
    balancer.observe_step(1, now)
    for step, seconds in enumerate([0.1] * 5 + [2.5] + [0.1] * 4, start=2):
        now += seconds
        balancer.observe_step(step, now)
    assert balancer.step_seconds == pytest.approx(0.1)
    balancer.observe_step(11, now + 0.1)  # the same step activated twice: not a step time
    balancer.observe_step(11, now + 0.2)
    assert balancer.step_seconds == pytest.approx(0.1)
    now += 0.1
    for step in range(12, 22):
        now += 0.3
        balancer.observe_step(step, now)
    assert balancer.step_seconds == pytest.approx(0.3)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sets_move_between_the_workers_and_the_device_lane_and_training_goes_on(name, threads):
    """The plan flips every set from one side to the other between their versions: an eigenbasis set that
    comes back to the workers seeds their chain with the bases in use, and every version is used, with one
    lane thread or several."""
    model = small_mlp()
    runtime = asteria.RuntimeConfig(workers=2, stagger=False, device_refresh=True, device_threads=threads)
    data = regression_data()
    with OPTIMIZERS[name](model.parameters(), runtime) as opt:
        refresher = opt._refresher
        assert refresher.lane is not None and refresher.balancer is not None
        train(model, opt, 4, data=data)  # the start-up versions, on the lane (inline)
        assert refresher.stats()["device_versions"] >= 2
        for side in (True, False, True, False):
            hold_plan(refresher, side)
            train(model, opt, 2, data=data)
            refresher.engine.drain(30.0)
            refresher.lane.drain(30.0)  # its versions finished too: the next turns move, none is deferred
            train(model, opt, 2, data=data)
        stats = opt.runtime_stats()
        versions = [min(fset.versions) for fset in refresher.sets]
    assert stats["lane_moves"] >= 2 * len(refresher.sets)
    assert stats["refresh_failures"] == 0
    assert min(versions) >= 6
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_lanes_threads_run_at_the_workers_nice_and_the_training_thread_keeps_its_own():
    """A lane thread waiting for its GPU work spins on a core, so it must yield the cores kept for the training
    thread: the lane's threads take ``worker_nice`` (never raising a thread that starts lower)."""
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if own > 7:
        pytest.skip(f"this process runs at nice {own}, above the nice tested")
    for nice, expected in ((7, 7), (0, own)):
        model = small_mlp()
        runtime = asteria.RuntimeConfig(workers=1, device_refresh=True, device_threads=2, worker_nice=nice)
        with OPTIMIZERS["shampoo"](model.parameters(), runtime) as opt:
            threads = opt._refresher.lane._threads
            assert len(threads) == 2
            assert [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threads] == [expected] * 2
            assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_start_up_refreshes_on_the_lane_match_native_mode_bit_for_bit(name):
    """Until the first version after the start-up ones comes into use, async mode with the lane computes what
    native mode computes, with the same code, at the same steps."""
    results = []
    # torch_threads="keep": the same intra-op threads, so the same rounding, in both runs.
    for runtime in (asteria.RuntimeConfig(mode="sync"),
                    asteria.RuntimeConfig(workers=1, stagger=False, device_refresh=True, torch_threads="keep")):
        model = small_mlp()
        with OPTIMIZERS[name](model.parameters(), runtime) as opt:
            train(model, opt, 4, data=regression_data())  # versions 1 (step 2) and 2 (step 4)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_the_lanes_threads_refresh_two_sets_at_once_each_as_native_mode_does(monkeypatch):
    """With two threads, two sets' refreshes run at the same time (each waits at a barrier for the other: one
    thread alone would time out there), and each result is native mode's for its snapshot; the lane's busy
    fraction counts both threads' time, and their CPU time counts the computing, not the waiting."""
    from asteria import _core
    from asteria.pipeline import device_lane
    from asteria.pipeline.factors import RootRequest

    both = threading.Barrier(2, timeout=30.0)

    def side_by_side(*args, **kwargs):
        both.wait()  # raises BrokenBarrierError unless the other set's refresh is under way too
        return refresh_set(*args, **kwargs)

    monkeypatch.setattr(device_lane, "refresh_set", side_by_side)
    sets = [lane_sets("root")[0][0], lane_sets("eigenbasis")[0][0]]
    engine = _core.RefreshEngine(workers=1, deterministic=True)
    ids = [[engine.add_block(torch.zeros(1, 21), torch.zeros(1, rows, 6), kind=fset.kind) for _ in range(2)]
           for fset, rows in zip(sets, (6, 8), strict=True)]
    lane = device_lane.DeviceLane(engine, sets, ids, timeout_s=30.0, threads=2)
    try:
        request = RootRequest(scale=1.0, eps=1e-6)
        snapshots = [fset.factors.clone() for fset in sets]
        for index in (0, 1):
            lane.start(index, 1, 1, request, lambda fset, index=index: (snapshots[index], None))
        lane.drain(30.0)
        for index, fset in enumerate(sets):
            expected = refresh_set(fset, snapshots[index], request, fset.preconditioners, fset.installed,
                                   in_thread=True)
            assert torch.equal(lane.take(index, 1).new, expected.new)
        assert len(engine.activate(1, 30.0)) == 4 and not both.broken
        stats = lane.stats()
        assert 0 < stats["device_busy_fraction"] <= 1
        # the threads' CPU time: computing on the CPU here, asleep at the barrier (so below their seconds)
        assert 0 < stats["device_cpu_seconds"] < stats["device_refresh_seconds"]
    finally:
        lane.close()
        engine.close()


def test_the_lanes_own_timings_replace_the_inline_start_up_ones():
    """The balancer's device figures: a start-up refresh computed inline (on the training stream, with the whole
    GPU) stands in for its block size until the lane's threads have refreshed one; then theirs alone count."""
    from asteria import _core
    from asteria.pipeline.device_lane import DeviceLane
    from asteria.pipeline.factors import RootRequest

    sets, _ = lane_sets("root")
    engine = _core.RefreshEngine(workers=1, deterministic=True)
    ids = [[engine.add_block(torch.zeros(2, 21), torch.zeros(2, 6, 6), kind="root") for _ in range(2)]]
    lane = DeviceLane(engine, sets, ids, timeout_s=30.0)
    try:
        request = RootRequest(scale=1.0, eps=1e-6)
        lane.start(0, 1, 1, request, None)  # inline, on this thread
        assert lane.seconds_by_dim()[6][1] == 2
        inline = lane.seconds_by_dim()[6][0]
        lane.start(0, 2, 2, request, lambda fset: (fset.factors.clone(), None))
        lane.drain(30.0)
        seconds, blocks = lane.seconds_by_dim()[6]
        assert blocks == 2 and seconds > 0  # the thread's job only, not the inline one beside it
        assert lane.stats()["device_refresh_seconds"] == pytest.approx(inline + seconds)
    finally:
        lane.close()
        engine.close()


def test_a_failing_device_refresh_keeps_the_previous_version_and_raises_past_the_bound(monkeypatch):
    """A refresh on the lane that raises is the blocks' failure in the registry, as a worker's would be: the
    previous version stays in use, and past ``max_consecutive_failures`` the step raises naming the cause."""
    from asteria.errors import RefreshError
    from asteria.pipeline import device_lane

    model = small_mlp()
    runtime = asteria.RuntimeConfig(workers=1, stagger=False, device_refresh=True, max_consecutive_failures=1)
    data = regression_data()
    with OPTIMIZERS["shampoo"](model.parameters(), runtime) as opt:
        train(model, opt, 2, data=data)  # version 1 on the lane, inline
        before = [p.detach().clone() for p in model.parameters()]

        def broken(*args, **kwargs):
            raise RuntimeError("injected device failure")

        monkeypatch.setattr(device_lane, "refresh_set", broken)
        train(model, opt, 1, data=data)
        with pytest.raises(RefreshError, match="injected device failure"):
            train(model, opt, 1, data=data)  # version 2 fails at step 4
        assert opt._refresher.stats()["refresh_failures"] == opt._refresher.sets[0].batch * len(opt._refresher.sets)
        assert all(min(fset.versions) == 1 for fset in opt._refresher.sets)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_failed_device_versions_hold_up_none_of_the_workers_versions(monkeypatch, name):
    """The lane's versions never hold a buffer of the workers' result ring. A ring's depth of them fail in a
    row (never used, so never retired), then the sets move to the workers: their first version takes the
    buffer of the first failed one, and comes into use on time. (It used to wait for that buffer until
    ``timeout_s``, and the steps past the staleness bound with it: a hang on a GPU whose lane fell behind.)"""
    from asteria.pipeline import device_lane

    model = small_mlp()
    data = regression_data()
    runtime = asteria.RuntimeConfig(workers=1, stagger=False, device_refresh=True, deterministic=False,
                                    timeout_s=20.0, max_consecutive_failures=100)
    with OPTIMIZERS[name](model.parameters(), runtime) as opt:
        refresher = opt._refresher
        train(model, opt, 4, data=data)  # the start-up versions, inline on the lane
        first = max(refresher._newest_versions) + 1

        def broken(*args, **kwargs):
            raise RuntimeError("injected device failure")

        monkeypatch.setattr(device_lane, "refresh_set", broken)
        for plan in (True, False):
            hold_plan(refresher, plan)
            while plan and min(refresher._newest_versions) < first + refresher.depth - 1:
                train(model, opt, 1, data=data)
                refresher.lane.drain(20.0)
        stats = refresher.stats()
        failed = stats["refresh_failures"]
        assert failed >= refresher.depth * sum(fset.batch for fset in refresher.sets)
        blocks = {fset.describe(b) for fset in refresher.sets for b in range(fset.batch)}
        assert set(stats["refresh_errors"]) == blocks  # every block, each with why
        assert all("injected device failure" in why for why in stats["refresh_errors"].values())
        train(model, opt, 6, data=data)
        refresher.engine.drain(10.0)  # (the bug: a job waiting for its buffer until timeout_s=20 times this out)
        train(model, opt, 1, data=data)  # its activation uses what the workers finished
        assert all(min(fset.versions) >= first + refresher.depth for fset in refresher.sets)
        assert refresher.stats()["refresh_failures"] == failed


def green_contexts_supported() -> bool:
    import torch.cuda.green_contexts as green

    return bool(green.SUPPORTED) and hasattr(green.GreenContext, "Stream")


@pytest.mark.skipif(green_contexts_supported(), reason="this torch has green contexts (tests/test_cuda.py uses them)")
def test_a_partition_of_the_gpu_names_what_this_torch_lacks():
    """device_sms needs torch's green-context streams; a torch built without them is refused by name, before
    anything touches a GPU."""
    from asteria.pipeline.partition import Partition

    version = re.escape(torch.__version__)
    with pytest.raises(ValueError, match=rf"Invalid RuntimeConfig.device_sms=16: it needs CUDA green contexts with "
                                         rf"their streams .*which torch {version} .* lacks: leave it None"):
        Partition(torch.device("cuda"), 16, 1)
