"""Checkpoints of the distributed refresher: each rank saves its own part (the versions scheduled but not yet
in use travel as the snapshots of the blocks it owns, recomputed on load) and resumes only on the same layout
of ranks and block owners."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asteria.checks import check_arg, check_saved_request, check_saved_snapshot
from asteria.config import is_int
from asteria.pipeline.factors import RootRequest
from asteria.pipeline.refresh import SAVED
from asteria.pipeline.worker_refresh import claimed

if TYPE_CHECKING:
    from asteria.distributed.refresher import DistributedRefresher


def check_scheduled(refresher: DistributedRefresher, state: dict[str, Any],
                    entries: Iterable[tuple[str, dict[str, Any]]]) -> None:
    """Refuses, by name, a saved rank state whose scheduled versions do not fit ``refresher``'s sets and
    blocks (``entries``: the named scheduled entries, their keys checked)."""
    if "newest_versions" not in state:  # written before staggered multi-rank schedules
        check_arg(is_int(state.get("newest_version")) and state["newest_version"] >= 0,
                  f"{SAVED}['newest_version']", state.get("newest_version"),
                  "must be an int >= 0 (or newest_versions, one per factor set)")
    newest = state["newest_versions"] if "newest_versions" in state else [state["newest_version"]] * len(refresher.sets)
    seen: set[int] = set()
    for name, entry in entries:
        check_arg(entry["version"] not in seen, f"{name}['version']", entry["version"],
                  "must differ from the other scheduled versions (listed twice)")
        seen.add(entry["version"])
        entry = _with_set_indices(entry, len(refresher.sets), name)
        requests, snapshots = entry["requests"], entry["snapshots"]
        check_arg(isinstance(snapshots, dict) and snapshots.keys() == requests.keys(), f"{name}['snapshots']",
                  type(snapshots).__name__,
                  f"must hold one entry per factor set requested ({sorted(requests, key=str)})")
        check_arg(all(is_int(index) and 0 <= index < len(refresher.sets) for index in requests), f"{name}['requests']",
                  sorted(requests, key=str), f"must be keyed by factor set indices in [0, {len(refresher.sets)})")
        for index, request in requests.items():
            check_arg(entry["version"] <= newest[index], f"{name}['version']", entry["version"],
                      f"must be at most {newest[index]}, the newest version of {refresher.sets[index].name} "
                      "snapshotted")
            check_saved_request(request, refresher.sets[index].batch, f"{name}['requests'][{index}]")
            mine = refresher.snapshots[index]
            if mine is None:  # this rank owns no block of the set
                check_arg(snapshots[index] is None, f"{name}['snapshots'][{index}]",
                          type(snapshots[index]).__name__, "must be None: this rank owns no block of the set")
            else:
                check_saved_snapshot(snapshots[index], tuple(mine.shape[1:]), f"{name}['snapshots'][{index}]")


def check_layout(refresher: DistributedRefresher, state: dict[str, Any]) -> None:
    """Refuses, by name, a saved rank state from another layout of ranks and block owners (before anything is
    loaded)."""
    saved = state.get("distributed")
    mine = refresher.identity()
    if saved is None:
        raise ValueError(f"Invalid state_dict: saved by a single-process run; this optimizer runs on rank "
                         f"{mine['rank']} of {mine['world_size']} (load each rank's own state_dict)")
    keys = ("world_size", "local_world_size", "rank", "owners")
    check_arg(isinstance(saved, dict) and all(key in saved for key in keys), f"{SAVED}['distributed']", saved,
              f"must be a dict with the saving rank's {', '.join(keys)}")
    for key in keys:
        if saved[key] != mine[key]:
            shown = ("block owners differ (another layout, or an Asteria version before each rank owned an "
                     "equal share of every factor set)") if key == "owners" else f"{saved[key]} != {mine[key]}"
            raise ValueError(f"Invalid state_dict: saved by rank {saved['rank']} of world size "
                             f"{saved['world_size']} (local world size {saved['local_world_size']}), loaded on "
                             f"rank {mine['rank']} of {mine['world_size']} (local world size "
                             f"{mine['local_world_size']}): {key} {shown}; resume with the same layout and load "
                             "each rank's own state_dict")


def restore(refresher: DistributedRefresher, state: dict[str, Any]) -> None:
    """Loads this rank's saved part (checked by ``check_layout`` and ``check_scheduled``) into ``refresher``;
    the scheduled versions are resubmitted from their snapshots."""
    scheduled = [_with_set_indices(entry, len(refresher.sets)) for entry in state["scheduled"]]
    refresher._newest_versions = list(state["newest_versions"]) if "newest_versions" in state else (
        [state["newest_version"]] * len(refresher.sets))  # written before staggered multi-rank schedules
    refresher._consecutive = [np.array(c, dtype=np.int64) for c in state["consecutive_failures"]]
    for index, ids in enumerate(refresher.ids):
        pending = [entry["version"] for entry in scheduled if index in entry["requests"]]
        if ids:
            refresher.engine.resume_at(ids, [refresher.sets[index].versions[b] for b in refresher.owned[index]])
            refresher.engine.start_at(ids, min(pending) if pending else refresher._newest_versions[index] + 1)
    for index, (fset, ids) in enumerate(zip(refresher.sets, refresher.ids)):
        if fset.kind != "eigenbasis":
            continue
        for block_id, b in zip(ids, refresher.owned[index]):
            if fset.versions[b] > 0:
                basis = fset.preconditioners[b].detach().to("cpu", torch.float32).contiguous()
                refresher.engine.set_basis(block_id, fset.versions[b], basis)
    refresher._scheduled = []
    for entry in scheduled:
        version, due = entry["version"], entry["due"]
        requests = {index: RootRequest.load(r) for index, r in entry["requests"].items()}
        for index, request in requests.items():
            snapshot = entry["snapshots"][index]
            if not refresher.ids[index]:
                continue
            with claimed(refresher.engine, refresher.ids[index], version, refresher.config.timeout_s):
                refresher.snapshots[index][version % refresher.depth].copy_(snapshot)
                request.for_blocks(refresher.owned[index]).submit(refresher.engine, refresher.ids[index], version,
                                                                  due, refresher.sets[index].exponent)
        refresher._scheduled.append((version, due, requests))


def _with_set_indices(entry: dict[str, Any], sets: int, name: str = "a scheduled version") -> dict[str, Any]:
    """A scheduled entry of ``state()`` (``name`` in errors) with its requests and snapshots keyed by set
    index (checkpoints written before staggered multi-rank schedules list them for every set, in order)."""
    if isinstance(entry["requests"], dict):
        return entry
    if not isinstance(entry["requests"], (list, tuple)) or not isinstance(entry["snapshots"], (list, tuple)):
        raise ValueError(f"Invalid {name}: its requests and snapshots are {type(entry['requests']).__name__} and "
                         f"{type(entry['snapshots']).__name__}: must be dicts keyed by factor set index (or lists, "
                         "one per set)")
    if len(entry["requests"]) != sets or len(entry["snapshots"]) != sets:
        raise ValueError(f"Invalid {name}: it lists {len(entry['requests'])} requests and {len(entry['snapshots'])} "
                         f"snapshots, one per factor set: this optimizer has {sets}")
    return entry | {"requests": dict(enumerate(entry["requests"])), "snapshots": dict(enumerate(entry["snapshots"]))}
