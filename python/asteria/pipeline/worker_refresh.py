"""What the refreshers on the C++ workers share (one process, or one rank of several): the snapshot staging
from the device's side stream into pinned host rings, the rings' depth, the deterministic rule's lag, and the
engine's start and stop."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, NamedTuple

import torch
from torch import Tensor

from asteria import _core, cpus
from asteria.checks import MAX_COUNT, check_arg, check_entry
from asteria.config import RuntimeConfig, is_int
from asteria.pipeline import streams
from asteria.pipeline.factors import FactorSet, RootRequest
from asteria.pipeline.refresh import SAVED, Refresher


def ring_depth(config: RuntimeConfig, interval: int, lag: int) -> int:
    """Host buffers per block for the versions in flight: under the deterministic rule a version waits
    ``lag`` steps for its use, and a set's snapshots come at least ``interval`` steps apart, so
    ``lag // interval + 1`` versions of a block can be snapshotted and not yet in use; under the
    newest-finished rule a set has at most ``in_flight`` versions on their way (a refresh due beyond that is
    deferred), so one buffer each for their snapshots and results."""
    return lag // interval + 1 if config.deterministic else config.in_flight


@contextmanager
def claimed(engine: Any, ids: list[int], version: int, timeout_s: float) -> Iterator[None]:
    """The snapshot buffers of ``version`` for blocks ``ids``, claimed (``begin_snapshot``) for the body, which
    fills them and may submit them. Where the body raises first, the claims are given back, so that the same
    version can be staged again rather than finding its buffers claimed."""
    engine.begin_snapshot(ids, version, timeout_s)
    try:
        yield
    except BaseException:
        # (Nothing to give back where the body's submit went through, or the engine closed meanwhile: the
        # body's error is the one to raise.)
        with suppress(ValueError, RuntimeError):
            engine.abandon_snapshot(ids, version)
        raise


class Seed(NamedTuple):
    """The warm start of an eigenbasis set's workers' chain after versions computed elsewhere (the device lane):
    ``bases`` (B, n, n), the ones in use, copied into ``rows`` (the result buffers of the version staged with it,
    rows [0, n)), for the engine's ``seed_basis`` as the basis of ``version``."""

    version: int
    bases: Tensor
    rows: Tensor


class Staged(NamedTuple):
    """A snapshot on its way to the workers: set ``index``'s engine blocks ``ids``, its ``version`` due at step
    ``due``, the copy's ``event`` (None: done), and the version whose basis seeds the chain (0: none)."""

    index: int
    ids: list[int]
    version: int
    due: int
    request: RootRequest
    event: torch.cuda.Event | None
    seed_version: int


class SnapshotStager:
    """Factor snapshots on their way to the workers: each is copied into its pinned host ring slot on the
    device's side stream (after the work the main stream has queued, without the training thread waiting),
    and handed to the engine once that copy has completed; a snapshot due at a step is waited for then.
    The main stream waits for the copies (their events only) before the factors change in place."""

    def __init__(self, engine: Any, sets: list[FactorSet], timeout_s: float) -> None:
        self.engine = engine
        self.sets = sets
        self.timeout_s = timeout_s
        self.side = {device: streams.SideStream(device) for device in {s.device for s in sets}}
        self.pending: list[Staged] = []
        self._events: dict[torch.device, torch.cuda.Event | None] = {}

    def copy_on_device(self, fset: FactorSet) -> tuple[Tensor, torch.cuda.Event | None]:
        """A device copy of ``fset``'s factors made on the side stream (a snapshot for the device lane), and
        the copy's event, which the main stream waits for before the factors change."""
        side = self.side[fset.device]
        with side.staging():
            snapshot = fset.factors.clone()
        event = side.record()
        if event is not None:
            self._events[fset.device] = event
        return snapshot, event

    def stage(self, index: int, ids: list[int], version: int, due: int, request: RootRequest, slot: Tensor,
              source: Callable[[], Tensor], seed: Seed | None = None) -> None:
        """Copies ``source()`` (evaluated on the side stream) into ``slot`` for ``version`` of set ``index``,
        and ``seed``'s bases into its rows first: on the side stream, after the installs queued there, so the
        training thread neither waits for the device nor copies them (the engine's job reads them)."""
        device = self.sets[index].device
        side = self.side[device]
        with claimed(self.engine, ids, version, self.timeout_s), side.staging():
            if seed is not None:
                for block in range(seed.bases.shape[0]):  # (each block's rows are contiguous, the slab is not)
                    seed.rows[block].copy_(seed.bases[block], non_blocking=side.cuda)
            slot.copy_(source(), non_blocking=side.cuda)
        event = side.record()
        if event is not None:
            self._events[device] = event
        self.pending.append(Staged(index, ids, version, due, request, event, 0 if seed is None else seed.version))

    def submit_ready(self, step: int) -> None:
        """Hands finished snapshots to the workers; those due by ``step`` are waited for."""
        waiting = []
        for entry in self.pending:
            if not streams.done(entry.event):
                if entry.due > step:
                    waiting.append(entry)
                    continue
                streams.wait(entry.event)
            if entry.seed_version:
                for block_id in entry.ids:
                    self.engine.seed_basis(block_id, entry.seed_version, entry.version)
            entry.request.submit(self.engine, entry.ids, entry.version, entry.due, self.sets[entry.index].exponent)
        self.pending = waiting

    def before_factor_update(self) -> None:
        for device, event in self._events.items():
            self.side[device].main_waits(event)
        self._events.clear()

    def wait_all(self) -> None:
        """Waits for every snapshot copy still in flight (before the host reads the rings)."""
        for entry in self.pending:
            streams.wait(entry.event)


class WorkerRefresher(Refresher):
    """Base of the refreshers whose jobs run on the C++ workers (one process, or one rank of several):
    rings of ``ring_depth`` slots per block, the deterministic rule's lag, the engine and the snapshot
    staging (both made by ``_start_workers``)."""

    @staticmethod
    def _scheduled_entries(state: dict[str, Any], keys: tuple[str, ...]) -> Iterator[tuple[str, dict[str, Any]]]:
        """The refreshes in flight of a checkpoint's ``state()``, each with its name in errors, once its
        ``keys``, its version (an int >= 1) and its due step (an int >= 0) are checked."""
        scheduled = state["scheduled"]
        check_arg(isinstance(scheduled, (list, tuple)), f"{SAVED}['scheduled']", type(scheduled).__name__,
                  "must be a tuple of the refreshes in flight")
        for i, entry in enumerate(scheduled):
            name = f"{SAVED}['scheduled'][{i}]"
            check_entry(entry, keys, name)
            check_arg(is_int(entry["version"]) and 1 <= entry["version"] <= MAX_COUNT, f"{name}['version']",
                      entry["version"], "must be an int in [1, 2^62]")
            check_arg(is_int(entry["due"]) and 0 <= entry["due"] <= MAX_COUNT, f"{name}['due']", entry["due"],
                      "must be an int in [0, 2^62], the step the version is due")
            yield name, entry

    def __init__(self, sets: list[FactorSet], config: RuntimeConfig, interval: int) -> None:
        super().__init__(sets, config, interval)  # (lag_steps is checked there, before any thread starts)
        self.depth = ring_depth(config, interval, self.rule.lag)
        # Installs queued on a side stream, which the current stream waits for before it reads them.
        self._install_events: list[tuple[streams.SideStream, torch.cuda.Event | None]] = []

    def before_factor_update(self) -> None:
        self.stager.before_factor_update()

    def ready(self) -> None:
        for side, event in self._install_events:
            side.main_waits(event)
        self._install_events.clear()

    def _start_workers(self, deterministic: bool, max_consecutive_failures: int) -> None:
        """Starts the C++ refresh engine (``self.engine``, fed by ``self.stager``) on the configured worker
        CPUs and caps torch's CPU threads meanwhile (``_stop_workers`` undoes both)."""
        config = self.config
        self.worker_cpus = config.resolved_worker_cpus()
        express, express_max_n = config.resolved_express([fset.dim for fset in self.sets])
        self.engine = _core.RefreshEngine(
            workers=config.resolved_workers(), blas_threads=config.blas_threads, staleness=config.staleness,
            deterministic=deterministic, max_consecutive_failures=max_consecutive_failures,
            slot_timeout_s=config.timeout_s, worker_nice=config.worker_nice, worker_cpus=self.worker_cpus,
            sync_versions=config.sync_refreshes, queue_order=config.queue_order, express_workers=express,
            express_max_n=express_max_n)
        self.thread_cap = cpus.TorchThreadCap(config.torch_threads, self.worker_cpus)
        self.stager = SnapshotStager(self.engine, self.sets, config.timeout_s)

    def _stop_workers(self) -> None:
        self.engine.close()
        self.thread_cap.restore()

    def _worker_stats(self, pool: dict[str, Any]) -> dict[str, Any]:
        """The workers' part of ``stats()``."""
        return {"workers": pool["workers"], "express_workers": pool["express_workers"], "worker_cpus": self.worker_cpus,
                "torch_threads": torch.get_num_threads(), "worker_busy_fraction": pool["busy_fraction"]}
