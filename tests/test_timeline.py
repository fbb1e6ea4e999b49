"""The refresh timeline (``asteria.pipeline.timeline``): when version k of a factor set is snapshotted,
from which step it is in use, by which step it must be and which update first reads it. The tables are
worked out by hand from the rules in the module's docstring; the last tests check that an optimizer's
installs happen where its timeline says."""

from __future__ import annotations

import pytest
import torch

import asteria
from asteria.pipeline.timeline import ActivationRule, RefreshSchedule, Timeline

# Two sets, start 10, interval 10; set 1 on phase 3. (aligned, set, version) -> snapshot step.
SNAPSHOTS = [
    # one aligned version: the bootstrap at 10, then phase 0 one interval later and phase 3 three steps later
    (1, 0, 1, 10), (1, 0, 2, 20), (1, 0, 3, 30), (1, 1, 1, 10), (1, 1, 2, 13), (1, 1, 3, 23), (1, 1, 5, 43),
    # two aligned versions (sync_refreshes=2): 10 and 20 for both, then the phases from 20 on
    (2, 0, 2, 20), (2, 0, 3, 30), (2, 0, 4, 40), (2, 1, 2, 20), (2, 1, 3, 23), (2, 1, 4, 33),
    # three aligned: 10, 20, 30, then set 1 at 33
    (3, 1, 3, 30), (3, 1, 4, 33), (3, 0, 4, 40),
]


@pytest.mark.parametrize("aligned, index, version, step", SNAPSHOTS)
def test_snapshot_steps(aligned, index, version, step):
    schedule = RefreshSchedule(start=10, interval=10, phases=[0, 3], aligned=aligned)
    assert schedule.snapshot_step(index, version) == step
    assert schedule.version_at(step, index) == version
    assert schedule.version_at(step - 1, index) == version - 1
    assert (index, version) in schedule.due(step)


# (config, interval) -> the rule, then (version, snapshot step) -> activation step.
RULES = [
    # native mode: every version in use from its own step
    (dict(mode="sync"), 10, (True, 0), [(1, 10, 10), (2, 20, 20), (7, 70, 70)]),
    # deterministic, lag_steps None: one interval (at most S intervals); the first 2 versions at once
    (dict(mode="async", deterministic=True, staleness=5), 10, (True, 10), [(1, 10, 10), (2, 20, 20), (3, 30, 40)]),
    (dict(mode="async", deterministic=True, staleness=5, lag_steps=50), 10, (True, 50), [(2, 20, 20), (3, 33, 83)]),
    (dict(mode="async", deterministic=True, staleness=5, lag_steps=4, sync_refreshes=0), 10, (True, 4),
     [(1, 10, 14), (2, 20, 24)]),
    # staleness 0: the lag is 0, so async follows the sync timeline
    (dict(mode="async", deterministic=True, staleness=0), 10, (True, 0), [(3, 30, 30)]),
    # the bound caps the default lag: S = 1 at interval 10 is 10 steps; at interval 1 it is 1
    (dict(mode="async", deterministic=True, staleness=1), 1, (True, 1), [(3, 3, 4)]),
    # newest-finished: due (waited for) at own step for the sync versions; later ones once done
    (dict(mode="async", deterministic=False, staleness=2, sync_refreshes=1), 10, (False, 10),
     [(1, 10, 10), (2, 20, 30)]),
]


@pytest.mark.parametrize("kwargs, interval, rule, table", RULES)
def test_activation_steps(kwargs, interval, rule, table):
    made = ActivationRule.of(asteria.RuntimeConfig(**kwargs), interval)
    assert (made.deterministic, made.lag) == rule
    for version, snapshot, activation in table:
        assert made.activation_step(snapshot, version) == activation, (version, snapshot)


def test_a_lag_beyond_the_bound_is_refused_by_name():
    with pytest.raises(ValueError, match=r"lag_steps.*51.*staleness x precondition_frequency = 5 x 10 = 50"):
        ActivationRule.of(asteria.RuntimeConfig(mode="async", deterministic=True, lag_steps=51), 10)


# Timeline of the two sets above with two aligned versions: (rule, read lag) -> (set, version) ->
# (activation, deadline, first read).
TIMELINES = [
    (ActivationRule(deterministic=True, lag=10, staleness=5, sync_versions=2), 0,
     [(0, 2, 20, 20, 20), (0, 3, 40, 40, 40), (1, 3, 33, 33, 33), (1, 4, 43, 43, 43)]),
    (ActivationRule(deterministic=True, lag=10, staleness=5, sync_versions=2), 1,
     [(0, 1, 10, 10, 11), (1, 3, 33, 33, 34)]),
    # newest-finished with S = 2: version 3 of set 1 (snapshot 23) must be in use by the activation of
    # step 43, which follows the snapshot of version 5 at that step.
    (ActivationRule(deterministic=False, lag=10, staleness=2, sync_versions=2), 0,
     [(0, 2, 20, 20, 20), (0, 3, 40, 50, 40), (1, 3, 33, 43, 33)]),
    (ActivationRule.native(), 1, [(0, 3, 30, 30, 31), (1, 3, 23, 23, 24)]),
]


@pytest.mark.parametrize("rule, read_lag, table", TIMELINES)
def test_timeline(rule, read_lag, table):
    timeline = Timeline(RefreshSchedule(start=10, interval=10, phases=[0, 3], aligned=2), rule, read_lag)
    for index, version, activation, deadline, first_read in table:
        assert timeline.activation_step(index, version) == activation
        assert timeline.deadline(index, version) == deadline
        assert timeline.first_read(index, version) == first_read
        assert timeline.activation_read_at(first_read) == activation
        assert timeline.used_at_once(index, version) == (activation == timeline.snapshot_step(index, version))


def _installs(make, runtime: asteria.RuntimeConfig, steps: int = 30):
    """Trains a small MLP (factor sets of 3, 6 and 10) for ``steps`` steps; returns the optimizer, every
    block install as (activation step, set, version), and per step and set the oldest version in use and
    the newest snapshotted."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(10, 3, bias=False))
    x, y = torch.randn(64, 6), torch.randn(64, 3)
    opt = make(model.parameters(), lr=0.01, precondition_frequency=3, runtime=runtime)
    seen: list[tuple[int, int, int]] = []
    record = opt._delays.record
    opt._delays.record = lambda step, index, version: (seen.append((step, index, version)),
                                                       record(step, index, version))
    versions: list[list[tuple[int, int]]] = [[]]  # per step (from 1): (oldest in use, newest snapshot)
    with opt:
        for step in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[step % 4 * 16:][:16]), y[step % 4 * 16:][:16]).backward()
            opt.step()
            versions.append([(min(s.versions), newest)
                             for s, newest in zip(opt._refresher.sets, opt._refresher._newest_versions, strict=True)])
    return opt, seen, versions


OPTIMIZERS = {"shampoo": asteria.Shampoo, "soap": asteria.SOAP}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_deterministic_rule_installs_every_version_at_its_activation_step(name):
    runtime = asteria.RuntimeConfig(mode="async", deterministic=True, staleness=2, workers=1, stagger=True)
    opt, seen, _ = _installs(OPTIMIZERS[name], runtime)
    timeline = opt.timeline
    assert len(set(timeline.schedule.phases)) > 1  # staggered: the sets' timelines differ
    assert seen and all(step == timeline.activation_step(index, version) for step, index, version in seen), seen
    last = timeline.activation_read_at(30)  # the last activation the 30 steps made
    due = {(i, v) for i in range(len(timeline.schedule.phases)) for v in range(1, 20)
           if timeline.activation_step(i, v) <= last}
    assert {(index, version) for _, index, version in seen} == due


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_newest_finished_rule_installs_within_the_bound(name):
    staleness = 1
    runtime = asteria.RuntimeConfig(mode="async", deterministic=False, staleness=staleness, workers=1, stagger=True)
    opt, seen, versions = _installs(OPTIMIZERS[name], runtime)
    timeline = opt.timeline
    assert seen
    for step, index, version in seen:
        if timeline.rule.at_own_step(version):
            assert step == timeline.snapshot_step(index, version)
        else:  # the activation of a step follows its snapshots: a quick result may be in use at once
            assert timeline.snapshot_step(index, version) <= step
    # The bound, on the snapshots as they happened (a busy worker defers a set's turn): the activation of
    # step t uses versions at most S behind the newest snapshot by step t. It is made at the end of step t,
    # or with a read lag at the start of step t + 1.
    for step in range(1, 31):
        activation = timeline.activation_read_at(step)
        if activation >= 1:
            for (oldest, _), (_, newest) in zip(versions[step], versions[activation], strict=True):
                assert oldest >= newest - staleness, (step, versions[step])
