"""The distributed refresher: block ownership, node-shared stores and the hierarchical exchange, on the
deterministic activation schedule.

Life of version k of a block (snapshotted at step t, due at step d = t + lag, by default t + f, or t
for the first ``sync_refreshes``):
1. Step t: the block's owner (one rank of its replica domain) snapshots the factors and submits the
   job to its C++ engine; no other rank computes it.
2. Step d: the owner waits (bounded) for its job and publishes the result into its node's store
   (shared memory: one copy per node). A refresh that kept the basis bit for bit (eigenbasis skip) or
   failed publishes only its status.
3. Step d: each node leader of the domain waits for its node's owners, then the leaders exchange the
   node's new versions over a Gloo group (statuses first, then only the data of refreshed blocks) and
   publish what they receive into their node's store.
4. Step d: every rank reads version k of every block from its node's store (waiting, bounded, for the
   version word) and installs it. So every replica activates the same version at the same step.
Before writing a store at step d, a rank waits until every local rank has read everything due by the
previous step its sets were due (the slot written then holds an older version, so the two slots per
block suffice); on a GPU a rank counts a step as read once its copies from the store have completed.

With a staggered schedule (the default in Asteria mode) each step refreshes the factor sets of one phase
of the interval, so the steps above run for those sets' blocks only: every replica has the same sets and
phases (they follow from the shapes and ``stagger_small``, which the ranks compare), so the ranks of a domain
still exchange the same blocks at the same step, and no step carries every set's snapshot, job and install.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from asteria import cpus
from asteria.config import RuntimeConfig
from asteria.distributed import resume
from asteria.distributed.domains import Domain, Unit, build_domains
from asteria.distributed.topology import Topology, replica_ranks
from asteria.pipeline import streams
from asteria.pipeline.factors import FactorSet, RootRequest
from asteria.pipeline.worker_refresh import WorkerRefresher

STATUS_CODES = {"ok": 1, "failed": 2, "skipped": 3}
STATUS_NAMES = {code: name for name, code in STATUS_CODES.items()}
# The engine never raises for failures itself: all ranks count them from the published statuses.
_NO_ENGINE_BOUND = 1 << 30
PUBLISH_THREADS = 4  # at most, for an owner's copy of its results into the node store
# The exchange's point-to-point tag: a user's own transfers on the same group (e.g. a pipeline schedule's
# early receives on a stage's group) keep theirs apart.
EXCHANGE_TAG = 0x4153


class PeerError(RuntimeError):
    """Another rank died, stalled or failed, so this rank cannot continue; the message says which and where."""


class DistributedRefresher(WorkerRefresher):
    """Refreshes each block on its owner's C++ workers and shares the result with every replica."""

    STATE_KEYS = ("distributed", "scheduled", "consecutive_failures")

    def __init__(self, sets: list[FactorSet], config: RuntimeConfig, interval: int, groups: list[Any],
                 topo: Topology) -> None:
        super().__init__(sets, config, interval)
        if len(groups) != len(sets):
            raise ValueError(f"Invalid groups: {len(groups)} for {len(sets)} factor sets")
        self.topo = topo
        # ---- units and their domains
        self.units: list[list[Unit]] = []
        by_ranks: dict[tuple[int, ...], list[Unit]] = {}
        ranks_of: dict[int, tuple[int, ...]] = {}
        modes: dict[int, int] = {}
        for set_index, (fset, group) in enumerate(zip(sets, groups)):
            mode = modes.get(id(group), 0)
            modes[id(group)] = mode + 1
            units = []
            for b, (block, param) in enumerate(zip(group.blocks, group.params)):
                if id(param) not in ranks_of:
                    ranks_of[id(param)] = replica_ranks(param, topo)
                rows = fset.dim + 2 if fset.kind == "eigenbasis" else fset.dim
                key = (group.group_index, block.param_index, tuple(s.start for s in block.region), mode)
                unit = Unit(set_index, b, key, fset.dim, rows, fset.kind, fset.name)
                by_ranks.setdefault(ranks_of[id(param)], []).append(unit)
                units.append(unit)
            self.units.append(units)
        self.domains, self.whole = build_domains(by_ranks, topo)
        self.domain_of: dict[int, Domain] = {}
        for d in self.domains:
            for u in d.units:
                self.domain_of[id(u)] = d
        self.node_units = {id(d): {node: d.units_of_node(node) for node in d.nodes} for d in self.domains}
        self.views = {id(d): torch.from_numpy(d.store.data()) for d in self.domains}
        # On a GPU the stores are page-locked, so that installs are DMA copies straight from them.
        self._registrations: dict[int, streams.HostRegistration] = {}
        cuda = [fset.device for fset in sets if fset.device.type == "cuda"]
        if cuda:
            for d in self.domains:
                registration = streams.HostRegistration.register(
                    self.views[id(d)], f"the node store of rank {topo.rank} (domain {d.ranks})", cuda[0])
                if registration is not None:
                    self._registrations[id(d)] = registration
        # ---- the engine, for the blocks this rank owns
        self._start_workers(deterministic=True, max_consecutive_failures=_NO_ENGINE_BOUND)
        # The owner's copies into the store run on a few threads of this rank's share of the CPUs (the
        # training thread waits for them; the workers run at a lower priority).
        share = len(cpus.allowed_cpus()) // cpus.local_layout()[1]  # the host's ranks (not the group's per node)
        self._copy_threads = max(1, min(PUBLISH_THREADS, share))
        self.owned: list[list[int]] = []             # per set: owned block indices
        self.owned_index: list[torch.Tensor] = []    # the same on the set's device
        self.snapshots: list[torch.Tensor | None] = []
        self.results: list[torch.Tensor | None] = []
        self.ids: list[list[int]] = []
        self.engine_unit: dict[int, Unit] = {}
        for fset, units in zip(sets, self.units):
            owned = [u.block for u in units if u.owner == topo.rank]
            self.owned.append(owned)
            self.owned_index.append(torch.tensor(owned, dtype=torch.long, device=fset.device))
            if not owned:
                self.snapshots.append(None)
                self.results.append(None)
                self.ids.append([])
                continue
            pin = fset.device.type == "cuda"
            n, rows = fset.dim, units[0].rows
            snaps = torch.empty((self.depth, len(owned), n, n), dtype=torch.float32, pin_memory=pin, device="cpu")
            results = torch.empty((self.depth, len(owned), rows, n), dtype=torch.float32, pin_memory=pin, device="cpu")
            ids = [self.engine.add_block(snaps[:, j], results[:, j], kind=fset.kind, first_basis=fset.first_basis)
                   for j in range(len(owned))]
            for block_id, b in zip(ids, owned):
                self.engine_unit[block_id] = units[b]
            self.snapshots.append(snaps)
            self.results.append(results)
            self.ids.append(ids)
        self._consecutive = [np.zeros(s.batch, dtype=np.int64) for s in sets]
        self._errors: dict[tuple[int, int], str] = {}
        self._triangles: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Versions snapshotted but not yet due: (version, activation step, {set index: request}).
        self._scheduled: list[tuple[int, int, dict[int, RootRequest]]] = []
        self._previous_due = [0] * len(sets)  # per set: the last step a version of it was due (0: none yet)
        # Due steps whose installs may still be copying from the stores: (their copies' events, step).
        self._reading: list[tuple[list[torch.cuda.Event], int]] = []
        self._counts = {"bytes_inter_node_sent": 0, "bytes_inter_node_received": 0, "bytes_intra_node_shared": 0,
                        "bytes_to_host": 0, "bytes_to_device": 0, "exchanges_skipped": 0, "exchanges": 0,
                        "blocks_published": 0, "store_waits": 0, "failures_seen": 0}
        self._exchange_seconds = 0.0
        self._store_wait_seconds = 0.0
        self._histogram = [0] * (config.staleness + 2)
        self._max_staleness = 0
        self._closed = False

    # ---- schedule ----------------------------------------------------------------------------
    def refresh(self, step: int, items: list[tuple[int, int, RootRequest]]) -> None:
        # The sets refreshed at one step share their version number (the schedule's phases: see
        # RefreshSchedule), so one entry covers them.
        versions = {version for _, version, _ in items}
        if len(versions) != 1:
            raise RuntimeError(f"the sets refreshed at one step must share their version; got versions "
                               f"{sorted(versions)} at step {step}")
        version = versions.pop()
        requests = {index: request for index, _, request in sorted(items, key=lambda item: item[0])}
        due = self.rule.activation_step(step, version)
        self._scheduled.append((version, due, requests))
        for index, request in requests.items():
            fset = self.sets[index]
            self._newest_versions[index] = version
            if not self.owned[index]:
                continue
            snaps = self.snapshots[index]
            self.stager.stage(index, self.ids[index], version, due, request.for_blocks(self.owned[index]),
                              snaps[version % self.depth],
                              lambda fset=fset, index=index: fset.factors.index_select(0, self.owned_index[index]))
            self._counts["bytes_to_host"] += snaps[0].numel() * 4
        self.stager.submit_ready(step)

    def poll(self, step: int) -> None:
        if self.stager.pending:
            self.stager.submit_ready(step)
        if self._reading:
            self._finish_reads(upto=0)

    def activate(self, step: int) -> None:
        self.stager.submit_ready(step)
        due = []
        while self._scheduled and self._scheduled[0][1] <= step:
            due.append(self._scheduled.pop(0))
        if due:
            changes = self._activate_engine([version for version, _, _ in due], step)
            for version, _, requests in due:
                self._complete(version, sorted(requests), changes, step)
        self._record_staleness()

    # ---- one due version -----------------------------------------------------------------------
    def _activate_engine(self, versions: list[int], step: int) -> list[tuple[int, int]]:
        """This rank's jobs due by ``step`` (waited for): ``(engine block id, version)`` of each change."""
        if not any(self.ids):
            return []
        try:
            return self.engine.activate(step, self.config.timeout_s)
        except TimeoutError as error:
            raise TimeoutError(f"rank {self.topo.rank}: the refresh of version {max(versions)} on this rank's workers "
                               f"did not finish by step {step}: {error}") from error

    def _complete(self, version: int, sets: list[int], changes: list[tuple[int, int]], step: int) -> None:
        """Publishes, exchanges, reads and installs ``version`` of the blocks of ``sets``.

        A block's store slot written now holds a version older than the one in use, last read at or before
        the previous step ``sets`` were due: once every local rank has read everything due by then, nobody
        reads that slot any more (its copies to a GPU included: a rank counts a step as read when they
        have completed)."""
        previous = max(self._previous_due[index] for index in sets)
        self._finish_reads(upto=previous)
        for d in self.domains:
            if d.shared:
                self._guard(lambda d=d: d.store.wait_done(previous, self.config.timeout_s),
                            f"waiting at step {step} for the local ranks to read the versions of step {previous}")
        self._publish_owned(version, sets, changes)
        chosen = set(sets)
        for d in self.domains:
            if d.exchanges:
                self._exchange(d, version, chosen, step)
        readings = {id(d): self._read(d, version, chosen, step) for d in self.domains}
        self._reading.append((self._install(version, readings, step), step))
        for index in sets:
            self._previous_due[index] = step
        self._finish_reads(upto=0)

    def _finish_reads(self, upto: int) -> None:
        """Marks as read, in order, the due steps whose copies from the stores have completed; those up to
        step ``upto`` are waited for."""
        while self._reading:
            events, step = self._reading[0]
            if not all(streams.done(event) for event in events):
                if step > upto:
                    return
                for event in events:
                    streams.wait(event)
            self._reading.pop(0)
            for d in self.domains:
                if d.shared:
                    d.store.mark_done(d.local_index, step)

    def _publish_owned(self, version: int, sets: list[int], changes: list[tuple[int, int]]) -> None:
        ok = {block_id for block_id, v in changes if v == version}
        released = set()
        for index in sets:
            ids = self.ids[index]
            released.update(ids)
            for j, block_id in enumerate(ids):
                unit = self.engine_unit[block_id]
                d = self.domain_of[id(unit)]
                if block_id in ok:
                    result = self.results[index][version % self.depth, j]
                    status = self._write_result(d, unit, result)
                else:
                    self._errors[(unit.set_index, unit.block)] = self.engine.status(block_id)["last_error"]
                    status = "failed"
                d.store.publish(unit.index, version, status)
                self._counts["blocks_published"] += 1
        for block_id, v in changes:
            if block_id in released:
                self.engine.release(block_id, v)

    def _write_result(self, d: Domain, unit: Unit, result: torch.Tensor) -> str:
        """Copies an owned block's result into the store; an eigenbasis kept bit for bit is only flagged."""
        view = self.views[id(d)]
        _, _, good = d.store.published(unit.index)
        n = unit.n
        if unit.kind == "eigenbasis" and good >= 0:
            order = result[n + 1]
            if torch.equal(order, torch.arange(n, dtype=order.dtype, device=order.device)):
                offset = d.store.offset(unit.index, good)
                if torch.equal(view[offset:offset + n * n].view(n, n), result[:n]):
                    self._counts["exchanges_skipped"] += 1
                    return "skipped"
        d.store.write(unit.index, d.store.write_slot(unit.index), result.reshape(-1), self._copy_threads)
        if d.shared:
            self._counts["bytes_intra_node_shared"] += unit.capacity * 4
        return "ok"

    def _payload_size(self, unit: Unit) -> int:
        """Floats a refreshed block sends between nodes: an inverse root's upper triangle (the C++ root
        is exactly symmetric, so the mirror rebuilds it bit for bit), or a basis and its column order."""
        n = unit.n
        return n * (n + 1) // 2 if unit.kind == "root" else n * n + n

    def _triangle(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n not in self._triangles:
            self._triangles[n] = tuple(torch.triu_indices(n, n))
        return self._triangles[n]

    def _pack(self, unit: Unit, view: torch.Tensor, base: int) -> torch.Tensor:
        n = unit.n
        if unit.kind == "root":
            rows, cols = self._triangle(n)
            return view[base:base + n * n].view(n, n)[rows, cols]
        return torch.cat([view[base:base + n * n], view[base + (n + 1) * n:base + (n + 2) * n]])

    def _unpack(self, unit: Unit, payload: torch.Tensor, view: torch.Tensor, base: int) -> None:
        n = unit.n
        if unit.kind == "root":
            rows, cols = self._triangle(n)
            matrix = view[base:base + n * n].view(n, n)
            matrix[rows, cols] = payload
            matrix[cols, rows] = payload
            return
        view[base:base + n * n].copy_(payload[:n * n])
        view[base + (n + 1) * n:base + (n + 2) * n].copy_(payload[n * n:])

    def _exchange(self, d: Domain, version: int, sets: set[int], step: int) -> None:
        """Node leaders of ``d`` send their node's new versions of ``version`` of ``sets``' blocks to each other."""
        started = time.perf_counter()
        view = self.views[id(d)]
        peers = len(d.nodes) - 1
        try:
            for node in d.nodes:
                units = [u for u in self.node_units[id(d)][node] if u.set_index in sets]
                if not units:
                    continue
                leader = d.by_node[node][0]
                statuses = torch.zeros(len(units), dtype=torch.int8, device="cpu")
                if node == self.topo.node:
                    seen = self._wait(d, units, version, step)
                    statuses = torch.tensor([STATUS_CODES[s] for _, s, _ in seen], dtype=torch.int8, device="cpu")
                self._from_leader(statuses, leader, d.leaders)
                refreshed = [u for u, code in zip(units, statuses.tolist()) if code == STATUS_CODES["ok"]]
                size = sum(self._payload_size(u) for u in refreshed)
                if node == self.topo.node:
                    self._counts["bytes_inter_node_sent"] += (statuses.numel() + size * 4) * peers
                else:
                    self._counts["bytes_inter_node_received"] += statuses.numel() + size * 4
                self._counts["exchanges"] += 1
                if size == 0:
                    if node != self.topo.node:
                        for u, code in zip(units, statuses.tolist()):
                            d.store.publish(u.index, version, STATUS_NAMES[code])
                    continue
                if node == self.topo.node:
                    parts = []
                    for u in refreshed:
                        _, _, good = d.store.published(u.index)
                        base = d.store.offset(u.index, good)
                        parts.append(self._pack(u, view, base))
                    payload = torch.cat(parts)
                    self._from_leader(payload, leader, d.leaders)
                    continue
                payload = torch.empty(size, dtype=torch.float32, device="cpu")
                self._from_leader(payload, leader, d.leaders)
                at = 0
                for u, code in zip(units, statuses.tolist()):
                    if code == STATUS_CODES["ok"]:
                        base = d.store.offset(u.index, d.store.write_slot(u.index))
                        count = self._payload_size(u)
                        self._unpack(u, payload[at:at + count], view, base)
                        at += count
                        if d.shared:
                            self._counts["bytes_intra_node_shared"] += u.capacity * 4
                    d.store.publish(u.index, version, STATUS_NAMES[code])
        except (RuntimeError, dist.DistBackendError) as error:
            if isinstance(error, (TimeoutError, PeerError)):
                raise
            raise PeerError(f"rank {self.topo.rank}: the inter-node exchange of version {version} at step {step} "
                            f"with the node leaders {d.leaders} failed (a rank died, stalled or failed): "
                            f"{error}") from error
        self._exchange_seconds += time.perf_counter() - started

    def _from_leader(self, tensor: torch.Tensor, leader: int, leaders: list[int]) -> None:
        """``leader`` sends ``tensor`` to the other ``leaders``, which receive it into theirs: point to point over
        the whole group, so that no group of the leaders need be created (which every rank of the world
        would have to take part in). Each transfer waits at most ``timeout_s`` (over a subgroup too, whose own
        timeout may be longer)."""
        timeout = timedelta(seconds=self.config.timeout_s)
        if self.topo.rank != leader:
            dist.irecv(tensor, src=leader, group=self.whole, tag=EXCHANGE_TAG).wait(timeout)
            return
        sends = [dist.isend(tensor, dst=peer, group=self.whole, tag=EXCHANGE_TAG) for peer in leaders if peer != leader]
        for request in sends:
            request.wait(timeout)

    def _wait(self, d: Domain, units: list[Unit], version: int, step: int) -> list[tuple[int, str, int]]:
        started = time.perf_counter()
        before = d.store.stats()["waits"]
        owners = sorted({u.owner for u in units})
        seen = self._guard(lambda: d.store.wait([u.index for u in units], [version] * len(units),
                                                self.config.timeout_s),
                           f"waiting at step {step} for version {version} of blocks owned by ranks {owners}")
        if d.store.stats()["waits"] > before:
            self._counts["store_waits"] += 1
            self._store_wait_seconds += time.perf_counter() - started
        return seen

    def _guard(self, call: Any, what: str) -> Any:
        try:
            return call()
        except TimeoutError as error:
            raise TimeoutError(f"rank {self.topo.rank} (node {self.topo.node}): timed out {what} "
                               f"(RuntimeConfig.timeout_s={self.config.timeout_s}): {error}") from error
        except RuntimeError as error:
            raise PeerError(f"rank {self.topo.rank} (node {self.topo.node}): {what}: {error}") from error

    def _read(self, d: Domain, version: int, sets: set[int], step: int) -> list[tuple[Unit, tuple[int, str, int]]]:
        units = [u for u in d.units if u.set_index in sets]
        if not units:
            return []
        return list(zip(units, self._wait(d, units, version, step)))

    # ---- installing ------------------------------------------------------------------------------
    def _install(self, version: int, readings: dict[int, list[tuple[int, str, int]]],
                 step: int) -> list[torch.cuda.Event]:
        """Installs the refreshed blocks of ``version``; returns the events of copies still reading the stores."""
        events = []
        per_set: list[list[tuple[Unit, str, int, Domain]]] = [[] for _ in self.sets]
        for d in self.domains:
            for unit, (seen_version, status, good) in readings[id(d)]:
                if seen_version != version:
                    raise PeerError(f"rank {self.topo.rank}: block {unit.key} holds version {seen_version} at step "
                                    f"{step}, expected {version}: the ranks are out of step")
                per_set[unit.set_index].append((unit, status, good, d))
        # Check every failure bound first, so that a raise changes nothing.
        bound = self.config.max_consecutive_failures
        for index, items in enumerate(per_set):
            for unit, status, _, _ in items:
                if status == "failed" and self._consecutive[index][unit.block] + 1 >= bound:
                    fset = self.sets[index]
                    cause = self._errors.get((index, unit.block), _failed_on_owner(unit))
                    self._raise_failure(fset, unit.block, version,
                                        f"{cause} ({self._consecutive[index][unit.block] + 1} failures in a row; "
                                        f"max_consecutive_failures={bound})")
        for index, items in enumerate(per_set):
            fset = self.sets[index]
            consecutive = self._consecutive[index]
            refreshed = [(u, good, d) for u, status, good, d in items if status == "ok"]
            for unit, status, _, _ in items:
                if status == "failed":
                    self._errors.setdefault((index, unit.block), _failed_on_owner(unit))
                    consecutive[unit.block] += 1
                    self._counts["failures_seen"] += 1
                else:
                    consecutive[unit.block] = 0
                    self._set_version(index, unit.block, version)
            if not refreshed:
                continue
            n = fset.dim
            ids = [u.block for u, _, _ in refreshed]
            if self.tier is not None:
                self.tier.before_install(fset)
            target = fset.preconditioners  # on fset's device, or in host memory (host placements)
            bases = [self.views[id(d)][d.store.offset(u.index, good):][:n * n].view(n, n) for u, good, d in refreshed]
            orders = None if fset.permute is None else [
                self.views[id(d)][d.store.offset(u.index, good) + (n + 1) * n:][:n] for u, good, d in refreshed]
            if target.is_cuda and all(id(d) in self._registrations for _, _, d in refreshed):
                events.append(self._install_direct(fset, ids, bases, orders))
            else:
                # Pageable memory: the copies to the GPU go through pinned memory, so that the host does not
                # wait (the stream orders them before the math that reads them).
                on_device = streams.indices_to_device(ids, fset.device)
                index = on_device if target.device == fset.device else streams.indices_to_device(ids, target.device)
                target.index_copy_(0, index, streams.to_device(bases, target.device))
                fset.installed.index_fill_(0, on_device, True)
                if orders is not None:
                    fset.permute(on_device, streams.to_device(orders, fset.device).long())
            self._counts["bytes_to_device"] += len(refreshed) * n * n * 4
        return events

    def _install_direct(self, fset: FactorSet, ids: list[int], bases: list[torch.Tensor],
                        orders: list[torch.Tensor] | None) -> torch.cuda.Event:
        """Copies the blocks ``ids`` of ``fset`` from page-locked store slots on the side stream (DMA, no
        host gather); the current stream waits for them in ``ready()``. Returns the copies' event."""
        side = self.stager.side[fset.device]
        target = fset.preconditioners
        with side.staging():
            blocks = streams.indices_to_device(ids, fset.device)
            for block, basis in zip(ids, bases):
                target[block].copy_(basis, non_blocking=True)
            fset.installed.index_fill_(0, blocks, True)
            if orders is not None:
                picked = torch.empty((len(ids), fset.dim), dtype=torch.float32, device=fset.device)
                for row, order in zip(picked, orders):
                    row.copy_(order, non_blocking=True)
                fset.permute(blocks, picked.long())
        event = side.record()
        self._install_events.append((side, event))
        return event

    def _record_staleness(self) -> None:
        top = self.config.staleness + 1
        for fset, newest in zip(self.sets, self._newest_versions):
            if newest == 0:
                continue
            for used in fset.versions:
                lag = newest - used
                self._histogram[min(lag, top)] += 1
                self._max_staleness = max(self._max_staleness, lag)

    # ---- checkpoints ------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        return {"rank": self.topo.rank, "world_size": self.topo.world_size,
                "local_world_size": self.topo.local_world_size,
                "owners": [[u.owner for u in units] for units in self.units]}

    def state(self, step: int) -> dict[str, Any]:
        """This rank's part: the versions scheduled but not yet in use travel as the snapshots of the blocks
        it owns (recomputed on load), with the rank and world size they belong to."""
        self.stager.wait_all()
        self._finish_reads(upto=step)
        scheduled = []
        for version, due, requests in self._scheduled:
            snapshots = {index: None if self.snapshots[index] is None else
                         self.snapshots[index][version % self.depth].clone() for index in requests}
            scheduled.append({"version": version, "due": due, "snapshots": snapshots,
                              "requests": {index: r.saved() for index, r in requests.items()}})
        return {"distributed": self.identity(), "newest_versions": list(self._newest_versions),
                "scheduled": tuple(scheduled),  # stored whole by torch.distributed.checkpoint (see AsyncRefresher)
                "consecutive_failures": [c.tolist() for c in self._consecutive]}  # ints: weights_only loads

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        resume.check_layout(self, state)
        resume.check_scheduled(self, state, self._scheduled_entries(state, ("version", "due", "requests",
                                                                                  "snapshots")))

    def load_state(self, state: dict[str, Any]) -> None:
        resume.restore(self, state)

    # ---- reporting and life cycle --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        engine = self.engine.stats()
        registry, pool = engine["registry"], engine["pool"]
        blocks = sum(len(u) for u in self.units)
        owned = sum(len(o) for o in self.owned)
        out = {
            "store_page_locked": bool(self._registrations) and len(self._registrations) == len(self.domains),
            "rank": self.topo.rank, "world_size": self.topo.world_size, "node": self.topo.node,
            "local_world_size": self.topo.local_world_size, "blocks": blocks, "owned_blocks": owned,
            "refreshes": engine["refreshes_ok"], "refresh_failures": engine["refreshes_failed"],
            "refresh_errors": {self.sets[i].describe(b): error for (i, b), error in self._errors.items()},
            "refreshes_skipped": engine["refreshes_skipped"], "float64_retries": engine["float64_retries"],
            "refresh_seconds_on_workers": engine["refresh_seconds"],
            "staleness_histogram": list(self._histogram), "max_staleness_seen": self._max_staleness,
            # Waits for this rank's own jobs (activation barrier, snapshot buffers) and for other ranks'
            # versions in the node store.
            "waits": registry["waits"] + engine["snapshot_waits"] + self._counts["store_waits"],
            "wait_seconds": registry["wait_seconds"] + engine["snapshot_wait_seconds"] + self._store_wait_seconds,
            "activation_waits": registry["waits"], "snapshot_waits": engine["snapshot_waits"],
            "store_wait_seconds": self._store_wait_seconds, "exchange_seconds": self._exchange_seconds,
            **self._worker_stats(pool),
            "shared_store_bytes": sum(d.store.bytes for d in self.domains if d.shared),
        }
        out.update(self._counts)
        return out

    def host_bytes(self) -> int:
        own = sum(t.numel() * t.element_size() for t in self.snapshots + self.results if t is not None)
        # A node's shared store is one copy for its local ranks: each counts its share.
        stores = sum(d.store.bytes // len(d.local) for d in self.domains)
        return own + stores

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_workers()
        if self._registrations:
            self._finish_reads(upto=1 << 62)
            for registration in self._registrations.values():
                registration.close()
            self._registrations.clear()


def _failed_on_owner(unit: Unit) -> str:
    """Why a block another rank refreshes failed, as this rank can tell."""
    return f"the refresh failed on its owner, rank {unit.owner} (its refresh_errors say why)"
