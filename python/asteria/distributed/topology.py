"""Where the ranks are: the process group, the node boundaries, and which ranks hold identical copies
(replicas) of a parameter.

Node boundaries come from torchrun's ``LOCAL_WORLD_SIZE``, or ``RuntimeConfig.local_world_size``,
which overrides it so that several nodes can be simulated on one machine (4 processes as 2 nodes x 2
ranks). The ranks of the process group fill the nodes in order: group ranks 0..L-1 are node 0, and
so on.
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
    """

    group: Any
    ranks: tuple[int, ...]
    rank: int
    local_world_size: int
    timeout_s: float

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

    def gloo_group(self, ranks: list[int] | tuple[int, ...] | None = None) -> Any:
        """A new Gloo group over ``ranks`` (global; None: all), with the runtime's timeout. Collective: every
        rank calls it for every group, in the same order (non-members get a non-member handle)."""
        return dist.new_group(ranks=sorted(ranks) if ranks is not None else None, backend="gloo",
                              timeout=timedelta(seconds=self.timeout_s))


def topology(config: RuntimeConfig) -> Topology | None:
    """The distributed layout the configuration runs under, or ``None`` for a single process (torch.distributed
    not initialized, or a group of one rank). Raises ``ValueError`` for a node size that does not divide the
    group, or ``deterministic=False`` with more than one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        if config.process_group is not None:
            raise ValueError(f"Invalid process_group={config.process_group!r}: torch.distributed is not initialized")
        return None
    group = config.process_group if config.process_group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) == 1:
        return None
    if len(ranks) != dist.get_world_size():
        raise ValueError(f"Invalid process_group={group!r}: it holds ranks {list(ranks)} of a world of "
                         f"{dist.get_world_size()}; Asteria's distributed runtime spans the whole world (every rank "
                         "constructs the optimizer)")
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
            local = int(env) if env is not None else len(ranks)
        except ValueError:
            raise ValueError(f"Invalid LOCAL_WORLD_SIZE={env!r}: must be an int >= 1") from None
    if local < 1 or len(ranks) % local != 0:
        raise ValueError(f"Invalid {source}={local!r}: must be >= 1 and divide the process group's "
                         f"{len(ranks)} ranks")
    return Topology(group=group, ranks=ranks, rank=dist.get_rank(), local_world_size=local,
                    timeout_s=float(config.timeout_s))


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
    """Whether every rank of ``topo`` passed an equal ``value`` (picklable). Collective over a Gloo group
    of all its ranks."""
    gathered: list[Any] = [None] * topo.world_size
    dist.all_gather_object(gathered, value, group=topo.gloo_group(topo.ranks))
    return all(other == value for other in gathered)
