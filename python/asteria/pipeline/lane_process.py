"""The device lane's math in a child process, with a CUDA context of its own.

Why: cuSOLVER's ``eigh`` (syevd) makes host round trips inside, and while one runs the CUDA driver holds every
other thread of the same process at its kernel launches. On an H100 a thread queuing 600 small kernels took 9 ms
alone, 83 ms beside a thread running 2048 x 2048 ``eigh``s (sleeping 425 times), and 11 ms beside the same
``eigh``s run by another process (docs/results.md, "The lane in a process of its own"). In its own process the lane's
math never holds training's launches; the GPU shares its time between the two contexts as it would between two
streams' kernels.

Data crosses once. At the start each of the lane's threads shares a slot with its thread in the child: one flat
buffer, sized for the largest set, that holds a job's snapshot (and, for eigenbases, the bases in use) on the way
in and its result, in the snapshot's place, on the way out; a CUDA slot crosses as a CUDA IPC handle, a CPU slot
as a shared file. A job is then one message each way on the thread's own pipe: the parent copies into the slot and
waits for the copy, the child computes on its own stream with native mode's math (``refresh_math.refresh_set``),
writes the result into the slot, waits for it and replies; the parent copies the result out.

A child that dies or overruns ``timeout_s`` breaks the lane: that job and every later one fail at once with the
reason, and the coherence registry counts the failures as it counts the workers' (``max_consecutive_failures``).
The child ignores Ctrl-C (the parent's to handle), stops when the parent says so or closes the pipes, and exits
when the parent dies, even where a process forked from the parent still holds the pipes.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection
from socket import socketpair
from typing import Any

import torch
from torch import Tensor

from asteria.pipeline.factors import FactorSet, RootRequest
from asteria.pipeline.refresh_math import Refreshed, refresh_set

_ALIGN = 64  # bytes: every field of a slot starts on a multiple (a view as any dtype stays aligned)
_POLL_S = 0.5  # how often a parent thread waiting for its reply checks that the child lives
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds asteria/


def slot_fields(kind: str, batch: int, n: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype, tuple]]:
    """A job's fields in a slot, name -> (byte offset, dtype, shape): the factors' snapshot and (eigenbases) the
    bases in use with which blocks have one, in; the new preconditioners, which are usable and (eigenbases) the
    column order, out. The new preconditioners take the snapshot's place: the child writes them once its math,
    queued before on the same stream, has read the snapshot."""
    square = (batch, n, n)
    fields = [("factors", dtype, square)]
    if kind == "eigenbasis":
        fields += [("current", dtype, square), ("installed", torch.bool, (batch,))]
    fields += [("usable", torch.bool, (batch,))]
    if kind == "eigenbasis":
        fields += [("order", torch.long, (batch, n))]
    layout, offset = {}, 0
    for name, field_dtype, shape in fields:
        layout[name] = (offset, field_dtype, shape)
        size = field_dtype.itemsize
        for extent in shape:
            size *= extent
        offset += -(-size // _ALIGN) * _ALIGN
    layout["new"] = layout["factors"]
    layout["end"] = (offset, torch.uint8, ())
    return layout


def slot_bytes(sets: list[FactorSet]) -> int:
    """The bytes of a slot that holds any job of ``sets``."""
    return max(slot_fields(s.kind, s.batch, s.dim, s.factors.dtype)["end"][0] for s in sets)


def _views(slot: Tensor, kind: str, batch: int, n: int, dtype: torch.dtype) -> dict[str, Tensor]:
    views = {}
    for name, (offset, field_dtype, shape) in slot_fields(kind, batch, n, dtype).items():
        if name != "end":
            size = field_dtype.itemsize
            for extent in shape:
                size *= extent
            views[name] = slot[offset:offset + size].view(field_dtype).view(shape)
    return views


class LaneProcess:
    """The child process and the parent's end of its ``threads`` slots (see the module docstring). ``refresh``
    is called by the lane's thread ``slot`` only; ``close`` by the training thread."""

    def __init__(self, device: torch.device, sets: list[FactorSet], threads: int, timeout_s: float,
                 sms: int | None = None, nice: int = 0) -> None:
        self.device = device
        self.timeout_s = timeout_s
        size = slot_bytes(sets)
        self._files: list[str | None] = [None] * threads
        self.slots: list[Tensor] = []
        for slot in range(threads):
            if device.type == "cuda":
                self.slots.append(torch.empty(size, dtype=torch.uint8, device=device))
            else:  # a file both processes map
                fd, path = tempfile.mkstemp(prefix="asteria-lane-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                            else None)
                os.close(fd)
                self._files[slot] = path
                self.slots.append(torch.from_file(path, shared=True, size=size, dtype=torch.uint8))
        self._ready = [False] * threads
        self._broken: str | None = None
        self.conns: list[Connection] = []
        self.proc: subprocess.Popen | None = None
        try:
            pairs = [socketpair() for _ in range(threads)]
            self.conns = [Connection(parent.detach()) for parent, _ in pairs]
            ends = [child.detach() for _, child in pairs]
            # The child imports this very asteria, from wherever this process found it.
            entry = (f"import sys; root = {_PACKAGE_ROOT!r}; root in sys.path or sys.path.insert(0, root); "
                     "from asteria.pipeline.lane_process import child_main; child_main()")
            try:
                self.proc = subprocess.Popen([sys.executable, "-c", entry, str(device), str(nice), str(sms or 0),
                                              *map(str, ends)], pass_fds=ends, stdin=subprocess.DEVNULL)
            finally:
                for fd in ends:
                    os.close(fd)
            for slot, conn in enumerate(self.conns):
                conn.send(("slot", self.slots[slot] if device.type == "cuda" else self._files[slot], size))
        except BaseException:  # (no child, or one gone at once): nothing is left behind
            self.close()
            raise
        atexit.register(self.close)  # (a lane never closed: the child lets go of the slots before this process ends)

    def refresh(self, slot: int, fset: FactorSet, factors: Tensor, request: RootRequest,
                stream: torch.cuda.Stream | None) -> tuple[Refreshed, float]:
        """``fset``'s refresh from ``factors``, computed in the child through the calling lane thread's ``slot``
        (the current stream is ``stream``, None on the CPU): the result as tensors of this process on that stream,
        and the child's CPU seconds for it. Raises RuntimeError once the child is gone or late."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        conn = self.conns[slot]
        if not self._ready[slot]:
            self._receive(conn, "starting")
            self._ready[slot] = True
            if self._files[slot] is not None:  # mapped on both sides: the name is no longer needed
                os.unlink(self._files[slot])
                self._files[slot] = None
        views = _views(self.slots[slot], fset.kind, fset.batch, fset.dim, fset.factors.dtype)
        views["factors"].copy_(factors)
        if fset.kind == "eigenbasis":
            views["current"].copy_(fset.preconditioners)
            views["installed"].copy_(fset.installed)
        if stream is not None:
            wait_asleep(stream)  # the child reads the slot on its own stream, in its own context
        conn.send(("refresh", fset.name, fset.kind, fset.exponent, fset.first_basis, fset.batch, fset.dim,
                   str(fset.factors.dtype).removeprefix("torch."), request.saved()))
        reply = self._receive(conn, f"refreshing {fset.name}")
        if reply[0] == "error":
            raise RuntimeError(f"in the lane's process: {reply[1]}")
        _, has_order, skipped, cpu_seconds = reply
        order = views["order"].clone() if has_order else None
        skipped_count = torch.tensor(skipped, dtype=torch.long, device=factors.device)
        return Refreshed(views["new"].clone(), views["usable"].clone(), order, skipped_count), cpu_seconds

    def _receive(self, conn: Connection, doing: str) -> tuple:
        deadline = time.monotonic() + self.timeout_s
        try:
            while not conn.poll(_POLL_S):
                code = self.proc.poll()  # (set: only a constructed child's slots are refreshed)
                if code is not None:
                    raise EOFError(f"exited with code {code}")
                if time.monotonic() > deadline:
                    self._broken = (f"the device lane's process did not finish {doing} within "
                                    f"timeout_s={self.timeout_s}; later device refreshes fail")
                    raise RuntimeError(self._broken)
            return conn.recv()
        except (EOFError, OSError) as gone:
            why = str(gone)
            try:  # (its pipe closes as it dies: the exit code says more than the pipe's error)
                why = f"exited with code {self.proc.wait(_POLL_S)}"
            except subprocess.TimeoutExpired:
                pass
            self._broken = (f"the device lane's process ended ({why}) while {doing}; later device refreshes fail "
                            "(its error, if any, is on stderr)")
            raise RuntimeError(self._broken) from None

    def close(self) -> None:
        """Ends the child (its threads stop at the end of their pipes) and frees the slots. Idempotent."""
        atexit.unregister(self.close)
        for conn in self.conns:  # (a process forked from this one may hold the pipes open: say so, then close)
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop",))
            conn.close()
        try:
            if self.proc is not None:
                self.proc.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for slot, path in enumerate(self._files):
            if path is not None:
                os.unlink(path)
                self._files[slot] = None
        self._broken = self._broken or "the device lane's process was closed"


def wait_asleep(stream: torch.cuda.Stream) -> None:
    """Blocks the calling thread until ``stream`` has run what is queued on it, asleep rather than spinning (a
    blocking-sync event), so that a lane thread's wait leaves its core to others."""
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    done.synchronize()


# ---- the child ---------------------------------------------------------------------------------------
def child_main() -> None:
    """The child's entry (``python -c``): argv holds the device, the nice, the SMs of a green context (0: none)
    and one pipe per slot. Each pipe gets a thread that serves its slot's jobs until the parent closes it."""
    device, nice, sms, *fds = sys.argv[1:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle; it ends the child
    if nice != "0" and sys.platform.startswith("linux"):
        os.nice(int(nice))  # before the threads, which inherit it (Linux's nice is per thread)
    torch.set_num_threads(1)  # the math runs on the GPU; the host only waits
    target = torch.device(device)
    streams: list[Any] = [None] * len(fds)
    if target.type == "cuda":
        torch.cuda.set_device(target)
        if int(sms):
            from asteria.pipeline.partition import Partition
            streams = Partition(target, int(sms), len(fds)).streams
        else:
            streams = [torch.cuda.Stream(target) for _ in fds]
    threads = [threading.Thread(target=_serve, args=(Connection(int(fd)), stream), daemon=True)
               for fd, stream in zip(fds, streams, strict=True)]
    for thread in threads:
        thread.start()
    parent = os.getppid()
    for thread in threads:
        while thread.is_alive():
            thread.join(_POLL_S)
            if os.getppid() != parent:  # the parent died (its pipes may live on in a process forked from it)
                os._exit(1)


def _serve(conn: Connection, stream: Any) -> None:
    """Serves one slot: maps it, then computes each job the parent sends until the parent closes the pipe."""
    try:
        _, shared, size = conn.recv()
        slot = torch.from_file(shared, shared=True, size=size, dtype=torch.uint8) if isinstance(shared, str) \
            else shared
        conn.send(("start",))
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            cpu = time.thread_time()
            try:
                reply = _compute(slot, stream, *message[1:])
            except Exception as failure:  # noqa: BLE001 - the parent reports it as the set's failure
                reply = ("error", f"{type(failure).__name__}: {failure}\n{traceback.format_exc(limit=4)}")
            conn.send(reply if reply[0] == "error" else (*reply, time.thread_time() - cpu))
    except (EOFError, OSError):  # the parent closed the pipe, or is gone
        return


def _compute(slot: Tensor, stream: Any, name: str, kind: str, exponent: float, first_basis: str, batch: int,
             n: int, dtype: str, request: tuple) -> tuple:
    views = _views(slot, kind, batch, n, getattr(torch, dtype))
    eigenbasis = kind == "eigenbasis"
    current = views["current"] if eigenbasis else views["factors"]  # (roots read no bases)
    installed = views["installed"] if eigenbasis else torch.zeros(batch, dtype=torch.bool, device=slot.device)
    fset = FactorSet(name=name, factors=views["factors"], preconditioners=current, installed=installed,
                     exponent=exponent, block_params=[name] * batch, kind=kind, first_basis=first_basis)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        refreshed = refresh_set(fset, views["factors"], RootRequest.load(request), current, installed,
                                in_thread=True)
        views["new"].copy_(refreshed.new)
        views["usable"].copy_(refreshed.usable)
        if refreshed.order is not None:
            views["order"].copy_(refreshed.order)
        skipped = int(refreshed.skipped)  # waits for this stream: the slot holds the result
    return ("ok", refreshed.order is not None, skipped)

