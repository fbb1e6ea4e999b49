"""What a training step costs beyond wall time: GPU time (CUDA events), energy (NVML's total-energy
counter) and peak GPU memory. Each meter reads nothing, and says so, where its source is absent."""

from __future__ import annotations

import torch


class EnergyMeter:
    """Joules used by the training GPU so far, from NVML's total-energy counter (nvidia-ml-py)."""

    def __init__(self, device: torch.device) -> None:
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            bus_id = getattr(torch.cuda.get_device_properties(index), "pci_bus_id", None)
            # The PCI bus id names the same GPU for CUDA and NVML even when CUDA_VISIBLE_DEVICES reorders.
            self.handle = (pynvml.nvmlDeviceGetHandleByPciBusId(bus_id) if bus_id
                           else pynvml.nvmlDeviceGetHandleByIndex(index))
            self._read = pynvml.nvmlDeviceGetTotalEnergyConsumption
            self._read(self.handle)
        except Exception:  # no NVML, no permission, or a GPU without the counter: energy is not reported
            self.handle = None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def joules(self) -> float | None:
        return self._read(self.handle) / 1000.0 if self.handle is not None else None


class StepTimer:
    """Wall-clock time of a step and, on a GPU, the time between CUDA events around it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.end = torch.cuda.Event(enable_timing=True) if self.cuda else None

    def begin(self) -> None:
        if self.start is not None:
            self.start.record()

    def finish(self) -> float | None:
        """Records the end event; after the step has synchronized, returns its GPU seconds."""
        if self.end is None:
            return None
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000.0


def rss_bytes() -> int | None:
    """Resident memory of this process (Linux ``/proc/self/statm``), ``None`` elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


try:
    import os as _os

    _PAGE_SIZE = _os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):
    _PAGE_SIZE = 4096
