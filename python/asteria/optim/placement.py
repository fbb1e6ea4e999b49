"""Where an optimizer's preconditioners in use live and how its step reads them: the placement (device,
pinned host with a staging ring, device views, the NVMe tier under a host budget), the memory checks made
before anything is allocated, the budget checks and the per-tier memory report."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from asteria.checks import check_arg
from asteria.config import RuntimeConfig
from asteria.cpus import local_layout
from asteria.memory import device_available, device_capacity, gib, host_available
from asteria.optim.groups import ShapeGroup
from asteria.pipeline.factors import FactorSet
from asteria.pipeline.refresh import Refresher
from asteria.pipeline.tiers import PreconditionerTier, coherent_memory

#: the default bound of one shape group's preconditioner bytes under the host placements
HOST_GROUP_BYTES = 32 * 2**20
#: and on the device: a step's temporaries are each a group's parameter size, and one of a whole model's largest
#: shape (olmo2-1b: 256 blocks of 2048, 4 GiB) found no room on an 80 GB card after the backward pass, so the CUDA
#: caching allocator freed its cache and mapped it again every step (173 ms of a 668 ms step there; docs/results.md,
#: "olmo2-1b at the current code"). Groups of 1 GiB (32 such blocks) leave the batched products as fast.
DEVICE_GROUP_BYTES = 2**30

#: host buffers of one set's size that the NVMe tier holds per set shape (read-ahead and install scratch)
PAGED_BUFFERS = 3


def default_group_bytes(resident: bool) -> int:
    """``MemoryConfig.group_bytes`` where it is None: the device's bound for preconditioners that stay where they
    are allocated (``Placement.resident``), else the host placements' (which bounds their staging ring)."""
    return DEVICE_GROUP_BYTES if resident else HOST_GROUP_BYTES


def host_room() -> tuple[int | None, str]:
    """The host memory this process may pin (None: not known), and what that figure is: what the host can give,
    shared among the ranks torchrun started on this host, which pin theirs at about the same time."""
    available = host_available()
    ranks = local_layout()[1]
    what = "the least of MemAvailable, its cgroup's limit and RLIMIT_AS" + (
        f", shared by this host's {ranks} ranks" if ranks > 1 else "")
    return (None if available is None else available // ranks), what


def check_pinned(need: int, refused: str, fewer: str) -> None:
    """Refuses (``ValueError``) ``need`` bytes of pinned host memory beyond ``host_room()``: ``refused`` says which
    setting asks for them and what they are ("Invalid ...: the ... need"), ``fewer`` what takes less."""
    available, what = host_room()
    if available is not None and need > available:
        raise ValueError(f"{refused} {gib(need)} of pinned host memory, and the host can give this process "
                         f"{gib(available)} ({what}); {fewer}")


def check_factor_memory(groups: list[ShapeGroup], refresh_dims: Callable[[ShapeGroup], list[int]],
                        moments: int, where: Placement, max_preconditioner_dim: int) -> None:
    """Refuses, before anything is allocated, a blocking whose state does not fit its device: the factors
    alone (float32, n x n for each preconditioned dimension of each block) beyond all of the device's memory,
    or the whole state (factors, the preconditioners in use where they stay on the device, ``moments``
    float32 tensors of each block's shape, and the start-up refreshes' results on a GPU) beyond what the
    device can still give, or under a host placement the pinned preconditioners beyond what the host can give.
    The error names the setting and the bytes; without it the allocation fails inside the allocator or the CUDA
    driver, or on a host that overcommits memory the first steps are killed."""
    placement = where.name
    factors: dict[torch.device, int] = {}
    state: dict[torch.device, int] = {}
    largest: dict[torch.device, tuple[int, ShapeGroup]] = {}
    pinned = 0  # the preconditioners in use under a host placement (those the NVMe tier leaves on the host)
    for group in groups:
        dims = refresh_dims(group)
        state[group.device] = state.get(group.device, 0) + moments * group.batch * 4 * math.prod(group.shape)
        if not dims:
            continue
        nbytes = group.batch * 4 * sum(d * d for d in dims)
        factors[group.device] = factors.get(group.device, 0) + nbytes
        # The preconditioners in use, and on a GPU the start-up refreshes' results until they are installed.
        copies = 1 + (placement == "device") + (group.device.type == "cuda")
        state[group.device] += copies * nbytes
        pinned += nbytes if placement != "device" else 0
        if max(dims) > largest.get(group.device, (0, group))[0]:
            largest[group.device] = (max(dims), group)
    for device, total in factors.items():
        capacity = device_capacity(device)
        if capacity is None or total <= capacity:
            continue
        dim, group = largest[device]
        raise ValueError(
            f"Invalid max_preconditioner_dim={max_preconditioner_dim}: the factors alone (float32, n x n for "
            f"each dimension of each block) would take {total / 2**30:.1f} GiB on {device}, which has "
            f"{capacity / 2**30:.1f} GiB in all (the largest, {dim} x {dim}, for {group.blocks[0].name}, a block "
            f"of shape {tuple(group.shape)}); a smaller max_preconditioner_dim splits large dimensions into more, "
            "smaller blocks")
    for device, need in state.items():
        available = device_available(device)
        if available is None or need <= available:
            continue
        raise ValueError(
            f"Invalid max_preconditioner_dim={max_preconditioner_dim}: this optimizer's state needs "
            f"{gib(need)} on {device} (factors {gib(factors.get(device, 0))}, with the preconditioners in use "
            f"under placement {placement!r}, the moments and the start-up refreshes), and {device} can "
            f"still give {gib(available)}; a smaller max_preconditioner_dim, MemoryConfig(placement='host') "
            "(preconditioners in pinned host memory) or fewer parameters per optimizer would fit")
    if where.pages_to_nvme():  # (the rest goes to NVMe; check_budgets refuses a host state beyond host_budget)
        pinned = min(pinned, where.runtime.memory.host_budget)
    if pinned:
        check_pinned(pinned, f"Invalid memory.placement={placement!r}: the preconditioners in use would take",
                     "placement 'device' (on the GPU), a smaller max_preconditioner_dim, fewer parameters per "
                     "optimizer or a host with more memory would fit")


def check_host_memory(runtime: RuntimeConfig, interval: int, refresh_bytes: int, groups: list[ShapeGroup],
                      placement: str) -> None:
    """Refuses, before the refresh buffers are allocated, ``refresh_bytes`` of pinned host memory that
    ``host_budget`` does not allow (the buffers are never paged to NVMe) or that the host cannot give, naming
    the bytes and what to change. Pinned pages cannot be swapped out, so the host's available memory bounds
    them (the CUDA driver pins them itself: the process's memlock limit does not apply)."""
    if refresh_bytes == 0:
        return
    memory = runtime.memory
    if runtime.deterministic:
        lag = runtime.activation_lag(interval)
        sized_by = f"{lag // interval + 1} packed snapshots and results per block: the versions waiting lag_steps={lag}"
        fewer = "use a shorter lag_steps, deterministic=False (one version in flight per set)"
    else:
        sized_by = f"a packed snapshot and a result per block for each of in_flight={runtime.in_flight} versions"
        fewer = "use in_flight=1 or a smaller max_preconditioner_dim"
    if memory.host_budget is not None and refresh_bytes > memory.host_budget:
        device = sum(t.numel() * t.element_size() for g in groups for t in g.state.values() if t.device.type != "cpu")
        raise ValueError(f"Invalid host_budget={memory.host_budget}: too small for this model's state (placement "
                         f"{placement!r}: device needs {device} bytes, host needs {refresh_bytes} bytes; per "
                         f"kind: host {{'refresh_buffers': {refresh_bytes}}}, nvme {{}}); the refresh buffers "
                         f"({sized_by}) stay in host memory: raise host_budget or {fewer}")
    check_pinned(refresh_bytes, f"Invalid runtime={runtime!r}: the refresh buffers ({sized_by}) need",
                 f"{fewer}, or use a host with more memory")


def resolve_placement(runtime: RuntimeConfig, devices: set[torch.device]) -> str:
    """The placement of the preconditioners in use for parameters on ``devices`` (``MemoryConfig.placement``,
    with ``"auto"`` decided from the devices and the GPU budget)."""
    memory = runtime.memory
    on_cuda = any(device.type == "cuda" for device in devices)
    if memory.placement != "auto":
        check_arg(on_cuda or memory.placement == "device", "memory.placement", memory.placement,
                  "the host placements are for parameters on a GPU (CPU parameters already live in host "
                  "memory): use 'auto' or 'device'")
        return memory.placement
    if not on_cuda or runtime.mode == "sync":
        return "device"
    if memory.nvme_dir is not None:
        return "host"
    if all(coherent_memory(device) for device in devices if device.type == "cuda"):
        return "device_view"
    return "device"  # moved to "host" by fit_gpu_budget when it exceeds gpu_budget


class Placement:
    """Where one optimizer's preconditioners in use live, and how its step reads them.

    Built in steps, as the optimizer's state is allocated between them: ``Placement(runtime, devices)``
    decides where (``name``), so that the optimizer allocates its preconditioners there
    (``new_preconditioners``); ``hold`` takes the shape groups and their factor sets and builds the tier
    over them; ``serve`` hands the tier to the refresher (whose host buffers the report counts). It reads
    nothing of the optimizer but these.
    """

    def __init__(self, runtime: RuntimeConfig, devices: set[torch.device]) -> None:
        self.runtime = runtime
        self.name = resolve_placement(runtime, devices)
        self.groups: list[ShapeGroup] = []
        #: the groups' own factor sets, whose tensors the tier holds (the refresh units may be slices of them)
        self.home_sets: list[tuple[FactorSet, ShapeGroup]] = []
        self.tier: PreconditionerTier | None = None
        self.refresher: Refresher | None = None
        #: group index -> state key -> the set whose preconditioners the NVMe tier holds (out of ``group.state``)
        self.paged_keys: dict[int, dict[str, FactorSet]] = {}
        self._group_index: dict[int, int] = {}
        self._reading: dict[int, list[Tensor]] = {}

    def resident(self) -> bool:
        """Whether the preconditioners in use stay where they are allocated, on the parameters' device: no
        host placement, no NVMe tier, and no GPU budget that could move them to the host."""
        memory = self.runtime.memory
        return (self.name == "device" and memory.nvme_dir is None
                and not (memory.placement == "auto" and memory.gpu_budget is not None))

    def pages_to_nvme(self) -> bool:
        """Whether some of the preconditioners in use may go to the NVMe tier (a host placement, ``nvme_dir``
        and a ``host_budget``): they are then allocated in pageable host memory, and only those the tier leaves
        on the host are pinned (``place_on_nvme``), so that what the tier takes is never pinned."""
        memory = self.runtime.memory
        return self.name == "host" and memory.nvme_dir is not None and memory.host_budget is not None

    def new_preconditioners(self, group: ShapeGroup, dim: int) -> Tensor:
        """(B, dim, dim) identities where the placement keeps the preconditioners in use: on the group's
        device, or in pinned host memory (pageable at first where the NVMe tier may take them)."""
        if self.name == "device":
            return torch.eye(dim, dtype=torch.float32, device=group.device).repeat(group.batch, 1, 1)
        identities = torch.eye(dim, dtype=torch.float32, device="cpu").repeat(group.batch, 1, 1)
        return identities if self.pages_to_nvme() else identities.pin_memory()

    def _state_keys(self, sets: list[FactorSet]) -> list[tuple[FactorSet, ShapeGroup, str]]:
        """Each of ``sets`` (home sets) with its shape group and the key of its preconditioners in the group's state."""
        groups = {id(fset): group for fset, group in self.home_sets}
        return [(fset, group, next(k for k, t in group.state.items() if t is fset.preconditioners))
                for fset, group in ((fset, groups[id(fset)]) for fset in sets)]

    def _pin(self, sets: list[FactorSet]) -> None:
        """Moves the preconditioners in use of ``sets`` (home sets) to pinned host memory."""
        for fset, group, key in self._state_keys(sets):
            group.state[key] = fset.preconditioners = fset.preconditioners.cpu().pin_memory()

    def hold(self, groups: list[ShapeGroup], group_sets: list[list[FactorSet]]) -> None:
        """Takes the shape groups and each one's factor sets, and builds the tier over them."""
        self.groups = groups
        self.home_sets = [(fset, group) for group, sets in zip(groups, group_sets, strict=True) for fset in sets]
        self._group_index = {id(group): index for index, group in enumerate(groups)}
        self.tier = PreconditionerTier(self.name, group_sets)

    def serve(self, refresher: Refresher) -> None:
        """Lets ``refresher`` install into the tier (it is told before a preconditioner is overwritten)."""
        self.refresher = refresher
        refresher.tier = self.tier

    def fit_gpu_budget(self) -> None:
        """Under ``placement="auto"``: when the device placement exceeds ``gpu_budget``, the preconditioners in
        use move to pinned host memory (the ``"host"`` placement)."""
        memory = self.runtime.memory
        if memory.placement != "auto" or self.name != "device" or memory.gpu_budget is None:
            return
        if not any(s.device.type == "cuda" for s, _ in self.home_sets):
            return
        if self.memory_report()["device"]["total"] <= memory.gpu_budget:
            return
        check_pinned(sum(fset.preconditioners.numel() * 4 for fset, _ in self.home_sets),
                     f"Invalid memory.gpu_budget={memory.gpu_budget}: the preconditioners in use exceed it on the GPU, "
                     "and pinning them in host memory (placement 'auto' moves them there) needs",
                     "a larger gpu_budget, a smaller max_preconditioner_dim or a host with more memory would fit")
        self._pin([fset for fset, _ in self.home_sets])
        self.name = "host"
        self.tier = PreconditionerTier("host", self.tier.groups_sets)
        if self.refresher is not None:
            self.refresher.tier = self.tier

    def place_on_nvme(self) -> None:
        """Moves preconditioner sets to the NVMe tier, largest first, until the host state fits
        ``host_budget`` (only with ``nvme_dir``; without a ``host_budget`` nothing moves)."""
        runtime = self.runtime
        memory = runtime.memory
        if memory.nvme_dir is None:
            return
        check_arg(runtime.mode == "async", "memory.nvme_dir", memory.nvme_dir,
                  "the NVMe tier needs mode='async' (the native sync mode keeps everything on the device)")
        on_host = [fset for fset, _ in self.home_sets if fset.preconditioners.device.type == "cpu"]
        check_arg(bool(on_host) or not self.home_sets, "memory.nvme_dir", memory.nvme_dir,
                  f"the NVMe tier pages host-resident preconditioners, and placement {self.name!r} keeps them on "
                  "the GPU: use placement='host'")
        check_arg(self.name in ("host", "device"), "memory.nvme_dir", memory.nvme_dir,
                  f"the NVMe tier cannot back placement {self.name!r}: use placement='host'")
        if memory.host_budget is None:
            return
        chosen = self._choose_for_nvme(on_host)
        if chosen:
            keys = self._state_keys(chosen)  # (before paging: it takes the preconditioners the keys are found by)
            self.tier.page(chosen, memory.nvme_dir, runtime.timeout_s)
            for fset, group, key in keys:
                del group.state[key]
                self.paged_keys.setdefault(self._group_index[id(group)], {})[key] = fset
        if self.pages_to_nvme():  # the sets left on the host, pageable until now
            paged = {id(fset) for fset in chosen}
            rest = [fset for fset in on_host if id(fset) not in paged]
            check_pinned(sum(fset.preconditioners.numel() * 4 for fset in rest),
                         f"Invalid memory.host_budget={memory.host_budget}: the preconditioners in use that the NVMe "
                         "tier leaves on the host would take",
                         "a smaller host_budget (more of them on NVMe) or a host with more memory would fit")
            self._pin(rest)

    def _choose_for_nvme(self, on_host: list[FactorSet]) -> list[FactorSet]:
        """The host sets to page to NVMe so that the host state fits ``host_budget``."""
        memory = self.runtime.memory
        host = self.memory_report()["host"]["total"]
        by_shape: dict[tuple[int, ...], list[FactorSet]] = {}
        for fset in on_host:
            by_shape.setdefault(tuple(fset.preconditioners.shape), []).append(fset)
        chosen: list[FactorSet] = []
        # Shapes with the most bytes first: paging a shape's first set brings its read-ahead buffers and
        # install scratch (PAGED_BUFFERS sets' worth), every further set of the shape only saves.
        for sets in sorted(by_shape.values(), key=lambda sets: -len(sets) * sets[0].preconditioners.numel()):
            if host <= memory.host_budget or len(sets) <= PAGED_BUFFERS:
                continue  # a shape with no more sets than its buffers would only cost host memory
            nbytes = sets[0].preconditioners.numel() * 4
            host += PAGED_BUFFERS * nbytes
            for k, fset in enumerate(sets):
                if k > PAGED_BUFFERS and host <= memory.host_budget:
                    break
                host -= nbytes
                chosen.append(fset)
        return chosen

    def expected_state(self, index: int) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of every state tensor of shape group ``index`` in a checkpoint (those on the
        NVMe tier included)."""
        expected = {key: (t.shape, t.dtype) for key, t in self.groups[index].state.items()}
        for key, fset in self.paged_keys.get(index, {}).items():
            expected[key] = (torch.Size((fset.batch, fset.dim, fset.dim)), torch.float32)
        return expected

    def read(self, group: ShapeGroup) -> list[Tensor]:
        """The device tensors with ``group``'s preconditioners in use (one per mode), readable by the
        current stream; under the host placement they are staged here once per step."""
        index = self._group_index[id(group)]
        if index not in self._reading:
            self._reading[index] = self.tier.read(index)
        return self._reading[index]

    def done(self, group: ShapeGroup) -> None:
        """The step no longer reads ``group``'s preconditioners: their staging buffers may serve the next."""
        index = self._group_index[id(group)]
        if self._reading.pop(index, None) is not None:
            self.tier.done(index)

    def memory_report(self) -> dict[str, Any]:
        """Bytes of optimizer state per tier and per kind of state: ``device`` (the parameters'
        device: factors, moments, and the preconditioners under the device placement, plus the
        staging ring and the device lane's slots), ``host`` (pinned host memory: preconditioners under
        the host placements, the refresh buffers, the NVMe tier's read-ahead buffers), ``nvme`` (the page
        files of the sets the NVMe tier holds); with the placement, the peak staging bytes and the bytes
        staged to the device so far (and with the NVMe tier, the bytes it has read and written)."""
        tiers: dict[str, dict[str, int]] = {"device": {}, "host": {}, "nvme": {}}
        homes = {id(fset.preconditioners) for fset, _ in self.home_sets}
        for index, group in enumerate(self.groups):
            for key, tensor in group.state.items():
                # Preconditioners in host memory count as host state even for CPU parameters (the host
                # budget, and the NVMe tier under it, are about them).
                host = tensor.device.type == "cpu" and (group.device.type != "cpu" or id(tensor) in homes)
                kind = key.rstrip("_0123456789")  # "factor_1" and "factor_0" are one kind
                tier = tiers["host" if host else "device"]
                tier[kind] = tier.get(kind, 0) + tensor.numel() * tensor.element_size()
            for key, fset in self.paged_keys.get(index, {}).items():
                kind = key.rstrip("_0123456789")
                tiers["nvme"][kind] = tiers["nvme"].get(kind, 0) + fset.batch * fset.dim * fset.dim * 4
        staging = self.tier.staging_bytes()
        if staging:
            tiers["device"]["staging"] = staging
        tiers["host"]["refresh_buffers"] = self.refresher.host_bytes() if self.refresher is not None else 0
        lane = self.refresher.lane_bytes() if self.refresher is not None else 0
        if lane:  # (the device lane's process; its CUDA context comes on top)
            tiers["device"]["lane_slots"] = lane
            tiers["device"]["lane_cache"] = self.refresher.lane_cache_bytes()  # (its math's, measured: 0 at first)
        paged = self.tier.paged
        if paged is not None and paged.closed:  # (its page files and buffers went at close())
            tiers["nvme"] = dict.fromkeys(tiers["nvme"], 0)
        elif paged is not None:
            tiers["host"]["nvme_buffers"] = paged.host_bytes
            tiers["nvme"]["page_files"] = paged.nvme_bytes - sum(tiers["nvme"].values())
        for tier in tiers.values():
            tier["total"] = sum(tier.values())
        report: dict[str, Any] = tiers | {"placement": self.name, "bytes_staged": self.tier.staged_bytes,
                                          "peak_staging_bytes": self.tier.peak_staging_bytes}
        if paged is not None:
            io = paged.stats()
            report |= {"nvme_bytes_read": io["bytes_read"], "nvme_bytes_written": io["bytes_written"]}
        return report

    def check_budgets(self) -> None:
        """Refuses a state beyond ``gpu_budget``, ``host_budget`` or ``nvme_budget``, with the bytes per tier."""
        report = self.memory_report()
        memory = self.runtime.memory
        # The staging ring grows to two groups per shape on the first steps: count it at its bound.
        device = report["device"]["total"] + self.tier.staging_bound()
        needs = (f"placement {self.name!r}: device needs {device} bytes, host needs "
                 f"{report['host']['total']} bytes; per kind: host {report['host']}, nvme {report['nvme']}")
        if memory.gpu_budget is not None and device > memory.gpu_budget:
            raise ValueError(f"Invalid gpu_budget={memory.gpu_budget}: too small for this model's state ({needs})")
        if memory.host_budget is not None and report["host"]["total"] > memory.host_budget:
            raise ValueError(f"Invalid host_budget={memory.host_budget}: too small for this model's state ({needs})")
        if memory.nvme_budget is not None and report["nvme"]["total"] > memory.nvme_budget:
            raise ValueError(f"Invalid nvme_budget={memory.nvme_budget}: the page files need "
                             f"{report['nvme']['total']} bytes to fit host_budget={memory.host_budget} ({needs})")

    def close(self) -> None:
        """Closes the tier in use (the NVMe tier removes its page files). Idempotent."""
        if self.tier is not None:
            self.tier.close()
