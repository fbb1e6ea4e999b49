"""The refresh executor of one process: the C++ workers, and beside them the device lane where the parameters
live on a GPU, under one coherence registry.

A set's refresh goes to one side per version. The start-up versions (``sync_refreshes``, used at their own
step) run where they are fastest: on the device, inline, when there is one. Later versions go to the workers,
except under the newest-finished rule, where ``LaneBalancer`` moves to the device lane the sets the workers
cannot finish within an interval (planned every interval from measured step time and throughputs). Host
memory follows the work in flight (``worker_refresh.ring_depth``): under the newest-finished rule one packed
snapshot and one result per block and version in flight (``RuntimeConfig.in_flight``, default 1), because a
set's refresh that comes due while that many of its versions are still on their way is deferred to its next
turn (counted in ``refreshes_deferred``) rather than queued behind them.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from asteria import _core
from asteria.checks import check_arg, check_saved_request, check_saved_snapshot
from asteria.config import RuntimeConfig, is_int
from asteria.pipeline import packing, streams
from asteria.pipeline.backlog import BacklogMonitor
from asteria.pipeline.balance import LaneBalancer
from asteria.pipeline.device_lane import DeviceLane
from asteria.pipeline.factors import FactorSet, RootRequest
from asteria.pipeline.worker_refresh import Seed, WorkerRefresher, claimed

CPU, DEVICE = "cpu", "device"
#: the largest block size whose root the workers' prior times itself (larger ones scale from it by n^3: BLAS runs
#: at its full rate there, so the flops tell the time)
PRIOR_MAX_TIMED = 2048


def refresh_buffer_bytes(sets: list[FactorSet], depth: int) -> int:
    """Pinned host bytes of the rings: per block ``depth`` packed snapshots and results (an eigenbasis
    result holds two more rows, its estimates and column order)."""
    total = 0
    for fset in sets:
        rows = fset.dim + 2 if fset.kind == "eigenbasis" else fset.dim
        total += depth * fset.batch * 4 * (packing.packed_size(fset.dim) + rows * fset.dim)
    return total


def device_lane_wanted(config: RuntimeConfig, sets: list[FactorSet]) -> bool:
    """``RuntimeConfig.device_refresh``: None means on for sets on a GPU with the preconditioners there."""
    if config.device_refresh is not None:
        return config.device_refresh
    return any(fset.device.type == "cuda" for fset in sets)


def cpu_prior(dims: list[int]) -> dict[int, float]:
    """Per block size in ``dims``, one core's seconds for a root before the workers have run a job (the engine's
    measurements replace it): a root of each size up to PRIOR_MAX_TIMED, timed once on this thread (the workers
    set the BLAS library to their one thread), and the largest of them scaled by n^3 above it. Each size is
    timed because BLAS runs a 2048 block about 3x faster per flop than a 256 one: scaled by n^3 from 256, the
    prior overstated a 2048 block's cost 3.3x, and the first plans sent to the device lane sets that the workers
    could have refreshed."""
    gen = torch.Generator().manual_seed(0)
    seconds: dict[int, float] = {}
    _core.inverse_root(torch.eye(8).numpy(), -0.25, 1e-6)  # the library's first call, outside the timings
    for n in sorted({min(dim, PRIOR_MAX_TIMED) for dim in dims}):
        g = torch.randn(n, n, generator=gen)
        a = (g @ g.T / n).numpy()
        started = time.perf_counter()
        _core.inverse_root(a, -0.25, 1e-6)
        seconds[n] = time.perf_counter() - started
    largest = max(seconds, default=1)
    return {dim: seconds[dim] if dim in seconds else seconds[largest] * (dim / largest) ** 3 for dim in dims}


class AsyncRefresher(WorkerRefresher):
    """The executor of one process (see the module docstring)."""

    STATE_KEYS = ("newest_versions", "scheduled")

    def __init__(self, sets: list[FactorSet], config: RuntimeConfig, interval: int, device_lane: bool) -> None:
        super().__init__(sets, config, interval)
        self._start_workers(config.deterministic, config.max_consecutive_failures)
        self.side = self.stager.side
        self.lane: DeviceLane | None = None
        self.balancer: LaneBalancer | None = None
        try:
            self._build(sets, config, interval, device_lane)
        except BaseException:  # (pinned memory or a green context refused): no thread outlives the refusal
            if self.lane is not None:
                self.lane.close()
            self._stop_workers()
            raise
        self.lanes = [CPU] * len(sets)  # the side of each set's newest version
        self._lane_of: dict[tuple[int, int], str] = {}  # (set, version) in flight -> its side
        self._open: dict[int, list[int]] = {}  # set -> its versions in flight (newest-finished rule)
        self._last_version = [0] * len(sets)  # per set: the newest version snapshotted or deferred
        self._next_plan = 0
        self._deferred = 0
        #: the latest deferrals (why refreshes were dropped, for ``stats()``): step, set, version, the side it
        #: would have gone to, the reason (``in_flight`` versions on their way, or ``held_up``: see
        #: ``_held_up``), and the versions of the set still on their way (with theirs)
        self._deferrals: deque[dict[str, Any]] = deque(maxlen=32)
        self._moves = 0
        self._pending_releases: list[tuple[torch.cuda.Event | None, list[tuple[int, int]]]] = []
        self._bytes_to_host = 0
        self._bytes_to_device = 0
        # Versions snapshotted but not yet activated: (set index, version, activation step, request).
        self._scheduled: list[tuple[int, int, int, RootRequest]] = []
        self.backlog = BacklogMonitor(config, interval)

    def _build(self, sets: list[FactorSet], config: RuntimeConfig, interval: int, device_lane: bool) -> None:
        """The pinned host buffers and the engine's blocks of every set, then the device lane and its balancer."""
        self.snapshots: list[torch.Tensor] = []  # per set (depth, B, n (n + 1) / 2): packed
        self.results: list[torch.Tensor] = []
        self.ids: list[list[int]] = []
        self.owner: dict[int, tuple[int, int]] = {}
        for index, fset in enumerate(sets):
            pin = fset.device.type == "cuda"
            n = fset.dim
            snapshots = torch.empty((self.depth, fset.batch, packing.packed_size(n)), dtype=torch.float32,
                                    pin_memory=pin, device="cpu")
            # An eigenbasis result carries two more rows: the eigenvalue estimates and the column order.
            rows = n + 2 if fset.kind == "eigenbasis" else n
            results = torch.empty((self.depth, fset.batch, rows, n), dtype=torch.float32, pin_memory=pin, device="cpu")
            ids = [self.engine.add_block(snapshots[:, b], results[:, b], kind=fset.kind, first_basis=fset.first_basis)
                   for b in range(fset.batch)]
            self.owner.update({block_id: (index, b) for b, block_id in enumerate(ids)})
            self.snapshots.append(snapshots)
            self.results.append(results)
            self.ids.append(ids)
        if device_lane:
            process = config.device_process
            if process is None:  # (on a GPU: see RuntimeConfig.device_process)
                process = any(fset.device.type == "cuda" for fset in sets)
            self.lane = DeviceLane(self.engine, sets, self.ids, config.timeout_s, config.device_sms,
                                   config.device_threads, config.worker_nice, process)
        if self.lane is not None and not config.deterministic:
            self.balancer = LaneBalancer(sets, interval, self.engine.stats()["pool"]["workers"],
                                         config.device_share * config.device_threads,
                                         cpu_prior([fset.dim for fset in self.sets]))

    # ---- refresh and activation -------------------------------------------------------------------
    def refresh(self, step: int, items: list[tuple[int, int, RootRequest]]) -> None:
        for index, version, request in items:
            fset = self.sets[index]
            for deferred in range(self._last_version[index] + 1, version):  # (in the run a checkpoint came from)
                self.engine.skip(self.ids[index], deferred)  # the rings go on in version order
            self._last_version[index] = version
            lane = self._choose_lane(index, version)
            if not self.config.deterministic:
                in_flight = self._open.setdefault(index, [])
                in_flight[:] = [v for v in in_flight if not self._settled(index, v)]
                full = len(in_flight) >= self.config.in_flight
                if full or self._held_up(index, version, lane, in_flight):
                    self._deferred += fset.batch
                    self._deferrals.append({"step": step, "set": fset.name, "version": version, "side": lane,
                                            "reason": "in_flight" if full else "held_up",
                                            "in_flight": [(v, self._lane_of.get((index, v), CPU)) for v in in_flight]})
                    self.engine.skip(self.ids[index], version)
                    continue
            due = self.rule.activation_step(step, version)
            if lane == DEVICE:
                inline = version <= self.config.sync_refreshes
                self.lane.start(index, version, due, request, None if inline else self.stager.copy_on_device)
            else:
                slot = self.snapshots[index][version % self.depth]
                self.stager.stage(index, self.ids[index], version, due, request, slot,
                                  lambda fset=fset: packing.pack(fset.factors), self._seed(index, version))
                self._bytes_to_host += self.snapshots[index][0].numel() * 4
            if lane != self.lanes[index] and version > self.config.sync_refreshes + 1:
                self._moves += 1
            self.lanes[index] = lane
            self._lane_of[(index, version)] = lane
            if not self.config.deterministic:
                self._open[index].append(version)
            self._scheduled.append((index, version, due, request))
            self._newest_versions[index] = version
        self.stager.submit_ready(step)

    def _choose_lane(self, index: int, version: int) -> str:
        if self.lane is None:
            return CPU
        if version <= self.config.sync_refreshes:
            return DEVICE
        if self.balancer is None:  # the deterministic rule: the workers, whose results follow the schedule only
            return CPU
        return DEVICE if self.balancer.plan[index] else CPU

    def _held_up(self, index: int, version: int, lane: str, in_flight: list[int]) -> bool:
        """Whether ``version`` of set ``index`` must be deferred though fewer than ``in_flight`` versions are on
        their way (with ``RuntimeConfig.in_flight`` > 1): for the device lane, an eigenbasis set's with any
        version of it on its way (see below); for the workers, where an unsettled workers' version holds its
        host buffers (``version % depth``), which it would wait for while the step waits for it; or an eigenbasis
        set comes back from the lane while one of its jobs still runs on the workers, whose chain cannot take the
        bases in use (``_seed``) until that job ends, or while a version of it still computes on the lane: the seed
        is named after the set's newest version, whose bases are not yet the ones in use, and the column orders of
        the versions after it would be composed relative to the wrong basis."""
        if lane != CPU:
            # A lane eigenbasis version starts from the bases in use when it computes, and its column order is
            # relative to them: another version of the set installed meanwhile would be reordered by it wrongly.
            return self.sets[index].kind == "eigenbasis" and bool(in_flight)
        if any(v % self.depth == version % self.depth and self._lane_of.get((index, v), CPU) == CPU
               for v in in_flight):
            return True
        fset = self.sets[index]
        if self.lanes[index] != DEVICE or fset.kind != "eigenbasis":
            return False
        if any(self._lane_of.get((index, v), CPU) == DEVICE for v in in_flight):
            return True
        return any(self.engine.chain_busy(block_id) for block_id in self.ids[index])

    def _settled(self, index: int, version: int) -> bool:
        """Whether ``version`` of set ``index`` is done with: every block uses it (or newer), or its refresh of
        the block failed. Until then its host buffers hold its snapshot or result. A device lane version is
        not done with while it computes: a newer version's failure (which the engine's figures would count as
        its own) leaves it to come into use later, from the lane's result."""
        fset = self.sets[index]
        if self._lane_of.get((index, version)) == DEVICE and not self.lane.ended(index, version):
            return all(used >= version for used in fset.versions)
        for block, used in enumerate(fset.versions):
            if used >= version:
                continue
            status = self.engine.status(self.ids[index][block])
            if not (status["newest_finished"] >= version and status["newest_ok"] < version):
                return False
        return True

    def _seed(self, index: int, version: int) -> Seed | None:
        """The warm start of set ``index``'s workers' chain when ``version`` brings an eigenbasis set back from the
        device lane, which computed the versions since the chain's last: the bases in use, as of the installs
        queued so far (they lie in ``version``'s own result buffers until its job starts: see ``Seed``)."""
        fset = self.sets[index]
        if self.lanes[index] != DEVICE or fset.kind != "eigenbasis":
            return None
        rows = self.results[index][version % self.depth, :, :fset.dim]
        return Seed(self._newest_versions[index], fset.preconditioners.detach(), rows)

    def check_backlog(self, step: int) -> None:
        if self.rule.lag == 0 and self.config.deterministic:
            return  # at S = 0 (or lag_steps = 0) every activation waits for its refresh by design
        if min(self._newest_versions) <= self.config.sync_refreshes:
            return  # each set's first versions are waited for at their own step by design
        device = self.lane.stats()["device_refresh_seconds"] if self.lane is not None else 0.0
        planned = self.balancer.load if self.balancer is not None and any(self.balancer.load) else None
        self.backlog.check(step, self.engine.stats(), self._deferred, device, planned)

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
        if self.balancer is not None:
            self._plan(step)
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
        # The workers' versions of a set install together; the lane's one version at a time (with in_flight > 1
        # two of a set may come at once, where the newer one is not usable for some blocks).
        by_set: dict[tuple[int, str, int], list[tuple[int, int, int]]] = {}
        for block_id, version in changes:
            index, block = self.owner[block_id]
            lane = self._lane_of.get((index, version), CPU)
            by_set.setdefault((index, lane, version if lane == DEVICE else 0), []).append((block, version, block_id))
        for (index, lane, _), items in sorted(by_set.items()):
            if lane == DEVICE:
                self._install_from_lane(index, items)
            else:
                self._install(index, items)
        self._scheduled = [entry for entry in self._scheduled if not self._applied(entry, step)]

    def _plan(self, step: int) -> None:
        """The balancer's view of the step time, and once an interval a new plan from the measured costs."""
        self.balancer.observe_step(step)
        if step < self._next_plan:
            return
        self._next_plan = step + self.interval
        by_dim = {int(n): (t["seconds"], t["jobs"]) for n, t in self.engine.stats()["by_dim"].items()}
        self.balancer.observe_costs(by_dim, self.lane.seconds_by_dim())
        self.balancer.replan()

    def _applied(self, entry: tuple[int, int, int, RootRequest], step: int) -> bool:
        """Whether a scheduled version has had its turn, once ``step``'s activation is done: its activation step
        has come (deterministic), or it is settled (newest-finished). The device lane then drops its tensors."""
        index, version, due, _ = entry
        if self.config.deterministic:
            done = due <= step
        else:
            done = self._settled(index, version)
        if done and self._lane_of.pop((index, version), CPU) == DEVICE:
            self.lane.release(index, version, self.side[self.sets[index].device].stream)
        return done

    # ---- installs -----------------------------------------------------------------------------------
    def _install(self, index: int, items: list[tuple[int, int, int]]) -> None:
        """Installs versions the workers computed, from the host result ring."""
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
        self._bytes_to_device += len(items) * n * n * 4
        self._installed(index, items, side)

    def _install_from_lane(self, index: int, items: list[tuple[int, int, int]]) -> None:
        """Installs a version the device lane computed (``items``: its blocks that come to use it)."""
        items = sorted(items)
        fset = self.sets[index]
        side = self.side[fset.device]
        (version,) = {version for _, version, _ in items}
        refreshed = self.lane.take(index, version)
        whole = len(items) == fset.batch
        target = fset.preconditioners if self.tier is None else self.tier.install_target(fset, full=whole)
        with side.staging():
            blocks = streams.indices_to_device([block for block, _, _ in items], fset.device)
            if whole:
                target.copy_(refreshed.new)
                fset.installed.fill_(True)
            else:
                target.index_copy_(0, blocks, refreshed.new.index_select(0, blocks))
                fset.installed.index_fill_(0, blocks, True)
        if self.tier is not None:
            self.tier.after_install(fset, target)
        with side.staging():
            if fset.permute is not None and refreshed.order is not None:
                fset.permute(blocks, refreshed.order.index_select(0, blocks))
        self._installed(index, items, side)

    def _installed(self, index: int, items: list[tuple[int, int, int]], side: streams.SideStream) -> None:
        event = side.record()
        # The main stream waits for the copy only where it uses the preconditioners (``ready()``), so a
        # prefetch issued from a forward hook does not stall the forward pass.
        self._install_events.append((side, event))
        for block, version, _ in items:
            self._set_version(index, block, version)
        self._pending_releases.append((event, [(block_id, version) for _, version, block_id in items]))
        if event is None:
            self._release_copied(block_all=True)

    # ---- checkpoints ----------------------------------------------------------------------------------
    def _snapshot(self, index: int, version: int) -> torch.Tensor:
        """The (B, n, n) factors ``version`` of set ``index`` was refreshed from, on the host."""
        fset = self.sets[index]
        if self._lane_of.get((index, version), CPU) == CPU:
            return packing.unpack(self.snapshots[index][version % self.depth], fset.dim)
        snapshot = self.lane.snapshot(index, version)
        side = self.side[fset.device]
        if snapshot is not None and side.cuda:  # (copied on the side stream, which the main stream need not wait
            side.stream.synchronize()            # for until the next factor update)
        # An inline version (the start-up's) was computed from the factors as they still are between steps.
        return (fset.factors if snapshot is None else snapshot).detach().to("cpu", torch.float32)

    def state(self, step: int) -> dict[str, Any]:
        """The versions not yet applied travel as their snapshots: recomputing them on the workers after a
        resume gives the same bits (one BLAS thread per job), so the resumed run continues exactly."""
        self.stager.wait_all()
        scheduled = tuple({"set": index, "version": version, "due": due, "request": request.saved(),
                           "snapshot": self._snapshot(index, version)}
                          for index, version, due, request in self._scheduled)
        # A tuple: torch.distributed.checkpoint stores it whole, as the one entry a fresh optimizer's
        # state_dict (its load template) has, however many refreshes are in flight.
        return {"newest_versions": list(self._newest_versions), "scheduled": scheduled}

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        seen: set[tuple[int, int]] = set()
        for name, entry in self._scheduled_entries(state, ("set", "version", "due", "request", "snapshot")):
            index = entry["set"]
            check_arg(is_int(index) and 0 <= index < len(self.sets), f"{name}['set']", index,
                      f"must be a factor set index in [0, {len(self.sets)})")
            fset = self.sets[index]
            newest = state["newest_versions"][index]
            check_arg(entry["version"] <= newest, f"{name}['version']", entry["version"],
                      f"must be an int in [1, {newest}], a version of {fset.name} snapshotted")
            check_arg((index, entry["version"]) not in seen, f"{name}['version']", entry["version"],
                      f"must differ from the other scheduled versions of {fset.name} (listed twice)")
            seen.add((index, entry["version"]))
            check_saved_request(entry["request"], fset.batch, f"{name}['request']")
            check_saved_snapshot(entry["snapshot"], (fset.batch, fset.dim, fset.dim), f"{name}['snapshot']")

    def load_state(self, state: dict[str, Any]) -> None:
        self._newest_versions = list(state["newest_versions"])
        self._last_version = list(self._newest_versions)
        scheduled = sorted(state["scheduled"], key=lambda e: (e["version"], e["set"]))
        if not self.config.deterministic:  # at most in_flight versions of a set: the newest (they supersede the others)
            kept = {index: [e for e in scheduled if e["set"] == index][-self.config.in_flight:]
                    for index in {e["set"] for e in scheduled}}
            scheduled = [entry for entry in scheduled if any(entry is e for e in kept[entry["set"]])]
        for index, ids in enumerate(self.ids):
            pending = [entry["version"] for entry in scheduled if entry["set"] == index]
            # Activations and staleness count from the versions in use, not from 0.
            self.engine.resume_at(ids, list(self.sets[index].versions))
            # The rings hand out buffers from the first version each block will be given: the first pending one
            # after the version it uses (under deterministic=False a block may already use a pending version,
            # and with in_flight > 1 another may still be pending after it), else the next snapshot.
            for used, block_id in zip(self.sets[index].versions, ids, strict=True):
                later = [version for version in pending if version > used]
                self.engine.start_at([block_id], min(later) if later else self._newest_versions[index] + 1)
        # An eigenbasis chain warm-starts from the newest good basis before it: the one in use now.
        for fset, ids in zip(self.sets, self.ids):
            if fset.kind == "eigenbasis":
                for block, block_id in enumerate(ids):
                    if fset.versions[block] > 0:
                        current = fset.preconditioners if self.tier is None else self.tier.current(fset)
                        basis = current[block].detach().to("cpu", torch.float32).contiguous()
                        self.engine.set_basis(block_id, fset.versions[block], basis)
        self._scheduled = []
        for entry in scheduled:
            index, version, due = entry["set"], entry["version"], entry["due"]
            request = RootRequest.load(entry["request"])
            fset = self.sets[index]
            # Only the blocks still behind it: under deterministic=False a block may already use this
            # version or a newer one (its chain was seeded with that basis just above).
            blocks = [b for b, used in enumerate(fset.versions) if used < version]
            if self.lane is not None and version <= self.config.sync_refreshes and len(blocks) == fset.batch:
                # A start-up version is the device's, as in the run that saved it.
                self.lane.start(index, version, due, request, None, entry["snapshot"].to(fset.device))
                lane = DEVICE
            else:
                ids = [self.ids[index][b] for b in blocks]
                with claimed(self.engine, ids, version, self.config.timeout_s):
                    self.snapshots[index][version % self.depth].copy_(packing.pack(entry["snapshot"]))
                    request.for_blocks(blocks).submit(self.engine, ids, version, due, fset.exponent)
                lane = CPU
            self.lanes[index] = lane
            self._lane_of[(index, version)] = lane
            if not self.config.deterministic:
                self._open.setdefault(index, []).append(version)
            self._scheduled.append((index, version, due, request))

    # ---- telemetry and life cycle ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        engine = self.engine.stats()
        registry = engine["registry"]
        pool = engine["pool"]
        stats = {
            "refreshes": engine["refreshes_ok"],
            "refresh_failures": engine["refreshes_failed"],
            "refresh_errors": self._errors(),
            "refreshes_skipped": engine["refreshes_skipped"],
            # deterministic=False: jobs that found a newer version of their block queued and did not compute.
            "refreshes_superseded": engine["refreshes_superseded"],
            # deterministic=False: block refreshes not started because their set's previous one was on its way.
            "refreshes_deferred": self._deferred,
            "recent_deferrals": list(self._deferrals),
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
            "job_mean_run_seconds": pool["mean_run_seconds"],
            "worker_jobs_ended": pool["completed"] + pool["failed"],
            # the small blocks' jobs alone (those the express workers take): waited for a thread, or ran slowly
            "small_jobs": pool["cheap_ended"],
            "small_job_mean_latency_seconds": pool["cheap_mean_latency_seconds"],
            "small_job_mean_run_seconds": pool["cheap_mean_run_seconds"],
            "bytes_to_host": self._bytes_to_host,
            "bytes_to_device": self._bytes_to_device,
            "device_lane": self.lane is not None,
            "device_versions": engine["external_versions"],
            "sets_on_device": sum(lane == DEVICE for lane in self.lanes),
            "lane_moves": self._moves,
        }
        if self.lane is not None:
            stats.update(self.lane.stats())
        if self.balancer is not None:
            stats["planned_load"] = {"workers": self.balancer.load[0], "device": self.balancer.load[1]}
        return stats

    def _errors(self) -> dict[str, str]:
        """The last failure's message of every block whose refreshes failed, by the block's description: why,
        where too few failed in a row to raise ``RefreshError``."""
        errors = {}
        for fset, ids in zip(self.sets, self.ids, strict=True):
            for block, block_id in enumerate(ids):
                status = self.engine.status(block_id)
                if status["total_failures"]:
                    errors[fset.describe(block)] = status["last_error"]
        return errors

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.snapshots + self.results)

    def lane_bytes(self) -> int:
        return self.lane.slot_bytes() if self.lane is not None else 0

    def lane_cache_bytes(self) -> int:
        return self.lane.process_cache_bytes() if self.lane is not None else 0

    def close(self) -> None:
        # The workers and the lane may still read snapshots and write results: stop them before buffers go.
        if self.lane is not None:
            self.lane.close()
        self._stop_workers()
        self._release_copied(block_all=True)
