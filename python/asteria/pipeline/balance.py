"""Which factor sets the device lane refreshes and which the C++ workers do, from what each side has been
measured to take.

Per interval of ``interval`` steps (T seconds of training: ``interval`` times the median step of the last
interval), the workers can give ``workers * T * WORKER_UTILIZATION`` CPU-seconds and the device lane ``T *
device_share`` seconds (``RuntimeConfig.device_share`` times the lane's threads, whose measured seconds per block
are those of refreshes running side by side). A set costs its blocks' refresh time on each side: the workers' mean
seconds per block of its size (the engine times every job; before any, a prior from one timed root of a small
block, scaled by n^3), and the lane's (it times every set; the start-up refreshes run there, so every size has a
figure before the first plan). The plan puts every set on the workers; while they cannot finish them within the
interval, it moves to the lane the sets where the lane is most ahead of the workers, one at a time, as long as the
lane's share of the interval holds them; the large blocks go to the device first, where an eigendecomposition gains
most, but where a large set would move more than the workers lack, smaller sets make up the rest if that takes less
of the device (``cover``). Work the workers can do stays with them: the device's time is the training's (a
refresh on the GPU beside training lengthens the steps by about its own time), and ``device_share`` caps it; what
neither side can finish is deferred, set by set. It is made again every interval, so it follows the measured
step time and throughputs; a set changes sides only between two of its versions.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from asteria.pipeline.factors import FactorSet

#: the share of the workers' time the plan fills. All of it: a reserve kept on the workers goes to the lane, whose
#: time is the training's (at 160m, 32 x 1024, on an H100, a 15% reserve gave the lane half an interval where a
#: quarter served, and the steps 1.20x AdamW's against 1.10x, with nothing deferred either way; docs/results.md).
#: Where the workers are short, a full plan defers a little more (at 8 x 1024 up to 1% of the refreshes)
WORKER_UTILIZATION = 1.0


class LaneBalancer:
    """Plans the sides of the factor sets (see the module docstring).

    Thread safety: the training thread's only."""

    def __init__(self, sets: list[FactorSet], interval: int, workers: int, device_share: float,
                 cpu_prior: dict[int, float]) -> None:
        self.sets = sets
        self.interval = interval
        self.workers = workers
        self.device_share = device_share
        self.cpu_prior = cpu_prior  # n -> per-core seconds of one block before any measurement
        self.cpu_seconds: dict[int, float] = {}  # n -> measured per-core seconds of one block
        self.device_seconds: dict[int, float] = {}  # n -> measured device seconds of one block
        #: the median of the last ``interval`` step times: a mean would carry the start-up refreshes' seconds-long
        #: steps (waited for by design) into the first plans as capacity the interval does not have
        self.step_seconds: float | None = None
        self._recent: deque[float] = deque(maxlen=max(interval, 3))
        self._last_step: tuple[int, float] | None = None
        self.plan: list[bool] = [False] * len(sets)  # per set: on the device lane
        self.plans = 0
        self.load = (0.0, 0.0)  # the last plan's share of each side's capacity (workers, device)

    def observe_step(self, step: int, now: float | None = None) -> None:
        """Notes that ``step`` is being activated at ``now`` (default: the monotonic clock's now; the wall clock
        between steps is the step time)."""
        now = time.monotonic() if now is None else now
        if self._last_step is not None and step == self._last_step[0] + 1:
            self._recent.append(now - self._last_step[1])
            self.step_seconds = statistics.median(self._recent)
        if self._last_step is None or step > self._last_step[0]:
            self._last_step = (step, now)

    def observe_costs(self, cpu: dict[int, tuple[float, int]], device: dict[int, tuple[float, int]]) -> None:
        """The sides' cumulative (seconds, blocks) per block size, as the engine and the lane report them."""
        for measured, into in ((cpu, self.cpu_seconds), (device, self.device_seconds)):
            for n, (seconds, blocks) in measured.items():
                if blocks:
                    into[n] = seconds / blocks

    def cpu_cost(self, n: int) -> float:
        if n in self.cpu_seconds:
            return self.cpu_seconds[n]
        if self.cpu_seconds:  # scale the nearest measured size by n^3
            m = min(self.cpu_seconds, key=lambda k: abs(k - n))
            return self.cpu_seconds[m] * (n / m) ** 3
        return self.cpu_prior[n]

    def device_cost(self, n: int) -> float | None:
        return self.device_seconds.get(n)

    def replan(self) -> list[bool]:
        """Plans the sides now from the latest measurements; returns (and keeps) the plan. Without a measured
        step time or a device figure for every size, every set stays on the workers."""
        self.plans += 1
        plan = [False] * len(self.sets)
        costs = [(self.cpu_cost(s.dim) * s.batch, self.device_cost(s.dim)) for s in self.sets]
        if self.step_seconds is None or any(device is None for _, device in costs):
            self.plan = plan
            return plan
        seconds = self.step_seconds * self.interval
        cpu_capacity = self.workers * seconds * WORKER_UTILIZATION
        device_capacity = seconds * self.device_share
        if device_capacity <= 0:
            self.plan = plan
            return plan
        cpu_load = sum(cpu for cpu, _ in costs)
        sides = [(cpu, device * s.batch) for (cpu, device), s in zip(costs, self.sets, strict=True)]
        # The device's advantage over the workers, largest first (ties: the larger sets first).
        order = sorted(range(len(sides)), key=lambda i: (-sides[i][0] / sides[i][1], -sides[i][0]))
        items = [sides[i] for i in order]
        device_load = 0.0
        for position in cover(items, cpu_load - cpu_capacity, device_capacity):
            plan[order[position]] = True
            cpu_load -= items[position][0]
            device_load += items[position][1]
        self.plan = plan
        self.load = (cpu_load / cpu_capacity, device_load / device_capacity)
        return plan


def cover(items: list[tuple[float, float]], need: float, room: float) -> list[int]:
    """Which of ``items`` (a set's worker seconds, its device seconds), given by the device's advantage, largest
    first, move to the device so that their worker seconds reach ``need`` within ``room`` device seconds; returns
    their positions. By the order, the device's time is spent where it saves the workers most; but where a set
    would overshoot what is left of ``need`` (at 160M a set of two 2048 blocks is a sixteenth to over a sixth of the
    workers' interval), the later, smaller sets cover the rest instead if that takes less of the device, whose time
    is the training's. Short of ``need`` where ``room`` runs out: the rest is deferred."""
    # Walked as a loop, not recursion (many equal sets overshooting in turn would nest one call per set): each level
    # takes sets by the order until one overshoots, and the next level, from the set after it with the same need
    # and room, is the alternative to that set; the levels are then settled from the last.
    levels: list[tuple[list[int], int, float]] = []  # (sets taken, the set that overshot, the need it overshot)
    start, chosen = 0, []
    while True:
        overshoot = None
        for k in range(start, len(items)):
            cpu, device = items[k]
            if need <= 0:
                break
            if device > room:  # the device's share is a cap: beyond it refreshes defer
                continue
            if cpu > need:
                overshoot = k
                break
            chosen.append(k)
            need -= cpu
            room -= device
        if overshoot is None:
            break
        levels.append((chosen, overshoot, need))
        start, chosen = overshoot + 1, []
    while levels:
        taken, k, short = levels.pop()
        rest_cpu = sum(items[j][0] for j in chosen)
        rest_device = sum(items[j][1] for j in chosen)
        chosen = taken + (chosen if rest_cpu >= short and rest_device < items[k][1] else [k])
    return chosen
