"""Distributed Asteria: block ownership, node-shared host stores and the hierarchical exchange over
torch.distributed (DDP, FSDP2, HSDP). See ``docs/architecture.md``, section "Distributed"."""

from __future__ import annotations

from asteria.distributed.ownership import assign_owners_by_set, block_cost
from asteria.distributed.refresher import DistributedRefresher, PeerError
from asteria.distributed.runtime import distributed_refresher, gather_runtime_stats
from asteria.distributed.topology import Topology, topology

__all__ = ["DistributedRefresher", "PeerError", "Topology", "assign_owners_by_set", "block_cost", "topology",
           "distributed_refresher", "gather_runtime_stats"]
