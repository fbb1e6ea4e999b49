"""Where a SecondOrderOptimizer's preconditioners in use live and how its step reads them: the
placement (device, pinned host with a staging ring, device views, the NVMe tier under a host budget),
the budget checks and the per-tier memory report. A mixin of ``asteria.optim.base.SecondOrderOptimizer``
(it uses the optimizer's groups, factor sets, tier and refresher)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import Tensor

from asteria.optim.groups import ShapeGroup
from asteria.optim.validation import check_arg
from asteria.pipeline.factors import FactorSet
from asteria.pipeline.tiers import PreconditionerTier, coherent_memory

#: the default bound of one shape group's preconditioner bytes under the host placements
HOST_GROUP_BYTES = 32 * 2**20
#: host buffers of one set's size that the NVMe tier holds per set shape (read-ahead and install scratch)
PAGED_BUFFERS = 3


def device_capacity(device: torch.device) -> int | None:
    """The bytes of memory ``device`` has in all (a GPU's, or the host's physical memory for the CPU);
    None where that is not known."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            return None
    return None


def host_available() -> int | None:
    """The host memory that can still be given without swapping (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def device_available(device: torch.device) -> int | None:
    """The bytes ``device`` can still give: a GPU's free memory plus what torch's allocator holds unused, or
    the host's available memory for the CPU; None where that is not known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        return host_available()
    return None


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


class MemoryTiers:
    """Memory placement and reporting of the Asteria optimizers (see the module docstring)."""

    def _check_factor_memory(self) -> None:
        """Refuses, before anything is allocated, a blocking whose state does not fit its device: the factors
        alone (float32, n x n for each preconditioned dimension of each block) beyond all of the device's
        memory, or the whole state (factors, the preconditioners in use where they stay on the device, the
        moments, and the start-up refreshes' results on a GPU) beyond what the device can still give. The
        error names ``max_preconditioner_dim`` and the bytes; without it the allocation fails inside the
        allocator, or on a host that overcommits memory the first steps are killed."""
        factors: dict[torch.device, int] = {}
        state: dict[torch.device, int] = {}
        largest: dict[torch.device, tuple[int, ShapeGroup]] = {}
        for group in self._groups:
            dims = self._refresh_dims(group)
            moments = self.PARAM_MOMENTS * group.batch * 4 * math.prod(group.shape)
            state[group.device] = state.get(group.device, 0) + moments
            if not dims:
                continue
            nbytes = group.batch * 4 * sum(d * d for d in dims)
            factors[group.device] = factors.get(group.device, 0) + nbytes
            # The preconditioners in use, and on a GPU the start-up refreshes' results until they are installed.
            copies = 1 + (self.placement == "device") + (group.device.type == "cuda")
            state[group.device] += copies * nbytes
            if max(dims) > largest.get(group.device, (0, group))[0]:
                largest[group.device] = (max(dims), group)
        for device, total in factors.items():
            capacity = device_capacity(device)
            if capacity is None or total <= capacity:
                continue
            dim, group = largest[device]
            raise ValueError(
                f"Invalid max_preconditioner_dim={self.max_preconditioner_dim}: the factors alone (float32, n x n for "
                f"each dimension of each block) would take {total / 2**30:.1f} GiB on {device}, which has "
                f"{capacity / 2**30:.1f} GiB in all (the largest, {dim} x {dim}, for {group.blocks[0].name}, a block "
                f"of shape {tuple(group.shape)}); a smaller max_preconditioner_dim splits large dimensions into more, "
                "smaller blocks")
        for device, need in state.items():
            available = device_available(device)
            if available is None or need <= available:
                continue
            raise ValueError(
                f"Invalid max_preconditioner_dim={self.max_preconditioner_dim}: this optimizer's state needs "
                f"{gib(need)} on {device} (factors {gib(factors.get(device, 0))}, with the preconditioners in use "
                f"under placement {self.placement!r}, the moments and the start-up refreshes), and {device} can "
                f"still give {gib(available)}; a smaller max_preconditioner_dim, MemoryConfig(placement='host') "
                "(preconditioners in pinned host memory) or fewer parameters per optimizer would fit")

    def _check_host_memory(self, refresh_bytes: int) -> None:
        """Refuses, before the refresh buffers are allocated, ``refresh_bytes`` of pinned host memory that
        ``host_budget`` does not allow (the buffers are never paged to NVMe) or that the host cannot give, naming
        the bytes and what to change. Pinned pages cannot be swapped out, so the host's available memory bounds
        them (the CUDA driver pins them itself: the process's memlock limit does not apply)."""
        if refresh_bytes == 0:
            return
        memory = self.runtime.memory
        if memory.host_budget is not None and refresh_bytes > memory.host_budget:
            device = sum(t.numel() * t.element_size() for g in self._groups for t in g.state.values()
                         if t.device.type != "cpu")
            raise ValueError(f"Invalid host_budget={memory.host_budget}: too small for this model's state (placement "
                             f"{self.placement!r}: device needs {device} bytes, host needs {refresh_bytes} bytes; per "
                             f"kind: host {{'refresh_buffers': {refresh_bytes}}}, nvme {{}}); the refresh buffers "
                             f"({self._in_flight_text()}) stay in host memory: raise host_budget or "
                             f"{self._fewer_text()}")
        available = host_available()
        if available is not None and refresh_bytes > available:
            raise ValueError(f"Invalid runtime={self.runtime!r}: the refresh buffers need {gib(refresh_bytes)} of "
                             f"pinned host memory ({self._in_flight_text()}), and the host can give {gib(available)} "
                             f"(MemAvailable); {self._fewer_text()}, or use a host with more memory")

    def _in_flight_text(self) -> str:
        """What sizes the refresh buffers, for messages."""
        if not self.runtime.deterministic:
            return (f"a packed snapshot and a result per block for each of in_flight={self.runtime.in_flight} "
                    "versions")
        lag = self.runtime.activation_lag(self.precondition_frequency)
        return (f"{lag // self.precondition_frequency + 1} packed snapshots and results per block: the versions "
                f"waiting lag_steps={lag}")

    def _fewer_text(self) -> str:
        if not self.runtime.deterministic:
            return "use in_flight=1 or a smaller max_preconditioner_dim"
        return "use a shorter lag_steps, deterministic=False (one version in flight per set)"

    def _resolve_placement(self) -> str:
        """The placement of the preconditioners in use (``MemoryConfig.placement``, with ``"auto"``
        decided from the device and the GPU budget)."""
        memory = self.runtime.memory
        devices = {p.device for group in self.param_groups for p in group["params"]}
        on_cuda = any(device.type == "cuda" for device in devices)
        if memory.placement != "auto":
            check_arg(on_cuda or memory.placement == "device", "memory.placement", memory.placement,
                      "the host placements are for parameters on a GPU (CPU parameters already live in host "
                      "memory): use 'auto' or 'device'")
            return memory.placement
        if not on_cuda or self.runtime.mode == "sync":
            return "device"
        if memory.nvme_dir is not None:
            return "host"
        if all(coherent_memory(device) for device in devices if device.type == "cuda"):
            return "device_view"
        return "device"  # moved to "host" by _fit_gpu_budget when it exceeds gpu_budget

    def _fit_gpu_budget(self) -> None:
        """Under ``placement="auto"``: when the device placement exceeds ``gpu_budget``, the
        preconditioners in use move to pinned host memory (the ``"host"`` placement)."""
        memory = self.runtime.memory
        if memory.placement != "auto" or self.placement != "device" or memory.gpu_budget is None:
            return
        if not any(s.device.type == "cuda" for s, _ in self._home_sets):
            return
        if self.memory_report()["device"]["total"] <= memory.gpu_budget:
            return
        for fset, group in self._home_sets:
            key = next(k for k, t in group.state.items() if t is fset.preconditioners)
            group.state[key] = fset.preconditioners = fset.preconditioners.cpu().pin_memory()
        self.placement = "host"
        self._tier = self._tier_box[0] = PreconditionerTier("host", self._tier.groups_sets)
        self._refresher.tier = self._tier

    def _new_preconditioners(self, group: ShapeGroup, dim: int) -> Tensor:
        """(B, dim, dim) identities where the placement keeps the preconditioners in use: on the
        group's device, or in pinned host memory."""
        if self.placement == "device":
            return torch.eye(dim, dtype=torch.float32, device=group.device).repeat(group.batch, 1, 1)
        return torch.eye(dim, dtype=torch.float32, device="cpu").repeat(group.batch, 1, 1).pin_memory()

    def _place_on_nvme(self) -> None:
        """Moves preconditioner sets to the NVMe tier, largest first, until the host state fits
        ``host_budget`` (only with ``nvme_dir``; without a ``host_budget`` nothing moves)."""
        memory = self.runtime.memory
        if memory.nvme_dir is None:
            return
        check_arg(self.runtime.mode == "async", "memory.nvme_dir", memory.nvme_dir,
                  "the NVMe tier needs mode='async' (the native sync mode keeps everything on the device)")
        on_host = [fset for fset, _ in self._home_sets if fset.preconditioners.device.type == "cpu"]
        check_arg(bool(on_host) or not self._home_sets, "memory.nvme_dir", memory.nvme_dir,
                  f"the NVMe tier pages host-resident preconditioners, and placement {self.placement!r} keeps them on "
                  "the GPU: use placement='host'")
        check_arg(self.placement in ("host", "device"), "memory.nvme_dir", memory.nvme_dir,
                  f"the NVMe tier cannot back placement {self.placement!r}: use placement='host'")
        if memory.host_budget is None:
            return
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
        if not chosen:
            return
        keys = {}
        chosen_ids = {id(fset) for fset in chosen}
        for fset, group in self._home_sets:
            if id(fset) in chosen_ids:
                keys[id(fset)] = (group, next(k for k, t in group.state.items() if t is fset.preconditioners))
        self._tier.page(chosen, memory.nvme_dir, self.runtime.timeout_s)
        for fset in chosen:
            group, key = keys[id(fset)]
            del group.state[key]
            self._paged_keys.setdefault(self._group_index[id(group)], {})[key] = fset

    def _expected_state(self, index: int) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of every state tensor of shape group ``index`` in a checkpoint (those on the
        NVMe tier included)."""
        expected = {key: (t.shape, t.dtype) for key, t in self._groups[index].state.items()}
        for key, fset in self._paged_keys.get(index, {}).items():
            expected[key] = (torch.Size((fset.batch, fset.dim, fset.dim)), torch.float32)
        return expected

    def _preconditioners(self, group: ShapeGroup) -> list[Tensor]:
        """The device tensors with ``group``'s preconditioners in use (one per mode), readable by the
        current stream; under the host placement they are staged here once per step."""
        index = self._group_index[id(group)]
        if index not in self._reading:
            self._reading[index] = self._tier.read(index)
        return self._reading[index]

    def _done_reading(self, group: ShapeGroup) -> None:
        index = self._group_index[id(group)]
        if self._reading.pop(index, None) is not None:
            self._tier.done(index)

    def memory_report(self) -> dict[str, Any]:
        """Bytes of optimizer state per tier and per kind of state: ``device`` (the parameters'
        device: factors, moments, and the preconditioners under the device placement, plus the
        staging ring), ``host`` (pinned host memory: preconditioners under the host placements, the
        refresh buffers, the NVMe tier's read-ahead buffers), ``nvme`` (the page files of the sets the
        NVMe tier holds); with the placement, the peak staging bytes and the bytes staged to the device so
        far (and with the NVMe tier, the bytes it has read and written)."""
        tiers: dict[str, dict[str, int]] = {"device": {}, "host": {}, "nvme": {}}
        homes = {id(fset.preconditioners) for fset, _ in self._home_sets}
        for index, group in enumerate(self._groups):
            for key, tensor in group.state.items():
                # Preconditioners in host memory count as host state even for CPU parameters (the host
                # budget, and the NVMe tier under it, are about them).
                host = tensor.device.type == "cpu" and (group.device.type != "cpu" or id(tensor) in homes)
                kind = key.rstrip("_0123456789")  # "factor_1" and "factor_0" are one kind
                tier = tiers["host" if host else "device"]
                tier[kind] = tier.get(kind, 0) + tensor.numel() * tensor.element_size()
            for key, fset in self._paged_keys.get(index, {}).items():
                kind = key.rstrip("_0123456789")
                tiers["nvme"][kind] = tiers["nvme"].get(kind, 0) + fset.batch * fset.dim * fset.dim * 4
        staging = self._tier.staging_bytes()
        if staging:
            tiers["device"]["staging"] = staging
        tiers["host"]["refresh_buffers"] = self._refresher.host_bytes()
        paged = self._tier.paged
        if paged is not None:
            tiers["host"]["nvme_buffers"] = paged.host_bytes
            tiers["nvme"]["page_files"] = paged.nvme_bytes - sum(tiers["nvme"].values())
        for tier in tiers.values():
            tier["total"] = sum(tier.values())
        report: dict[str, Any] = tiers | {"placement": self.placement, "bytes_staged": self._tier.staged_bytes,
                                          "peak_staging_bytes": self._tier.peak_staging_bytes}
        if paged is not None:
            io = paged.stats()
            report |= {"nvme_bytes_read": io["bytes_read"], "nvme_bytes_written": io["bytes_written"]}
        return report

    def _check_budgets(self) -> None:
        report = self.memory_report()
        memory = self.runtime.memory
        # The staging ring grows to two groups per shape on the first steps: count it at its bound.
        device = report["device"]["total"] + self._tier.staging_bound()
        needs = (f"placement {self.placement!r}: device needs {device} bytes, host needs "
                 f"{report['host']['total']} bytes; per kind: host {report['host']}, nvme {report['nvme']}")
        if memory.gpu_budget is not None and device > memory.gpu_budget:
            raise ValueError(f"Invalid gpu_budget={memory.gpu_budget}: too small for this model's state ({needs})")
        if memory.host_budget is not None and report["host"]["total"] > memory.host_budget:
            raise ValueError(f"Invalid host_budget={memory.host_budget}: too small for this model's state ({needs})")
        if memory.nvme_budget is not None and report["nvme"]["total"] > memory.nvme_budget:
            raise ValueError(f"Invalid nvme_budget={memory.nvme_budget}: the page files need "
                             f"{report['nvme']['total']} bytes to fit host_budget={memory.host_budget} ({needs})")
