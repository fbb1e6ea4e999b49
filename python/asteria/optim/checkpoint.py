"""An Asteria optimizer's checkpoint: what ``state_dict()`` holds, how ``load_state_dict()`` restores it, and
the checks that refuse a checkpoint naming what differs before anything changes.

The state of a ``SecondOrderOptimizer`` is kept per shape group (batched tensors), per factor set (the version
each block uses) and in its refresher (the refreshes scheduled but not yet in use, as their snapshots). With
``deterministic=True`` a run resumed from it continues bit for bit.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import torch

from asteria.checks import MAX_COUNT, check_arg, check_dense, check_entry
from asteria.config import is_int, plain
from asteria.optim.groups import ShapeGroup, build_shape_groups, preconditioner_bytes
from asteria.pipeline.timeline import RefreshSchedule

if TYPE_CHECKING:
    from asteria.optim.base import SecondOrderOptimizer

#: the format of one process's state
FORMAT = "asteria.v1"
#: the format of a state_dict taken on several ranks: each rank's own state under "rank<r>"
RANKS_FORMAT = "asteria.ranks.v1"
#: the largest step a checkpoint may hold: the core counts steps (and activation steps beyond them) in int64
MAX_STEP = MAX_COUNT

STATE_DICT_KEYS = ("step", "activated_step", "layout", "param_groups", "groups", "versions", "refresher",
                   "runtime_mode", "distributed")


class EngineUse(enum.Enum):
    """What an optimizer's refresh engine has seen. An async engine cannot go back to earlier versions, so
    only a fresh one may load a checkpoint."""

    FRESH = "fresh"
    STEPPED = "stepped"
    LOADED = "loaded a state_dict"
    #: a load that raised after it began changing the optimizer (past every check, so not a bad input the checks
    #: know of): its state is part old, part new, and only a load that goes through makes it whole again
    BROKEN = "failed midway through a load_state_dict"


def check_whole(opt: SecondOrderOptimizer, call: str) -> None:
    """Refuses ``call`` (a step, a state_dict) on an optimizer whose last load failed midway."""
    if opt._used is EngineUse.BROKEN:
        raise RuntimeError(f"Invalid {call}: a load_state_dict() into this {type(opt).__name__} failed after it had "
                           "begun changing its state, which is now part old and part loaded; load a state_dict that "
                           "goes through, or build a new optimizer")


def layout(groups: list[ShapeGroup]) -> list[list]:
    """The blocking a checkpoint's tensors belong to: per shape group its param group, shape, batch and blocks."""
    return [[g.group_index, list(g.shape), g.batch, [b.name for b in g.blocks]] for g in groups]


def regrouping_hint(opt: SecondOrderOptimizer, saved: Any) -> str:
    """Where only the shape groups' bound differs (a checkpoint of groups larger than the device's default bound,
    saved before that bound existed), the ``MemoryConfig.group_bytes`` that groups the blocks as the checkpoint
    did. Preconditioners on the device only: the other tiers' groups are also cut for the stagger."""
    if not opt._placement.resident():
        return ""
    try:
        largest = max(batch * preconditioner_bytes(tuple(shape)) for _, shape, batch, _ in saved)
    except (TypeError, ValueError):  # (not a layout of blocks: the message says what it holds)
        return ""
    if layout(build_shape_groups(opt.param_groups, opt.max_preconditioner_dim, opt.MERGE_DIMS, largest)) != saved:
        return ""
    return f"; MemoryConfig(group_bytes={largest}), its largest group's preconditioner bytes, groups them as it does"


def schedule_key(schedule: RefreshSchedule) -> dict[str, Any]:
    """When each set's versions are snapshotted: a checkpoint's versions, their activation steps and the blocks'
    first-gradient checks mean something only under the same schedule."""
    return {"start": schedule.start, "interval": schedule.interval, "aligned": schedule.aligned,
            "phases": list(schedule.phases)}


def stagger_cut(opt: SecondOrderOptimizer) -> dict[str, Any]:
    """How the factor sets were cut for the stagger: the versions and the refreshes in flight are per set."""
    return {"split": opt.stagger_split, "sets_per_step": opt.runtime.stagger_sets_per_step,
            "small": opt.stagger_small}


def saved_stagger_small(state_dict: dict[str, Any]) -> bool:
    """``RuntimeConfig.stagger_small`` as a checkpoint was saved with (False before it was recorded)."""
    saved = state_dict.get("stagger_cut")
    return bool(saved.get("small", False)) if isinstance(saved, dict) else False


def check_stagger_cut(opt: SecondOrderOptimizer, state_dict: dict[str, Any]) -> None:
    """Refuses, naming the setting, a checkpoint whose factor sets were cut for the stagger otherwise than
    ``opt``'s. One saved before the cut was recorded was split at one set a step, if at all, and before
    ``stagger_small`` existed without it. Where no set is large enough for the two cuts to differ, it loads."""
    saved = state_dict.get("stagger_cut")
    mine = stagger_cut(opt)
    split, sets_per_step = (saved.get("split"), saved.get("sets_per_step")) if isinstance(saved, dict) else (None, 1)
    small = saved_stagger_small(state_dict)
    other_split = split is not None and split != mine["split"]
    both_cut = mine["split"] and split is not False  # (then the unit and the small sets' cut can differ)
    other_unit = both_cut and sets_per_step != mine["sets_per_step"]
    other_small = both_cut and small != mine["small"]
    if not (other_split or other_unit or other_small):
        return
    versions = state_dict.get("versions")
    cut = ([len(v) if isinstance(v, (list, tuple)) else None for v in versions]
           if isinstance(versions, (list, tuple)) else None)
    if cut == [fset.batch for fset, _ in opt._set_groups] and state_dict.get("layout") == layout(opt._groups):
        return
    if other_split:
        def described(value: Any) -> str:
            return "split for the stagger" if value else "whole"
        raise ValueError(f"Invalid state_dict: its factor sets were {described(split)}, this optimizer's are "
                         f"{described(mine['split'])} (RuntimeConfig.stagger_split differ: resume with "
                         f"stagger_split={split})")
    before = "" if isinstance(saved, dict) else (" (saved before asteria recorded the cut; if its sets were split at "
                                                 "all: RuntimeConfig.stagger_split)")
    settings = ([f"stagger_sets_per_step={sets_per_step}"] if other_unit else []) + (
        [f"stagger_small={small}"] if other_small else [])
    raise ValueError(f"Invalid state_dict: its factor sets were cut for the stagger at {sets_per_step} a step"
                     f"{', the small ones apart' if small else ''}{before}, this optimizer's at "
                     f"{mine['sets_per_step']}{', the small ones apart' if mine['small'] else ''}; resume with "
                     f"RuntimeConfig({', '.join(settings)})")


def bound(opt: SecondOrderOptimizer) -> dict[str, int | None]:
    """The staleness bound and the deterministic rule's lag (None: not that rule) under which a checkpoint's
    refreshes in flight were scheduled."""
    deterministic = opt.runtime.mode == "async" and opt.runtime.deterministic
    return {"staleness": opt.runtime.staleness, "lag_steps": opt._refresher.rule.lag if deterministic else None}


def take(opt: SecondOrderOptimizer) -> dict[str, Any]:
    """``opt``'s state; on several ranks under this rank's own key, so that torch.distributed.checkpoint saves
    every rank's part (it keeps one copy of a key that every rank has) and each rank loads its own."""
    check_whole(opt, "state_dict()")
    state = _own_state(opt)
    identity = opt._refresher.identity()
    if identity is None:
        return state
    return {"format": RANKS_FORMAT, f"rank{identity['rank']}": state}


def _own_state(opt: SecondOrderOptimizer) -> dict[str, Any]:
    placement = opt._placement
    if opt._closed and placement.paged_keys:
        raise RuntimeError("Invalid state_dict() after close(): the preconditioners on the NVMe tier went with "
                           "their page files at close(); take the state_dict() before closing")
    # plain(): an lr scheduler may have put NumPy scalars there, which torch.load(weights_only=True) refuses
    param_groups = [{k: plain(v) for k, v in g.items() if k != "params"}
                    | {"params": list(range(len(g["params"])))} for g in opt.param_groups]
    return {
        "format": FORMAT,
        "optimizer": type(opt).__name__,
        "step": opt._step,
        "activated_step": opt._activated_step,
        "layout": layout(opt._groups),
        "param_groups": param_groups,
        "groups": [{k: v.detach().clone() for k, v in g.state.items()}
                   | {k: placement.tier.current(fset).clone() for k, fset in placement.paged_keys.get(i, {}).items()}
                   for i, g in enumerate(opt._groups)],
        "versions": [list(fset.versions) for fset, _ in opt._set_groups],
        "block_steps": [list(g.steps.counts) for g in opt._groups],
        "block_first_steps": [list(g.steps.first_steps) for g in opt._groups],
        "refresher": opt._refresher.state(opt._step),
        "runtime_mode": opt.runtime.mode,
        "distributed": opt._refresher.identity(),
        "bound": bound(opt),
        "schedule": schedule_key(opt.schedule),
        "precondition_1d": opt.precondition_1d,
        "stagger_cut": stagger_cut(opt),
    }


def own_part(opt: SecondOrderOptimizer, state_dict: Any) -> Any:
    """This rank's state in a state_dict taken on several ranks (others pass through unchanged)."""
    if not (isinstance(state_dict, dict) and state_dict.get("format") == RANKS_FORMAT):
        return state_dict
    identity = opt._refresher.identity()
    saved = sorted(k for k in state_dict if k != "format")
    key = None if identity is None else f"rank{identity['rank']}"
    if key not in state_dict:
        where = "one process" if identity is None else f"rank {identity['rank']}"
        raise ValueError(f"Invalid state_dict: it holds the state of {saved}, and this optimizer runs on {where}; "
                         "resume with the same ranks")
    return state_dict[key]


def restore(opt: SecondOrderOptimizer, state_dict: dict[str, Any]) -> None:
    """Checks ``state_dict`` in full, then loads it into ``opt``."""
    validate_state_dict(opt, state_dict)
    if opt.runtime.mode == "async" and opt._used is not EngineUse.FRESH:
        done = f"stepped (step {opt._step})" if opt._used is EngineUse.STEPPED else opt._used.value
        raise ValueError(f"Invalid load_state_dict into an async {type(opt).__name__} that has already {done}: "
                         "its refresh engine cannot go back to earlier versions; build a new optimizer and "
                         "load the state_dict into it")
    try:
        load(opt, state_dict)
    except BaseException:
        opt._used = EngineUse.BROKEN
        raise


def load(opt: SecondOrderOptimizer, state_dict: dict[str, Any]) -> None:
    """Loads a checked ``state_dict`` into ``opt`` (``restore`` marks ``opt`` broken where this raises)."""
    placement = opt._placement
    for index, (saved, group) in enumerate(zip(state_dict["groups"], opt._groups, strict=True)):
        paged = placement.paged_keys.get(index, {})
        for key, tensor in saved.items():
            if key in paged:
                placement.tier.set_current(paged[key], tensor)
            else:
                group.state[key].copy_(tensor)
    for versions, (fset, _) in zip(state_dict["versions"], opt._set_groups, strict=True):
        fset.versions = [int(v) for v in versions]
    # Older checkpoints: every block counted the optimizer's steps; without first steps, a block's
    # first gradient is taken as late as its count allows (the safe side for Shampoo's ``_informed``).
    step = int(state_dict["step"])
    counts = state_dict.get("block_steps") or [[step] * g.batch for g in opt._groups]
    firsts = state_dict.get("block_first_steps") or [[step - c + 1 if c else 0 for c in group] for group in counts]
    for group, group_counts, group_firsts in zip(opt._groups, counts, firsts, strict=True):
        group.steps.load(group_counts, group_firsts)
    opt._forget_derived()
    for saved, group in zip(state_dict["param_groups"], opt.param_groups, strict=True):
        group.update(opt.ADDED_HYPERPARAMETERS | {k: v for k, v in saved.items() if k != "params"})
    opt._step = state_dict["step"]
    opt._activated_step = state_dict["activated_step"]
    opt._used = EngineUse.LOADED if opt.runtime.mode == "async" else EngineUse.FRESH
    opt._refresher.load_state(state_dict["refresher"])


def unstaggered(schedule: Any) -> bool:
    """Whether a saved refresh schedule (``schedule_key()``) refreshes every set at the same steps."""
    return isinstance(schedule, dict) and isinstance(schedule.get("phases"), list) and not any(schedule["phases"])


def validate_state_dict(opt: SecondOrderOptimizer, state_dict: Any) -> None:
    """Checks a checkpoint against optimizer ``opt``:
    every key present, the step a count, one entry per shape group, param group and factor set, every
    state tensor of the expected shape and dtype and finite where it is floating point, versions counts,
    hyperparameters valid. Raises ``ValueError`` naming the entry; changes nothing."""
    check_arg(isinstance(state_dict, dict) and state_dict.get("format") == FORMAT, "state_dict",
              type(state_dict).__name__, "must come from an Asteria optimizer's state_dict()")
    saved_class = state_dict.get("optimizer")  # None: written before the class was recorded
    if saved_class is not None and saved_class != type(opt).__name__:
        raise ValueError(f"Invalid state_dict: saved by an asteria.{saved_class}, loaded into an "
                         f"asteria.{type(opt).__name__}; load it into the optimizer class that saved it")
    for key in STATE_DICT_KEYS:
        if key not in state_dict:
            raise ValueError(f"Invalid state_dict: missing key {key!r} (has {sorted(state_dict, key=str)})")
    check_precondition_1d(opt, state_dict)
    saved, mine = state_dict.get("distributed"), opt._refresher.identity()
    if saved != mine:
        raise ValueError(f"Invalid state_dict: saved on {describe_layout(saved)}, loaded on {describe_layout(mine)}; "
                         "resume with the same ranks and load each rank's own state_dict")
    if state_dict["runtime_mode"] != opt.runtime.mode:
        raise ValueError(f"Invalid state_dict: saved in mode {state_dict['runtime_mode']!r}, this optimizer runs "
                         f"mode {opt.runtime.mode!r}")
    check_bound(opt, state_dict.get("bound"))
    check_stagger_cut(opt, state_dict)
    if state_dict["layout"] != layout(opt._groups):
        raise ValueError(f"Invalid state_dict: its blocks {state_dict['layout']} do not match this optimizer's "
                         f"{layout(opt._groups)} (parameters, max_preconditioner_dim, MemoryConfig.group_bytes or "
                         f"RuntimeConfig.stagger_split differ){regrouping_hint(opt, state_dict['layout'])}")
    for key in ("step", "activated_step"):
        check_arg(is_int(state_dict[key]) and 0 <= state_dict[key] <= MAX_STEP, f"state_dict[{key!r}]",
                  state_dict[key], f"must be an int in [0, {MAX_STEP}] (the core counts steps in 64 bits)")
    step = state_dict["step"]
    # (prefetch may have activated the step the next update reads; an activation beyond it never comes, so every
    # later version would wait for it)
    newest_activation = max(step, opt.timeline.activation_read_at(step + 1))
    check_arg(state_dict["activated_step"] <= newest_activation, "state_dict['activated_step']",
              state_dict["activated_step"], f"must be at most {newest_activation}, the newest activation by step "
              f"{step}")
    for key, expected, what in (("groups", len(opt._groups), "shape group"),
                                ("param_groups", len(opt.param_groups), "param group"),
                                ("versions", len(opt._set_groups), "factor set refreshed (the sets are split for "
                                 "the stagger or not: RuntimeConfig.stagger_split differ?)")):
        value = state_dict[key]
        check_arg(isinstance(value, (list, tuple)) and len(value) == expected, f"state_dict[{key!r}]",
                  f"{type(value).__name__} of {len(value) if isinstance(value, (list, tuple)) else '?'} entries",
                  f"must be a list of {expected} entries, one per {what} of this optimizer")
    saved_schedule = state_dict.get("schedule")  # None: written before it was saved
    schedule = schedule_key(opt.schedule)
    if unstaggered(saved_schedule) and unstaggered(schedule):  # then how many versions are aligned changes nothing
        saved_schedule = saved_schedule | {"aligned": schedule["aligned"]}
    if saved_schedule is not None and saved_schedule != schedule:
        recorded = saved_schedule if isinstance(saved_schedule, dict) else {}
        differ = [key for key in schedule if recorded.get(key) != schedule[key]]
        small = saved_stagger_small(state_dict)
        hint = (f"; it was saved with RuntimeConfig.stagger_small={small}, which spreads the small sets otherwise"
                if small != opt.stagger_small and differ == ["phases"] and not unstaggered(saved_schedule)
                and not unstaggered(schedule) else "")
        raise ValueError(f"Invalid state_dict: saved under the refresh schedule {saved_schedule}, this optimizer's is "
                         f"{schedule} ({', '.join(differ)} differ: start_preconditioning_step, precondition_frequency, "
                         "RuntimeConfig.sync_refreshes or the stagger); its versions were numbered by the saved one: "
                         f"resume with the same settings{hint}")
    refresher = state_dict["refresher"]
    check_entry(refresher, opt._refresher.STATE_KEYS, "state_dict['refresher']")
    opt._refresher.check_state(refresher)
    for i, (saved, group) in enumerate(zip(state_dict["groups"], opt._groups)):
        if not isinstance(saved, dict):
            raise ValueError(f"Invalid state_dict['groups'][{i}]={type(saved).__name__}: must be a dict of tensors")
        expected = opt._placement.expected_state(i)
        if saved.keys() != expected.keys():
            raise ValueError(f"Invalid state_dict: state {sorted(saved, key=str)} of {group.name} does not match "
                             f"{sorted(expected)} (a different optimizer class?)")
        for key, (shape, dtype) in expected.items():
            tensor, name = saved[key], f"state_dict['groups'][{i}][{key!r}]"
            check_dense(tensor, name)
            check_arg(tensor.shape == shape and tensor.dtype == dtype, name, f"{tensor.dtype} {tuple(tensor.shape)}",
                      f"{group.name} expects {dtype} {tuple(shape)}")
            check_arg(not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()), name,
                      "tensor with non-finite values", "optimizer state must be finite (a corrupted checkpoint?)")
    newest = refresher.get("newest_versions")
    for i, (versions, (fset, _)) in enumerate(zip(state_dict["versions"], opt._set_groups)):
        check_arg(isinstance(versions, (list, tuple)) and len(versions) == fset.batch
                  and all(is_int(v) and v >= 0 for v in versions), f"state_dict['versions'][{i}]", versions,
                  f"must be {fset.batch} ints >= 0, the versions in use by the blocks of {fset.name}")
        if newest is not None and max(versions, default=0) > newest[i]:
            raise ValueError(f"Invalid state_dict['versions'][{i}]={list(versions)}: must be at most "
                             f"{newest[i]}, the newest version of {fset.name} snapshotted "
                             "(state_dict['refresher']['newest_versions'])")
    check_scheduled_steps(opt, state_dict)
    for key, what in (("block_steps", "the step counts"), ("block_first_steps", "the steps of the first gradients")):
        entries = state_dict.get(key)  # None: written before blocks counted their own steps
        check_arg(entries is None or (isinstance(entries, (list, tuple)) and len(entries) == len(opt._groups)),
                  f"state_dict[{key!r}]", f"{type(entries).__name__} of "
                  f"{len(entries) if isinstance(entries, (list, tuple)) else '?'} entries",
                  f"must be a list of {len(opt._groups)} entries, one per shape group")
        for i, (values, group) in enumerate(zip(entries or [], opt._groups)):
            check_arg(isinstance(values, (list, tuple)) and len(values) == group.batch
                      and all(is_int(v) and 0 <= v <= step for v in values), f"state_dict[{key!r}][{i}]",
                      values, f"must be {group.batch} ints in [0, step={step}], {what} of the blocks of {group.name}")
    counts, firsts = state_dict.get("block_steps"), state_dict.get("block_first_steps")
    for i, (group_counts, group_firsts) in enumerate(zip(counts or [], firsts or [])):
        for count, first in zip(group_counts, group_firsts):
            check_arg((count == 0) == (first == 0) and (count == 0 or first <= step - count + 1),
                      f"state_dict['block_first_steps'][{i}]", group_firsts,
                      f"must agree with block_steps[{i}]={group_counts}: 0 where a block has no step, else a step "
                      f"at most step - count + 1 (step={step})")
    for i, saved in enumerate(state_dict["param_groups"]):
        check_arg(isinstance(saved, dict), f"state_dict['param_groups'][{i}]", type(saved).__name__, "must be a dict")
        merged = {k: v for k, v in opt.param_groups[i].items() if k != "params"} | opt.ADDED_HYPERPARAMETERS | {
            k: v for k, v in saved.items() if k != "params"}
        opt.check_hyperparameters(merged, f"state_dict['param_groups'][{i}]")


def scheduled_sets(scheduled: Any) -> list[tuple[int, int, int, int]]:
    """(entry index, set index, version, due) of each set's version in flight in a refresher's saved ``scheduled``,
    in either format: one process's (an entry per version of a set) or the distributed refresher's (an entry per
    version, with the sets it requested: a dict keyed by set index, or, written before staggered multi-rank
    schedules, a list with one request per set)."""
    found = []
    for k, entry in enumerate(scheduled or ()):
        if "set" in entry:
            found.append((k, entry["set"], entry["version"], entry["due"]))
            continue
        requests = entry["requests"]
        for index in range(len(requests)) if isinstance(requests, (list, tuple)) else requests:
            found.append((k, index, entry["version"], entry["due"]))
    return found


def check_scheduled_steps(opt: SecondOrderOptimizer, state_dict: dict[str, Any]) -> None:
    """The refreshes in flight (either refresher's format: ``scheduled_sets``) against this optimizer's timeline:
    each is due at its snapshot step or within the activation lag after it (the saved rule's lag, at most this
    one's: ``check_bound``; a ``sync_refreshes`` that grew makes it one used at its own step), and under the
    deterministic rule every version after a set's version in use, up to its newest snapshotted, is among them (each
    is waited for at its due step: a checkpoint missing one would hang the resumed run there until ``timeout_s``;
    under the newest-finished rule versions may be deferred)."""
    refresher = state_dict["refresher"]
    scheduled = scheduled_sets(refresher.get("scheduled"))
    for k, index, version, due in scheduled:
        snapshot = opt.timeline.snapshot_step(index, version)
        latest = snapshot + opt._refresher.rule.lag
        check_arg(snapshot <= due <= latest, f"state_dict['refresher']['scheduled'][{k}]['due']", due,
                  f"must be in [{snapshot}, {latest}]: version {version} of {opt._set_groups[index][0].name} is "
                  f"snapshotted at step {snapshot} under this optimizer's schedule, and due within its activation "
                  "lag after it")
    if not (opt.runtime.mode == "async" and opt.runtime.deterministic and "newest_versions" in refresher):
        return
    for i, (versions, (fset, _)) in enumerate(zip(state_dict["versions"], opt._set_groups)):
        if len(set(versions)) != 1:  # (a set whose blocks differ: not this rule's to judge)
            continue
        pending = sorted(version for _, index, version, _ in scheduled if index == i)
        expected = list(range(versions[0] + 1, refresher["newest_versions"][i] + 1))
        check_arg(pending == expected, "state_dict['refresher']['scheduled']", f"versions {pending} of {fset.name}",
                  f"must be {expected}: under the deterministic rule every version after the one in use "
                  f"({versions[0]}) up to the newest snapshotted ({refresher['newest_versions'][i]}) is in flight")


def check_precondition_1d(opt: SecondOrderOptimizer, state_dict: dict[str, Any]) -> None:
    """A checkpoint holds 1-D parameters' factors or not: refused, naming the setting, by an optimizer built
    the other way. One written before the setting was saved holds what the class did then
    (``PRECONDITION_1D_BEFORE``: Shampoo preconditioned them; None: not known, left to the state checks)."""
    mine = opt.precondition_1d
    saved = state_dict.get("precondition_1d", getattr(opt, "PRECONDITION_1D_BEFORE", None))
    if mine is not None and saved is not None and saved != mine:
        raise ValueError(f"Invalid state_dict: saved with precondition_1d={saved}, this asteria.{type(opt).__name__} "
                         f"has precondition_1d={mine} (its 1-D parameters' factors are "
                         f"{'in the checkpoint' if saved else 'not in it'}); build the optimizer with "
                         f"precondition_1d={saved} to resume")


def check_bound(opt: SecondOrderOptimizer, saved: Any) -> None:
    """An async checkpoint's refreshes in flight were scheduled under its staleness bound and lag (ring
    slots and activation steps): resuming with a smaller one would make them late. ``saved`` is the
    checkpoint's ``bound`` entry (None: written before it was recorded; not checked)."""
    if saved is None or opt.runtime.mode != "async":
        return
    check_arg(isinstance(saved, dict) and is_int(saved.get("staleness"))
              and (saved.get("lag_steps") is None or is_int(saved["lag_steps"])), "state_dict['bound']", saved,
              "must be a dict with the staleness (an int) and lag_steps (an int or None) the checkpoint was written "
              "with")
    mine = bound(opt)
    if mine["staleness"] < saved["staleness"]:
        raise ValueError(f"Invalid state_dict: saved with staleness={saved['staleness']}, this optimizer has "
                         f"staleness={mine['staleness']}; the refreshes in flight were scheduled under the saved "
                         f"bound: resume with staleness >= {saved['staleness']}")
    if saved.get("lag_steps") is not None and mine["lag_steps"] is not None and mine["lag_steps"] < saved["lag_steps"]:
        raise ValueError(f"Invalid state_dict: saved under the deterministic rule with a lag of {saved['lag_steps']} "
                         f"steps, this optimizer's is {mine['lag_steps']}; the refreshes in flight were scheduled "
                         f"{saved['lag_steps']} steps after their snapshots: resume with lag_steps >= "
                         f"{saved['lag_steps']} (or the staleness that gives it)")


def describe_layout(identity: dict[str, Any] | None) -> str:
    """A rank layout recorded in a checkpoint, in words."""
    if identity is None:
        return "a single process"
    return (f"rank {identity['rank']} of world size {identity['world_size']} (local world size "
            f"{identity['local_world_size']}, block owners {identity['owners']})")
