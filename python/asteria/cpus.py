"""Where the C++ refresh workers run: a CPU plan that keeps whole physical cores free for the training
thread, which launches the GPU's kernels.

A busy worker on the other hardware thread (SMT sibling) of the training thread's core slows every
kernel launch; so does the OS moving the training thread between cores full of workers. The plan
groups the CPUs this process may use by physical core (``/sys/devices/system/cpu/cpuN/topology/
thread_siblings_list``), splits the cores among the ranks of this node (torchrun's ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE``), keeps the first cores of each rank's share free, and pins that rank's workers
(each to the whole rest of the share, so the kernel balances them) there. The training thread itself
is not pinned: the kernel finds it an idle core among the free ones.

torch's own CPU thread pool would still spread a parallel operator (a batch gather, say) over every
core, and those of its threads that land on a worker core wait behind the workers for a time slice,
which stalls the whole operator. ``TorchThreadCap`` caps that pool at the cores left to this rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SYSFS_CPU = Path("/sys/devices/system/cpu")


def allowed_cpus() -> list[int]:
    """The logical CPUs this process may run on, sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _parse_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def physical_cores(cpus: list[int], sysfs: Path = SYSFS_CPU) -> list[list[int]]:
    """``cpus`` grouped by physical core (SMT siblings together), ordered by their lowest CPU. A CPU
    whose topology cannot be read is a core of its own."""
    seen: set[int] = set()
    cores: list[list[int]] = []
    allowed = set(cpus)
    for cpu in sorted(cpus):
        if cpu in seen:
            continue
        try:
            siblings = _parse_list((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
        except (OSError, ValueError):
            siblings = [cpu]
        core = sorted({c for c in siblings if c in allowed} | {cpu})
        seen.update(core)
        cores.append(core)
    return cores


def rank_share(cores: list[list[int]], local_rank: int, local_world: int) -> list[list[int]]:
    """This rank's contiguous share of ``cores`` when they are split evenly among ``local_world`` ranks."""
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise ValueError(f"Invalid local_rank={local_rank!r}: must be in [0, local_world={local_world})")
    share = len(cores) // local_world
    return cores[local_rank * share:(local_rank + 1) * share]


def plan_worker_cpus(cores: list[list[int]], local_rank: int = 0, local_world: int = 1) -> list[int]:
    """The CPUs of this rank's workers: the rank's share of ``cores`` (contiguous, split evenly) less its
    first cores, kept for the training process (two of a share of 4 or more, one of a share of 2 or 3).
    Empty (do not pin) when the share has a single core or none."""
    mine = rank_share(cores, local_rank, local_world)
    reserve = 2 if len(mine) >= 4 else 1 if len(mine) >= 2 else 0
    if reserve == 0:
        return []
    return sorted(cpu for core in mine[reserve:] for cpu in core)


def local_layout() -> tuple[int, int]:
    """This process's (local rank, ranks on this node) from torchrun's environment; (0, 1) otherwise."""
    try:
        world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0, 1
    if world < 1 or not 0 <= rank < world:
        return 0, 1
    return rank, world


def default_worker_cpus() -> list[int]:
    """The automatic plan for this process (see the module's docstring)."""
    return plan_worker_cpus(physical_cores(allowed_cpus()), *local_layout())


def training_cores(worker_cpus: list[int], local_rank: int = 0, local_world: int = 1) -> int:
    """Physical cores of this rank's share of the allowed CPUs that hold none of ``worker_cpus`` (>= 1)."""
    busy = set(worker_cpus)
    mine = rank_share(physical_cores(allowed_cpus()), local_rank, local_world)
    return max(1, sum(1 for core in mine if not busy.intersection(core)))


class TorchThreadCap:
    """Sets torch's intra-op CPU threads for the life of an optimizer's workers and restores them after.

    ``setting`` is ``RuntimeConfig.torch_threads``: ``"auto"`` caps the threads at the cores left to the
    training process when the workers are pinned (nothing changes otherwise, or if torch already uses
    fewer), ``"keep"`` changes nothing, an int sets exactly that many. With several optimizers alive, the
    count in force is what the live caps make of the count found before the first of them, applied in
    the order they were made; it follows as they close, in any order, and the last one to close puts
    that first count back. Nothing is changed once someone else has changed the count since."""

    _live: list[TorchThreadCap] = []  # caps not yet restored, oldest first
    _original: int | None = None      # the count found when the first live cap was made
    _last_set: int | None = None      # the count the caps left in force

    def __init__(self, setting: int | str, worker_cpus: list[int]) -> None:
        self.previous: int | None = None  # the count this cap found, when it changed it
        self.applied: int | None = None   # the count it set then
        if setting == "keep" or (setting == "auto" and not worker_cpus):
            return
        self.exact = setting != "auto"
        self.target = int(setting) if self.exact else training_cores(worker_cpus, *local_layout())
        current = torch.get_num_threads()
        cls = TorchThreadCap
        if not cls._live or cls._original is None or current != cls._last_set:  # the count as found now
            cls._original = cls._last_set = current
        cls._live.append(self)
        wanted = self._rule(current)
        if wanted != current:
            self.previous, self.applied = current, wanted
            torch.set_num_threads(wanted)
            cls._last_set = wanted

    def _rule(self, count: int) -> int:
        """The count this cap makes of ``count``: its own (an int setting), or at most its own (auto)."""
        return self.target if self.exact else min(count, self.target)

    def restore(self) -> None:
        """Puts back the count the remaining caps make of the original one (the original itself after the
        last), unless someone else has changed it since. Idempotent."""
        cls = TorchThreadCap
        if self not in cls._live:
            return
        cls._live.remove(self)
        self.previous = self.applied = None
        current = torch.get_num_threads()
        if cls._original is not None and current == cls._last_set:
            wanted = cls._original
            for cap in cls._live:
                wanted = cap._rule(wanted)
            if wanted != current:
                torch.set_num_threads(wanted)
            cls._last_set = wanted
        else:  # changed by someone else: theirs to keep, and no cap restores over it
            cls._original = cls._last_set = None
        if not cls._live:
            cls._original = cls._last_set = None
