"""The device lane: refreshes of whole factor sets computed with torch on the parameters' device, beside
the C++ workers, when the workers alone cannot finish an interval's refreshes within the interval.

Life of version k of a set on the lane:
1. Its refresh step (training thread): the engine notes k as an external version (``note_external``), so
   that the one coherence registry decides when k comes into use, bounds its staleness and counts its
   failures as it does for the workers' versions. The factors are copied on the refresher's side stream
   into a device snapshot (the main stream waits for that copy only, before it updates the factors).
2. One of the lane's threads takes the job, makes its own low-priority stream wait for the snapshot, computes the
   refresh with the native mode's math (``refresh_math.refresh_set``) there or, with ``process``, in the
   lane's child process (``lane_process``: on a GPU, in a CUDA context that cannot hold training's launches),
   waits for it, and reports the blocks' outcome to the registry (``finish_external``). An eigenbasis
   warm-starts from the bases in use: an eigenbasis set's lane version starts only while no other version of
   the set is on its way (``AsyncRefresher._held_up``), so those are the previous version's.
3. An activation that picks k installs it from the lane's result on the side stream, releases it in the
   engine, and drops the lane's tensors (their memory stays the side stream's until the copy is done).

The versions used at their own step (the start-up refreshes) run inline instead: on the training
thread's stream, where they are fastest, since the step waits for them anyway.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from asteria.pipeline.factors import FactorSet, RootRequest
from asteria.pipeline.lane_process import LaneProcess, wait_asleep
from asteria.pipeline.partition import Partition
from asteria.pipeline.refresh_math import Refreshed, load_linalg, refresh_set


@dataclass
class LaneJob:
    index: int
    version: int
    request: RootRequest
    snapshot: Tensor
    ready: torch.cuda.Event | None  # the snapshot copy's event (None on the CPU)


class DeviceLane:
    """Refreshes factor sets on their device off the training thread (see the module docstring), with
    ``threads`` threads, each on its own stream (in the green context of ``sms`` SMs where given): a GPU's
    ``eigh`` is a long chain of small kernels, so concurrent refreshes can overlap where one alone leaves the
    SMs idle between its kernels. A job is a whole set's version, reading only its snapshot and the bases in
    use (never another job's result), so jobs may run in any order and side by side.

    ``process``: the threads hand the math to a child process (``lane_process``), one per device, and only copy
    in and out.

    Thread safety: ``start``, ``take``, ``release``, ``stats`` and ``close`` are called by the training thread;
    the lane's own threads only compute and report to the engine, which is safe to call concurrently."""

    def __init__(self, engine: Any, sets: list[FactorSet], ids: list[list[int]], timeout_s: float,
                 sms: int | None = None, threads: int = 1, nice: int = 0, process: bool = False) -> None:
        self.engine = engine
        self.nice = nice
        self.sets = sets
        self.ids = ids
        self.timeout_s = timeout_s
        self.threads = threads
        devices = {fset.device for fset in sets}
        if sms is not None and any(d.type != "cuda" for d in devices):
            raise ValueError(f"Invalid RuntimeConfig.device_sms={sms}: it partitions a GPU's SMs, and the device "
                             f"lane here computes on {sorted(str(d) for d in devices)}: leave it None")
        # CUDA priorities are 0 (the lowest, also the default stream's) down to negative numbers.
        self.partitions = {d: Partition(d, sms, threads) for d in devices if sms is not None and not process}
        self.streams: dict[torch.device, list[torch.cuda.Stream | None]] = {
            d: self.partitions[d].streams if d in self.partitions
            else [torch.cuda.Stream(d, priority=0) if d.type == "cuda" else None for _ in range(threads)]
            for d in devices}
        self._lock = threading.Condition()
        self._jobs: collections.deque[LaneJob] = collections.deque()       # guarded by _lock
        self._results: dict[tuple[int, int], Refreshed] = {}               # guarded by _lock
        self._snapshots: dict[tuple[int, int], Tensor] = {}                # guarded by _lock; kept for checkpoints
        self._ended: set[tuple[int, int]] = set()                          # guarded by _lock: jobs done, unreleased
        self._by_dim: dict[int, list[float]] = {}                          # guarded by _lock: n -> [seconds, blocks]
        self._inline_by_dim: dict[int, list[float]] = {}                   # guarded by _lock: the same, inline
        self._busy_seconds = 0.0                                           # guarded by _lock
        self._cpu_seconds = 0.0                                            # guarded by _lock: the threads' CPU
        self._running = 0                                                  # guarded by _lock: jobs computing
        self._stopping = False                                             # guarded by _lock
        self._failure: str | None = None  # guarded by _lock: why a lane thread ended early (start() raises it)
        self._started = time.monotonic()
        self._stopped: float | None = None                                 # guarded by _lock: when close() joined
        self._threads: list[threading.Thread] = []
        self._configured = threading.Semaphore(0)  # released by each thread once its priority is set
        self.processes: dict[torch.device, LaneProcess] = {}
        try:
            if process:  # (its green context, if any, is the child's)
                for d in sorted(devices, key=str):
                    self.processes[d] = LaneProcess(d, [s for s in sets if s.device == d], threads, timeout_s, sms,
                                                    nice)
            else:  # (the lane's threads share this process's linalg library: load it before they race to)
                for d in devices:
                    load_linalg(d)
            for slot in range(threads):
                self._threads.append(threading.Thread(target=self._run, args=(slot,),
                                                      name=f"asteria-device-lane-{slot}", daemon=True))
                self._threads[-1].start()
            for _ in range(threads):  # (so that none spins at the training thread's priority, even briefly)
                if not self._configured.acquire(timeout=timeout_s):
                    raise RuntimeError(f"the device lane's threads did not start within timeout_s={timeout_s}")
        except BaseException:  # (the system refused a thread): those started stop
            self.close()
            raise

    # ---- training thread -------------------------------------------------------------------------
    def start(self, index: int, version: int, due: int, request: RootRequest,
              copy: Callable[[FactorSet], tuple[Tensor, torch.cuda.Event | None]] | None,
              snapshot: Tensor | None = None) -> None:
        """Notes ``version`` of set ``index`` (due at step ``due``) and starts its refresh: queued for the lane's
        thread from the snapshot ``copy(fset)`` returns, or with ``copy=None`` computed now on the current
        stream from ``snapshot`` (default: the live factors; a version used at its own step)."""
        fset = self.sets[index]
        with self._lock:
            if self._failure is not None:
                raise RuntimeError(f"a device lane thread ended on an error: {self._failure}")
        self.engine.note_external(self.ids[index], version, due)
        if copy is None:
            self._compute(LaneJob(index, version, request, fset.factors if snapshot is None else snapshot, None),
                          inline=True)
            return
        snapshot, event = copy(fset)
        with self._lock:
            self._snapshots[(index, version)] = snapshot
            self._jobs.append(LaneJob(index, version, request, snapshot, event))
            self._lock.notify_all()  # the lane's thread, and any drain() waiting beside it

    def take(self, index: int, version: int) -> Refreshed:
        """The result of ``version`` of set ``index`` (the registry activated it, so it has finished)."""
        with self._lock:
            return self._results[(index, version)]

    def ended(self, index: int, version: int) -> bool:
        """Whether the refresh of ``version`` of set ``index`` has ended (computed or failed), until released."""
        with self._lock:
            return (index, version) in self._ended

    def release(self, index: int, version: int, stream: torch.cuda.Stream | None) -> None:
        """Drops the lane's tensors of ``version`` once ``stream`` (which copied them) is done with them."""
        with self._lock:
            refreshed = self._results.pop((index, version), None)
            self._snapshots.pop((index, version), None)
            self._ended.discard((index, version))
        if refreshed is not None and stream is not None:
            for tensor in (refreshed.new, refreshed.order):
                if tensor is not None:
                    tensor.record_stream(stream)

    def snapshot(self, index: int, version: int) -> Tensor | None:
        """The snapshot of a version not yet released (for a checkpoint), or None."""
        with self._lock:
            return self._snapshots.get((index, version))

    def seconds_by_dim(self) -> dict[int, tuple[float, int]]:
        """Per block size n: the lane's seconds and blocks refreshed (its measured throughput), from its threads'
        jobs; where it has none of a size yet, from the inline ones (the start-up refreshes, computed on the
        training stream with the whole GPU, one set at a time: faster than on a partition or beside other
        jobs, so they stand in only until the lane's own figures come)."""
        with self._lock:
            timings = {**self._inline_by_dim, **self._by_dim}
            return {n: (seconds, int(blocks)) for n, (seconds, blocks) in timings.items()}

    def stats(self) -> dict[str, Any]:
        """``device_refresh_seconds``: the jobs' seconds summed over the threads; ``device_busy_fraction``: that
        over the threads' whole life (each thread's wall time since the start, until ``close``);
        ``device_cpu_seconds``: the CPU time the threads' jobs took (near their seconds where a thread spins
        while its GPU work runs, and far below where it sleeps); ``device_process_ids``: the lane's processes
        (their GPU memory is theirs, not the training process's)."""
        with self._lock:
            end = time.monotonic() if self._stopped is None else self._stopped  # the busy fraction of the lane's life
            wall = max(end - self._started, 1e-9) * self.threads
            return {"device_refresh_seconds": self._busy_seconds, "device_busy_fraction": self._busy_seconds / wall,
                    "device_jobs_queued": len(self._jobs), "device_threads": self.threads,
                    "device_cpu_seconds": self._cpu_seconds,
                    "device_process_ids": [child.proc.pid for child in self.processes.values()
                                           if child.proc is not None]}

    def slot_bytes(self) -> int:
        """The bytes of the slots shared with the lane's processes (on their devices; none without them)."""
        return sum(slot.numel() for child in self.processes.values() for slot in child.slots)

    def process_cache_bytes(self) -> int:
        """The most the lane's processes' CUDA allocators have held beyond the slots (their math's workspace and
        results), as measured after their jobs so far: 0 before the first."""
        return sum(child.peak_reserved for child in self.processes.values())

    def drain(self, timeout_s: float) -> None:
        """Blocks until every queued job has ended (the engine's ``drain`` covers the workers' jobs only);
        raises TimeoutError after ``timeout_s`` seconds."""
        with self._lock:
            if not self._lock.wait_for(lambda: not (self._jobs or self._running), timeout_s):
                raise TimeoutError(f"the device lane did not finish its {len(self._jobs) + self._running} job(s) "
                                   f"within timeout_s={timeout_s}")

    def close(self) -> None:
        """Stops the threads after the jobs they run (queued jobs are dropped). Idempotent."""
        with self._lock:
            self._stopping = True
            self._jobs.clear()
            self._lock.notify_all()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(self.timeout_s)
        running = any(thread.is_alive() for thread in self._threads)  # (a job overran the join)
        for child in self.processes.values():
            child.close(force=running)
        with self._lock:
            if self._stopped is None:
                self._stopped = time.monotonic()

    # ---- the lane's thread -------------------------------------------------------------------------
    def _run(self, slot: int) -> None:
        try:
            lower_priority(self.nice)
        finally:
            self._configured.release()
        while True:
            with self._lock:
                while not self._jobs and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
                job = self._jobs.popleft()
                self._running += 1
            try:
                self._compute(job, slot=slot)
            except Exception as error:  # noqa: BLE001 - a defect: the thread ends, and the next start() says why
                with self._lock:
                    self._failure = self._failure or f"{type(error).__name__}: {error}"
                return
            finally:
                with self._lock:
                    self._running -= 1
                    self._lock.notify_all()

    def _compute(self, job: LaneJob, inline: bool = False, slot: int = 0) -> None:
        """Refreshes the job's set and reports the outcome; ``inline``: on the current stream and thread (the
        training thread's, which waits for it), else on the stream of the lane's thread ``slot``."""
        fset = self.sets[job.index]
        stream = None if inline else self.streams[fset.device][slot]
        started, cpu = time.perf_counter(), time.thread_time()
        cpu_child = 0.0  # the child's CPU seconds for the job, where it computed it
        refreshed: Refreshed | None = None
        ok = [False] * fset.batch
        error = ""
        child = None if inline else self.processes.get(fset.device)
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None:
                    if job.ready is not None:
                        stream.wait_event(job.ready)
                    job.snapshot.record_stream(stream)  # made on the side stream, read on this one
                    if child is None:  # (the math's first reads of the host then find it ready; the child's
                        wait_asleep(stream)  # copy into its slot waits for the snapshot with the copy)
                if child is not None:
                    refreshed, cpu_child = child.refresh(slot, fset, job.snapshot, job.request, stream)
                else:
                    refreshed = refresh_set(fset, job.snapshot, job.request, fset.preconditioners, fset.installed,
                                            in_thread=not inline)
                if stream is not None:
                    wait_asleep(stream)
                ok = refreshed.usable.tolist()  # waits for this stream only
        except Exception as failure:  # noqa: BLE001 - reported to the registry as the blocks' failure
            error = f"device refresh failed: {type(failure).__name__}: {failure}"
        self._finish(job.index, job.version, refreshed, ok, time.perf_counter() - started, error, inline,
                     0.0 if inline else time.thread_time() - cpu + cpu_child)

    def _finish(self, index: int, version: int, refreshed: Refreshed | None, ok: list[bool], seconds: float,
                error: str, inline: bool, cpu_seconds: float) -> None:
        fset = self.sets[index]
        with self._lock:
            # (a version released while it computed was passed over by a newer one: nothing will take it)
            if inline or (index, version) in self._snapshots:
                self._ended.add((index, version))
                if refreshed is not None:
                    self._results[(index, version)] = refreshed
            timing = (self._inline_by_dim if inline else self._by_dim).setdefault(fset.dim, [0.0, 0])
            timing[0] += seconds
            timing[1] += fset.batch
            self._busy_seconds += seconds
            self._cpu_seconds += cpu_seconds
        reason = error or "the device refresh's result is not finite (the previous version stays in use)"
        try:
            self.engine.finish_external(self.ids[index], version, ok, reason)
        except Exception:  # noqa: BLE001 - the engine was closed meanwhile: nothing waits for this version
            if not getattr(self.engine, "closed", False):
                raise


def lower_priority(nice: int) -> None:
    """Lowers the calling thread's CPU priority to at least ``nice`` (Linux per-thread nice; best effort, as the
    workers'). A lane thread waiting for its GPU work spins on a core (CUDA's default for a process with fewer
    contexts than CPUs, and torch's ``eigh`` waits so for its result), and at the training thread's own
    priority it would take the cores kept for launching training's kernels."""
    if nice <= 0 or not sys.platform.startswith("linux"):  # (elsewhere the id of a thread names no thread)
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:  # (refused: the thread keeps its priority)
        pass

