"""More than one version of a set on its way (``RuntimeConfig.in_flight`` > 1) under the newest-finished rule,
with the device lane on the CPU beside the workers: versions end out of order, and sets change sides while a
version of theirs is still computing on the other. Each case used to wait until ``timeout_s`` or to raise an
internal error; each must go on."""

from __future__ import annotations

import time

import pytest
from conftest import hold_plan, regression_data, small_mlp, train

import asteria
from asteria import testing
from asteria.pipeline import device_lane

SIZES = (8, 8, 8)
DATA = regression_data(sizes=SIZES)


def make(name: str, **runtime):
    model = small_mlp(sizes=SIZES)
    config = dict(mode="async", staleness=2, workers=2, deterministic=False, stagger=False, device_refresh=True,
                  device_process=False, timeout_s=20.0, in_flight=2) | runtime
    optimizer = {"soap": asteria.SOAP, "shampoo": asteria.Shampoo}[name]
    return model, optimizer(list(model.named_parameters()), lr=0.01, precondition_frequency=2,
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
