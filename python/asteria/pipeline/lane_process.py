"""The device lane's math in a child process, with a CUDA context of its own.

Why: cuSOLVER's ``eigh`` (syevd) makes host round trips inside, and while one runs the CUDA driver holds every
other thread of the same process at its kernel launches. On an H100 a thread queuing 600 small kernels took 9 ms
alone, 83 ms beside a thread running 2048 x 2048 ``eigh``s (sleeping 425 times), and 11 ms beside the same
``eigh``s run by another process (docs/results.md, "The lane in a process of its own"). In its own process the
lane's math never holds training's launches. The GPU then time-slices between the two contexts (without MPS their
kernels do not run side by side as two streams' do), so the lane still costs training the GPU time its math takes.

Data crosses once. At the start each of the lane's threads shares a slot with its thread in the child: one flat
buffer, sized for the largest set, that holds a job's snapshot (and, for eigenbases, the bases in use) on the way
in and its result, in the snapshot's place, on the way out; a CUDA slot crosses as a CUDA IPC handle (from a segment
of fixed size, also where the allocator maps expandable ones: ``memory.fixed_segments``), a CPU slot as an open
shared file (Linux). A job is then one message each way on the thread's own pipe: the parent copies
into the slot and waits for the copy, the child computes on its own stream with native mode's math
(``refresh_math.refresh_set``), writes the result into the slot, waits for it and replies; the parent copies the
result out.

A child that dies or overruns ``timeout_s`` breaks the lane: that job and every later one fail at once with the
reason, and the coherence registry counts the failures as it counts the workers' (``max_consecutive_failures``).
The child ignores Ctrl-C (the parent's to handle), stops when the parent says so or closes the pipes, and exits
when the parent dies, even where a process forked from the parent still holds the pipes.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
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

from asteria.memory import device_available, fixed_segments, gib
from asteria.pipeline.factors import FactorSet, RootRequest
from asteria.pipeline.partition import Partition, check_partition
from asteria.pipeline.refresh_math import Refreshed, load_linalg, refresh_set

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
        offset += -(-_nbytes(field_dtype, shape) // _ALIGN) * _ALIGN
    layout["new"] = layout["factors"]
    layout["end"] = (offset, torch.uint8, ())
    return layout


def slot_bytes(sets: list[FactorSet]) -> int:
    """The bytes of a slot that holds any job of ``sets``."""
    return max(slot_fields(s.kind, s.batch, s.dim, s.factors.dtype)["end"][0] for s in sets)


def _nbytes(dtype: torch.dtype, shape: tuple) -> int:
    return dtype.itemsize * math.prod(shape)


def _views(slot: Tensor, kind: str, batch: int, n: int, dtype: torch.dtype) -> dict[str, Tensor]:
    return {name: slot[offset:offset + _nbytes(field_dtype, shape)].view(field_dtype).view(shape)
            for name, (offset, field_dtype, shape) in slot_fields(kind, batch, n, dtype).items() if name != "end"}


class LaneProcess:
    """The child process and the parent's end of its ``threads`` slots (see the module docstring). ``refresh``
    is called by the lane's thread ``slot`` only; ``close`` by the training thread."""

    def __init__(self, device: torch.device, sets: list[FactorSet], threads: int, timeout_s: float,
                 sms: int | None = None, nice: int = 0) -> None:
        if device.type == "cpu" and not os.path.isdir("/proc/self/fd"):
            raise ValueError("Invalid RuntimeConfig.device_process=True for a device lane on the CPU here: its "
                             "slots cross as open files named through /proc/self/fd (Linux); leave it None")
        if sms is not None:  # (refused here by name, before the child would fail on it)
            check_partition(device, sms)
        need, available = threads * slot_bytes(sets), device_available(device)
        if available is not None and need > available:
            raise ValueError(
                f"Invalid RuntimeConfig.device_threads={threads}: the device lane's process needs {gib(need)} on "
                f"{device} for its slots (one a thread, each the largest factor set's snapshot, bases in use and "
                f"result), and {device} can still give {gib(available)}; fewer device_threads, "
                "device_process=False (the lane's math in this process, without slots), a smaller "
                "max_preconditioner_dim or device_refresh=False would fit")
        self.device = device
        self.timeout_s = timeout_s
        self.slots: list[Tensor] = []
        self.conns: list[Connection] = []
        self.proc: subprocess.Popen | None = None
        self._ready = [False] * threads
        self.child_sms: int | None = None  # the SMs of the child's green context, once it has said (None: all)
        #: the most the child's CUDA caching allocator has held, as its replies say (its math's workspace and results;
        #: its CUDA context comes on top)
        self.peak_reserved = 0
        self._broken: str | None = None
        self._lock = threading.Lock()  # guards _broken against close() beside a lane thread
        files: list[int] = []  # a CPU slot's open (unlinked) file, passed to the child, closed once it runs
        try:
            size = need // threads
            for _ in range(threads):
                if device.type == "cuda":  # (a plain IPC handle: see fixed_segments)
                    with fixed_segments(device):
                        self.slots.append(torch.empty(size, dtype=torch.uint8, device=device))
                    continue
                fd, path = tempfile.mkstemp(prefix="asteria-lane-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                            else None)
                try:
                    self.slots.append(torch.from_file(path, shared=True, size=size, dtype=torch.uint8))
                finally:
                    os.unlink(path)  # (mapped here, and open for the child: no name to leak)
                files.append(fd)
            child_files = list(files)  # (the numbers the child inherits them under)
            pairs = [socketpair() for _ in range(threads)]
            self.conns = [Connection(parent.detach()) for parent, _ in pairs]
            ends = [child.detach() for _, child in pairs]
            # The child ignores Ctrl-C from its first line, and imports this very asteria.
            entry = (f"import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); import sys; "
                     f"sys.path.insert(0, {_PACKAGE_ROOT!r}); "
                     "from asteria.pipeline.lane_process import child_main; child_main()")
            try:
                self.proc = subprocess.Popen([sys.executable, "-c", entry, str(os.getpid()), str(device), str(nice),
                                              str(sms or 0), *map(str, ends)], pass_fds=ends + files,
                                             stdin=subprocess.DEVNULL)
            finally:
                for fd in ends + files:
                    os.close(fd)
                files.clear()  # (the child holds its own copies)
            for slot, conn in enumerate(self.conns):
                shared = self.slots[slot] if device.type == "cuda" else f"/proc/self/fd/{child_files[slot]}"
                self._exchange(slot, ("slot", shared, size), "starting", reply=False)
        except BaseException:  # nothing is left behind: no child, no file, no pipe
            for fd in files:  # (those not yet handed over)
                os.close(fd)
            self.close(force=True)
            for conn in self.conns:  # (no lane thread uses them yet)
                conn.close()
            raise
        atexit.register(self.close)  # (a lane never closed: the child lets go of the slots before this process ends)

    def refresh(self, slot: int, fset: FactorSet, factors: Tensor, request: RootRequest,
                stream: torch.cuda.Stream | None) -> tuple[Refreshed, float]:
        """``fset``'s refresh from ``factors``, computed in the child through the calling lane thread's ``slot``
        (the current stream is ``stream``, None on the CPU): the result as tensors of this process on that stream,
        and the child's CPU seconds for it. Raises RuntimeError once the child is gone, late or closed."""
        if not self._ready[slot]:  # the child's first reply on a slot: it runs, and has mapped the slot
            self.child_sms = self._receive(slot, "starting")[1]
            self._ready[slot] = True
        views = _views(self.slots[slot], fset.kind, fset.batch, fset.dim, fset.factors.dtype)
        views["factors"].copy_(factors)
        if fset.kind == "eigenbasis":
            views["current"].copy_(fset.preconditioners)
            views["installed"].copy_(fset.installed)
        if stream is not None:
            wait_asleep(stream)  # the child reads the slot on its own stream, in its own context
        reply = self._exchange(slot, ("refresh", fset.name, fset.kind, fset.exponent, fset.first_basis, fset.batch,
                                      fset.dim, str(fset.factors.dtype).removeprefix("torch."), request.saved()),
                               f"refreshing {fset.name}")
        _, has_order, skipped, cpu_seconds, reserved = reply
        self.peak_reserved = max(self.peak_reserved, reserved)
        order = views["order"].clone() if has_order else None
        skipped_count = torch.tensor(skipped, dtype=torch.long, device=factors.device)
        return Refreshed(views["new"].clone(), views["usable"].clone(), order, skipped_count), cpu_seconds

    def _exchange(self, slot: int, message: tuple, doing: str, reply: bool = True) -> tuple:
        """Sends ``message`` on ``slot``'s pipe and (``reply``) returns the child's answer; every way the child can
        be gone or late breaks the lane with the reason."""
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(self._broken)
        try:
            self.conns[slot].send(message)
        except (OSError, ValueError) as gone:  # (a dead child's pipe, or one closed meanwhile)
            self._break(f"the device lane's process ended ({self._exit_reason(gone)}) while {doing}")
        return self._receive(slot, doing) if reply else ()

    def _receive(self, slot: int, doing: str) -> tuple:
        conn = self.conns[slot]
        deadline = time.monotonic() + self.timeout_s
        try:
            while not conn.poll(_POLL_S):
                if self.proc.poll() is not None:
                    raise EOFError
                if time.monotonic() > deadline:
                    self.proc.kill()  # (its GPU work stops with it)
                    self._break(f"the device lane's process did not finish {doing} within timeout_s="
                                f"{self.timeout_s}")
            answer = conn.recv()
        except (EOFError, OSError, ValueError) as gone:
            self._break(f"the device lane's process ended ({self._exit_reason(gone)}) while {doing}")
        if answer[0] == "error":
            if doing == "starting":  # (the child cannot serve this slot: nothing later can work)
                self._break(f"the device lane's process could not start: {answer[1]}")
            raise RuntimeError(f"in the lane's process: {answer[1]}")
        return answer

    def _exit_reason(self, gone: BaseException) -> str:
        try:  # (its pipe closes as it dies: the exit code says more than the pipe's error)
            return f"exited with code {self.proc.wait(_POLL_S)}"
        except subprocess.TimeoutExpired:
            return str(gone) or type(gone).__name__

    def _break(self, reason: str) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = f"{reason}; later device refreshes fail (its error, if any, is on stderr)"
            raise RuntimeError(self._broken)

    def close(self, force: bool = False) -> None:
        """Ends the child and frees the slots. Idempotent. ``force``: a lane thread may still be inside
        ``refresh`` (its join timed out), so the child is killed rather than its pipes closed under the thread."""
        atexit.unregister(self.close)
        with self._lock:
            self._broken = self._broken or "the device lane's process was closed"
        if self.proc is not None and force:
            self.proc.kill()
        elif self.proc is not None:
            for conn in self.conns:  # (a process forked from this one may hold the pipes open: say so)
                with contextlib.suppress(OSError, ValueError):
                    conn.send(("stop",))
        if self.proc is not None:
            try:
                self.proc.wait(self.timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not force:
            for conn in self.conns:
                conn.close()
        self.slots = []  # (the child has let go of them)


def wait_asleep(stream: torch.cuda.Stream) -> None:
    """Blocks the calling thread until ``stream`` has run what is queued on it, asleep rather than spinning (a
    blocking-sync event), so that a lane thread's wait leaves its core to others."""
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    done.synchronize()


# ---- the child ---------------------------------------------------------------------------------------
def child_main() -> None:
    """The child's entry (``python -c``): argv holds the parent's pid, the device, the nice, the SMs of a green
    context (0: none) and one pipe per slot. Each pipe gets a thread that serves its slot's jobs until the parent
    says stop or closes it; the child ends with the parent."""
    parent, device, nice, sms, *fds = sys.argv[1:]
    if nice != "0" and sys.platform.startswith("linux"):
        os.nice(int(nice))  # before the threads, which inherit it (Linux's nice is per thread)
    torch.set_num_threads(1)  # the math runs on the GPU; the host only waits
    target = torch.device(device)
    streams: list[Any] = [None] * len(fds)
    failure, granted = None, None
    try:
        if target.type == "cuda":
            torch.cuda.set_device(target)
            load_linalg(target)  # (before the threads, whose first eigh calls would race to load it)
            if int(sms):
                partition = Partition(target, int(sms), len(fds))
                streams, granted = partition.streams, partition.sms
            else:
                streams = [torch.cuda.Stream(target) for _ in fds]
    except Exception as error:  # noqa: BLE001 - each slot's first reply says why
        failure = f"{type(error).__name__}: {error}"
    threads = [threading.Thread(target=_serve, args=(Connection(int(fd)), stream, failure, granted), daemon=True)
               for fd, stream in zip(fds, streams, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(_POLL_S)
            if os.getppid() != int(parent):  # the parent died (its pipes may live on in a process forked from it)
                os._exit(1)


def _serve(conn: Connection, stream: Any, failure: str | None, granted: int | None) -> None:
    """Serves one slot: maps it and says so, with the SMs its stream's green context ``granted`` (or says why
    not), then computes each job the parent sends until the parent says stop or closes the pipe."""
    try:
        _, shared, size = conn.recv()
        try:
            if failure is not None:
                raise RuntimeError(failure)
            slot = torch.from_file(shared, shared=True, size=size, dtype=torch.uint8) if isinstance(shared, str) \
                else shared
        except Exception as error:  # noqa: BLE001 - the parent reports it and breaks the lane
            conn.send(("error", f"{type(error).__name__}: {error}"))
            return
        conn.send(("start", granted))
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            cpu = time.thread_time()
            try:
                reply = _compute(slot, stream, *message[1:])
            except Exception as error:  # noqa: BLE001 - the parent reports it as the set's failure
                reply = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}")
            reserved = torch.cuda.max_memory_reserved(slot.device) if slot.device.type == "cuda" else 0
            conn.send(reply if reply[0] == "error" else (*reply, time.thread_time() - cpu, reserved))
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
    # The result overwrites the snapshot ("new" is "factors"): refresh_set returns new tensors, never views of
    # its input, and the copies below come after its reads on this stream.
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        refreshed = refresh_set(fset, views["factors"], RootRequest.load(request), current, installed,
                                in_thread=True)
        views["new"].copy_(refreshed.new)
        views["usable"].copy_(refreshed.usable)
        if refreshed.order is not None:
            views["order"].copy_(refreshed.order)
        skipped = int(refreshed.skipped)  # waits for this stream: the slot holds the result
    return ("ok", refreshed.order is not None, skipped)

