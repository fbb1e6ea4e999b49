"""Where the C++ refresh workers run: a CPU plan that keeps whole physical cores free for the training
thread, which launches the GPU's kernels.

A busy worker on the other hardware thread (SMT sibling) of the training thread's core slows every
kernel launch; so does the OS moving the training thread between cores full of workers. The plan
groups the CPUs this process may use by physical core (``/sys/devices/system/cpu/cpuN/topology/
thread_siblings_list``), splits the cores among the ranks of this node (torchrun's ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE``), keeps the first cores of each rank's share free, and pins that rank's workers
(each to the whole rest of the share, so the kernel balances them) there. The training thread itself
is not pinned: the kernel finds it an idle core among the free ones.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def plan_worker_cpus(cores: list[list[int]], local_rank: int = 0, local_world: int = 1) -> list[int]:
    """The CPUs of this rank's workers: the rank's share of ``cores`` (contiguous, split evenly) less its
    first cores, kept for the training process (two of a share of 4 or more, one of a share of 2 or 3).
    Empty (do not pin) when the share has a single core or none."""
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise ValueError(f"Invalid local_rank={local_rank!r}: must be in [0, local_world={local_world})")
    share = len(cores) // local_world
    mine = cores[local_rank * share:(local_rank + 1) * share]
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
