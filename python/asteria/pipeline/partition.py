"""A share of a GPU's streaming multiprocessors for the device lane (``RuntimeConfig.device_sms``): streams of
a CUDA green context (``torch.cuda.green_contexts``), whose kernels run only on the context's SMs whatever
thread launches them, while every other stream, training's included, keeps every SM.

The contexts live as long as the process: a tensor whose memory a lane's stream used (``record_stream``)
may be freed after the lane is gone, and the caching allocator then records an event on that stream, which
must still belong to a live context. One context per device and SM count serves every lane that asks for it.
"""

from __future__ import annotations

import importlib
import math
import threading
from typing import Any

import torch

#: the SM granularity of green-context partitions by compute capability major (the CUDA driver's guide: a
#: partition is rounded up to a multiple of it, and is at least it)
GRANULARITY = {6: 1, 7: 2, 8: 4}
HOPPER_AND_LATER = 8  # compute capability 9.0 and newer

_lock = threading.Lock()
_contexts: dict[tuple[int, int], tuple[Any, list[torch.cuda.Stream]]] = {}  # guarded by _lock


def granularity(device: torch.device) -> int:
    """The SM count that green-context partitions of ``device`` are multiples of."""
    major = torch.cuda.get_device_properties(device).major
    return GRANULARITY.get(major, HOPPER_AND_LATER if major >= 9 else 1)


def granted_sms(device: torch.device, sms: int) -> int:
    """The SMs a partition asked for ``sms`` gets on ``device``: rounded up to the architecture's granularity."""
    step = granularity(device)
    return max(step, math.ceil(sms / step) * step)


def check_partition(device: torch.device, sms: int) -> Any:
    """Refuses by name a partition of ``sms`` SMs that ``device`` cannot give (more SMs than it has once rounded
    to its granularity, or a torch without green-context streams); returns ``torch.cuda.green_contexts``."""
    try:
        green = importlib.import_module("torch.cuda.green_contexts")
    except ImportError:
        green = None
    if green is None or not getattr(green, "SUPPORTED", False) or not hasattr(green.GreenContext, "Stream"):
        raise ValueError(f"Invalid RuntimeConfig.device_sms={sms}: it needs CUDA green contexts with their "
                         f"streams (torch.cuda.green_contexts.GreenContext.Stream, CUDA 12.8 or newer), which "
                         f"torch {torch.__version__} (CUDA {torch.version.cuda}) lacks: leave it None")
    total = torch.cuda.get_device_properties(device).multi_processor_count
    granted = granted_sms(device, sms)
    if granted > total:
        step = granularity(device)
        raise ValueError(f"Invalid RuntimeConfig.device_sms={sms}: {torch.cuda.get_device_name(device)} ({device}) "
                         f"has {total} SMs, in partitions of multiples of {step} (this one: {granted}); give at most "
                         f"{total - total % step}, or None for all of them")
    return green


class Partition:
    """``count`` distinct streams of the green context of ``sms`` SMs on ``device`` (made once a process)."""

    def __init__(self, device: torch.device, sms: int, count: int) -> None:
        green = check_partition(device, sms)
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.sms = granted_sms(self.device, sms)
        with _lock:
            if (index, self.sms) not in _contexts:
                try:
                    context = green.GreenContext.create(num_sms=self.sms, device_id=index)
                except RuntimeError as error:
                    raise ValueError(f"Invalid RuntimeConfig.device_sms={sms}: CUDA refused a green context of "
                                     f"{self.sms} SMs on {self.device} ({error}); leave it None") from None
                _contexts[(index, self.sms)] = (context, [])
            context, streams = _contexts[(index, self.sms)]
            while len(streams) < count:
                stream = context.Stream()
                if any(stream.cuda_stream == s.cuda_stream for s in streams):
                    raise ValueError(f"Invalid RuntimeConfig.device_threads={count}: torch {torch.__version__}'s "
                                     f"green context of {self.sms} SMs gives {len(streams)} distinct streams; use "
                                     "fewer threads")
                streams.append(stream)
            self.streams = streams[:count]
