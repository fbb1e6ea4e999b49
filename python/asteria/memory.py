"""What memory a device has and can still give: the figures the checks made before anything is allocated compare
a configuration's needs with (the optimizer's state, the refresh buffers, the device lane's slots)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch


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
    """The host memory this process can still be given: the least of what the machine can give without swapping
    (Linux's MemAvailable), the room under its cgroup's memory limit (a container's) and the room under its
    address-space limit (``RLIMIT_AS``); None where none of them is known. Past any of them an allocation fails or
    the process is killed, so the checks made before allocating compare with the least."""
    known = [room for room in (meminfo_available(), cgroup_room(), address_space_room()) if room is not None]
    return min(known) if known else None


def _read_int(path: str, field: str | None = None, unit: int = 1) -> int | None:
    """The integer in file ``path``, or on its line starting with ``field``, times ``unit`` (1024 for the kB of
    /proc's files); None where the file or the number is missing ("max": no limit)."""
    try:
        with open(path) as file:
            for line in file:
                if field is None:
                    return int(line.split()[0]) * unit
                if line.startswith(field):
                    return int(line.split()[1]) * unit
    except (OSError, ValueError, IndexError):
        pass
    return None


def meminfo_available() -> int | None:
    return _read_int("/proc/meminfo", "MemAvailable:", unit=1024)


#: a cgroup v1 limit at or above this is the kernel's "unlimited" (PAGE_COUNTER_MAX pages)
UNLIMITED = 2**62


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The bytes this process's memory cgroup can still charge: the least, over its cgroup and every parent with a
    limit, of the limit less the usage, the usage without the inactive page cache the kernel reclaims before it
    refuses (cgroup v2's ``memory.max``, ``memory.current`` and ``memory.stat``'s ``inactive_file``; v1's
    ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and ``total_inactive_file``). None where no level has a
    limit or none can be read. The hierarchy is looked up under ``root`` (v1: ``root/memory``) and, as in a
    container whose own cgroup is mounted there, from ``root`` itself up."""
    try:
        with open(proc_cgroup) as file:
            entries = [line.rstrip("\n").split(":", 2) for line in file if line.count(":") >= 2]
    except OSError:
        return None
    for _, controllers, path in entries:
        if controllers == "":  # v2: one unified hierarchy
            files, mounts = ("memory.max", "memory.current", "inactive_file "), [root]
        elif "memory" in controllers.split(","):
            files, mounts = (("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file "),
                             [os.path.join(root, "memory"), root])
        else:
            continue
        for mount in mounts:
            leaf = os.path.join(mount, path.strip("/"))
            folder = leaf if os.path.exists(os.path.join(leaf, files[0])) else mount
            if not os.path.exists(os.path.join(folder, files[0])):
                continue
            rooms = []
            while True:  # the cgroup, then each parent up to the mount
                limit = _read_int(os.path.join(folder, files[0]))
                usage = _read_int(os.path.join(folder, files[1]))
                if limit is not None and usage is not None and limit < UNLIMITED:
                    inactive = _read_int(os.path.join(folder, "memory.stat"), files[2]) or 0
                    rooms.append(max(limit - (usage - inactive), 0))
                if os.path.normpath(folder) == os.path.normpath(mount):
                    break
                folder = os.path.dirname(folder)
            return min(rooms) if rooms else None
    return None


def address_space_room() -> int | None:
    """The bytes of address space this process may still map under ``RLIMIT_AS`` (its limit less its VmSize), or
    None where it has no such limit."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return None
    if limit == resource.RLIM_INFINITY:
        return None
    used = _read_int("/proc/self/status", "VmSize:", unit=1024)
    return None if used is None else max(limit - used, 0)


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
    """Bytes as GiB with two decimals, for messages."""
    return f"{nbytes / 2**30:.2f} GiB"


def explain_out_of_memory(error: BaseException, optimizer: Any) -> str:
    """torch's out-of-memory ``error`` from inside ``optimizer.step()``, with what the optimizer's state holds on
    the device (its ``memory_report()``) and the settings that take less there."""
    report = optimizer.memory_report()
    device = {kind: nbytes for kind, nbytes in report["device"].items() if nbytes and kind != "total"}
    preconditioners = device.get("root", 0) + device.get("basis", 0)  # (on the host already for CPU parameters)
    kinds = ", ".join(f"{kind} {gib(nbytes)}" for kind, nbytes in sorted(device.items(), key=lambda kv: -kv[1]))
    remedies = [f"MemoryConfig(placement='host') keeps the {gib(preconditioners)} of preconditioners in pinned host "
                "memory (and turns the device lane off)"] if preconditioners and report["placement"] != "host" else []
    remedies += ["a smaller max_preconditioner_dim shrinks the factors and preconditioners",
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before CUDA starts, lets memory freed between "
                 "tensors of different sizes serve the next ones"]
    return (f"{error}\nIn {type(optimizer).__name__}.step(): the optimizer's state holds "
            f"{gib(sum(device.values()))} on the device ({kinds}); {'; '.join(remedies)}")


def allocator_settings() -> str:
    """The CUDA caching allocator's settings as torch holds them (``PYTORCH_CUDA_ALLOC_CONF``'s syntax); with a
    torch that has no getter for them, as the environment set them at the start."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return str(getter())
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))


def _set_allocator_settings(settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # (torch before the accelerator-wide setting)
        setter = torch._C._cuda_cudaCachingAllocator_set_allocator_settings
    setter(settings)


def expandable_segments() -> bool:
    """Whether torch's CUDA allocator maps its memory in expandable segments."""
    for option in allocator_settings().split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


@contextlib.contextmanager
def fixed_segments(device: torch.device) -> Iterator[None]:
    """Within the block, ``device``'s new CUDA allocations take segments of fixed size even where the allocator
    maps expandable ones. Why: another process opens an expandable segment's memory through ``pidfd_getfd``,
    which needs ptrace rights over this process and is refused without them (unprivileged containers:
    pytorch/pytorch#165685); a fixed segment crosses as a plain CUDA IPC handle. The setting comes back after
    the block."""
    if device.type != "cuda" or not expandable_segments():
        yield
        return
    _set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        _set_allocator_settings("expandable_segments:True")
