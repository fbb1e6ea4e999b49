"""Distributed Asteria: block ownership, node-shared host stores and the hierarchical exchange over
torch.distributed (DDP, FSDP2, HSDP). See ``docs/architecture.md``, section "Distributed"."""

from __future__ import annotations

from typing import Any

from asteria.config import RuntimeConfig
from asteria.distributed.ownership import assign_owners_by_set, block_cost
from asteria.distributed.refresher import DistributedRefresher, PeerError
from asteria.distributed.topology import Topology, topology

__all__ = ["DistributedRefresher", "PeerError", "Topology", "assign_owners_by_set", "block_cost", "topology",
           "distributed_refresher", "gather_runtime_stats"]


def distributed_refresher(sets: list, config: RuntimeConfig, interval: int, groups: list | None):
    """The distributed refresher when the configuration runs on more than one rank, else ``None``."""
    topo = topology(config)
    if topo is None:
        return None
    if groups is None:
        raise ValueError("Invalid groups=None: the distributed refresher needs the shape group of each factor set")
    return DistributedRefresher(sets, config, interval, groups, topo)


def gather_runtime_stats(optimizer: Any) -> list[dict[str, Any]]:
    """Every rank's ``runtime_stats()``, in rank order, on every rank (collective over the optimizer's
    whole group)."""
    import torch.distributed as dist

    refresher = getattr(optimizer, "_refresher", None)
    mine = optimizer.runtime_stats()
    if not isinstance(refresher, DistributedRefresher):
        return [mine]
    gathered: list[Any] = [None] * refresher.topo.world_size
    dist.all_gather_object(gathered, mine, group=refresher.whole)
    return gathered
