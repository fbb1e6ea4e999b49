"""When each factor set is refreshed: the refresh schedule, optionally staggered within the interval.

Every set is refreshed for the first time at ``start`` (the bootstrap: all sets at once, since no set
has a preconditioner yet), and its first ``aligned`` versions (the bootstrap and the refreshes used at
their own step, ``RuntimeConfig.sync_refreshes``) come on the unstaggered steps ``start + k * interval``.
After that, set i is refreshed every ``interval`` steps from ``start + (aligned - 1) * interval +
phase_i`` (one interval later for phase 0). Without staggering every phase is 0 and all sets refresh
on the same steps. With staggering the phases spread the sets over the interval so that no single step
carries every snapshot copy and every job: sets are placed largest first (by their O(n^3) refresh cost)
on the step of the interval with the least cost so far.

So a staggered set's versions never come later than an unstaggered set's, and the versions used at
their own step are the unstaggered ones. An earlier schedule started the phases after the bootstrap,
so that some sets waited up to 2 * interval - 1 steps for their second version; on olmo-160m it went
with an 8.5% higher loss for native KL-Shampoo after 250 steps (one seed; docs/results.md). Staggering
the aligned versions as well made them come from fewer gradients, which cost 0.8-3.5% on the tiny preset
under the deterministic rule, where each such version stays in use for S intervals.

The phases depend only on the sets' shapes, never on timing, so a staggered run stays deterministic.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence


def stagger_phases(costs: Sequence[float], interval: int) -> list[int]:
    """Phases in ``[0, interval)`` that balance ``costs`` over the steps of one interval (greedy
    longest-processing-time; ties go to the earliest step, and equal costs keep their order)."""
    load = [0.0] * interval
    phases = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        slot = min(range(interval), key=lambda s: (load[s], s))
        phases[index] = slot
        load[slot] += costs[index]
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


class InstallDelays:
    """How many steps after native mode's each version is first used. Native mode uses a version
    snapshotted at step t from the activation of step t on (SOAP and KL-Shampoo read it from step t + 1),
    so a version's delay is the step whose activation (or, in native mode, whose refresh) installed it,
    minus t: 0 in native mode, exactly ``lag_steps`` (default S intervals) under the deterministic rule,
    and under the newest-finished rule how late the workers' result came. Counted per block install, for
    the versions after the first ``excluded`` (the sync refreshes, used at their own step by design).
    Versions a block passes over are not counted. Never negative, as no version is installed before its
    snapshot (one that would be is a bookkeeping error: warned about once and left out)."""

    def __init__(self, schedule: RefreshSchedule, names: Sequence[str], excluded: int) -> None:
        self.schedule = schedule
        self.names = list(names)
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
        before any), ``install_delay_histogram`` (entry d: installs d steps late) and
        ``install_delay_by_set`` (per set: its name, installs, mean and max delay)."""
        installs = sum(self.histogram)
        total = sum(d * n for d, n in enumerate(self.histogram))
        return {
            "install_delay_mean_steps": total / installs if installs else None,
            "install_delay_max_steps": len(self.histogram) - 1 if installs else None,
            "install_delay_histogram": list(self.histogram),
            "install_delay_by_set": [{"set": name, "installs": n, "mean_steps": summed / n if n else None,
                                      "max_steps": top if n else None}
                                     for name, (n, summed, top) in zip(self.names, self.per_set)],
        }
