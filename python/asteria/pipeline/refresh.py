"""Refreshers: who computes the preconditioners from the factors, and when they come into use.

``SyncRefresher`` is the native baseline: every refresh runs inside ``step()`` on the parameter's
device with torch. ``AsyncRefresher`` snapshots the factors into (pinned) host rings, has the C++
engine compute roots or eigenbases on its worker threads, and installs the versions that the coherence
registry activates at each step boundary.
"""

from __future__ import annotations

import math
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from asteria import _core
from asteria.config import RuntimeConfig, is_int
from asteria.errors import RefreshBacklogWarning, RefreshError
from asteria.optim import functional as F
from asteria.optim.validation import check_arg, check_counts, check_entry, check_saved_request, check_saved_snapshot
from asteria.pipeline import cpus, streams
from asteria.pipeline.factors import FactorSet, RootRequest


SAVED = "state_dict['refresher']"  # how a checkpoint's refresher state is named in errors
BACKLOG_MIN_SECONDS = 0.05  # RefreshBacklogWarning: wait time that counts, at least...
BACKLOG_FRACTION = 0.05     # ...and this fraction of the training time it spans


class Refresher(ABC):
    """Computes and installs preconditioners for a fixed list of factor sets."""

    #: the keys of ``state()``, checked before a checkpoint is loaded (``validate_state_dict``)
    STATE_KEYS: tuple[str, ...] = ()

    def __init__(self, sets: list[FactorSet], config: RuntimeConfig, interval: int) -> None:
        self.sets = sets
        self.config = config
        self.interval = interval
        self._newest_versions = [0] * len(sets)
        self.tier: Any = None  # the optimizer's PreconditionerTier: told before a preconditioner is overwritten
        self._installs: list[tuple[int, int]] = []  # (set index, version) per block whose version changed

    def _set_version(self, index: int, block: int, version: int) -> None:
        """Records that ``block`` of set ``index`` now uses ``version`` (see ``take_installs``)."""
        versions = self.sets[index].versions
        if versions[block] != version:
            versions[block] = version
            self._installs.append((index, version))

    def take_installs(self) -> list[tuple[int, int]]:
        """``(set index, version)`` of every block install since the last call."""
        installs, self._installs = self._installs, []
        return installs

    @abstractmethod
    def refresh(self, step: int, items: list[tuple[int, int, RootRequest]]) -> None:
        """Starts, for each ``(set index, version, request)``, that refresh of the set from its factors
        as they are at ``step``."""

    @abstractmethod
    def activate(self, step: int) -> None:
        """Installs into ``preconditioners`` the versions the schedule gives for ``step``."""

    def before_factor_update(self) -> None:
        """Called before the factors are modified in place (a snapshot may still be reading them)."""

    def activation_step(self, step: int, version: int) -> int:
        """The step from which ``version`` of a set, snapshotted at ``step``, is in use."""
        return step

    def poll(self, step: int) -> None:
        """Moves finished transfers along without waiting (``step``: the last completed step)."""

    def ready(self) -> None:
        """Makes the current stream wait for the installs issued so far (before it reads them)."""

    def check_backlog(self, step: int) -> None:
        """Warns (once) when the workers fall behind the schedule; called at refresh steps."""

    @abstractmethod
    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint at ``step`` must hold for a resumed run to continue bit for bit."""

    @abstractmethod
    def load_state(self, state: dict[str, Any]) -> None:
        """Restores ``state()`` into a refresher over the same factor sets."""

    def check_state(self, state: dict[str, Any]) -> None:
        """Raises ``ValueError`` naming the first entry of ``state`` (a checkpoint's ``state()``, holding
        ``STATE_KEYS``) that ``load_state`` could not restore into this refresher; changes nothing."""
        if "newest_versions" in state:
            check_counts(state["newest_versions"], f"{SAVED}['newest_versions']", len(self.sets),
                         "the newest version snapshotted of each factor set")
        if "consecutive_failures" in state:
            failures = state["consecutive_failures"]
            check_arg(isinstance(failures, (list, tuple)) and len(failures) == len(self.sets),
                      f"{SAVED}['consecutive_failures']", failures, f"must be a list of {len(self.sets)} entries, "
                      "one per factor set")
            for index, (counts, fset) in enumerate(zip(failures, self.sets)):
                check_counts(counts, f"{SAVED}['consecutive_failures'][{index}]", fset.batch,
                             f"the failed refreshes in a row of each block of {fset.name}")

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for ``runtime_stats()``."""

    def close(self) -> None:
        """Releases threads and buffers. Idempotent."""

    def host_bytes(self) -> int:
        """Bytes of host memory held for refreshes."""
        return 0

    def identity(self) -> dict[str, Any] | None:
        """The rank layout a checkpoint of this refresher belongs to (None: a single process)."""
        return None

    def _raise_failure(self, fset: FactorSet, block: int, version: int, cause: str) -> None:
        raise RefreshError(fset.block_params[block], fset.describe(block), version, cause)


class SyncRefresher(Refresher):
    """Every refresh computed at its own step on the parameter's device (torch eigh), in float32 matrix
    products whatever ``torch.set_float32_matmul_precision`` says: TF32's 10-bit mantissa would blur
    the power step of an eigenbasis refresh, and the CPU workers compute it in float32 (see
    ``float32_matmuls``)."""

    STATE_KEYS = ("newest_versions", "consecutive_failures")

    def __init__(self, sets: list[FactorSet], config: RuntimeConfig, interval: int) -> None:
        super().__init__(sets, config, interval)
        self._refreshes = 0
        self._failures = 0
        self._skipped = 0
        self._consecutive = [np.zeros(s.batch, dtype=np.int64) for s in sets]
        self._last_error = "non-finite factor, or a refresh result that is not finite"
        self._seconds = 0.0

    def refresh(self, step: int, items: list[tuple[int, int, RootRequest]]) -> None:
        with F.float32_matmuls():
            self._refresh(step, items)

    def _refresh(self, step: int, items: list[tuple[int, int, RootRequest]]) -> None:
        started = time.perf_counter()
        results = []
        for index, version, request in items:
            fset = self.sets[index]
            order = None
            if fset.kind == "root":
                scale = request.scale
                if isinstance(scale, tuple):  # the blocks' own step counts differ
                    scale = F.batch_view(torch.tensor(scale, dtype=fset.factors.dtype, device=fset.factors.device),
                                         fset.factors)
                new, usable = F.inverse_root(fset.factors, fset.exponent, request.eps, scale)
                # A zero factor tells nothing: the identity, not (eps I)^exponent (the C++ engine's rule).
                eye = torch.eye(fset.dim, dtype=new.dtype, device=new.device)
                new = torch.where(F.batch_view(F.zero_rows(fset.factors), new), eye, new)
            else:
                new, usable, order = self._eigenbases(fset, request.skip_tol)
            results.append((index, version, new, usable, usable.cpu().numpy(), order))
        # Check every bound before changing anything, so that a raise leaves all state as it was.
        for index, version, _, _, ok, _ in results:
            consecutive = self._consecutive[index]
            failing = np.where(~ok & (consecutive + 1 >= self.config.max_consecutive_failures))[0]
            if failing.size:
                self._raise_failure(self.sets[index], int(failing[0]), version, self._last_error)
        for index, version, new, usable, ok, order in results:
            fset, consecutive = self.sets[index], self._consecutive[index]
            if order is not None and fset.permute is not None:
                refreshed = (usable & fset.installed).nonzero().flatten()
                if refreshed.numel():
                    fset.permute(refreshed, order[refreshed])
            fset.preconditioners.copy_(torch.where(F.batch_view(usable, new), new, fset.preconditioners))
            fset.installed |= usable
            consecutive[:] = np.where(ok, 0, consecutive + 1)
            for block in np.where(ok)[0]:
                self._set_version(index, int(block), version)
            self._failures += int((~ok).sum())
            self._refreshes += fset.batch
            self._newest_versions[index] = version
        self._seconds += time.perf_counter() - started

    def _eigenbases(self, fset: FactorSet, skip_tol: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A full eigendecomposition for blocks without a basis yet (or with a zero factor's identity), the
        warm-started QR refresh for the others; the column order is None when no block was refreshed
        from an old basis (the blocks decomposed afresh keep theirs: the identity order)."""
        warm = fset.installed & ~F.identity_rows(fset.preconditioners)
        if not bool(warm.any()):
            bases, usable = F.eigenbasis(fset.factors)
            return bases, usable, None
        refreshed, order, usable, skipped = F.qr_refresh(fset.factors, fset.preconditioners, skip_tol)
        self._skipped += int((skipped & warm).sum())
        if bool(warm.all()):
            return refreshed, usable, order
        fresh, fresh_usable = F.eigenbasis(fset.factors)
        mask = F.batch_view(warm, fresh)
        kept = torch.arange(order.shape[-1], device=order.device).expand_as(order)
        return (torch.where(mask, refreshed, fresh), torch.where(warm, usable, fresh_usable),
                torch.where(warm.unsqueeze(-1), order, kept))

    def activate(self, step: int) -> None:
        """Nothing to do: a sync refresh is in use from its own step."""

    def state(self, step: int) -> dict[str, Any]:
        return {"newest_versions": list(self._newest_versions),
                "consecutive_failures": [c.tolist() for c in self._consecutive]}  # ints: weights_only loads

    def load_state(self, state: dict[str, Any]) -> None:
        self._newest_versions = list(state["newest_versions"])
        self._consecutive = [np.array(c, dtype=np.int64) for c in state["consecutive_failures"]]

    def stats(self) -> dict[str, Any]:
        return {
            "refreshes": self._refreshes,
            "refresh_failures": self._failures,
            "refreshes_skipped": self._skipped,
            "refresh_seconds_on_step": self._seconds,
            "staleness_histogram": [],
            "waits": 0,
            "wait_seconds": 0.0,
        }


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
        # (set index, engine block ids, version, activation step, request, the copy's event)
        self.pending: list[tuple[int, list[int], int, int, RootRequest, torch.cuda.Event | None]] = []
        self._events: dict[torch.device, torch.cuda.Event | None] = {}

    def stage(self, index: int, ids: list[int], version: int, due: int, request: RootRequest, slot: Tensor,
              source: Callable[[], Tensor]) -> None:
        """Copies ``source()`` (evaluated on the side stream) into ``slot`` for ``version`` of set ``index``."""
        self.engine.begin_snapshot(ids, version, self.timeout_s)
        device = self.sets[index].device
        side = self.side[device]
        with side.staging():
            slot.copy_(source(), non_blocking=side.cuda)
        event = side.record()
        if event is not None:
            self._events[device] = event
        self.pending.append((index, ids, version, due, request, event))

    def submit_ready(self, step: int) -> None:
        """Hands finished snapshots to the workers; those due by ``step`` are waited for."""
        waiting = []
        for entry in self.pending:
            index, ids, version, due, request, event = entry
            if not streams.done(event):
                if due > step:
                    waiting.append(entry)
                    continue
                streams.wait(event)
            request.submit(self.engine, ids, version, due, self.sets[index].exponent)
        self.pending = waiting

    def before_factor_update(self) -> None:
        for device, event in self._events.items():
            self.side[device].main_waits(event)
        self._events.clear()

    def wait_all(self) -> None:
        """Waits for every snapshot copy still in flight (before the host reads the rings)."""
        for *_, event in self.pending:
            streams.wait(event)


class WorkerRefresher(Refresher):
    """Base of the refreshers whose jobs run on the C++ workers (one process, or one rank of several):
    rings of S + 1 slots per block, the deterministic rule's lag, the engine and the snapshot staging
    (both made by ``_start_workers``)."""

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
            check_arg(is_int(entry["version"]) and entry["version"] >= 1, f"{name}['version']", entry["version"],
                      "must be an int >= 1")
            check_arg(is_int(entry["due"]) and entry["due"] >= 0, f"{name}['due']", entry["due"],
                      "must be an int >= 0, the step the version is due")
            yield name, entry

    def __init__(self, sets: list[FactorSet], config: RuntimeConfig, interval: int) -> None:
        super().__init__(sets, config, interval)
        self.depth = config.staleness + 1
        self.lag = config.activation_lag(interval)  # checked before any thread starts
        # Installs queued on a side stream, which the current stream waits for before it reads them.
        self._install_events: list[tuple[streams.SideStream, torch.cuda.Event | None]] = []

    def activation_step(self, step: int, version: int) -> int:
        """The step from which ``version`` (snapshotted at ``step``) is used under the deterministic rule:
        ``lag_steps`` later (default S intervals), except the first ``sync_refreshes`` versions (used at
        once)."""
        if version <= self.config.sync_refreshes:
            return step
        return step + self.lag

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
        self.engine = _core.RefreshEngine(
            workers=config.resolved_workers(), blas_threads=config.blas_threads, staleness=config.staleness,
            deterministic=deterministic, max_consecutive_failures=max_consecutive_failures,
            slot_timeout_s=config.timeout_s, worker_nice=config.worker_nice, worker_cpus=self.worker_cpus,
            sync_versions=config.sync_refreshes)
        self.thread_cap = cpus.TorchThreadCap(config.torch_threads, self.worker_cpus)
        self.stager = SnapshotStager(self.engine, self.sets, config.timeout_s)

    def _stop_workers(self) -> None:
        self.engine.close()
        self.thread_cap.restore()

    def _worker_stats(self, pool: dict[str, Any]) -> dict[str, Any]:
        """The workers' part of ``stats()``."""
        return {"workers": pool["workers"], "worker_cpus": self.worker_cpus, "torch_threads": torch.get_num_threads(),
                "worker_busy_fraction": pool["busy_fraction"]}


class AsyncRefresher(WorkerRefresher):
    """Refreshes on the C++ workers with deterministic or bounded-staleness activation."""

    STATE_KEYS = ("newest_versions", "scheduled")

    def __init__(self, sets: list[FactorSet], config: RuntimeConfig, interval: int) -> None:
        super().__init__(sets, config, interval)
        self._start_workers(config.deterministic, config.max_consecutive_failures)
        self.side = self.stager.side
        self.snapshots: list[torch.Tensor] = []
        self.results: list[torch.Tensor] = []
        self.ids: list[list[int]] = []
        self.owner: dict[int, tuple[int, int]] = {}
        for index, fset in enumerate(sets):
            pin = fset.device.type == "cuda"
            n = fset.dim
            snapshots = torch.empty((self.depth, fset.batch, n, n), dtype=torch.float32, pin_memory=pin, device="cpu")
            # An eigenbasis result carries two more rows: the eigenvalue estimates and the column order.
            rows = n + 2 if fset.kind == "eigenbasis" else n
            results = torch.empty((self.depth, fset.batch, rows, n), dtype=torch.float32, pin_memory=pin, device="cpu")
            ids = [self.engine.add_block(snapshots[:, b], results[:, b], kind=fset.kind) for b in range(fset.batch)]
            self.owner.update({block_id: (index, b) for b, block_id in enumerate(ids)})
            self.snapshots.append(snapshots)
            self.results.append(results)
            self.ids.append(ids)
        self._pending_releases: list[tuple[torch.cuda.Event | None, list[tuple[int, int]]]] = []
        self._bytes_to_host = 0
        self._bytes_to_device = 0
        # Versions snapshotted but not yet activated: (set index, version, activation step, request).
        self._scheduled: list[tuple[int, int, int, RootRequest]] = []
        self._backlog_warned = False
        # The baseline: waits, wait seconds, time, refresh CPU-seconds, step.
        self._backlog_base: tuple[int, float, float, float, int] | None = None
        self._backlog_next_check = 0

    def refresh(self, step: int, items: list[tuple[int, int, RootRequest]]) -> None:
        for index, version, request in items:
            fset = self.sets[index]
            due = self.activation_step(step, version)
            self._scheduled.append((index, version, due, request))
            self.stager.stage(index, self.ids[index], version, due, request,
                              self.snapshots[index][version % self.depth], lambda fset=fset: fset.factors)
            self._bytes_to_host += fset.factors.numel() * 4
            self._newest_versions[index] = version
        self.stager.submit_ready(step)

    def check_backlog(self, step: int) -> None:
        if self._backlog_warned or self.lag == 0:
            return  # at S = 0 (or lag_steps = 0) every activation waits for its refresh by design
        # Each set's first versions are waited for at their own step by design (sync_refreshes, staggered
        # over the first intervals): count from the first refresh after all of them. Then look once per
        # interval (staggered sets refresh on every step; the engine's counters need not be read that often).
        if min(self._newest_versions) <= self.config.sync_refreshes or step < self._backlog_next_check:
            return
        self._backlog_next_check = step + self.interval
        engine = self.engine.stats()
        waits = engine["registry"]["waits"] + engine["snapshot_waits"]
        seconds = engine["registry"]["wait_seconds"] + engine["snapshot_wait_seconds"]
        now = time.monotonic()
        if self._backlog_base is None:
            self._backlog_base = (waits, seconds, now, engine["refresh_seconds"], step)
            return
        base_waits, base_seconds, since, base_work, base_step = self._backlog_base
        waited, lost = waits - base_waits, seconds - base_seconds
        # Two or more waits that cost at least 5% of the training time since (and 50 ms) mean the workers
        # are behind; a few scheduling hiccups on a loaded machine do not.
        if waited < 2 or lost < max(BACKLOG_MIN_SECONDS, BACKLOG_FRACTION * (now - since)):
            return
        self._backlog_warned = True
        pool = engine["pool"]
        # The refresh work of one interval (CPU-seconds, the same whatever the interval) against what the
        # workers have in an interval of training without the waits; the frequency scales the latter.
        intervals = max((step - base_step) / self.interval, 1e-9)
        work = (engine["refresh_seconds"] - base_work) / intervals
        capacity = pool["workers"] * max(now - since - lost, 1e-9) / intervals
        waited_text = (f"Asteria: step() waited {waited} times for the CPU refresh workers between the first "
                       f"interval and step {step} ({lost:.2f} s, {lost / max(now - since, 1e-9):.0%} of that time); "
                       f"the {pool['workers']} workers were busy {pool['busy_fraction']:.0%} of the time.")
        advice = backlog_advice(self.config, self.interval, work, capacity)
        warnings.warn(RefreshBacklogWarning(waited_text + advice), stacklevel=5)

    def poll(self, step: int) -> None:
        if self.stager.pending:
            self.stager.submit_ready(step)
        if self._pending_releases:
            self._release_copied(block_all=False)

    def _release_copied(self, block_all: bool) -> None:
        still = []
        for event, pins in self._pending_releases:
            if block_all:
                streams.wait(event)
            elif not streams.done(event):
                still.append((event, pins))
                continue
            for block_id, version in pins:
                self.engine.release(block_id, version)
        self._pending_releases = still

    def activate(self, step: int) -> None:
        self.stager.submit_ready(step)
        self._release_copied(block_all=False)
        self._scheduled = [entry for entry in self._scheduled if not self._applied(entry, step)]
        try:
            changes = self.engine.activate(step, self.config.timeout_s)
        except _core.BlockFailure as failure:
            _, block_id, version, cause = failure.args
            index, block = self.owner[block_id]
            self._raise_failure(self.sets[index], block, version, cause)
        except _core.BlockTimeout as timeout:
            index, block = self.owner[timeout.block]
            fset = self.sets[index]
            raise TimeoutError(f"refresh of {fset.describe(block)} of parameter {fset.block_params[block]!r} "
                               f"(version {timeout.version}) not done within timeout_s={self.config.timeout_s}: "
                               f"{timeout}") from timeout
        by_set: dict[int, list[tuple[int, int, int]]] = {}
        for block_id, version in changes:
            index, block = self.owner[block_id]
            by_set.setdefault(index, []).append((block, version, block_id))
        for index, items in by_set.items():
            self._install(index, items)

    def _applied(self, entry: tuple[int, int, int, RootRequest], step: int) -> bool:
        """Whether a scheduled version has had its turn: its activation step has passed (deterministic),
        or every block of its set uses it or a newer version (non-deterministic)."""
        index, version, due, _ = entry
        if self.config.deterministic:
            return due <= step
        return min(self.sets[index].versions) >= version

    def state(self, step: int) -> dict[str, Any]:
        """The versions not yet applied travel as their snapshots: recomputing them on the workers after a
        resume gives the same bits (one BLAS thread per job), so the resumed run continues exactly."""
        self.stager.wait_all()
        scheduled = tuple({"set": index, "version": version, "due": due,
                           "request": request.saved(),
                           "snapshot": self.snapshots[index][version % self.depth].clone()}
                          for index, version, due, request in self._scheduled)
        # A tuple: torch.distributed.checkpoint stores it whole, as the one entry a fresh optimizer's
        # state_dict (its load template) has, however many refreshes are in flight.
        return {"newest_versions": list(self._newest_versions), "scheduled": scheduled}

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        for name, entry in self._scheduled_entries(state, ("set", "version", "due", "request", "snapshot")):
            index = entry["set"]
            check_arg(is_int(index) and 0 <= index < len(self.sets), f"{name}['set']", index,
                      f"must be a factor set index in [0, {len(self.sets)})")
            fset = self.sets[index]
            newest = state["newest_versions"][index]
            check_arg(entry["version"] <= newest, f"{name}['version']", entry["version"],
                      f"must be an int in [1, {newest}], a version of {fset.name} snapshotted")
            check_saved_request(entry["request"], fset.batch, f"{name}['request']")
            check_saved_snapshot(entry["snapshot"], tuple(self.snapshots[index].shape[1:]), f"{name}['snapshot']")

    def load_state(self, state: dict[str, Any]) -> None:
        self._newest_versions = list(state["newest_versions"])
        scheduled = state["scheduled"]
        for index, ids in enumerate(self.ids):
            pending = [entry["version"] for entry in scheduled if entry["set"] == index]
            # Activations and staleness count from the versions in use, not from 0.
            self.engine.resume_at(ids, list(self.sets[index].versions))
            self.engine.start_at(ids, min(pending) if pending else self._newest_versions[index] + 1)
        # An eigenbasis chain warm-starts from the newest good basis before it: the one in use now.
        for fset, ids in zip(self.sets, self.ids):
            if fset.kind == "eigenbasis":
                for block, block_id in enumerate(ids):
                    if fset.versions[block] > 0:
                        current = fset.preconditioners if self.tier is None else self.tier.current(fset)
                        basis = current[block].detach().to("cpu", torch.float32).contiguous()
                        self.engine.set_basis(block_id, fset.versions[block], basis)
        self._scheduled = []
        for entry in sorted(scheduled, key=lambda e: (e["version"], e["set"])):
            index, version, due = entry["set"], entry["version"], entry["due"]
            request = RootRequest.load(entry["request"])
            # Only the blocks still behind it: under deterministic=False a block may already use this
            # version or a newer one (its chain was seeded with that basis just above).
            blocks = [b for b, used in enumerate(self.sets[index].versions) if used < version]
            ids = [self.ids[index][b] for b in blocks]
            self.engine.begin_snapshot(ids, version, self.config.timeout_s)
            self.snapshots[index][version % self.depth].copy_(entry["snapshot"])
            request.for_blocks(blocks).submit(self.engine, ids, version, due, self.sets[index].exponent)
            self._scheduled.append((index, version, due, request))

    def _install(self, index: int, items: list[tuple[int, int, int]]) -> None:
        items = sorted(items)  # by block: a whole set's column orders come in block order
        fset = self.sets[index]
        side = self.side[fset.device]
        results = self.results[index]
        versions = {version for _, version, _ in items}
        n = fset.dim
        whole = len(items) == fset.batch and len(versions) == 1  # the usual case: one copy for the whole set
        target = fset.preconditioners if self.tier is None else self.tier.install_target(fset, full=whole)
        # Everything here runs on the training thread: no copy may come from pageable memory (torch copies
        # those synchronously), and no small host value may be written into a device tensor.
        orders = None  # the new column orders, on the device (None: not picked by the copy)
        with side.staging():
            blocks = (streams.indices_to_device([block for block, _, _ in items], fset.device)
                      if not whole or fset.permute is not None else None)
            if whole:  # an eigenbasis result's two extra rows make the slab strided: never copy it as such
                orders = streams.copy_leading_rows_(target, results[next(iter(versions)) % self.depth],
                                                    n + 1 if fset.permute is not None else None)
                fset.installed.fill_(True)
            else:
                for block, version, _ in items:
                    target[block].copy_(results[version % self.depth, block, :n], non_blocking=side.cuda)
                fset.installed.index_fill_(0, blocks, True)
        if self.tier is not None:
            self.tier.after_install(fset, target)
        with side.staging():
            if fset.permute is not None:
                if orders is None:  # per-block installs, or a whole set installed into host memory
                    orders = streams.to_device([results[version % self.depth, block, n + 1]
                                                for block, version, _ in items], fset.device)
                fset.permute(blocks, orders.long())
        event = side.record()
        # The main stream waits for the copy only where it uses the preconditioners (``ready()``), so a
        # prefetch issued from a forward hook does not stall the forward pass.
        self._install_events.append((side, event))
        for block, version, _ in items:
            self._set_version(index, block, version)
        self._bytes_to_device += len(items) * fset.dim * fset.dim * 4
        self._pending_releases.append((event, [(block_id, version) for _, version, block_id in items]))
        if event is None:
            self._release_copied(block_all=True)

    def stats(self) -> dict[str, Any]:
        engine = self.engine.stats()
        registry = engine["registry"]
        pool = engine["pool"]
        return {
            "refreshes": engine["refreshes_ok"],
            "refresh_failures": engine["refreshes_failed"],
            "refreshes_skipped": engine["refreshes_skipped"],
            # deterministic=False: jobs that found a newer version of their block queued and did not compute.
            "refreshes_superseded": engine["refreshes_superseded"],
            "float64_retries": engine["float64_retries"],
            "refresh_seconds_on_workers": engine["refresh_seconds"],
            "staleness_histogram": registry["staleness_histogram"],
            "max_staleness_seen": registry["max_staleness_seen"],
            # Waits at the activation barrier and for snapshot buffers the workers still read.
            "waits": registry["waits"] + engine["snapshot_waits"],
            "wait_seconds": registry["wait_seconds"] + engine["snapshot_wait_seconds"],
            "activation_waits": registry["waits"],
            "snapshot_waits": engine["snapshot_waits"],
            "max_wait_seconds": registry["max_wait_seconds"],
            "activations": registry["activations"],
            # Finished versions never used because a newer one was activated first (mostly
            # deterministic=False); an eigenbasis' state follows the composed orders of those.
            "skipped_versions": registry["skipped_versions"],
            **self._worker_stats(pool),
            "jobs_queued": pool["queue_depth"],
            "job_mean_latency_seconds": pool["mean_latency_seconds"],
            "job_max_latency_seconds": pool["max_latency_seconds"],
            "bytes_to_host": self._bytes_to_host,
            "bytes_to_device": self._bytes_to_device,
        }

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.snapshots + self.results)

    def close(self) -> None:
        # The workers may still read snapshots and write results: stop them before buffers go away.
        self._stop_workers()
        self._release_copied(block_all=True)


def backlog_advice(config: RuntimeConfig, interval: int, work: float, capacity: float) -> str:
    """What to change when ``step()`` keeps waiting for the workers, from the refresh work of an interval
    and the workers' time in one (both in CPU-seconds, measured): with the work within the capacity and a
    ``lag_steps`` set, the lag is shorter than a job; otherwise the workers are short of time."""
    lag_steps = config.lag_steps
    if lag_steps is not None and work <= capacity:
        return (f" They keep up with the refresh work (about {work:.3g} CPU-seconds an interval against "
                f"{capacity:.3g} worker-seconds of training), but jobs take longer than lag_steps={lag_steps} steps: "
                f"raise RuntimeConfig.lag_steps (at most staleness x precondition_frequency = "
                f"{config.staleness * interval}).")
    enough = math.ceil(interval * 1.25 * work / capacity)
    other = " or deterministic=False (workers then skip versions already overtaken)" if config.deterministic else ""
    bound = (f"lag_steps (now {lag_steps}), " if lag_steps is not None else "") + f"staleness (now {config.staleness})"
    return (f" The refresh work of an interval takes longer than the interval: about {work:.3g} CPU-seconds "
            f"against {capacity:.3g} worker-seconds of training. Raise precondition_frequency (now {interval}; "
            f"about {enough} would keep up), {bound} or RuntimeConfig.workers{other}, or train with fewer, larger "
            f"steps.")


def make_refresher(sets: list[FactorSet], config: RuntimeConfig, interval: int,
                   groups: list | None = None) -> Refresher:
    """The refresher the runtime configuration asks for; ``groups`` (the shape group of each set) lets an
    async run on several ranks use the distributed refresher (``asteria.distributed``)."""
    from asteria.distributed import distributed_refresher, topology

    if config.mode == "sync":
        topology(config)  # refuses layouts the distributed runtime cannot run (e.g. deterministic=False)
        return SyncRefresher(sets, config, interval)
    distributed = distributed_refresher(sets, config, interval, groups)
    if distributed is not None:
        return distributed
    return AsyncRefresher(sets, config, interval)
