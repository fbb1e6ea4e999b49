"""Replica domains: the ranks that hold identical copies of a set of preconditioner blocks, the owner of
each block among them, the node-shared store each node of the domain keeps, and which of its ranks (the
node leaders) exchange its blocks across nodes.

- DDP (plain tensors): one domain over all ranks; one shared store per node; leaders exchange.
- FSDP2 (sharded DTensors): a domain of one rank per shard; the rank owns its blocks; no exchange.
- HSDP (shard within a node, replicate across nodes): a domain per shard, one rank per node; each
  rank is its node's leader for that domain; the domain's ranks exchange across nodes.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asteria import _core
from asteria.distributed.ownership import assign_owners_by_set
from asteria.distributed.topology import Topology


@dataclass
class Unit:
    """One block of one factor set: what one refresh job computes."""

    set_index: int
    block: int
    key: Hashable      # agreed by every replica: (param group, param index, block offsets, mode)
    n: int
    rows: int          # result rows: n (roots) or n + 2 (eigenbases: basis, estimates, column order)
    kind: str
    set_name: str = ""  # the factor set's name, agreed by every replica: its blocks are due on the same step
    owner: int = -1    # global rank
    index: int = -1    # position in the domain's store

    @property
    def capacity(self) -> int:
        return self.rows * self.n


@dataclass
class Domain:
    """Ranks holding identical copies of ``units`` (see the module docstring)."""

    ranks: tuple[int, ...]
    topo: Topology
    units: list[Unit] = field(default_factory=list)
    store: Any = None            # _core.NodeStore
    by_node: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for rank in self.ranks:
            self.by_node.setdefault(self.topo.node_of(rank), []).append(rank)

    @property
    def nodes(self) -> list[int]:
        return sorted(self.by_node)

    @property
    def local(self) -> list[int]:
        """This node's ranks of the domain."""
        return self.by_node[self.topo.node]

    @property
    def local_index(self) -> int:
        return self.local.index(self.topo.rank)

    @property
    def leaders(self) -> list[int]:
        return [self.by_node[node][0] for node in self.nodes]

    @property
    def is_leader(self) -> bool:
        return self.local[0] == self.topo.rank

    @property
    def exchanges(self) -> bool:
        """Whether this rank exchanges the domain's blocks with other nodes (a leader of a multi-node domain)."""
        return self.is_leader and len(self.by_node) > 1

    @property
    def shared(self) -> bool:
        """Whether this node's store is shared memory (more than one local rank in the domain)."""
        return len(self.local) > 1

    def units_of_node(self, node: int) -> list[Unit]:
        members = set(self.by_node[node])
        return [u for u in self.units if u.owner in members]

    def fingerprint(self) -> int:
        text = repr([(u.key, u.n, u.rows, u.kind, u.set_name) for u in self.units])
        return zlib.crc32(text.encode())


def _check_agreement(domains: list[Domain], whole: Any, topo: Topology) -> None:
    """Every rank of each domain must see the same blocks."""
    mine = [(d.ranks, d.fingerprint(), len(d.units)) for d in domains]
    gathered: list[Any] = [None] * topo.world_size
    dist.all_gather_object(gathered, mine, group=whole)
    seen: dict[tuple[int, ...], tuple[int, int, int]] = {}
    for rank, entries in zip(topo.ranks, gathered):
        for ranks, fingerprint, count in entries:
            if ranks in seen and seen[ranks][0] != fingerprint:
                other = seen[ranks][2]
                raise ValueError(f"Invalid model: ranks {other} and {rank} hold replicas of the same parameters "
                                 f"(ranks {list(ranks)}) but see different preconditioner blocks ({seen[ranks][1]} "
                                 f"and {count} blocks, or other shapes); every replica needs the same parameters and "
                                 "max_preconditioner_dim")
            seen.setdefault(ranks, (fingerprint, count, rank))


def build_domains(units_by_ranks: dict[tuple[int, ...], list[Unit]], topo: Topology) -> tuple[list[Domain], Any]:
    """Creates the domains, assigns owners and creates the stores. Collective over the whole group. Returns
    the domains this rank belongs to and the whole group's Gloo group (``Topology.host_group``), over which
    the node leaders exchange point to point."""
    whole = topo.host_group()
    domains = [Domain(ranks=ranks, topo=topo, units=sorted(units, key=lambda u: u.key))
               for ranks, units in sorted(units_by_ranks.items())]
    for d in domains:
        keys = [u.key for u in d.units]
        if len(set(keys)) != len(keys):
            raise ValueError(f"Invalid parameters: two blocks share the key of {keys}; a parameter appears twice")
        for index, unit in enumerate(d.units):
            unit.index = index
    _check_agreement(domains, whole, topo)
    # Ownership: every rank of a domain owns an equal share of each factor set (see assign_owners_by_set);
    # the whole-world domain first (every rank knows it), then each other domain balanced on top of the
    # world's loads, which all of its members know.
    world_loads: dict[int, int] = {}
    ordered = sorted(domains, key=lambda d: (d.ranks != topo.ranks, d.ranks))
    for d in ordered:
        loads = world_loads if d.ranks == topo.ranks else dict(world_loads)
        by_set: dict[str, list[tuple[Any, int]]] = {}
        for u in d.units:
            by_set.setdefault(u.set_name, []).append((u.key, u.n))
        owners = assign_owners_by_set([by_set[name] for name in sorted(by_set)], d.ranks, loads)
        for unit in d.units:
            unit.owner = owners[unit.key]
    _create_stores(domains, whole, topo)
    return domains, whole


def _run_id(whole: Any, topo: Topology) -> str:
    token = torch.frombuffer(bytearray(os.urandom(8)), dtype=torch.uint8).clone()
    dist.broadcast(token, src=topo.ranks[0], group=whole)
    return bytes(token.tolist()).hex()


def _barrier(whole: Any, topo: Topology) -> None:
    """Every rank of the group waits for all, at most ``timeout_s``: ``monitored_barrier`` (which names the
    ranks that did not come) on a Gloo group; on a group with Gloo for CPU tensors among other backends
    (``"cpu:gloo,cuda:nccl"``, or an unnamed backend), which it refuses, an all-reduce of a CPU tensor."""
    timeout = timedelta(seconds=topo.timeout_s)
    if dist.get_backend(whole) == "gloo":
        dist.monitored_barrier(group=whole, timeout=timeout, wait_all_ranks=True)
    else:
        dist.all_reduce(torch.zeros(1), group=whole, async_op=True).wait(timeout)


def _create_stores(domains: list[Domain], whole: Any, topo: Topology) -> None:
    """Node leaders create a uniquely named segment per shared domain, the other local ranks map it, and
    once every rank has done so (a barrier) every name is unlinked at once: nothing stays in /dev/shm,
    even if a rank crashes later. Any failure on the way unlinks what this rank created."""
    run = _run_id(whole, topo)
    created = []
    try:
        for d in domains:
            capacities = [u.capacity for u in d.units]
            if not d.shared:
                d.store = _core.NodeStore.private_memory(capacities)
            elif d.is_leader:
                tag = f"{zlib.crc32(repr(d.ranks).encode()):08x}"
                d.store = _core.NodeStore.create(f"/asteria-{run}-{tag}-n{topo.node}", len(d.local), capacities)
                created.append(d.store)
        _barrier(whole, topo)
        for d in domains:
            if d.shared and not d.is_leader:
                tag = f"{zlib.crc32(repr(d.ranks).encode()):08x}"
                d.store = _core.NodeStore.open(f"/asteria-{run}-{tag}-n{topo.node}", len(d.local),
                                               [u.capacity for u in d.units])
        _barrier(whole, topo)
        # Every local rank unlinks (the first one wins), so the name is gone once any rank returns.
        for d in domains:
            d.store.unlink()
    finally:
        for store in created:
            store.unlink()
    for d in domains:
        d.store.register_rank(d.local_index, os.getpid())
