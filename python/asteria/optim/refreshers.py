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
from asteria.pipeline.streams import check_partition


def make_refresher(sets: list[FactorSet], config: RuntimeConfig, interval: int, groups: list | None = None,
                   resident: bool = True) -> Refresher:
    """The refresher ``config`` asks for; ``groups`` (the shape group of each set) lets an async run on several
    ranks use the distributed refresher; ``resident`` says whether the preconditioners stay on the parameters'
    device, which the device lane needs."""
    if config.mode == "sync":
        topology(config)  # refuses layouts the distributed runtime cannot run (e.g. deterministic=False)
        return SyncRefresher(sets, config, interval)
    lane = topology(config) is None and resident and device_lane_wanted(config, sets)
    on_gpus = all(fset.device.type == "cuda" for fset in sets)
    check_arg(config.device_sms is None or (lane and on_gpus), "device_sms", config.device_sms,
              "partitions a GPU for the device lane, which does not run on one here (it needs one process, the "
              "parameters and preconditioners on a GPU, and device_refresh None or True): leave it None")
    if config.device_sms is not None:
        for device in {fset.device for fset in sets}:
            check_partition(device, config.device_sms)  # before any worker or buffer
    check_arg(config.device_threads == 1 or lane, "device_threads", config.device_threads,
              "sets the device lane's threads, and the lane does not run here (it needs one process, the "
              "preconditioners on the parameters' device, and device_refresh True, or None with a GPU): leave it 1")
    distributed = distributed_refresher(sets, config, interval, groups)
    if distributed is not None:
        return distributed
    check_arg(resident or config.device_refresh is not True, "device_refresh", config.device_refresh,
              f"the device lane installs into preconditioners on the parameters' device, and placement "
              f"{config.memory.placement!r} (or a gpu_budget under 'auto', or an nvme_dir) keeps them elsewhere: "
              "use None or False")
    return AsyncRefresher(sets, config, interval, device_lane=lane)
