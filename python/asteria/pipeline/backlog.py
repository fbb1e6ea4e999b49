"""Telling the user, once, that the refresh executor falls behind the schedule, and what to change."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

from asteria.config import RuntimeConfig
from asteria.errors import RefreshBacklogWarning

BACKLOG_MIN_SECONDS = 0.05  # RefreshBacklogWarning: wait time that counts, at least...
BACKLOG_FRACTION = 0.05     # ...and this fraction of the training time it spans


class BacklogMonitor:
    """Looks once per interval, from the first refresh after the start-up ones, at the waits (the
    deterministic rule waits for a late version) and the deferred refreshes (the newest-finished rule defers a
    set's refresh while its previous one is still on its way), and warns once when they show the executor
    cannot keep up: two waits or more that cost at least 5% of the training time since (and 50 ms), or
    refreshes deferred in two intervals. With a device lane the balancer's last plan says how much of the workers'
    time the refresh work takes (its ``load``: the work the lane could not take), which the measured mean job
    cannot: it averages the workers' jobs with the lane's, whose seconds are the GPU's."""

    def __init__(self, config: RuntimeConfig, interval: int) -> None:
        self.config = config
        self.interval = interval
        self.warned = False
        self._next_check = 0
        # The baseline: waits, wait seconds, deferred refreshes, time, refresh seconds, jobs, step.
        self._base: tuple[int, float, int, float, float, int, int] | None = None
        self._deferring_intervals = 0  # intervals in a row that deferred refreshes
        self._last_deferred = 0        # the deferred refreshes counted at the last look

    def check(self, step: int, engine: dict[str, Any], deferred: int, device_seconds: float,
              planned: tuple[float, float] | None = None, now: float | None = None) -> None:
        """``planned``: the balancer's last plan, the share of the workers' and of the device lane's time in an
        interval that it filled (None: no plan, as without a device lane); ``now``: the monotonic clock's time
        (default: now)."""
        if self.warned or step < self._next_check:
            return
        self._next_check = step + self.interval
        waits = engine["registry"]["waits"] + engine["snapshot_waits"]
        seconds = engine["registry"]["wait_seconds"] + engine["snapshot_wait_seconds"]
        now = time.monotonic() if now is None else now
        work_seconds = engine["refresh_seconds"] + device_seconds
        jobs = engine["refreshes_ok"] + engine["refreshes_failed"]
        if self._base is None:
            self._base = (waits, seconds, deferred, now, work_seconds, jobs, step)
            self._last_deferred = deferred
            return
        base_waits, base_seconds, base_deferred, since, _, base_jobs, base_step = self._base
        waited, lost = waits - base_waits, seconds - base_seconds
        self._deferring_intervals = self._deferring_intervals + 1 if deferred > self._last_deferred else 0
        self._last_deferred = deferred
        behind_waits = waited >= 2 and lost >= max(BACKLOG_MIN_SECONDS, BACKLOG_FRACTION * (now - since))
        behind_deferred = self._deferring_intervals >= 2 and now - since >= BACKLOG_MIN_SECONDS
        if not (behind_waits or behind_deferred):
            return
        self.warned = True
        pool = engine["pool"]
        # The refresh work of one interval against what the workers have in an interval of training without the
        # waits: the balancer's planned share of that time where it plans; else the jobs done and the ones
        # deferred, at the mean time of a job (seconds on either side, the same whatever the interval).
        intervals = max((step - base_step) / self.interval, 1e-9)
        capacity = pool["workers"] * max(now - since - lost, 1e-9) / intervals
        if planned is not None:
            work = planned[0] * capacity
        else:
            work = work_seconds / max(jobs, 1) * (jobs - base_jobs + deferred - base_deferred) / intervals
        if behind_waits:
            what = (f"step() waited {waited} times for the refresh workers between the first interval and step "
                    f"{step} ({lost:.2f} s, {lost / max(now - since, 1e-9):.0%} of that time)")
        else:
            what = (f"{deferred - base_deferred} block refreshes were deferred between the first interval and step "
                    f"{step}, each because its set's previous refresh was still on its way")
        plan = (f" The balancer's last plan left the workers {planned[0]:.2f}x their time in an interval and the "
                f"device lane {planned[1]:.2f}x its share." if planned is not None else "")
        text = (f"Asteria: {what}; the {pool['workers']} workers were busy {pool['busy_fraction']:.0%} of the time."
                + plan + backlog_advice(self.config, self.interval, work, capacity))
        warnings.warn(RefreshBacklogWarning(text), stacklevel=6)

def backlog_advice(config: RuntimeConfig, interval: int, work: float, capacity: float) -> str:
    """What to change when the executor falls behind, from the refresh work of an interval and the workers'
    time in one (both in seconds, measured): with the work within the capacity, single refreshes outlast the
    lag (the deterministic rule) or the interval (the newest-finished rule: a set's next turn finds its version
    still on its way, on the workers or the device lane); otherwise the executor is short of time."""
    lag_steps = config.lag_steps
    deterministic = config.resolved_deterministic(several_ranks=False)
    if work <= capacity:
        keep_up = (f" They keep up with the refresh work (about {work:.3g} CPU-seconds an interval against "
                   f"{capacity:.3g} worker-seconds of training), but ")
        if deterministic:
            lag = f"lag_steps={lag_steps} steps" if lag_steps is not None else f"the default lag of {interval} steps"
            return (keep_up + f"jobs take longer than {lag}: raise RuntimeConfig.lag_steps (at most staleness x "
                    f"precondition_frequency = {config.staleness * interval}).")
        return (keep_up + f"single refreshes stay on their way longer than an interval of {interval} steps: raise "
                f"RuntimeConfig.in_flight (now {config.in_flight}) or precondition_frequency.")
    enough = math.ceil(interval * 1.25 * work / capacity)
    other = (" or deterministic=False (the device lane then takes what the workers cannot)" if deterministic else
             f", RuntimeConfig.device_share (now {config.device_share})")
    bound = (f"lag_steps (now {lag_steps}), " if lag_steps is not None else "") + f"staleness (now {config.staleness})"
    return (f" The refresh work of an interval takes longer than the interval: about {work:.3g} CPU-seconds "
            f"against {capacity:.3g} worker-seconds of training. Raise precondition_frequency (now {interval}; "
            f"about {enough} would keep up), {bound}, RuntimeConfig.workers{other}, or train with fewer, larger "
            f"steps.")
