"""More than one version of a set on its way (``RuntimeConfig.in_flight`` > 1) under the newest-finished rule,
with the device lane on the CPU beside the workers: versions end out of order, and sets change sides while a
version of theirs is still computing on the other. Each case used to wait until ``timeout_s`` or to raise an
internal error; each must go on."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch
from conftest import hold_plan, regression_data, small_mlp, train

import asteria
from asteria import testing
from asteria.pipeline import async_refresh, device_lane

SIZES = (8, 8, 8)
DATA = regression_data(sizes=SIZES)


def make(name: str, frequency: int = 2, **runtime):
    model = small_mlp(sizes=SIZES)
    config = dict(mode="async", staleness=2, workers=2, deterministic=False, stagger=False, device_refresh=True,
                  device_process=False, timeout_s=20.0, in_flight=2) | runtime
    optimizer = {"soap": asteria.SOAP, "shampoo": asteria.Shampoo}[name]
    return model, optimizer(list(model.named_parameters()), lr=0.01, precondition_frequency=frequency,
                            runtime=asteria.RuntimeConfig(**config))


def train_until(model, opt, version: int) -> None:
    while min(opt._refresher._newest_versions) < version:
        train(model, opt, 1, data=DATA)


def slow_lane(monkeypatch):
    """Makes each of the device lane's refreshes take a second longer; returns what undoes it."""
    real = device_lane.refresh_set

    def late(*args, **kwargs):
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(device_lane, "refresh_set", late)
    return lambda: monkeypatch.setattr(device_lane, "refresh_set", real)


def goes_on(model, opt, drain) -> None:
    """Training goes on: 8 more steps, ``drain`` (the lane's or the engine's), one step; every set then uses a
    version newer than the newest before, and no refresh failed."""
    newest = max(opt._refresher._newest_versions)
    train(model, opt, 8, data=DATA)
    drain(20.0)
    train(model, opt, 1, data=DATA)
    assert all(min(fset.versions) > newest for fset in opt._refresher.sets)
    assert opt.runtime_stats()["refresh_failures"] == 0


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_a_lane_version_passed_over_while_it_computes_ends_quietly(monkeypatch, name):
    """Version v computes on a slow lane while v + 1, on the workers, ends first and comes into use. v's end is
    then counted, not refused (the refusal ended the lane's thread, and every later lane version waited)."""
    model, opt = make(name)
    with opt:
        refresher = opt._refresher
        train(model, opt, 5, data=DATA)
        restore = slow_lane(monkeypatch)
        version = max(refresher._newest_versions) + 1
        hold_plan(refresher, True)
        train_until(model, opt, version)
        hold_plan(refresher, False)
        train_until(model, opt, version + 1)
        refresher.engine.drain(20.0)
        train(model, opt, 2, data=DATA)  # v + 1 comes into use
        refresher.lane.drain(20.0)  # v ends, passed over
        assert all(thread.is_alive() for thread in refresher.lane._threads)
        restore()
        hold_plan(refresher, True)
        goes_on(model, opt, refresher.lane.drain)
        assert not refresher.lane._results  # (the passed-over version's result is not kept)


def test_an_eigenbasis_set_returns_to_the_workers_after_its_running_job():
    """SOAP: worker version v is slow; lane version v + 1 ends first and comes into use; the set's next version,
    back on the workers, waits (deferred) until v's job has ended, since the chain cannot take the bases in use
    before (set_basis refused, and the step raised)."""
    model, opt = make("soap")
    with opt:
        refresher = opt._refresher
        hold_plan(refresher, False)
        train(model, opt, 5, data=DATA)
        step = next(s for s in range(6, 40) if opt.is_refresh_step(s))
        version = opt.refresh_version(step)
        testing.inject_fault(opt, "0.weight", "delay", version=version, seconds=2.0)
        train_until(model, opt, version)
        hold_plan(refresher, True)
        train_until(model, opt, version + 1)
        refresher.lane.drain(20.0)
        train(model, opt, 1, data=DATA)
        hold_plan(refresher, False)
        train(model, opt, 4, data=DATA)  # raised ValueError from set_basis here
        refresher.engine.drain(20.0)
        train(model, opt, 8, data=DATA)
        refresher.engine.drain(20.0)
        train(model, opt, 1, data=DATA)
        assert all(min(fset.versions) > version + 1 for fset in refresher.sets)
        stats = opt.runtime_stats()
        assert stats["refresh_failures"] == 0, stats["refresh_errors"]


def test_an_eigenbasis_set_returns_to_the_workers_only_once_its_lane_version_is_settled(monkeypatch):
    """SOAP: lane version v is slow; the set's next turn, planned on the workers, is deferred until v is settled.
    Seeded at once, the workers' chain would start from the bases before v under v's name, and the column orders
    composed after v's install would be relative to the wrong basis."""
    model, opt = make("soap")
    with opt:
        refresher = opt._refresher
        train(model, opt, 5, data=DATA)
        restore = slow_lane(monkeypatch)
        hold_plan(refresher, True)
        version = max(refresher._newest_versions) + 1
        train_until(model, opt, version)  # v on the lane, still computing
        hold_plan(refresher, False)
        deferred = opt.runtime_stats()["refreshes_deferred"]
        train(model, opt, 2, data=DATA)  # the next turn (f = 2), while v computes
        assert opt.runtime_stats()["refreshes_deferred"] > deferred
        assert all((index, version + 1) not in refresher._lane_of for index in range(len(refresher.sets)))
        restore()
        refresher.lane.drain(20.0)
        goes_on(model, opt, refresher.engine.drain)


def test_a_version_is_deferred_while_an_unsettled_one_holds_its_host_buffers():
    """Two versions on their way share the host buffers by version parity: a new version whose buffer an
    unsettled one still holds is deferred (it waited for that buffer while the step waited for it)."""
    model, opt = make("shampoo", device_refresh=False, workers=6)
    with opt:
        refresher = opt._refresher
        train(model, opt, 5, data=DATA)
        first = max(refresher._newest_versions) + 1
        for param in ("0.weight", "2.weight"):
            testing.inject_fault(opt, param, "pause", version=first)
            testing.inject_fault(opt, param, "delay", version=first + 1, seconds=2.0)
        train_until(model, opt, first + 1)
        train(model, opt, 8, data=DATA)  # deferred: the staleness bound now asks for the next admitted version
        # first ends and comes into use one step before a refresh step whose version has first + 1's parity,
        # while first + 1 (2 s) still holds that host buffer
        while not (not opt.is_refresh_step(opt._step + 1) and opt.is_refresh_step(opt._step + 2)
                   and opt.refresh_version(opt._step + 2) % 2 == (first + 1) % 2):
            train(model, opt, 1, data=DATA)
        refresher.engine.release_pauses()
        started = time.monotonic()
        train(model, opt, 12, data=DATA)
        assert time.monotonic() - started < 15.0
        refresher.engine.drain(20.0)
        train(model, opt, 4, data=DATA)
        refresher.engine.drain(20.0)
        train(model, opt, 1, data=DATA)
        assert all(min(fset.versions) > first + 1 for fset in refresher.sets)
        assert opt.runtime_stats()["refresh_failures"] == 0


def lane_versions(monkeypatch) -> threading.local:
    """Makes each lane job's version known to the math it calls, on the lane's thread (``.version``)."""
    local = threading.local()
    real = device_lane.DeviceLane._compute

    def compute(self, job, inline=False, slot=0):
        local.version = job.version
        return real(self, job, inline, slot)

    monkeypatch.setattr(device_lane.DeviceLane, "_compute", compute)
    return local


def test_a_lane_version_that_outlives_a_failed_newer_one_comes_into_use_from_its_own_result(monkeypatch):
    """Version v computes on a slow lane while v + 1, on the workers, fails. The engine's figures alone would then
    count v as failed too: v must stay on its way, and come into use from the lane's result once it ends (it was
    installed from the workers' host buffers, which hold nothing of it: garbage, or NaN)."""
    model, opt = make("shampoo")
    with opt:
        refresher = opt._refresher
        train(model, opt, 5, data=DATA)
        computed, real = {}, device_lane.refresh_set

        def slow(fset, *args, **kwargs):
            time.sleep(1.0)
            refreshed = real(fset, *args, **kwargs)
            computed[fset.name] = refreshed.new.clone()
            return refreshed

        monkeypatch.setattr(device_lane, "refresh_set", slow)
        version = max(refresher._newest_versions) + 1
        hold_plan(refresher, True)
        train_until(model, opt, version)
        hold_plan(refresher, False)
        for param in ("0.weight", "2.weight"):
            testing.inject_fault(opt, param, "nonfinite", version=version + 1)
        train_until(model, opt, version + 1)
        refresher.engine.drain(20.0)
        train(model, opt, 1, data=DATA)
        refresher.lane.drain(20.0)
        # The next step is a refresh step: its version goes to the (slow) lane, so that it cannot come into use
        # within that step (the workers' jobs on these small blocks end in microseconds, and one ending before the
        # step's end was taken in, in about half the runs).
        hold_plan(refresher, True)
        train(model, opt, 1, data=DATA)
        for fset in refresher.sets:
            assert fset.versions == [version] * fset.batch
            assert torch.equal(fset.preconditioners, computed[fset.name])
        assert all(torch.isfinite(param).all() for param in model.parameters())


def test_two_lane_versions_of_a_set_coming_into_use_at_once_each_install_their_blocks(monkeypatch):
    """Shampoo, f = 1: lane versions v and v + 1 of every set end before the same activation, and v + 1 is not
    usable for block 0. Block 0 then comes to use v and block 1 v + 1, each from its own result (the install took
    one version per set, and the step raised)."""
    model, opt = make("shampoo", frequency=1, staleness=8)
    local, real = lane_versions(monkeypatch), device_lane.refresh_set
    with opt:
        refresher = opt._refresher
        train(model, opt, 5, data=DATA)
        hold_plan(refresher, True)
        train(model, opt, 3, data=DATA)  # (the sets' versions on the lane, all ended: none left for the
        refresher.engine.drain(20.0)  # staleness bound to wait for while the lane's lock is held below, where
        refresher.lane.drain(20.0)  # versions deferred meanwhile move the bound on: S = 8 leaves it room)
        versions: dict[str, list[int]] = {}  # per set, v and v + 1: the first two versions it has queued on the lane
        computed = {}

        def refresh(fset, *args, **kwargs):
            refreshed = real(fset, *args, **kwargs)
            if local.version == versions[fset.name][1]:  # (block 0's factor as if not finite)
                refreshed.new[0] = float("nan")
                refreshed.usable[0] = False
            computed[(fset.name, local.version)] = refreshed.new.clone()
            return refreshed

        monkeypatch.setattr(device_lane, "refresh_set", refresh)
        with refresher.lane._lock:  # (the training thread takes it again; the lane's thread waits: both queue)
            # (which versions: under the lock, until two of each set queue; a set's version may be deferred
            # behind its versions still unsettled)
            def queued(index: int) -> list[int]:
                return sorted(job.version for job in refresher.lane._jobs if job.index == index)

            while not all(len(queued(index)) >= 2 for index in range(len(refresher.sets))):
                train(model, opt, 1, data=DATA)
            versions.update({fset.name: queued(index)[:2] for index, fset in enumerate(refresher.sets)})
        refresher.lane.drain(20.0)
        train(model, opt, 1, data=DATA)
        for fset in refresher.sets:
            first, second = versions[fset.name]
            assert fset.versions == [first, second]
            assert torch.equal(fset.preconditioners[0], computed[(fset.name, first)][0])
            assert torch.equal(fset.preconditioners[1], computed[(fset.name, second)][1])
        assert opt.runtime_stats()["refresh_failures"] == len(refresher.sets)  # block 0 of v + 1, per set


def test_a_lane_eigenbasis_version_waits_until_no_other_version_of_its_set_is_on_its_way(monkeypatch):
    """SOAP on the lane, two versions in flight allowed: a version warm-starts from the bases in use when it
    computes, and its column order, relative to them, reorders the second moment at its install. Were v + 1 to
    compute while v is on its way and v then come into use first, v + 1's order (relative to v - 1's bases) would
    reorder state kept in v's order. So v + 1 is deferred, and every lane version's bases at its start are those
    it is installed over."""
    model, opt = make("soap", frequency=1, staleness=8, device_threads=4)
    local, real = lane_versions(monkeypatch), device_lane.refresh_set
    computed: dict[tuple[str, int], threading.Event] = collections.defaultdict(threading.Event)
    gates: dict[int, threading.Event] = collections.defaultdict(threading.Event)  # version -> may end
    started_over, installed_over = {}, {}

    def gated(fset, *args, **kwargs):
        version = local.version
        started_over[(fset.name, version)] = list(fset.versions)
        refreshed = real(fset, *args, **kwargs)
        computed[(fset.name, version)].set()
        gates[version].wait(20.0)
        return refreshed

    real_install = async_refresh.AsyncRefresher._install_from_lane

    def install(self, index, items):
        fset = self.sets[index]
        installed_over[(fset.name, items[0][1])] = list(fset.versions)
        return real_install(self, index, items)

    with opt:
        refresher = opt._refresher
        train(model, opt, 5, data=DATA)
        refresher.lane.drain(20.0)  # (v - 1, if the balancer put it on the lane, ended ungated: v is not deferred)
        monkeypatch.setattr(device_lane, "refresh_set", gated)
        monkeypatch.setattr(async_refresh.AsyncRefresher, "_install_from_lane", install)
        hold_plan(refresher, True)
        version = max(refresher._newest_versions) + 1
        refresher.engine.drain(20.0)  # (v - 1, on the workers, ended: v is not deferred behind it)
        train_until(model, opt, version)  # v of each set on the lane, held before it ends
        for fset in refresher.sets:  # (computed before v + 1 comes due: a version still queued then is superseded)
            assert computed[(fset.name, version)].wait(20.0)
        deferred = opt.runtime_stats()["refreshes_deferred"]
        train(model, opt, 1, data=DATA)  # v + 1 comes due
        later = [fset.name for index, fset in enumerate(refresher.sets) if (index, version + 1) in refresher._lane_of]
        for name in later:  # (started: it computes from the bases before v's)
            assert computed[(name, version + 1)].wait(20.0)
        assert later or opt.runtime_stats()["refreshes_deferred"] > deferred
        ids = [block_ids[0] for block_ids in refresher.ids]

        def end(v: int) -> None:
            gates[v].set()
            waited = time.monotonic()  # (bounded: v's end, which no event of the library's marks)
            while any(refresher.engine.status(i)["newest_finished"] < v for i in ids):
                assert time.monotonic() - waited < 20.0
                time.sleep(0.01)
            train(model, opt, 1, data=DATA)  # v comes into use

        end(version)
        if later:
            end(version + 1)
        for v in range(version + 1, version + 40):
            gates[v].set()
        train(model, opt, 3, data=DATA)
        refresher.lane.drain(20.0)
        train(model, opt, 1, data=DATA)
        checked = [key for key in installed_over if key in started_over]
        assert len(checked) >= 2 * len(refresher.sets)
        for key in checked:
            assert started_over[key] == installed_over[key], key
        assert opt.runtime_stats()["refresh_failures"] == 0


def test_the_sides_of_versions_done_with_are_forgotten_without_a_lane():
    """Each version's side is kept while it is on its way only, also without the device lane."""
    model, opt = make("shampoo", frequency=1, device_refresh=False)
    with opt:
        train(model, opt, 40, data=DATA)
        assert len(opt._refresher._lane_of) <= 2 * len(opt._refresher.sets)
