"""Device-agnostic stream and event helpers: real CUDA streams and events on GPUs, no-ops on the CPU
(where every copy is synchronous)."""

from __future__ import annotations

import collections
import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from asteria.config import is_int


class SideStream:
    """A CUDA stream for state staging, or nothing on the CPU. Its priority is that of the stream current when
    it is made (the training stream's: CUDA's lowest, 0, on the default stream): the training stream waits for
    its copies, so a lower priority than training's would let the device lane's kernels delay them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # CUDA priorities are 0 (the lowest, also the default's) down to negative numbers.
        self.stream = (torch.cuda.Stream(device, priority=torch.cuda.current_stream(device).priority) if self.cuda
                       else None)

    @contextlib.contextmanager
    def staging(self) -> Iterator[None]:
        """Runs the body on the side stream after the work the main stream has queued so far."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> torch.cuda.Event | None:
        """An event marking everything queued on the side stream so far."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def main_waits(self, event: torch.cuda.Event | None) -> None:
        """Makes the main stream wait for ``event`` (only that, not the whole side stream)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


def training_stream(device: torch.device | str | int | None = None,
                    priority: int = -1) -> contextlib.AbstractContextManager[None]:
    """Runs the body on a new CUDA stream of ``priority`` (a no-op on the CPU), after what the current stream has
    queued, and makes the current stream wait for the body's work at the end (after an error too); the current
    stream and device are as before afterwards.

    Build the model and the optimizer inside it, and train there: the device lane refreshes on streams of CUDA's
    lowest priority, which the default stream shares, so at equal priority the GPU's block scheduler interleaves
    the lane's thousands of small kernels with training's; one priority above lets training's start first. The
    optimizer's staging streams take the priority current when it is built. With ``device=None`` it runs on the
    current CUDA device, or plainly where there is none."""
    if not (is_int(priority) and -64 <= priority <= 0):
        raise ValueError(f"Invalid priority={priority!r}: must be an int in [-64, 0] (CUDA stream priorities: 0 is "
                         "the lowest, the default stream's and the device lane's; CUDA clamps below its highest)")
    given = device
    if device is None:
        if not torch.cuda.is_available():
            return contextlib.nullcontext()  # (nothing shares a CPU's kernels with a lane)
        device = torch.device("cuda", torch.cuda.current_device())
    elif is_int(device) and device >= 0:
        device = torch.device("cuda", int(device))
    else:
        try:
            device = torch.device(device) if isinstance(device, (str, torch.device)) else None
        except RuntimeError:  # (a string torch cannot parse)
            device = None
        if device is None:
            raise ValueError(f"Invalid device={given!r}: must be None, a CUDA device index >= 0, or a device such "
                             "as 'cuda:0' or 'cpu'")
    if device.type != "cuda":
        return contextlib.nullcontext()
    if not torch.cuda.is_available():
        raise ValueError(f"Invalid device={str(device)!r}: CUDA is not available on this machine")
    return _on_stream(device, int(priority))


@contextlib.contextmanager
def _on_stream(device: torch.device, priority: int) -> Iterator[None]:
    original = torch.cuda.current_device()  # (set_stream makes the stream's device current)
    previous = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device, priority=priority)
    stream.wait_stream(previous)
    torch.cuda.set_stream(stream)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # (the body's error is the one to see)
            previous.wait_stream(stream)
        raise
    else:
        previous.wait_stream(stream)
    finally:
        torch.cuda.set_stream(previous)
        torch.cuda.set_device(original)


class BackwardMarks:
    """How far the backward pass has been queued: events recorded on the stream of the gradients by the
    backward hooks of ``asteria.attach`` (nothing on the CPU, where every kernel has run when it returns).
    ``wait()`` lets the host wait until the GPU has reached the next-to-last mark, so the host's next
    decision is taken as late as the GPU's work allows while the last stretch of the backward still runs.

    What the wait costs is measured (``stats()``): after it the host queues the rest of the step while the GPU
    runs what was queued before it; the GPU's time from the mark waited for to the step's end, against the
    host's time from the wait's return to the step's end, says whether the GPU had work to spare. Where the
    GPU's time exceeds the host's by less than ``TIGHT_SECONDS`` the GPU ran out of work: it waited for the
    host to queue the step."""

    TIGHT_SECONDS = 1e-3
    MAX_PENDING = 64  # steps whose end the GPU has not reached yet (a loop that never waits for the GPU)

    def __init__(self) -> None:
        self._events: collections.deque[torch.cuda.Event] = collections.deque(maxlen=2)
        self._device: torch.device | None = None
        self._waited: tuple[torch.cuda.Event, float] | None = None  # this step's: the mark, the host's time after
        self._pending: collections.deque[tuple[torch.cuda.Event, torch.cuda.Event, float]] = collections.deque(
            maxlen=self.MAX_PENDING)
        self._steps, self._host, self._gpu, self._tight = 0, 0.0, 0.0, 0
        self._waits, self._wait_seconds = 0, 0.0  # the waits themselves (the training thread spins in them)

    def mark(self, device: torch.device) -> None:
        """Records the point the current stream of ``device`` has been queued to."""
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)
            self._device = device

    def wait(self) -> None:
        """Blocks until the GPU has passed the next-to-last mark (the only one, if one), then forgets the
        marks; returns at once when there are none."""
        if self._events:
            started = time.perf_counter()
            self._events[0].synchronize()
            self._waited = (self._events[0], time.perf_counter())
            self._waits += 1
            self._wait_seconds += self._waited[1] - started
        self._events.clear()

    def clear(self) -> None:
        """The step's end: forgets its marks, and where it waited, notes how the rest of the step went."""
        if self._waited is not None and self._device is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self._device))
            self._pending.append((self._waited[0], end, time.perf_counter() - self._waited[1]))
        self._waited = None
        self._events.clear()
        self._settle()

    def _settle(self) -> None:
        while self._pending and self._pending[0][1].query():  # (the GPU has reached that step's end)
            mark, end, host = self._pending.popleft()
            gpu = mark.elapsed_time(end) / 1e3
            self._steps += 1
            self._host += host
            self._gpu += gpu
            self._tight += gpu - host < self.TIGHT_SECONDS

    def stats(self) -> dict[str, Any]:
        """Over the steps that waited and whose end the GPU has reached: how many, the host's and the GPU's mean
        seconds from the wait to the step's end, and the steps where the GPU ran out of work meanwhile; and the
        mean seconds of the waits themselves, over all of them."""
        self._settle()
        steps = self._steps
        return {"late_activation_steps": steps,
                "late_activation_wait_seconds": self._wait_seconds / self._waits if self._waits else None,
                "late_activation_host_seconds": self._host / steps if steps else None,
                "late_activation_gpu_seconds": self._gpu / steps if steps else None,
                "late_activation_tight_steps": self._tight}


def done(event: torch.cuda.Event | None) -> bool:
    return event is None or event.query()


def wait(event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.synchronize()


def to_device(rows: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``torch.stack(rows)`` on ``device``, the copy queued on the current stream without the host
    waiting: on a GPU the host rows are gathered into pinned memory first (a copy from pageable memory
    would make the training thread wait for the stream)."""
    pin = device.type == "cuda"
    staged = torch.empty((len(rows), *rows[0].shape), dtype=rows[0].dtype, pin_memory=pin, device="cpu")
    torch.stack(list(rows), out=staged)
    return staged.to(device, non_blocking=pin)


STAGING_CHUNK_BYTES = 64 << 20  # device staging of ``copy_leading_rows_``, per chunk


def copy_leading_rows_(target: torch.Tensor, slab: torch.Tensor, extra_row: int | None = None) -> torch.Tensor | None:
    """``target.copy_(slab[:, :n])`` for a (B, rows, n) host ``slab`` with ``rows >= n``, queued on the
    current stream; also returns ``slab[:, extra_row]`` on ``target``'s device when asked and ``target`` is
    on a GPU (None otherwise). On a GPU the slab crosses whole, in chunks of contiguous blocks, and the
    leading rows are picked on the device: torch would gather a strided host source into pageable memory
    on the training thread and copy that synchronously (measured: 113 MB took 15 ms of copy and 40 ms of
    idle main stream on an H200)."""
    n = target.shape[1]
    if not target.is_cuda or (slab.shape[1] == n and extra_row is None):
        target.copy_(slab[:, :n], non_blocking=target.is_cuda)
        return None
    extra = None if extra_row is None else torch.empty((slab.shape[0], slab.shape[2]), dtype=slab.dtype,
                                                       device=target.device)
    chunk = max(1, STAGING_CHUNK_BYTES // (slab[0].numel() * slab.element_size()))
    for lo in range(0, slab.shape[0], chunk):
        staged = slab[lo:lo + chunk].to(target.device, non_blocking=True)
        target[lo:lo + chunk].copy_(staged[:, :n])
        if extra is not None:
            extra[lo:lo + chunk].copy_(staged[:, extra_row])
    return extra


def indices_to_device(indices: Sequence[int], device: torch.device) -> torch.Tensor:
    """A long tensor of ``indices`` on ``device``, copied as ``to_device`` does."""
    pin = device.type == "cuda"
    return torch.tensor(list(indices), dtype=torch.long, pin_memory=pin, device="cpu").to(device, non_blocking=pin)


class HostRegistration:
    """Page-locks the memory of an existing host tensor for CUDA (``cudaHostRegister``), such as a node
    store's shared-memory segment, so that copies from it to a GPU are DMA transfers queued on a stream
    without the training thread gathering anything first. ``close()`` unregisters it (idempotent); it must
    run before the memory is unmapped. Build one with ``register``."""

    PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ptr = tensor.data_ptr()
        self._open = True

    @classmethod
    def register(cls, tensor: torch.Tensor, what: str, device: torch.device) -> HostRegistration | None:
        """Registers ``tensor``'s memory, or warns naming ``what`` and returns None when CUDA refuses (copies
        from it then go through pinned staging buffers: correct, only slower)."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return None
        code = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, cls.PORTABLE))
        if code == 0:
            return cls(tensor)
        _clear_cuda_error(device)
        warnings.warn(f"Asteria: CUDA refused to page-lock {what} ({nbytes} bytes; cudaError {code}): its copies "
                      "to the GPU go through pinned staging buffers on the training thread instead", RuntimeWarning,
                      stacklevel=3)
        return None

    def close(self) -> None:
        if self._open:
            self._open = False
            torch.cuda.cudart().cudaHostUnregister(self.ptr)


def _clear_cuda_error(device: torch.device) -> None:
    """Takes the error a refused CUDA runtime call left behind off the thread, where torch's next kernel
    launch check would raise it: torch raises such an error once, clearing it (``cudaGetLastError``), so a
    trivial kernel is launched until one runs clean."""
    for _ in range(2):
        try:
            torch.empty(1, device=device).zero_()
            return
        except RuntimeError:
            continue

