"""What a training step costs beyond wall time: GPU time (CUDA events), energy (NVML's total-energy
counter) and the GPU memory the driver gave the run's processes. Each meter reads nothing, and says so, where its
source is absent."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch


class EnergyMeter:
    """Joules used by the training GPU so far, from NVML's total-energy counter (nvidia-ml-py).
    ``nvml_device`` names the GPU it reads (its PCI bus id), None where energy is not reported."""

    def __init__(self, device: torch.device) -> None:
        self.handle = None
        self.nvml_device: str | None = None
        nvml = open_nvml(device)
        if nvml is None:
            return
        try:
            pynvml, handle = nvml
            self._read = pynvml.nvmlDeviceGetTotalEnergyConsumption
            self._read(handle)
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            self.nvml_device = bus.decode() if isinstance(bus, bytes) else str(bus)
            self.handle = handle
        except Exception:  # a GPU without the counter: energy is not reported
            self.handle = None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def joules(self) -> float | None:
        return self._read(self.handle) / 1000.0 if self.handle is not None else None


def open_nvml(device: torch.device):  # noqa: ANN201 (pynvml has no type hints)
    """(pynvml, NVML's handle of ``device``), None off a GPU or where NVML cannot be read (no nvidia-ml-py, no
    driver library, no permission)."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        return pynvml, nvml_handle(pynvml, index)
    except Exception:  # noqa: BLE001 - any of those: the meters read nothing
        return None


def nvml_handle(pynvml, index: int):  # noqa: ANN001, ANN201 (pynvml has no type hints)
    """NVML's handle of CUDA device ``index`` of this process. NVML numbers every GPU of the machine while
    CUDA numbers the visible ones (``CUDA_VISIBLE_DEVICES=1`` makes physical GPU 1 CUDA's device 0), so the
    GPU is matched by its UUID, then by its PCI address; the index is the last resort."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except pynvml.NVMLError:
            pass
    if all(hasattr(props, key) for key in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        address = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(address)
        except pynvml.NVMLError:
            pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    physical = int(visible[index]) if index < len(visible) and visible[index].strip().isdigit() else index
    return pynvml.nvmlDeviceGetHandleByIndex(physical)


class ProcessMemoryMeter:
    """The GPU memory the driver gives this process and its helpers (the device lane's process), from NVML's list
    of the GPU's compute processes: their CUDA contexts and their allocators' pools, which torch's counters of
    this process's allocations leave out. Reads None where NVML cannot list this process (no NVML, a driver that
    does not count per process, or a PID namespace apart from the driver's, as in some containers)."""

    def __init__(self, device: torch.device, helpers: Iterable[int] = ()) -> None:
        self.handle = None
        self.pids = {os.getpid(), *helpers}
        nvml = open_nvml(device)
        if nvml is not None:
            pynvml, self.handle = nvml
            self._list = pynvml.nvmlDeviceGetComputeRunningProcesses

    def read(self) -> int | None:
        """The bytes the driver gives the processes now; None where it lists neither this process nor its usage."""
        if self.handle is None:
            return None
        try:
            used = {process.pid: process.usedGpuMemory for process in self._list(self.handle)}
        except Exception:  # (a driver error mid-run: this reading only)
            return None
        if used.get(os.getpid()) is None:  # (not listed, or NVML's "not available")
            return None
        return sum(used.get(pid) or 0 for pid in self.pids)


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


def thread_sched() -> tuple[float, int] | None:
    """The calling thread's seconds spent runnable but waiting for a core (the scheduler's run-queue delay), and
    how many times it slept (voluntary context switches: on the GIL, a lock, a blocking event), so far; from
    Linux's ``/proc/thread-self``, None elsewhere or where the kernel keeps no schedstat."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            waited = int(f.read().split()[1]) / 1e9
        with open("/proc/thread-self/status") as f:
            sleeps = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return waited, sleeps


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
