"""The refresh timeline: when version k of factor set i is snapshotted, from which step it is in use, by
which step it must be, and which step first reads it. Every answer to "when is version k used?" comes from
here; the C++ coherence registry (``cpp/asteria/coherence/registry.h``) enforces the activation part at run
time and its documentation points here.

- **Snapshot** (``RefreshSchedule``): every set is refreshed for the first time at ``start`` (the bootstrap:
  all sets at once, since none has a preconditioner yet); its first ``aligned`` versions (the bootstrap and
  the refreshes used at their own step, ``RuntimeConfig.sync_refreshes``) come on the unstaggered steps
  ``start + k * interval``; after that set i is refreshed every ``interval`` steps from
  ``start + (aligned - 1) * interval + phase_i`` (one interval later for phase 0). Staggering spreads the
  phases over the interval, largest sets first (by their O(n^3) refresh cost) on the step with the least
  cost so far, so that no single step carries every snapshot copy and every job. The sets of small blocks
  (``RuntimeConfig.stagger_small``) are spread by their own cost: by the large ones' they would all land on
  the few steps the large sets leave light, and wait there for a thread behind each other; among steps of equal
  small load they take the one of least load overall. The phases depend only on the sets' shapes and classes,
  never on timing, so a staggered run stays deterministic.
- **Activation** (``ActivationRule``): native mode uses a version from its own snapshot step, as do async
  runs for the first ``sync_refreshes`` versions (waited for). Otherwise, under the deterministic rule a
  version is activated exactly ``lag`` steps after its snapshot; under the newest-finished rule at the first
  activation after its result is done, and at the latest when its block would otherwise fall more than S
  versions behind its newest snapshot (``deadline``). The activation of step t sees the snapshots of step t
  (with a read lag it runs at the start of step t + 1).
- **First read**: the step whose parameter update reads the versions activated for step t is
  t + ``read_lag``: 0 for Shampoo, 1 for SOAP and KL-Shampoo, whose direction is computed while
  accumulating, before the step's own refresh (``SecondOrderOptimizer.ACTIVATION_LAG``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from asteria.checks import check_arg
from asteria.config import RuntimeConfig


def stagger_phases(costs: Sequence[float], interval: int, classes: Sequence[int] | None = None) -> list[int]:
    """Phases in ``[0, interval)`` that balance ``costs`` over the steps of one interval (greedy
    longest-processing-time; ties go to the earliest step, and equal costs keep their order), each of
    ``classes`` (a key per cost; None: one class) balanced on its own, its ties going to the step of least load
    of all classes."""
    classes = [0] * len(costs) if classes is None else list(classes)
    load = {kind: [0.0] * interval for kind in set(classes)}
    total = [0.0] * interval
    phases = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        steps = load[classes[index]]
        slot = min(range(interval), key=lambda s: (steps[s], total[s], s))
        phases[index] = slot
        steps[slot] += costs[index]
        total[slot] += costs[index]
    return phases


class RefreshSchedule:
    """The refresh steps and version numbers of each factor set (version 1 is the bootstrap refresh
    at ``start``; version k + 1 is the k-th refresh after it)."""

    def __init__(self, start: int, interval: int, phases: Sequence[int], aligned: int = 1) -> None:
        if any(not 0 <= p < interval for p in phases):
            raise ValueError(f"Invalid phases={list(phases)}: each must be in [0, {interval})")
        if not isinstance(aligned, int) or aligned < 1:
            raise ValueError(f"Invalid aligned={aligned!r}: must be an int >= 1 (the bootstrap is always aligned)")
        self.start = start
        self.interval = interval
        self.phases = list(phases)
        self.aligned = aligned

    def first_staggered(self, index: int) -> int:
        """The step of set ``index``'s first refresh on its own phase (version ``aligned + 1``)."""
        return self.start + (self.aligned - 1) * self.interval + (self.phases[index] or self.interval)

    def snapshot_step(self, index: int, version: int) -> int:
        """The step at which version ``version`` (>= 1) of set ``index`` is snapshotted."""
        if not isinstance(version, int) or version < 1:
            raise ValueError(f"Invalid version={version!r}: must be an int >= 1 (1 is the bootstrap)")
        if version <= self.aligned:
            return self.start + (version - 1) * self.interval
        return self.first_staggered(index) + (version - self.aligned - 1) * self.interval

    def version_at(self, step: int, index: int) -> int:
        """The newest version of set ``index`` snapshotted at or before ``step`` (0: none yet)."""
        if step < self.start:
            return 0
        first = self.first_staggered(index)
        if step < first:
            return min(self.aligned, 1 + (step - self.start) // self.interval)
        return self.aligned + 1 + (step - first) // self.interval

    def is_refresh_step(self, step: int, index: int) -> bool:
        offset = step - self.start
        if 0 <= offset <= (self.aligned - 1) * self.interval:
            return offset % self.interval == 0
        offset = step - self.first_staggered(index)
        return offset >= 0 and offset % self.interval == 0

    def due(self, step: int) -> list[tuple[int, int]]:
        """``(set index, version)`` of every set refreshed at ``step``."""
        return [(i, self.version_at(step, i)) for i in range(len(self.phases)) if self.is_refresh_step(step, i)]

    def interval_loads(self, sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Per step of the first interval after the aligned refreshes (every set refreshes once in it), the
        blocks refreshed and their work (sum of batch x dim^3), for sets of ``sizes`` (batch, dim)."""
        first = self.start + self.aligned * self.interval
        loads = []
        for step in range(first, first + self.interval):
            due = [sizes[index] for index, _ in self.due(step)]
            loads.append((sum(batch for batch, _ in due), sum(batch * dim**3 for batch, dim in due)))
        return loads


def is_staggered(setting: bool | None, wanted: bool, same_on_every_rank: bool | None) -> bool:
    """Whether the schedule is staggered: ``wanted`` (``RuntimeConfig.stagger_wanted()``) unless the ranks'
    factor sets differ (``same_on_every_rank`` False; None on one process). The replicas of a block must
    refresh it at the same step, and the phases follow the sets, so uneven FSDP2 shards fall back to the
    unstaggered schedule, and an explicit ``stagger=True`` is refused there."""
    if not wanted or same_on_every_rank is None or same_on_every_rank:
        return wanted
    check_arg(setting is None, "stagger", setting,
              "the ranks' factor sets differ (e.g. uneven FSDP2 shards), so their phases would differ and the "
              "replicas of a block would refresh it at different steps: use None or False")
    return False


def plan_schedule(start: int, interval: int, costs: Sequence[float], staggered: bool,
                  sync_refreshes: int, small: Sequence[bool] | None = None) -> RefreshSchedule:
    """The schedule of sets with refresh ``costs`` (batch x dim^3), staggered or not; the versions used at
    their own step (the first ``sync_refreshes``, at least the bootstrap) come on the unstaggered steps.
    ``small`` (per set; ``RuntimeConfig.stagger_small``) spreads the small blocks' sets by their own work."""
    phases = stagger_phases(costs, interval, small) if staggered else [0] * len(costs)
    return RefreshSchedule(start, interval, phases, aligned=max(1, sync_refreshes))


@dataclass(frozen=True)
class ActivationRule:
    """From which step a version is in use, given its snapshot step (see the module's docstring)."""

    #: versions come into use by the schedule alone (True: native mode and the deterministic rule), or each
    #: block takes its newest finished one within the staleness bound (False)
    deterministic: bool
    #: steps from a snapshot to its activation under the deterministic rule (0 in native mode)
    lag: int
    #: S: refresh intervals a block's version in use may lag its newest snapshot (async mode)
    staleness: int
    #: the first versions used at their own snapshot step under either rule (every version in native mode)
    sync_versions: int | None

    @classmethod
    def native(cls) -> ActivationRule:
        """Native (sync) mode: every version in use from its own step."""
        return cls(deterministic=True, lag=0, staleness=0, sync_versions=None)

    @classmethod
    def of(cls, config: RuntimeConfig, interval: int) -> ActivationRule:
        """The rule ``config`` asks for, for refreshes every ``interval`` steps (``lag_steps`` is checked
        against the staleness bound here)."""
        if config.mode == "sync":
            return cls.native()
        return cls(deterministic=bool(config.deterministic), lag=config.activation_lag(interval),
                   staleness=config.staleness, sync_versions=config.sync_refreshes)

    def at_own_step(self, version: int) -> bool:
        """Whether ``version`` is used from its own snapshot step (and waited for there)."""
        return self.sync_versions is None or version <= self.sync_versions

    def activation_step(self, snapshot_step: int, version: int) -> int:
        """The step whose activation ``version``, snapshotted at ``snapshot_step``, is due at: the
        deterministic rule uses it from there on (waiting for it), the newest-finished rule from there
        on at the latest for the versions used at their own step, and otherwise once it is done."""
        return snapshot_step if self.at_own_step(version) else snapshot_step + self.lag


class Timeline:
    """The whole timeline of an optimizer's factor sets: its ``schedule``, its activation ``rule`` and the
    ``read_lag`` from an activation to the update that reads it (see the module's docstring)."""

    def __init__(self, schedule: RefreshSchedule, rule: ActivationRule, read_lag: int) -> None:
        self.schedule = schedule
        self.rule = rule
        self.read_lag = read_lag

    def snapshot_step(self, index: int, version: int) -> int:
        return self.schedule.snapshot_step(index, version)

    def activation_step(self, index: int, version: int) -> int:
        """The step from whose activation version ``version`` of set ``index`` is due (see ``ActivationRule``)."""
        return self.rule.activation_step(self.snapshot_step(index, version), version)

    def deadline(self, index: int, version: int) -> int:
        """The step by whose activation ``version`` (or a newer one) is in use at the latest: its due step,
        except under the newest-finished rule for the versions after the aligned ones, where it is the step
        of the snapshot S versions later (the activation of a step comes after that step's snapshots, and a
        block may lag its newest snapshot by S versions, not more). A snapshot deferred by the executor
        moves it later."""
        if self.rule.deterministic or self.rule.at_own_step(version):
            return self.activation_step(index, version)
        return self.snapshot_step(index, version + self.rule.staleness)

    def first_read(self, index: int, version: int) -> int:
        """The first step whose parameter update reads ``version`` when it comes into use at its due step."""
        return self.activation_step(index, version) + self.read_lag

    def activation_read_at(self, step: int) -> int:
        """The step whose activation the update of ``step`` reads."""
        return step - self.read_lag

    def used_at_once(self, index: int, version: int) -> bool:
        """Whether ``version`` is due at its own snapshot step, where the refresh itself is waited for."""
        return self.activation_step(index, version) <= self.snapshot_step(index, version)


class InstallDelays:
    """How many steps after native mode's each version is first used. Native mode uses a version
    snapshotted at step t from the activation of step t on (SOAP and KL-Shampoo read it from step t + 1),
    so a version's delay is the step whose activation (or, in native mode, whose refresh) installed it,
    minus t: 0 in native mode, exactly ``lag_steps`` (default one interval) under the deterministic rule,
    and under the newest-finished rule how late the workers' result came. Counted per block install, for
    the versions after the first ``excluded`` (the sync refreshes, used at their own step by design).
    Versions a block passes over are not counted. Never negative, as no version is installed before its
    snapshot (one that would be is a bookkeeping error: warned about once and left out)."""

    def __init__(self, schedule: RefreshSchedule, names: Sequence[str], excluded: int,
                 sides: Sequence[int] | None = None) -> None:
        self.schedule = schedule
        self.names = list(names)
        self.sides = list(sides) if sides is not None else None  # each set's factor side, for the by-side view
        self.excluded = excluded
        self.histogram: list[int] = []
        self.per_set = [[0, 0, 0] for _ in self.names]  # installs, summed delay, max delay
        self.anomalies = 0  # installs counted before their snapshot (none unless the bookkeeping is wrong)

    def record(self, step: int, index: int, version: int) -> None:
        if version <= self.excluded:
            return
        snapshot = self.schedule.snapshot_step(index, version)
        delay = step - snapshot
        if delay < 0:  # a bookkeeping error: reported once, never allowed to stop the training step
            if not self.anomalies:
                warnings.warn(f"Asteria: version {version} of {self.names[index]!r} counted as installed at step "
                              f"{step}, before its snapshot at step {snapshot}; install delays exclude it",
                              RuntimeWarning, stacklevel=2)
            self.anomalies += 1
            return
        if delay >= len(self.histogram):
            self.histogram.extend([0] * (delay + 1 - len(self.histogram)))
        self.histogram[delay] += 1
        counts = self.per_set[index]
        counts[0] += 1
        counts[1] += delay
        counts[2] = max(counts[2], delay)

    def stats(self) -> dict[str, object]:
        """``install_delay_mean_steps`` and ``install_delay_max_steps`` over every counted install (None
        before any), ``install_delay_histogram`` (entry d: installs d steps late),
        ``install_delay_by_set`` (per set: its name, installs, mean and max delay) and, given the sets' sides,
        ``install_delay_by_side`` (the same per factor side, ascending: which block sizes wait)."""
        installs = sum(self.histogram)
        total = sum(d * n for d, n in enumerate(self.histogram))
        by_side: dict[int, list[int]] = {}
        for side, (n, summed, top) in zip(self.sides, self.per_set, strict=True) if self.sides is not None else ():
            counts = by_side.setdefault(side, [0, 0, 0])
            counts[0] += n
            counts[1] += summed
            counts[2] = max(counts[2], top)
        return {
            "install_delay_mean_steps": total / installs if installs else None,
            "install_delay_max_steps": len(self.histogram) - 1 if installs else None,
            "install_delay_histogram": list(self.histogram),
            "install_delay_by_set": [{"set": name, **_summary(*counts)}
                                     for name, counts in zip(self.names, self.per_set, strict=True)],
            "install_delay_by_side": [{"side": side, **_summary(*counts)} for side, counts in sorted(by_side.items())],
        }


def _summary(installs: int, summed: int, top: int) -> dict[str, object]:
    """One row of ``InstallDelays.stats``' breakdowns: its installs, mean and max delay (None without installs)."""
    return {"installs": installs, "mean_steps": summed / installs if installs else None,
            "max_steps": top if installs else None}
