"""Where the preconditioners in use live, and how the device reads them each step.

Placements (``MemoryConfig.placement``):

- ``"device"``: on the parameters' device, as native implementations keep them. Nothing to stage.
- ``"host"``: in pinned host memory. Each step, the preconditioners of a shape group are copied to a
  small device staging ring on the low-priority side stream just before the group's math needs them
  (the copy of the next group is issued before this group computes, so copies overlap compute), and
  the main stream waits only on that copy's event. The ring holds two slots per set shape, so the
  device holds at most two groups' preconditioners at a time; ``MemoryConfig.group_bytes`` bounds a
  group's size.
- ``"device_view"``: in pinned host memory that the device reads directly, through device views of
  the host buffers (unified addressing). On coherent-memory machines (GH200, GB10) that is as fast as
  device memory; elsewhere (PCIe GPUs) it is correct but slower.
- ``"auto"``: ``"host"`` with an ``nvme_dir`` (the pager serves host buffers); else ``"device_view"`` on a
  coherent-memory device; else ``"device"`` unless a ``gpu_budget`` would be exceeded with it, then
  ``"host"``. CPU parameters and sync mode always use ``"device"``.

A host-resident preconditioner is overwritten only by an install, after the device's last read of
it (copy or view) has completed, so no stream ever reads a half-written buffer.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

from asteria.pipeline import streams
from asteria.pipeline.factors import FactorSet
from asteria.pipeline.nvme import PagedSets

PLACEMENTS = ("auto", "device", "host", "device_view")


@functools.lru_cache(maxsize=None)
def coherent_memory(device: torch.device) -> bool:
    """Whether ``device`` reads pageable host memory through the host's page tables (hardware
    coherence: Grace Hopper, Grace Blackwell) or shares it as an integrated GPU."""
    if device.type != "cuda":
        return False
    props = torch.cuda.get_device_properties(device)
    if getattr(props, "is_integrated", False):
        return True
    try:
        cudart = ctypes.CDLL("libcudart.so" + _cudart_suffix())
    except OSError:
        return False
    value = ctypes.c_int(0)
    # cudaDevAttrPageableMemoryAccessUsesHostPageTables = 100
    index = device.index if device.index is not None else torch.cuda.current_device()
    if cudart.cudaDeviceGetAttribute(ctypes.byref(value), 100, index) != 0:
        return False
    return bool(value.value)


def _cudart_suffix() -> str:
    version = torch.version.cuda or ""
    return "." + version.split(".")[0] if version else ""


class _DeviceView:
    """A ``__cuda_array_interface__`` over a pinned host tensor, so that torch builds a device tensor
    on the same memory (no copy); it keeps the host tensor alive."""

    def __init__(self, host: Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "<f4",
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def device_view(host: Tensor, device: torch.device) -> Tensor:
    """A tensor on ``device`` aliasing the pinned float32 host tensor ``host``."""
    if not host.is_pinned() or host.dtype != torch.float32 or not host.is_contiguous():
        raise ValueError(f"Invalid host tensor for a device view: needs pinned, contiguous float32, got "
                         f"pinned={host.is_pinned()} dtype={host.dtype} contiguous={host.is_contiguous()}")
    view = torch.as_tensor(_DeviceView(host), device=device)
    if view.data_ptr() != host.data_ptr():
        raise RuntimeError("the device view does not alias the host buffer (no unified addressing?)")
    return view


class PreconditionerTier:
    """The preconditioners' home per factor set and the device tensors the math reads."""

    def __init__(self, placement: str, groups_sets: list[list[FactorSet]]) -> None:
        self.placement = placement
        self.groups_sets = groups_sets  # per shape group, in the order the step uses them
        self._order = [g for g, sets in enumerate(groups_sets) if sets]
        # The group the step reads after each one (staged while that one computes), and every set in
        # the order the step reads them (the NVMe tier's read-ahead schedule): fixed, so built once.
        self._next = dict(zip(self._order, self._order[1:]))
        self._read_order = [s for g in self._order for s in groups_sets[g]]
        self._views: dict[int, list[Tensor]] = {}
        self._slots: dict[tuple, list[list[Any]]] = {}  # (shape, mode) -> [[buffer, last-use event], x2]
        self._turn: dict[tuple, int] = {}
        self._last_read: dict[int, torch.cuda.Event | None] = {}  # id(set) -> event of its last device read
        self._side: dict[torch.device, streams.SideStream] = {}
        self._used: dict[int, list[list[Any]]] = {}  # group -> the slots its staged copy occupies
        self._group_of = {id(s): g for g, sets in enumerate(groups_sets) for s in sets}
        self.paged: PagedSets | None = None
        self._cpu_held: dict[int, list[tuple[Any, int]]] = {}
        self.staged_bytes = 0
        self.peak_staging_bytes = 0
        if placement == "device_view":
            for g in self._order:
                self._views[g] = [device_view(s.preconditioners, s.device) for s in groups_sets[g]]

    @property
    def resident(self) -> bool:
        return self.placement == "device" and self.paged is None

    # ---- the NVMe tier ---------------------------------------------------------------------------
    def page(self, sets: list[FactorSet], directory: str, timeout_s: float) -> None:
        """Moves the preconditioners of ``sets`` (host-resident) to the NVMe tier under ``directory``."""
        contents = [s.preconditioners for s in sets]
        pin = any(s.device.type == "cuda" for s in sets)
        self.paged = PagedSets(directory, sets, contents, pin, timeout_s)
        for fset in sets:  # nothing may read the set except through the tier from now on
            # keeps the shape
            fset.preconditioners = torch.empty(fset.preconditioners.shape, dtype=torch.float32, device="meta")

    def is_paged(self, fset: FactorSet) -> bool:
        return self.paged is not None and fset in self.paged

    def current(self, fset: FactorSet) -> Tensor:
        """The preconditioners of ``fset`` in use, as a tensor (read from NVMe if paged there)."""
        if not self.is_paged(fset):
            return fset.preconditioners
        return self.paged.read_into(fset, torch.empty(fset.preconditioners.shape, dtype=torch.float32, device="cpu"))

    def set_current(self, fset: FactorSet, value: Tensor) -> None:
        """Replaces the preconditioners of ``fset`` in use (a checkpoint load)."""
        target = self.install_target(fset, full=True)
        target.copy_(value)
        self.after_install(fset, target)

    def install_target(self, fset: FactorSet, full: bool) -> Tensor:
        """The tensor an install writes ``fset``'s new preconditioners into (``full``: every block is
        replaced); hand it to ``after_install`` afterwards."""
        if self.is_paged(fset):
            return self.paged.scratch_for(fset, current=not full)
        self.before_install(fset)
        return fset.preconditioners

    def after_install(self, fset: FactorSet, target: Tensor) -> None:
        if self.is_paged(fset):
            self.paged.commit(fset, target)

    def end_step(self) -> None:
        """The step has read everything it needs: unread staging is dropped and read buffers recycled."""
        if self.paged is not None:
            for group in list(self._views):
                self._views.pop(group)
            self.paged.end_step()

    def _source(self, group_index: int, fset: FactorSet) -> tuple[Tensor, Any]:
        """Where ``fset``'s preconditioners are read from now: its home, or an acquired NVMe buffer."""
        if not self.is_paged(fset):
            return fset.preconditioners, None
        self.paged.schedule(self._read_order)
        buffer, pager, index = self.paged.acquire(fset)
        return buffer, (pager, index)

    def staging_bound(self) -> int:
        """The most device bytes the staging ring can take: two slots per set shape and mode."""
        if self.placement != "host":
            return 0
        keys = {(tuple(s.preconditioners.shape), position)
                for sets in self.groups_sets for position, s in enumerate(sets)}
        return sum(2 * 4 * torch.Size(shape).numel() for shape, _ in keys)

    def staging_bytes(self) -> int:
        return sum(slot[0].numel() * 4 for slots in self._slots.values() for slot in slots)

    def read(self, group_index: int) -> list[Tensor]:
        """The device tensors holding group ``group_index``'s preconditioners in use, ready for the
        current stream (staged now if needed; the next group's copy is issued too)."""
        sets = self.groups_sets[group_index]
        if self.placement == "device" and self.paged is None:
            return [s.preconditioners for s in sets]
        if self.placement == "device_view":
            return self._views[group_index]
        if self.placement == "device":  # CPU parameters with sets on NVMe: the buffers are read in place
            views = []
            try:
                for fset in sets:
                    tensor, held = self._source(group_index, fset)
                    if held is not None:
                        self._cpu_held.setdefault(group_index, []).append(held)
                    views.append(tensor)
            except BaseException:  # the buffers acquired before a failed read go back to the pool
                self.done(group_index)
                raise
            return views
        if group_index not in self._views:
            self._stage(group_index)
        views = self._views.pop(group_index)
        following = self._next.get(group_index)
        if following is not None and following not in self._views:
            self._stage(following)
        for fset, view in zip(sets, views):
            side = self._side_stream(fset.device)
            side.main_waits(self._last_read[id(fset)])
        return views

    def done(self, group_index: int) -> None:
        """Marks the end of this step's reads of the group (the buffers may be reused after them)."""
        for pager, index in self._cpu_held.pop(group_index, []):
            pager.release(index)
        if self.placement == "device":
            return
        event = None
        for fset in self.groups_sets[group_index]:
            if fset.device.type == "cuda":
                event = event or torch.cuda.Event()
                event.record(torch.cuda.current_stream(fset.device))
            if self.placement == "device_view":
                self._last_read[id(fset)] = event
        if self.placement == "host":
            for slot in self._used.pop(group_index, []):
                slot[1] = event

    def prefetch(self) -> None:
        """Issues the staging copy of the first group the next step reads."""
        if self.placement == "host" and self._order and self._order[0] not in self._views:
            self._stage(self._order[0])

    def close(self) -> None:
        if self.paged is not None:
            self.paged.close()

    def before_install(self, fset: FactorSet) -> None:
        """Waits until the device no longer reads ``fset``'s host buffer (called before an install)."""
        if self.resident:
            return
        streams.wait(self._last_read.get(id(fset)))
        group = self._group_of[id(fset)]
        if self.placement == "host" and group in self._views:  # staged before this install: stale now
            del self._views[group]
            for slot in self._used.pop(group, []):
                slot[1] = self._last_read[id(fset)]

    def _side_stream(self, device: torch.device) -> streams.SideStream:
        if device not in self._side:
            self._side[device] = streams.SideStream(device)
        return self._side[device]

    def _stage(self, group_index: int) -> None:
        views = []
        for position, fset in enumerate(self.groups_sets[group_index]):
            # Two slots per (shape, mode): the two modes of a square block have one shape, and both
            # are in use while the next group's copies arrive.
            shape = tuple(fset.preconditioners.shape)
            key = (shape, position)
            slots = self._slots.setdefault(key, [])
            if len(slots) < 2:
                slots.append([torch.empty(shape, dtype=torch.float32, device=fset.device), None])
                self.peak_staging_bytes = max(self.peak_staging_bytes, self.staging_bytes())
            turn = self._turn.get(key, 0)
            self._turn[key] = turn + 1
            slot = slots[turn % len(slots)]
            side = self._side_stream(fset.device)
            if slot[1] is not None and side.stream is not None:
                side.stream.wait_event(slot[1])  # the math that read this slot last has finished
            source, held = self._source(group_index, fset)
            with side.staging():
                slot[0].copy_(source, non_blocking=side.cuda)
            self._last_read[id(fset)] = side.record()
            if held is not None:
                self.paged.release_after(*held, self._last_read[id(fset)])
            self._used.setdefault(group_index, []).append(slot)
            self.staged_bytes += source.numel() * 4
            views.append(slot[0])
        self._views[group_index] = views
