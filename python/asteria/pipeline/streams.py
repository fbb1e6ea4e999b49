"""Device-agnostic stream and event helpers: real CUDA streams and events on GPUs, no-ops on the CPU
(where every copy is synchronous)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


class SideStream:
    """A low-priority CUDA stream for state staging, or nothing on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # CUDA priorities are 0 (the lowest, also the default's) down to negative numbers.
        self.stream = torch.cuda.Stream(device, priority=0) if self.cuda else None

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
    staged = torch.empty((len(rows), *rows[0].shape), dtype=rows[0].dtype, pin_memory=pin)
    torch.stack(list(rows), out=staged)
    return staged.to(device, non_blocking=pin)


def indices_to_device(indices: Sequence[int], device: torch.device) -> torch.Tensor:
    """A long tensor of ``indices`` on ``device``, copied as ``to_device`` does."""
    pin = device.type == "cuda"
    return torch.tensor(list(indices), dtype=torch.long, pin_memory=pin).to(device, non_blocking=pin)
