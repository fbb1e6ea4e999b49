"""Which refresher an optimizer's runtime configuration asks for: native mode's, the executor of one process,
or the distributed one."""

from __future__ import annotations

from asteria.checks import check_arg
from asteria.config import RuntimeConfig
from asteria.distributed.runtime import distributed_refresher
from asteria.distributed.topology import topology
from asteria.pipeline.async_refresh import AsyncRefresher, device_lane_wanted
from asteria.pipeline.factors import FactorSet
from asteria.pipeline.refresh import Refresher, SyncRefresher


def make_refresher(sets: list[FactorSet], config: RuntimeConfig, interval: int, groups: list | None = None,
                   resident: bool = True) -> Refresher:
    """The refresher ``config`` asks for; ``groups`` (the shape group of each set) lets an async run on several
    ranks use the distributed refresher; ``resident`` says whether the preconditioners stay on the parameters'
    device, which the device lane needs."""
    if config.mode == "sync":
        topology(config)  # refuses layouts the distributed runtime cannot run (e.g. deterministic=False)
        return SyncRefresher(sets, config, interval)
    distributed = distributed_refresher(sets, config, interval, groups)
    if distributed is not None:
        return distributed
    check_arg(resident or config.device_refresh is not True, "device_refresh", config.device_refresh,
              f"the device lane installs into preconditioners on the parameters' device, and placement "
              f"{config.memory.placement!r} (or a gpu_budget under 'auto', or an nvme_dir) keeps them elsewhere: "
              "use None or False")
    return AsyncRefresher(sets, config, interval, device_lane=resident and device_lane_wanted(config, sets))
