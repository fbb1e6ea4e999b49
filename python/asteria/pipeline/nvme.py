"""The NVMe tier of the preconditioners in use: sets that do not fit the host budget live in page files
of the C++ pager (``asteria._core.Pager``: aligned O_DIRECT I/O on its own threads, checksummed pages,
atomic publish) and are read back every step, ahead of use, into a few pinned buffers.

One pager per set shape (a pager's records have one size); each has ``buffers_per_shape`` read-ahead
buffers, so the host holds at most that many sets of a shape at a time. At the first read of a step
the keys of every paged set are scheduled in the order the step reads them; the step then acquires
them one by one, and a buffer goes back to the pool once the device has copied it (or, for CPU
parameters, once the step's math has read it). An install writes the new set through a pinned scratch
buffer; the pager publishes the new version only when its write has completed, so a failed write
(full disk, I/O error) leaves the previous version readable and raises a clear ``PagerIOError``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import shutil
import tempfile
from typing import Any

import torch
from torch import Tensor

from asteria import _core
from asteria.errors import StateLostError
from asteria.pipeline.factors import FactorSet


class PagedSets:
    """Factor sets whose preconditioners in use are kept on NVMe."""

    def __init__(self, directory: str, sets: list[FactorSet], contents: list[Tensor], pin: bool,
                 timeout_s: float, buffers_per_shape: int = 2) -> None:
        #: the folders this tier made on the way to ``directory`` (the outermost first), removed at close if empty
        self._made = missing_folders(directory)
        try:  # the directory is created if missing; the page files go to a fresh directory inside it
            os.makedirs(directory, exist_ok=True)
            reclaim_dead_roots(directory)
            self.root, self._owner = claim_root(directory)
        except OSError as error:
            self._remove_made()
            raise ValueError(f"Invalid memory.nvme_dir={directory!r}: must be a directory this process can create "
                             f"files in ({error.strerror or error})") from error
        self.timeout_s = timeout_s
        self.pin = pin
        self.key: dict[int, int] = {}
        self.shape_of: dict[int, tuple[int, ...]] = {}
        self.pagers: dict[tuple[int, ...], Any] = {}
        self.buffers: dict[tuple[int, ...], Tensor] = {}
        self.scratch: dict[tuple[int, ...], list[list[Any]]] = {}  # shape -> [[tensor, (ticket, set, key) | None]]
        self._turn: dict[tuple[int, ...], int] = {}
        self._versions: dict[int, int] = {}
        self._lost: dict[int, str] = {}  # key -> why its newest version is unreadable (``acquire``)
        self._scheduled = False
        self._held: list[tuple[Any, int, torch.cuda.Event | None]] = []  # (pager, buffer, event to wait)
        try:
            for key, (fset, content) in enumerate(zip(sets, contents)):
                shape = tuple(content.shape)
                if shape not in self.pagers:
                    nbytes = content.numel() * 4
                    self.buffers[shape] = torch.zeros((buffers_per_shape, nbytes), dtype=torch.uint8, pin_memory=pin,
                                                      device="cpu")
                    name = os.path.join(self.root, "x".join(map(str, shape)))
                    self.pagers[shape] = _core.Pager(name, self.buffers[shape], io_threads=2)
                self.key[id(fset)] = key
                self.shape_of[id(fset)] = shape
                self._versions[key] = 0
                self.write(fset, content)
        except BaseException:
            self.close()
            raise

    def __contains__(self, fset: FactorSet) -> bool:
        return id(fset) in self.key

    @property
    def host_bytes(self) -> int:
        """Pinned bytes the tier holds: read-ahead buffers and install scratch, one (B, n, n) set per shape, counted
        from the start (it is made at the shape's first install: a budget checked before must allow for it)."""
        scratch = sum(math.prod(shape) * 4 for shape in self.pagers)
        return sum(b.numel() for b in self.buffers.values()) + scratch

    @property
    def nvme_bytes(self) -> int:
        """Bytes of page files: two page slots per set (the live version and the one being written)."""
        return sum(2 * pager.slot_bytes * sum(1 for k in self.key if self.shape_of[k] == shape)
                   for shape, pager in self.pagers.items())

    def scratch_for(self, fset: FactorSet, current: bool) -> Tensor:
        """A pinned (B, n, n) buffer to build the new content of ``fset`` in (holding its current
        content when ``current``); hand it to ``commit`` afterwards."""
        shape = self.shape_of[id(fset)]
        slots = self.scratch.setdefault(shape, [])
        if not slots:  # one per shape: an install waits for the previous write of its shape to leave it
            slots.append([torch.empty(shape, dtype=torch.float32, pin_memory=self.pin, device="cpu"), None])
        turn = self._turn.get(shape, 0)
        self._turn[shape] = turn + 1
        slot = slots[turn % len(slots)]
        if slot[1] is not None:  # its previous write must have left the buffer
            try:
                self._wait_write(shape, *slot[1])
            except TimeoutError:  # still being written from: the buffer stays held (the ticket stays valid)
                self._turn[shape] = turn
                raise
            except BaseException:
                slot[1] = None  # waited for once: a failed ticket is gone
                raise
            slot[1] = None
        if current:
            self.read_into(fset, slot[0])
        return slot[0]

    def commit(self, fset: FactorSet, content: Tensor) -> None:
        """Writes ``content`` (a buffer from ``scratch_for``) as the next version of ``fset``."""
        self.write(fset, content)

    def write(self, fset: FactorSet, content: Tensor) -> None:
        key = self.key[id(fset)]
        shape = self.shape_of[id(fset)]
        version = self._versions[key] + 1
        ticket = self.pagers[shape].write(key, version, content)
        self._versions[key] = version  # (only once the pager took it: a refused write changes nothing)
        for slot in self.scratch.get(shape, []):
            if slot[0] is content:
                slot[1] = (ticket, fset, key)
                return
        self._wait_write(shape, ticket, fset, key)  # not a scratch buffer: the caller may reuse it

    def _wait_write(self, shape: tuple[int, ...], ticket: int, fset: FactorSet, key: int) -> None:
        """Waits for a write; one that failed (a full disk, a file removed) leaves the set without its newest
        version on disk (the pager keeps the previous one), so the set is marked lost and the error raised."""
        try:
            self.pagers[shape].wait(ticket, self.timeout_s)
        except OSError as error:
            if not isinstance(error, TimeoutError):
                self._lose(fset, key, f"writing it failed: {type(error).__name__}: {error}")
            raise

    def read_into(self, fset: FactorSet, out: Tensor) -> Tensor:
        """Reads the newest version of ``fset`` into the host tensor ``out`` (synchronous)."""
        self.pagers[self.shape_of[id(fset)]].read(self.key[id(fset)], out, self.timeout_s)
        return out

    def schedule(self, order: list[FactorSet]) -> None:
        """Schedules this step's reads, in the order the step will acquire them (once per step)."""
        if self._scheduled:
            return
        self._scheduled = True
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for fset in order:
            if fset in self:
                by_shape.setdefault(self.shape_of[id(fset)], []).append(self.key[id(fset)])
        for shape, keys in by_shape.items():
            self.pagers[shape].read_ahead(keys)

    def acquire(self, fset: FactorSet) -> tuple[Tensor, Any, int]:
        """The host buffer holding ``fset``'s preconditioners, with its pager and index for ``release``. Raises
        ``StateLostError`` when the newest version written cannot be read (a corrupt page: the pager falls back
        to the older copy), now and at every later read of the set."""
        shape = self.shape_of[id(fset)]
        pager = self.pagers[shape]
        key = self.key[id(fset)]
        if key in self._lost:
            raise StateLostError(self._lost[key])
        try:
            index, version, _ = pager.acquire(key, self.timeout_s)
        except (OSError, KeyError) as error:  # a corrupt page (ChecksumError), a file gone: the newest is lost
            if not isinstance(error, TimeoutError):
                self._lose(fset, key, f"{type(error).__name__}: {error}")
            raise
        if version != self._versions[key]:
            pager.release(index)
            self._lose(fset, key, f"only version {version} is readable, not the newest, {self._versions[key]}")
            raise StateLostError(self._lost[key])
        return self.buffers[shape][index].view(torch.float32).view(shape), pager, index

    def _lose(self, fset: FactorSet, key: int, cause: str) -> None:
        """Marks ``fset``'s newest version lost: every later read of it raises ``StateLostError``."""
        self._lost[key] = (f"the preconditioners of {fset.name} (parameters {sorted(set(fset.block_params))}) on the "
                           f"NVMe tier under {self.root} lost their newest version ({cause}); going on would leave "
                           "the run's trajectory: load the last state_dict() into a new optimizer to go on")

    def release_after(self, pager: Any, index: int, event: torch.cuda.Event | None) -> None:
        """Returns a buffer to its pool once ``event`` (the device's copy of it) has completed."""
        self._held.append((pager, index, event))
        self.recycle(block=False)

    def recycle(self, block: bool) -> None:
        still = []
        for pager, index, event in self._held:
            if event is not None and not event.query():
                if not block:
                    still.append((pager, index, event))
                    continue
                event.synchronize()
            pager.release(index)
        self._held = still

    def end_step(self) -> None:
        """Frees what the step did not consume, so that the next step schedules from a clean pool."""
        self.recycle(block=True)
        for pager in self.pagers.values():
            pager.cancel_read_ahead()
        self._scheduled = False

    def stats(self) -> dict[str, int]:
        totals = {"bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0, "read_ahead_hits": 0,
                  "read_ahead_misses": 0}
        for pager in self.pagers.values():
            stats = pager.stats()
            for key in totals:
                totals[key] += stats[key]
        return totals

    def close(self) -> None:
        self._held = []
        for pager in self.pagers.values():
            pager.close()
        self.pagers = {}
        if self._owner is not None:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.root, OWNER_LOCK))
            os.close(self._owner)
            self._owner = None
        try:
            os.rmdir(self.root)
        except OSError:
            pass
        self.buffers, self.scratch = {}, {}
        self._remove_made()

    @property
    def closed(self) -> bool:
        return self._owner is None

    def _remove_made(self) -> None:
        """Removes the folders this tier made on the way to its directory, the innermost first, while empty."""
        for folder in reversed(self._made):
            try:
                os.rmdir(folder)
            except OSError as error:  # not made (makedirs failed below it: continue up), or not empty (stop)
                if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    break  # (something else lives there now)
        self._made = []


def missing_folders(directory: str) -> list[str]:
    """The folders of ``directory``'s path that do not exist yet, the outermost first."""
    missing, path = [], os.path.abspath(directory)
    while not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing[::-1]


#: the lock its owner holds on a tier's directory for its life; the kernel drops it when the process dies
OWNER_LOCK = ".asteria-owner.lock"
ROOT_PREFIX = "asteria-nvme-"


def claim_root(directory: str) -> tuple[str, int]:
    """A fresh directory for one tier's page files inside ``directory``, with its owner lock held (returned as
    an open descriptor): made under a hidden name, locked, then renamed into view, so that no other process
    ever sees it without its lock."""
    staging = tempfile.mkdtemp(prefix="." + ROOT_PREFIX + "new-", dir=directory)
    fd = os.open(os.path.join(staging, OWNER_LOCK), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    root = os.path.join(directory, ROOT_PREFIX + os.path.basename(staging)[len(ROOT_PREFIX) + 5:])
    os.rename(staging, root)
    return root, fd


def reclaim_dead_roots(directory: str) -> list[str]:
    """Removes the page directories under ``directory`` whose owner process is gone (killed, say: its owner lock
    is free); a live owner's, and any directory without an owner lock, are left alone. Returns the removed."""
    removed = []
    for entry in os.scandir(directory):
        if not (entry.name.startswith(ROOT_PREFIX) and entry.is_dir(follow_symlinks=False)):
            continue
        try:
            fd = os.open(os.path.join(entry.path, OWNER_LOCK), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # its owner is alive
        shutil.rmtree(entry.path, ignore_errors=True)
        os.close(fd)
        removed.append(entry.path)
    return removed
