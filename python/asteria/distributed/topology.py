"""Where the ranks are: the process group, the node boundaries, and which ranks hold identical copies
(replicas) of a parameter.

Node boundaries come from torchrun's ``LOCAL_WORLD_SIZE``, or ``RuntimeConfig.local_world_size``,
which overrides it so that several nodes can be simulated on one machine (4 processes as 2 nodes x 2
ranks). The ranks of the process group fill the nodes in order: group ranks 0..L-1 are node 0, and
so on. A process group smaller than the world (e.g. one pipeline stage's ranks) must run CPU tensors on
Gloo: the optimizer moves its host tensors over it as it is, since a group of its own would need every rank
of the world to create it. Its node size, unless given, is how many of its ranks each host holds
(torchrun numbers ranks host by host, ``LOCAL_WORLD_SIZE`` to a host).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asteria.config import RuntimeConfig


@dataclass(frozen=True)
class Topology:
    """The process group the optimizer runs over, and its node layout.

    Attributes:
        group: the user's process group (``RuntimeConfig.process_group`` or WORLD).
        ranks: global ranks of the group, in group order.
        rank: this process's global rank.
        local_world_size: ranks per node.
        timeout_s: the runtime's timeout, used for every Gloo group created here.
        subgroup: whether the group is smaller than the world (then Gloo for CPU tensors, used as it is).
    """

    group: Any
    ranks: tuple[int, ...]
    rank: int
    local_world_size: int
    timeout_s: float
    subgroup: bool = False

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def group_rank(self) -> int:
        return self.ranks.index(self.rank)

    def node_of(self, rank: int) -> int:
        return self.ranks.index(rank) // self.local_world_size

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    def host_group(self) -> Any:
        """A Gloo group over all the ranks, for host tensors: the user's group itself when it is smaller
        than the world, else a new one over the world with the runtime's timeout (collective: every rank
        of the world calls it, in the same order)."""
        if self.subgroup:
            return self.group
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))


def topology(config: RuntimeConfig) -> Topology | None:
    """The distributed layout the configuration runs under, or ``None`` for a single process (torch.distributed
    not initialized, or a group of one rank). Raises ``ValueError`` for a node size that does not divide the
    group, or ``deterministic=False`` with more than one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        if config.process_group is not None:
            raise ValueError(f"Invalid process_group={config.process_group!r}: torch.distributed is not initialized")
        return None
    group = config.process_group if config.process_group is not None else dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"Invalid process_group={group!r}: rank {dist.get_rank()} is not in it (dist.new_group "
                         "gives that handle to the ranks it leaves out); pass each rank a group it belongs to")
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) == 1:
        return None
    subgroup = len(ranks) != dist.get_world_size()
    if subgroup and not moves_host_tensors(dist.get_backend_config(group)):
        raise ValueError(f"Invalid process_group={group!r}: backend {dist.get_backend_config(group)!r} over ranks "
                         f"{list(ranks)} of a world of {dist.get_world_size()}; a group smaller than the world must "
                         "move host tensors over Gloo, as the optimizer does: dist.new_group("
                         f"{list(ranks)}, backend='gloo') (or 'cpu:gloo,cuda:nccl'), called on every rank as torch "
                         "requires")
    if not config.deterministic:
        raise ValueError(f"Invalid deterministic={config.deterministic!r}: with {len(ranks)} ranks every rank must "
                         "activate the same version at the same step, which only the deterministic schedule "
                         "guarantees; use deterministic=True")
    local = config.local_world_size
    source = "RuntimeConfig.local_world_size"
    if local is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        source = "LOCAL_WORLD_SIZE"
        try:
            local = int(env) if env is not None else dist.get_world_size()
        except ValueError:
            raise ValueError(f"Invalid LOCAL_WORLD_SIZE={env!r}: must be an int >= 1") from None
        if subgroup and local >= 1:
            local = _ranks_per_host(ranks, local)
    if local < 1 or len(ranks) % local != 0:
        raise ValueError(f"Invalid {source}={local!r}: must be >= 1 and divide the process group's "
                         f"{len(ranks)} ranks")
    return Topology(group=group, ranks=ranks, rank=dist.get_rank(), local_world_size=local,
                    timeout_s=float(config.timeout_s), subgroup=subgroup)


def moves_host_tensors(backend: str) -> bool:
    """Whether a process group of ``backend`` (``dist.get_backend_config``: per device type as in
    ``"cpu:gloo,cuda:nccl"``, which is also what a group of an unnamed backend gets; or one name, as
    ``"gloo"``) runs CPU tensors' collectives on Gloo."""
    if ":" not in backend:
        return backend == "gloo"
    return dict(part.split(":", 1) for part in backend.split(",")).get("cpu") == "gloo"


def _ranks_per_host(ranks: tuple[int, ...], host_size: int) -> int:
    """How many of a subgroup's ``ranks`` each host holds, hosts being consecutive blocks of ``host_size``
    global ranks. Raises ``ValueError`` unless every host of the group holds the same number, in group order."""
    hosts = [rank // host_size for rank in ranks]
    counts = {host: hosts.count(host) for host in hosts}
    if len(set(counts.values())) != 1 or hosts != sorted(hosts):
        raise ValueError(f"Invalid process_group: its ranks {list(ranks)} fall on the hosts of LOCAL_WORLD_SIZE="
                         f"{host_size} ranks as {counts} (host: ranks); the optimizer's nodes need the same number "
                         "of its ranks each, in rank order: give RuntimeConfig.local_world_size to declare them")
    return counts[hosts[0]]


def is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "device_mesh")


def replica_ranks(param: torch.Tensor, topo: Topology) -> tuple[int, ...]:
    """Global ranks holding the same values as this rank's copy (or shard) of ``param``: all ranks of the
    group for a plain tensor (DDP: replicated), and for a DTensor the ranks of its mesh that share this
    rank's coordinates on every dimension it is sharded on (FSDP2: this rank alone; HSDP: one rank per
    replica along the replicate dimension)."""
    if not is_dtensor(param):
        return topo.ranks
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"Invalid parameter: rank {topo.rank} is not in its device mesh {mesh}")
    index: list[Any] = []
    for dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            index.append(slice(None))
        elif placement.is_shard():
            index.append(coordinate[dim])
        else:
            raise ValueError(f"Invalid parameter placement {placement!r} on mesh dimension {dim}: Asteria handles "
                             "Shard and Replicate placements")
    ranks = tuple(sorted(int(r) for r in mesh.mesh[tuple(index)].flatten().tolist()))
    outside = [r for r in ranks if r not in topo.ranks]
    if outside:
        raise ValueError(f"Invalid process_group: the parameter's mesh has ranks {outside} outside the optimizer's "
                         f"process group {list(topo.ranks)}")
    return ranks


def same_on_every_rank(topo: Topology, value: Any) -> bool:
    """Whether every rank of ``topo`` passed an equal ``value`` (picklable). Collective over
    ``topo.host_group()``."""
    gathered: list[Any] = [None] * topo.world_size
    dist.all_gather_object(gathered, value, group=topo.host_group())
    return all(other == value for other in gathered)
