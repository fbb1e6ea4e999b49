"""Runtime and memory configuration of the Asteria optimizers."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from asteria import cpus

MODES = ("sync", "async")
PLACEMENTS = ("auto", "device", "host", "device_view")
MAX_STALENESS = 1000  # async mode keeps up to S + 1 host snapshots of each block
MAX_FREQUENCY = 10**6  # precondition_frequency: the schedule keeps per-step tables of an interval
MAX_SMS = 1024  # beyond any GPU's streaming multiprocessors
MAX_LANE_THREADS = 16  # the device lane's threads: beyond what overlapping refreshes can use, within torch's
# pool of 32 streams a priority (and a green context's), from which each thread takes its own
MAX_THREADS = 1024  # workers, blas_threads: beyond any host's cores
MAX_TIMEOUT_S = 1e7  # about 115 days; the core counts waits in int64 nanoseconds
MIN_TIMEOUT_S = 1e-6  # a microsecond: the core's waits are whole nanoseconds
MAX_SETS_PER_STEP = 64  # stagger_sets_per_step: finer cuts only add per-set overhead
MAX_COUNT = 2**31 - 1  # sync_refreshes, max_consecutive_failures, max_nonfinite_grad_steps: C ints in the core
NONFINITE_POLICIES = ("skip", "raise")
QUEUE_ORDERS = ("deadline", "shortest")


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
    coherent-memory machines) or ``"auto"`` (``"host"`` with an ``nvme_dir``, else ``"device_view"`` on a
    coherent-memory device, else ``"device"``, or ``"host"`` when ``"device"`` would exceed ``gpu_budget``).
    Host placements need ``mode="async"``: the native ``"sync"`` mode is the all-device baseline. ``group_bytes`` bounds
    the preconditioner bytes of one batched shape group (default: 32 MiB under the host placements,
    which bounds the staging ring, and 1 GiB on the device, which bounds the step's temporaries: each is a
    group's parameter size). The optimizer checks the budgets against
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
        _check(self.nvme_dir is None or (isinstance(self.nvme_dir, str) and self.nvme_dir.strip() != ""
                                         and "\0" not in self.nvme_dir),
               "nvme_dir", self.nvme_dir, "must be None or a directory path (a str or os.PathLike, no NUL byte)")
        _check(self.nvme_budget is None or self.nvme_dir is not None, "nvme_budget", self.nvme_budget,
               "bounds the page files under nvme_dir: set nvme_dir too, or leave nvme_budget None")


@dataclass(kw_only=True)
class RuntimeConfig:
    """How preconditioner refreshes are computed and scheduled (a reference with the reasons behind each
    default: the README's "Configuration" and ``docs/architecture.md``).

    Attributes:
        mode: ``"sync"`` computes every refresh inside ``step()`` on the parameters' device (the native
            baseline); ``"async"`` snapshots the factors into host buffers and refreshes off the step.
        staleness: S >= 0, the refresh intervals a block's preconditioner may lag its newest snapshot;
            ``step()`` waits (bounded) rather than exceed it. 0 in async mode follows the sync trajectory
            to rounding (with the same schedule: ``stagger`` alike in both).
        workers: C++ worker threads. ``None``: one per CPU of ``worker_cpus`` (at most 32), or, unpinned,
            this rank's share of the CPUs less 2 for the training process and its data loader.
        worker_cpus: ``"auto"`` pins the workers off the first physical cores of this rank's share (left
            to the thread that launches GPU kernels, see ``asteria.cpus``); ``"any"``; or logical CPUs.
        torch_threads: torch's intra-op threads while the workers run (restored by ``close()``).
            ``"auto"``: with pinned workers, at most the cores left to training; ``"keep"``; or an int.
        worker_nice: 0..19, the workers' and the device lane's threads' CPU priority below the training thread's
            (Linux nice).
        blas_threads: BLAS threads per job. Results do not depend on ``workers``, only on this.
        deterministic: ``True``: versions come into use by schedule alone, ``lag_steps`` after their
            snapshot (bitwise reproducible, the same version on every rank at the same step). ``False``:
            each block uses its newest finished version (bounded by S); a set's turn that comes while its
            previous version is on its way is deferred. ``None``: ``True`` on several ranks, with
            ``lag_steps`` given or at S = 0, else ``False``.
        lag_steps: deterministic rule only: steps from snapshot to first use, at most S x
            ``precondition_frequency``. ``None``: one interval (within that bound). Host buffers per
            block: ``lag_steps // precondition_frequency + 1``.
        stagger: spread the factor sets' refreshes over each interval, balanced by O(n^3) cost, so that no
            step carries every snapshot and job. ``None``: on in async mode except where every version is
            used at its own step (S = 0 or ``lag_steps=0``); off in sync mode; on several ranks only where
            all have the same factor sets (a block's replicas refresh it at the same step).
        stagger_split: also cut factor sets bigger than an even share of an interval's work so that the
            stagger can spread them (the math is unchanged). ``None``: on where the schedule is staggered
            on one process. Needs ``stagger`` not False.
        stagger_sets_per_step: ``stagger_split`` cuts a large set into runs of at most 1 /
            (``precondition_frequency`` x this) of an interval's work. A cut set is also the unit the device
            lane's balancer moves between the workers and the GPU, so 2 lets the lane take about what the
            workers lack, not up to a step's share more (at olmo-160m a set of two 2048 blocks instead of
            four). A checkpoint resumes only with the value it was saved with (1 before this setting existed).
        stagger_small: spread the sets of small blocks (at most half the largest factor's size, those the
            express workers take) by their own work, and with ``stagger_split`` cut them by an even share of
            it: by the share of all the work they would come a few large sets at a time, on the steps the
            large sets leave light, and queue for a thread behind each other (at olmo-160m, 48 roots of 768
            on each of two steps of ten). ``None``: on wherever the schedule is staggered or its sets split. A
            checkpoint resumes only with the value it was saved with (False before this setting existed).
        sync_refreshes: the first versions of every set (the bootstrap, then the first refreshes) are
            waited for at their own step under either rule: a late basis costs most while the factors are
            young. 0: none.
        timeout_s: the longest any wait (barrier, buffer) may take before a ``TimeoutError``.
        max_consecutive_failures: failed refreshes of one block in a row (the last good version stays in
            use) before ``step()`` raises ``RefreshError``.
        nonfinite_grad_policy: for a block whose gradient holds NaN/Inf, ``"skip"`` its update and count
            it, or ``"raise"``.
        max_nonfinite_grad_steps: skipped steps of one block in a row before ``step()`` raises.
        in_flight: newest-finished rule: versions of a set on their way at once (each holds pinned
            snapshot and result buffers, by version number modulo in_flight); a turn beyond that is deferred,
            as is a workers' turn whose buffers an unsettled version still holds, and an eigenbasis set's turn
            on the device lane while any version of the set is on its way (it starts from the bases in use).
        queue_order: newest-finished rule: the order in which the workers take queued refreshes after the
            ``sync_refreshes`` (which are waited for). ``"deadline"``: by the step each is due at, the largest
            blocks first within one; ``"shortest"``: the smallest blocks first, so that a cheap refresh never
            queues behind costly ones (the mean delay to use is shortest; a costly one waits at most for the
            cheaper ones' share of the work). The deterministic rule waits for every version at its step and
            runs by deadline (an optimizer on that rule refuses ``"shortest"``).
        express_workers: C++ threads beside the workers, on their CPUs at half their nice (a higher priority), that
            take only the refreshes of blocks at most half the largest block's size: where every worker is busy
            with roots of a second, the kernel lets such a refresh preempt one, so that it never waits for a core
            (the workers' jobs resume when it ends; no core is added). ``None``: as many as the workers where the
            blocks come in such sizes and the workers are pinned (``worker_cpus``: unpinned, they would share the
            training thread's cores at a higher priority than the workers'), else 0; 0: none.
        device_refresh: whether the refresh executor may also compute on the parameters' device
            (``asteria.pipeline.device_lane``). ``None``: on a GPU (start-up refreshes, and the sets the
            workers cannot finish within an interval); ``False``: workers only; ``True``: also on CPU.
        device_share: (0, 1], the share of an interval's wall time the device lane may fill.
        device_sms: the streaming multiprocessors the device lane's refreshes may occupy, through a CUDA green
            context (``torch.cuda.green_contexts``; the driver rounds the count up to its granularity, 8 on
            Hopper). Training keeps the whole GPU; the lane's kernels cannot take more than this share of it.
            ``None``: the lane shares every SM with training at equal stream priority. With ``device_process``
            (the default on a GPU) the partition is the child's: it bounds the lane's kernels, and its context
            shares the GPU with training's by time.
        device_threads: the device lane's threads, each refreshing one set at a time on its own stream;
            ``device_share`` then caps each thread's time. Measured on an H100, a second thread did not raise the
            lane's rate: cuSOLVER's ``eigh`` of one thread holds the others' launches (docs/results.md).
        device_process: whether the device lane computes in a child process with a CUDA context of its own
            (``asteria.pipeline.lane_process``). A GPU ``eigh`` in the training process holds the training
            thread's kernel launches while it runs; in its own context it cannot. ``None``: on a GPU.
        memory: tier placement and budgets (``MemoryConfig``).
        process_group, local_world_size: the distributed layout (defaults: WORLD and torchrun's
            LOCAL_WORLD_SIZE). A group smaller than the world runs CPU tensors on Gloo; its node size
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
    stagger_sets_per_step: int = 2
    stagger_small: bool | None = None
    sync_refreshes: int = 2
    timeout_s: float = 600.0
    max_consecutive_failures: int = 3
    nonfinite_grad_policy: Literal["skip", "raise"] = "skip"
    max_nonfinite_grad_steps: int = 10
    in_flight: int = 1
    queue_order: Literal["deadline", "shortest"] = "deadline"
    express_workers: int | None = None
    device_refresh: bool | None = None
    device_share: float = 1.0
    device_sms: int | None = None
    device_threads: int = 1
    device_process: bool | None = None
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
        _check(self.stagger_small is None or isinstance(self.stagger_small, bool), "stagger_small",
               self.stagger_small, "must be None or a bool")
        _check(not (self.stagger_small is True and self.stagger is False), "stagger_small", self.stagger_small,
               "spreads the small sets over the staggered schedule: needs stagger=None or True, not False")
        _check(is_int(self.stagger_sets_per_step) and 1 <= self.stagger_sets_per_step <= MAX_SETS_PER_STEP,
               "stagger_sets_per_step", self.stagger_sets_per_step, f"must be an int in [1, {MAX_SETS_PER_STEP}]")
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
        _check(self.queue_order in QUEUE_ORDERS, "queue_order", self.queue_order, f"must be one of {QUEUE_ORDERS}")
        _check(self.express_workers is None or (is_int(self.express_workers)
                                                and 0 <= self.express_workers <= MAX_THREADS),
               "express_workers", self.express_workers, f"must be None or an int in [0, {MAX_THREADS}]")
        _check(self.device_refresh is None or isinstance(self.device_refresh, bool), "device_refresh",
               self.device_refresh, "must be None or a bool")
        _check(is_real(self.device_share) and 0 < self.device_share <= 1, "device_share", self.device_share,
               "must be a number in (0, 1], the share of an interval the device lane's work may fill")
        _check(self.device_sms is None or (is_int(self.device_sms) and 1 <= self.device_sms <= MAX_SMS), "device_sms",
               self.device_sms, f"must be None or an int in [1, {MAX_SMS}] (SMs the device lane may occupy)")
        _check(is_int(self.device_threads) and 1 <= self.device_threads <= MAX_LANE_THREADS, "device_threads",
               self.device_threads, f"must be an int in [1, {MAX_LANE_THREADS}] (the device lane's threads)")
        lane = self.mode == "async" and self.device_refresh is not False
        runs = f"runs in mode='async' unless device_refresh=False (here mode={self.mode!r}, device_refresh=" \
               f"{self.device_refresh!r})"
        _check(self.device_sms is None or lane, "device_sms", self.device_sms,
               f"partitions the GPU for the device lane, which {runs}: leave it None")
        _check(self.device_threads == 1 or lane, "device_threads", self.device_threads,
               f"sets the device lane's threads, and the lane {runs}: leave it 1")
        _check(self.device_process is None or isinstance(self.device_process, bool), "device_process",
               self.device_process, "must be None or a bool")
        _check(not self.device_process or lane, "device_process", self.device_process,
               f"moves the device lane into a child process, and the lane {runs}: leave it None")
        _check(isinstance(self.memory, MemoryConfig), "memory", self.memory, "must be an asteria.MemoryConfig")
        _check(self.mode == "async" or self.memory.placement in ("auto", "device"), "memory.placement",
               self.memory.placement, "mode='sync' (the native baseline) keeps preconditioners on the device: "
               "use 'auto' or 'device', or mode='async'")
        _check(self.local_world_size is None or (is_int(self.local_world_size) and self.local_world_size >= 1),
               "local_world_size", self.local_world_size, "must be None or an int >= 1")

    def checked_copy(self) -> RuntimeConfig:
        """A copy, its memory settings too, checked again: the caller's object may have been changed since it was
        built (the checks run in ``__post_init__``), or be reused for another optimizer."""
        memory = replace(self.memory) if isinstance(self.memory, MemoryConfig) else self.memory
        return replace(self, memory=memory)

    def resolved_deterministic(self, several_ranks: bool) -> bool:
        """``deterministic`` resolved: None means the deterministic rule on several ranks (which need it), where
        ``lag_steps`` is given, or at staleness 0 (where both rules use every version at its own step), else the
        newest-finished rule. Refuses (ValueError) an async ``queue_order`` the resolved rule cannot take."""
        resolved = self.deterministic if self.deterministic is not None else (
            several_ranks or self.lag_steps is not None or self.staleness == 0)
        ranks = "several ranks" if several_ranks else "one rank"
        _check(not (resolved and self.mode == "async" and self.queue_order != "deadline"), "queue_order",
               self.queue_order, "applies to the newest-finished rule only, and this optimizer runs the deterministic "
               f"rule (deterministic={self.deterministic} on {ranks}, lag_steps={self.lag_steps}, staleness="
               f"{self.staleness}), which waits for every version at its step: pass deterministic=False or leave "
               "queue_order='deadline'")
        return resolved

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

    def resolved_express(self, dims: Sequence[int]) -> tuple[int, int]:
        """The express workers to start for blocks of sizes ``dims``, and the largest block size they take (half
        the largest): ``express_workers``, or by default as many as the workers where some block is that small and
        the workers are pinned."""
        max_n = max(dims, default=0) // 2
        if self.express_workers is not None:
            return self.express_workers, max_n
        wanted = any(n <= max_n for n in dims) and bool(self.resolved_worker_cpus())
        return (self.resolved_workers() if wanted else 0), max_n

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
