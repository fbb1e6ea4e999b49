"""Which refresher an optimizer's runtime configuration asks for: native mode's, the executor of one process,
or the distributed one."""

from __future__ import annotations

from asteria.checks import check_arg
from asteria.config import RuntimeConfig
from asteria.distributed.runtime import distributed_refresher
from asteria.distributed.topology import topology
from asteria.pipeline.async_refresh import AsyncRefresher, device_lane_wanted
from asteria.pipeline.factors import FactorSet
from asteria.pipeline.partition import check_partition
from asteria.pipeline.refresh import Refresher, SyncRefresher


def make_refresher(sets: list[FactorSet], config: RuntimeConfig, interval: int, groups: list | None = None,
                   resident: bool = True) -> Refresher:
    """The refresher ``config`` asks for; ``groups`` (the shape group of each set) lets an async run on several
    ranks use the distributed refresher; ``resident`` says whether the preconditioners stay on the parameters'
    device, which the device lane needs."""
    if config.mode == "sync":
        topology(config)  # refuses layouts the distributed runtime cannot run (e.g. deterministic=False)
        return SyncRefresher(sets, config, interval)
    one_process = topology(config) is None
    check_arg(resident or config.device_refresh is not True or not one_process, "device_refresh",
              config.device_refresh, f"the device lane installs into preconditioners on the parameters' device, and "
              f"placement {config.memory.placement!r} (or a gpu_budget under 'auto', or an nvme_dir) keeps them "
              "elsewhere: use None or False")
    lane = one_process and resident and device_lane_wanted(config, sets)
    check_lane_settings(config, lane, on_gpus=all(fset.device.type == "cuda" for fset in sets))
    if config.device_sms is not None:
        for device in {fset.device for fset in sets}:
            check_partition(device, config.device_sms)  # before any worker or buffer
    distributed = distributed_refresher(sets, config, interval, groups)
    if distributed is not None:
        return distributed
    return AsyncRefresher(sets, config, interval, device_lane=lane)


def check_lane_settings(config: RuntimeConfig, lane: bool, on_gpus: bool) -> None:
    """Refuses ``device_sms`` and ``device_threads`` where they would change nothing: no device lane (several
    processes, the preconditioners off the parameters' device, device_refresh False, or None on the CPU), the
    lane on the CPU (``device_sms``), or the deterministic rule, under which the lane computes only the
    start-up refreshes, inline on the training stream."""
    if not lane:
        why = ("the lane does not run here (it needs one process, the preconditioners on the parameters' device, "
               "and device_refresh True, or None with a GPU)")
    elif config.deterministic:
        why = ("under the deterministic rule the lane computes only the start-up refreshes, inline on the "
               "training stream (deterministic=False gives it the sets the workers cannot finish)")
    else:
        why = ""
    sms_why = why or ("the lane computes on the CPU here" if not on_gpus else "")
    check_arg(config.device_sms is None or not sms_why, "device_sms", config.device_sms,
              f"partitions a GPU for the device lane, and {sms_why}: leave it None")
    check_arg(config.device_threads == 1 or not why, "device_threads", config.device_threads,
              f"sets the device lane's threads, and {why}: leave it 1")
