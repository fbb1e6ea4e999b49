"""What the optimizers and the training loop use of the distributed runtime: the refresher for a run on
several ranks, and every rank's statistics."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from asteria.config import RuntimeConfig
from asteria.distributed.refresher import DistributedRefresher
from asteria.distributed.topology import topology
from asteria.pipeline.factors import FactorSet


def distributed_refresher(sets: list[FactorSet], config: RuntimeConfig, interval: int,
                          groups: list | None) -> DistributedRefresher | None:
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
    refresher = getattr(optimizer, "_refresher", None)
    mine = optimizer.runtime_stats()
    if not isinstance(refresher, DistributedRefresher):
        return [mine]
    gathered: list[Any] = [None] * refresher.topo.world_size
    dist.all_gather_object(gathered, mine, group=refresher.whole)
    return gathered
