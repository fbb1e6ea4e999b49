"""Runtime and memory configuration of the Asteria optimizers."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from asteria import cpus

MODES = ("sync", "async")
PLACEMENTS = ("auto", "device", "host", "device_view")
MAX_STALENESS = 1000  # async mode keeps up to S + 1 host snapshots of each block
MAX_FREQUENCY = 10**6  # precondition_frequency: the schedule keeps per-step tables of an interval
MAX_THREADS = 1024  # workers, blas_threads: beyond any host's cores
MAX_TIMEOUT_S = 1e7  # about 115 days; the core counts waits in int64 nanoseconds
MIN_TIMEOUT_S = 1e-6  # a microsecond: the core's waits are whole nanoseconds
MAX_COUNT = 2**31 - 1  # sync_refreshes, max_consecutive_failures, max_nonfinite_grad_steps: C ints in the core
NONFINITE_POLICIES = ("skip", "raise")


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"Invalid {name}={value!r}: {allowed}")


@dataclass(kw_only=True)
class MemoryConfig:
    """Where second-order state may live. Budgets are bytes; ``None`` means unlimited.

    Factors and per-step moments always live on the parameters' device, and the refresh buffers
    (snapshots, computed versions) in pinned host memory. ``placement`` says where the preconditioners
    in use live (see ``asteria.pipeline.tiers``): ``"device"`` (as native implementations keep them),
    ``"host"`` (pinned host memory, staged each step through a small device ring of at most two
    groups per shape), ``"device_view"`` (pinned host memory read in place by the device: for
    coherent-memory machines) or ``"auto"`` (``"device_view"`` on a coherent-memory device, else
    ``"device"``, or ``"host"`` when ``"device"`` would exceed ``gpu_budget``). Host placements need
    ``mode="async"``: the native ``"sync"`` mode is the all-device baseline. ``group_bytes`` bounds
    the preconditioner bytes of one batched shape group (default: 32 MiB under the host placements,
    unbounded on the device), which bounds the staging ring. The optimizer checks the budgets against
    the bytes each tier needs before the first step and raises, listing them, when one cannot be met.
    With ``nvme_dir`` (async mode, preconditioners in host memory: placement ``"host"``, or CPU
    parameters), sets of preconditioners move to page files in a fresh directory under it, largest
    shapes first, until the host state fits ``host_budget``; they are read back every step ahead of use
    (see ``asteria.pipeline.nvme``), and the directory is removed at ``close()``. ``nvme_budget`` bounds
    the bytes of those page files: the optimizer refuses a model whose host state needs more of them to
    fit ``host_budget``.
    """

    gpu_budget: int | None = None
    host_budget: int | None = None
    nvme_dir: str | None = None
    nvme_budget: int | None = None
    placement: Literal["auto", "device", "host", "device_view"] = "auto"
    group_bytes: int | None = None

    def __post_init__(self) -> None:
        _plain_fields(self)
        for name in ("gpu_budget", "host_budget", "nvme_budget", "group_bytes"):
            value = getattr(self, name)
            _check(value is None or (is_int(value) and value > 0), name, value,
                   "must be None or a positive number of bytes")
        _check(self.placement in PLACEMENTS, "placement", self.placement, f"must be one of {PLACEMENTS}")
        if isinstance(self.nvme_dir, os.PathLike):
            self.nvme_dir = os.fspath(self.nvme_dir)
        _check(self.nvme_dir is None or (isinstance(self.nvme_dir, str) and self.nvme_dir.strip() != ""),
               "nvme_dir", self.nvme_dir, "must be None or a directory path (a str or os.PathLike)")
        _check(self.nvme_budget is None or self.nvme_dir is not None, "nvme_budget", self.nvme_budget,
               "bounds the page files under nvme_dir: set nvme_dir too, or leave nvme_budget None")


@dataclass(kw_only=True)
class RuntimeConfig:
    """How preconditioner refreshes are computed and scheduled.

    Attributes:
        mode: ``"sync"`` computes every refresh inside ``step()`` on the parameter's device with torch
            (the native baseline, as Meta's Distributed Shampoo does). ``"async"`` snapshots the
            factors into host buffers and computes the refresh on the C++ workers.
        staleness: S >= 0. A block's preconditioner in use is at most S refresh intervals behind its
            newest snapshot; the optimizer waits (bounded barrier) rather than exceed it.
            ``staleness=0`` in async mode reproduces the sync trajectory (to rounding: the eigensolvers
            differ), as long as both modes use the same schedule, which they do unless ``stagger=True``
            is given to one of them only.
        workers: C++ worker threads; ``None``: one per CPU of the workers' set (``worker_cpus``), capped
            at 32; unpinned, this rank's share of the CPUs less 2 (cores left to the training process
            and its data loader).
        worker_cpus: where the workers run. ``"auto"``: pinned off the first physical cores of this
            rank's share of the machine (SMT siblings included), which stay free for the training
            thread that launches the GPU's kernels (see ``asteria.cpus``); ``"any"``: not
            pinned; or a sequence of logical CPUs this process may use.
        torch_threads: torch's intra-op CPU threads while the workers run (restored by ``close()``).
            ``"auto"``: when the workers are pinned, at most the physical cores left to this rank's
            training process, so that a parallel CPU operator of the training loop does not wait for
            time slices on the workers' cores; ``"keep"``: unchanged; or an int >= 1.
        worker_nice: 0..19, how far below the training thread the workers' CPU priority sits (Linux
            per-thread nice), so that the thread launching the GPU's work never queues behind them.
        blas_threads: BLAS threads per worker job (results do not depend on ``workers``, so runs with
            different worker counts are bitwise identical as long as this stays the same).
        deterministic: ``True``: versions come into use by schedule only (``lag_steps`` after their snapshot),
            never by timing, so that runs are bitwise reproducible with any worker count and every rank uses
            the same version at the same step; a version's host buffers are kept for the whole lag. ``False``:
            each block uses its newest finished version from the next step, and a set's refresh that comes
            due while its previous one is still on its way is deferred to its next turn. ``None``: ``True``
            on several ranks (which need it), with ``lag_steps`` given or at ``staleness=0``, else ``False``.
        lag_steps: under the deterministic rule, the steps from a version's snapshot to its first use:
            at most ``staleness`` x ``precondition_frequency`` (checked when the optimizer is built).
            ``None``: one interval (``precondition_frequency`` steps, capped by that bound). A short lag keeps
            what the rule guarantees (runs reproducible bit for bit, every rank on the same version at the same
            step) with fresher versions and fewer host buffers (``lag_steps // precondition_frequency + 1`` per
            block); ``step()`` waits for a version the workers have not finished by then. Not used by
            ``mode="sync"``; with ``deterministic=False`` it is an error.
        stagger: spread the refreshes of the factor sets over the steps of each interval (balanced by
            their O(n^3) cost) instead of refreshing all of them on one step, so that no step carries
            the whole burst of snapshot copies and jobs. ``None``: on in async mode, off in sync mode
            (the native baseline refreshes everything together) and off where async mode uses every
            version at its own step (``staleness=0`` or ``lag_steps=0``), so that it follows the sync
            trajectory; on several ranks only where every rank has the same factor sets (DDP), as a
            block's replicas must refresh it at the same step. Deterministic either way.
        stagger_split: also cut the factor sets that would carry more than an even share
            (1 / ``precondition_frequency``) of an interval's refresh work, so that the stagger can spread
            it evenly: a set is refreshed whole at one step, and one large set (48 blocks of 1024 in a
            160M-parameter model) otherwise brings most of a step's jobs at once. Only what a refresh
            covers changes, not the math: preconditioners on the device are refreshed in runs of blocks
            (views of the whole group, which the step still computes as one batch); the other placements
            split the shape groups. ``None``: on wherever the schedule is staggered on one process (async
            mode by default); on several ranks only when asked. True needs ``stagger`` not False.
        sync_refreshes: the first ``sync_refreshes`` versions of every factor set (the bootstrap
            eigendecomposition, then the first refreshes after it) are waited for at their own step
            (lag 0) under either rule, so that training does not run S intervals on the grafting
            direction alone, nor on a basis taken from a handful of gradients: a late basis costs most
            while the factors are young (SOAP's loss, measured in ``docs/results.md``). Later versions
            follow the rule of ``deterministic``. 0: none.
        timeout_s: the longest any wait (barrier, buffer) may take before a ``TimeoutError``.
        max_consecutive_failures: refreshes of one block that may fail in a row (the last good
            preconditioner stays in use meanwhile) before ``step()`` raises ``RefreshError``.
        nonfinite_grad_policy: what to do with a block whose gradient holds NaN/Inf: ``"skip"`` leaves
            its state and parameter untouched for that step and counts it; ``"raise"`` raises.
        max_nonfinite_grad_steps: skipped steps per block, counted in a row, before ``step()`` raises.
        in_flight: under the newest-finished rule, how many versions of a factor set may be on their way at
            once (each holds a snapshot and a result buffer per block in pinned host memory). A set's refresh
            that comes due beyond that is deferred to its next turn, so the work never queues behind itself;
            more lets a newer version queue behind an older one and supersede it before it starts.
        device_refresh: whether the refresh executor may compute on the parameters' device beside the
            workers (``asteria.pipeline.device_lane``). ``None``: where the parameters and preconditioners are
            on a GPU; there the start-up refreshes run on the device (where they are fastest), and under the
            newest-finished rule the sets the workers cannot finish within an interval go to it too. ``False``:
            the workers compute everything. ``True``: also for CPU parameters (a torch thread beside the
            workers; for tests).
        device_share: (0, 1], the share of an interval's wall time the device lane's work may fill when
            the balancer plans it: lower keeps training steps shorter, at the cost of deferred refreshes
            when the workers and that share together cannot keep up.
        memory: tier placement and budgets.
        process_group, local_world_size: distributed layout (defaults: WORLD and torchrun's
            LOCAL_WORLD_SIZE when torch.distributed is initialized). A group smaller than the world must
            run CPU tensors on Gloo (``dist.new_group(ranks, backend="gloo")``, or ``"cpu:gloo,cuda:nccl"``);
            its node size (``local_world_size``: the group's ranks per node, not the host's processes)
            defaults to how many of its ranks each host holds.
    """

    mode: Literal["sync", "async"] = "async"
    staleness: int = 5
    workers: int | None = None
    blas_threads: int = 1
    worker_cpus: Sequence[int] | Literal["auto", "any"] = "auto"
    torch_threads: int | Literal["auto", "keep"] = "auto"
    worker_nice: int = 10
    deterministic: bool | None = None
    lag_steps: int | None = None
    stagger: bool | None = None
    stagger_split: bool | None = None
    sync_refreshes: int = 2
    timeout_s: float = 600.0
    max_consecutive_failures: int = 3
    nonfinite_grad_policy: Literal["skip", "raise"] = "skip"
    max_nonfinite_grad_steps: int = 10
    in_flight: int = 1
    device_refresh: bool | None = None
    device_share: float = 1.0
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    process_group: Any = None
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        _plain_fields(self)
        _check(self.mode in MODES, "mode", self.mode, f"must be one of {MODES}")
        _check(is_int(self.staleness) and 0 <= self.staleness <= MAX_STALENESS, "staleness", self.staleness,
               f"must be an int in [0, {MAX_STALENESS}] (async mode keeps up to S + 1 snapshots of each block)")
        _check(self.workers is None or (is_int(self.workers) and 1 <= self.workers <= MAX_THREADS), "workers",
               self.workers, f"must be None or an int in [1, {MAX_THREADS}]")
        _check(is_int(self.blas_threads) and 1 <= self.blas_threads <= MAX_THREADS, "blas_threads", self.blas_threads,
               f"must be an int in [1, {MAX_THREADS}]")
        if not (isinstance(self.worker_cpus, str) and self.worker_cpus in ("auto", "any")):
            allowed = cpus.allowed_cpus()
            _check(isinstance(self.worker_cpus, Sequence) and not isinstance(self.worker_cpus, str)
                   and len(self.worker_cpus) > 0
                   and all(is_int(c) and c in allowed for c in self.worker_cpus), "worker_cpus", self.worker_cpus,
                   f"must be 'auto', 'any' or a non-empty sequence of CPUs this process may use ({allowed})")
        _check(self.torch_threads in ("auto", "keep")
               or (is_int(self.torch_threads) and 1 <= self.torch_threads <= MAX_THREADS),
               "torch_threads", self.torch_threads, f"must be 'auto', 'keep' or an int in [1, {MAX_THREADS}]")
        _check(is_int(self.worker_nice) and 0 <= self.worker_nice <= 19, "worker_nice", self.worker_nice,
               "must be an int in [0, 19]")
        _check(self.deterministic is None or isinstance(self.deterministic, bool), "deterministic", self.deterministic,
               "must be None or a bool")
        _check(self.lag_steps is None or (is_int(self.lag_steps) and self.lag_steps >= 0), "lag_steps",
               self.lag_steps, "must be None or an int >= 0 (steps from a snapshot to its use)")
        _check(self.lag_steps is None or self.deterministic is not False, "lag_steps", self.lag_steps,
               "applies to the deterministic rule only; with deterministic=False each block takes its newest "
               "finished version: leave lag_steps=None")
        _check(self.stagger is None or isinstance(self.stagger, bool), "stagger", self.stagger,
               "must be None or a bool")
        _check(self.stagger_split is None or isinstance(self.stagger_split, bool), "stagger_split",
               self.stagger_split, "must be None or a bool")
        _check(not (self.stagger_split is True and self.stagger is False), "stagger_split", self.stagger_split,
               "splits groups for the staggered schedule: needs stagger=None or True, not False")
        _check(is_int(self.sync_refreshes) and 0 <= self.sync_refreshes <= MAX_COUNT, "sync_refreshes",
               self.sync_refreshes, f"must be an int in [0, {MAX_COUNT}]")
        _check(is_real(self.timeout_s) and MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S,
               "timeout_s", self.timeout_s,
               f"must be a finite number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}]")
        _check(is_int(self.max_consecutive_failures) and 1 <= self.max_consecutive_failures <= MAX_COUNT,
               "max_consecutive_failures", self.max_consecutive_failures, f"must be an int in [1, {MAX_COUNT}]")
        _check(self.nonfinite_grad_policy in NONFINITE_POLICIES, "nonfinite_grad_policy",
               self.nonfinite_grad_policy, f"must be one of {NONFINITE_POLICIES}")
        _check(is_int(self.max_nonfinite_grad_steps) and 1 <= self.max_nonfinite_grad_steps <= MAX_COUNT,
               "max_nonfinite_grad_steps", self.max_nonfinite_grad_steps, f"must be an int in [1, {MAX_COUNT}]")
        _check(is_int(self.in_flight) and 1 <= self.in_flight <= MAX_STALENESS + 1, "in_flight", self.in_flight,
               f"must be an int in [1, {MAX_STALENESS + 1}] (versions of a set on their way at once)")
        _check(self.device_refresh is None or isinstance(self.device_refresh, bool), "device_refresh",
               self.device_refresh, "must be None or a bool")
        _check(is_real(self.device_share) and 0 < self.device_share <= 1, "device_share", self.device_share,
               "must be a number in (0, 1], the share of an interval the device lane's work may fill")
        _check(isinstance(self.memory, MemoryConfig), "memory", self.memory, "must be an asteria.MemoryConfig")
        _check(self.mode == "async" or self.memory.placement in ("auto", "device"), "memory.placement",
               self.memory.placement, "mode='sync' (the native baseline) keeps preconditioners on the device: "
               "use 'auto' or 'device', or mode='async'")
        _check(self.local_world_size is None or (is_int(self.local_world_size) and self.local_world_size >= 1),
               "local_world_size", self.local_world_size, "must be None or an int >= 1")

    def resolved_deterministic(self, several_ranks: bool) -> bool:
        """``deterministic`` resolved: None means the deterministic rule on several ranks (which need it), where
        ``lag_steps`` is given, or at staleness 0 (where both rules use every version at its own step), else the
        newest-finished rule."""
        if self.deterministic is not None:
            return self.deterministic
        return several_ranks or self.lag_steps is not None or self.staleness == 0

    def stagger_wanted(self) -> bool:
        """``stagger`` resolved before the ranks are consulted: its value, or whether the mode is async and
        some version is used later than its own step (where every one is used at its own step, async mode
        follows the sync trajectory, and so the sync schedule)."""
        if self.stagger is not None:
            return self.stagger
        at_own_step = self.staleness == 0 or (self.deterministic is not False and self.lag_steps == 0)
        return self.mode == "async" and not at_own_step

    def activation_lag(self, interval: int) -> int:
        """Steps from a version's snapshot to its first use under the deterministic rule, for refreshes
        every ``interval`` steps: ``lag_steps``, or one interval (at most the bound, S intervals) when it is
        None."""
        bound = self.staleness * interval
        if self.lag_steps is None:
            return min(interval, bound)
        _check(self.lag_steps <= bound, "lag_steps", self.lag_steps,
               f"must be at most staleness x precondition_frequency = {self.staleness} x {interval} = {bound} "
               "(the staleness bound, in steps)")
        return self.lag_steps

    def resolved_worker_cpus(self) -> list[int]:
        """The CPUs the workers are pinned to (empty: not pinned)."""
        if self.worker_cpus == "any":
            return []
        if self.worker_cpus == "auto":
            return cpus.default_worker_cpus()
        return sorted(set(self.worker_cpus))

    def resolved_workers(self) -> int:
        """The worker count to start: ``workers`` or the default that leaves cores free."""
        if self.workers is not None:
            return self.workers
        pinned = self.resolved_worker_cpus()
        if pinned:
            return min(32, len(pinned))
        _, local_world = cpus.local_layout()
        return max(1, min(32, len(cpus.allowed_cpus()) // local_world - 2))


def is_int(value: Any) -> bool:
    """An integer (a Python or NumPy one) that is not a bool (``True`` is an int in Python, never a count
    here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A finite real number (Python or NumPy) that is not a bool, nor a fraction (torch's operators take
    ints and floats, not ``fractions.Fraction``)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and (isinstance(value, numbers.Integral) or not isinstance(value, numbers.Rational)))


def plain(value: Any) -> Any:
    """``value`` with NumPy scalars (also inside a tuple or list) turned into Python ones, as the
    optimizers and the C++ runtime store and pass them."""
    if isinstance(value, (tuple, list)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, numbers.Number) and hasattr(value, "item") and not isinstance(value, bool):
        return value.item()
    return value


def _plain_fields(config: Any) -> None:
    """Turns NumPy scalars in ``config``'s fields into Python ones."""
    for name in config.__dataclass_fields__:
        setattr(config, name, plain(getattr(config, name)))
