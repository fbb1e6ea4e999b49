"""Argument checks shared by the optimizers: hyperparameters (also per param group) and checkpoints.

Every error is ``ValueError("Invalid <name>=<value>: <what is allowed>")``; a checkpoint is checked in
full before ``load_state_dict`` changes anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asteria.config import is_int, is_real

#: the largest step a checkpoint may hold: the core counts steps (and activation steps beyond them) in int64
MAX_STEP = 2**62

STATE_DICT_KEYS = ("step", "activated_step", "layout", "param_groups", "groups", "versions", "refresher",
                   "runtime_mode", "distributed")


def check_arg(ok: bool, name: str, value: Any, allowed: str) -> None:
    """Raises ``ValueError('Invalid name=value: allowed')`` unless ``ok``."""
    if not ok:
        raise ValueError(f"Invalid {name}={value!r}: {allowed}")


def is_scalar_tensor(value: Any) -> bool:
    """A one-element real tensor that needs no gradient (torch's optimizers accept one as ``lr``)."""
    return (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()
            and value.dtype != torch.bool and not value.requires_grad)


def check_nonnegative(value: Any, name: str) -> None:
    check_arg(is_real(value) and value >= 0, name, value, "must be a finite number >= 0")


def check_positive(value: Any, name: str) -> None:
    check_arg(is_real(value) and value > 0, name, value, "must be a finite number > 0")


def check_unit(value: Any, name: str, allowed: str = "must be in [0, 1)") -> None:
    check_arg(is_real(value) and 0.0 <= value < 1.0, name, value, allowed)


def check_betas(betas: Any, name: str = "betas") -> None:
    check_arg(isinstance(betas, (tuple, list)) and len(betas) == 2, name, betas, "must be a pair of floats")
    for i, beta in enumerate(betas):
        check_unit(beta, f"{name}[{i}]")


def check_count(value: Any, name: str, minimum: int = 1, optional: bool = False) -> None:
    prefix = "None or " if optional else ""
    check_arg((optional and value is None) or (is_int(value) and value >= minimum), name, value,
              f"must be {prefix}an int >= {minimum}")


def check_counts(value: Any, name: str, length: int, what: str, minimum: int = 0) -> None:
    """``value`` must be a list (or tuple, or a 1-D integer NumPy array, as older checkpoints hold) of
    ``length`` ints >= ``minimum``: ``what`` says what they are."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and np.issubdtype(value.dtype, np.integer):
        value = value.tolist()
    check_arg(isinstance(value, (list, tuple)) and len(value) == length
              and all(is_int(v) and v >= minimum for v in value), name, value,
              f"must be {length} ints >= {minimum}, {what}")


def check_saved_request(saved: Any, batch: int, name: str) -> None:
    """A ``RootRequest.saved()``: (scale, eps, skip_tol), or (scale, eps) as older checkpoints hold it, the
    scale one number or one per block of the set."""
    ok = isinstance(saved, (list, tuple)) and len(saved) in (2, 3) and all(is_real(v) for v in saved[1:])
    if ok:
        scale = saved[0]
        ok = is_real(scale) or (isinstance(scale, (list, tuple)) and len(scale) == batch
                                and all(is_real(v) for v in scale))
    check_arg(ok, name, saved, f"must be (scale, eps, skip_tol): finite numbers, the scale one or {batch} of them "
              "(one per block); skip_tol may be left out")


def check_dense(tensor: Any, name: str) -> None:
    """A torch.Tensor with data a step can read: strided (not sparse) and not on the meta device."""
    check_arg(isinstance(tensor, torch.Tensor), name, type(tensor).__name__, "must be a torch.Tensor")
    check_arg(tensor.layout == torch.strided and not tensor.is_meta, name,
              f"{tensor.layout} tensor on {tensor.device}", "must be a dense (strided) tensor with data, not sparse "
              "or on the meta device")


def check_saved_snapshot(tensor: Any, shape: tuple[int, ...], name: str) -> None:
    """A factor snapshot of a refresh in flight: a finite float32 tensor of the set's ``shape``."""
    check_dense(tensor, name)
    check_arg(tensor.dtype == torch.float32 and tuple(tensor.shape) == tuple(shape), name,
              f"{tensor.dtype} {tuple(tensor.shape)}", f"must be torch.float32 {tuple(shape)}")
    check_arg(bool(torch.isfinite(tensor).all()), name, "tensor with non-finite values",
              "a snapshot of the factors must be finite (a corrupted checkpoint?)")


def check_entry(entry: Any, keys: tuple[str, ...], name: str) -> None:
    """A dict holding at least ``keys``."""
    check_arg(isinstance(entry, dict) and all(key in entry for key in keys), name,
              f"{type(entry).__name__} with keys {sorted(entry, key=str) if isinstance(entry, dict) else '?'}",
              f"must be a dict with the keys {list(keys)}")


def key_name(where: str, key: str) -> str:
    """``lr`` for the defaults (where == ""), ``param_groups[1]['lr']`` for a group."""
    return f"{where}[{key!r}]" if where else key


def unstaggered(schedule: Any) -> bool:
    """Whether a saved refresh schedule (``_schedule_key()``) refreshes every set at the same steps."""
    return isinstance(schedule, dict) and isinstance(schedule.get("phases"), list) and not any(schedule["phases"])


def validate_state_dict(opt: Any, state_dict: Any) -> None:
    """Checks a checkpoint against optimizer ``opt`` (an ``asteria.optim.base.SecondOrderOptimizer``):
    every key present, the step a count, one entry per shape group, param group and factor set, every
    state tensor of the expected shape and dtype and finite where it is floating point, versions counts,
    hyperparameters valid. Raises ``ValueError`` naming the entry; changes nothing."""
    check_arg(isinstance(state_dict, dict) and state_dict.get("format") == "asteria.v1", "state_dict",
              type(state_dict).__name__, "must come from an Asteria optimizer's state_dict()")
    saved_class = state_dict.get("optimizer")  # None: written before the class was recorded
    if saved_class is not None and saved_class != type(opt).__name__:
        raise ValueError(f"Invalid state_dict: saved by an asteria.{saved_class}, loaded into an "
                         f"asteria.{type(opt).__name__}; load it into the optimizer class that saved it")
    for key in STATE_DICT_KEYS:
        if key not in state_dict:
            raise ValueError(f"Invalid state_dict: missing key {key!r} (has {sorted(state_dict, key=str)})")
    saved, mine = state_dict.get("distributed"), opt._refresher.identity()
    if saved != mine:
        raise ValueError(f"Invalid state_dict: saved on {describe_layout(saved)}, loaded on {describe_layout(mine)}; "
                         "resume with the same ranks and load each rank's own state_dict")
    if state_dict["runtime_mode"] != opt.runtime.mode:
        raise ValueError(f"Invalid state_dict: saved in mode {state_dict['runtime_mode']!r}, this optimizer runs "
                         f"mode {opt.runtime.mode!r}")
    check_bound(opt, state_dict.get("bound"))
    if state_dict["layout"] != opt._layout():
        raise ValueError(f"Invalid state_dict: its blocks {state_dict['layout']} do not match this optimizer's "
                         f"{opt._layout()} (parameters, max_preconditioner_dim, MemoryConfig.group_bytes or "
                         "RuntimeConfig.stagger_split differ)")
    for key in ("step", "activated_step"):
        check_arg(is_int(state_dict[key]) and 0 <= state_dict[key] <= MAX_STEP, f"state_dict[{key!r}]",
                  state_dict[key], f"must be an int in [0, {MAX_STEP}] (the core counts steps in 64 bits)")
    step = state_dict["step"]
    for key, expected, what in (("groups", len(opt._groups), "shape group"),
                                ("param_groups", len(opt.param_groups), "param group"),
                                ("versions", len(opt._set_groups), "factor set refreshed (the sets are split for "
                                 "the stagger or not: RuntimeConfig.stagger_split differ?)")):
        value = state_dict[key]
        check_arg(isinstance(value, (list, tuple)) and len(value) == expected, f"state_dict[{key!r}]",
                  f"{type(value).__name__} of {len(value) if isinstance(value, (list, tuple)) else '?'} entries",
                  f"must be a list of {expected} entries, one per {what} of this optimizer")
    saved_schedule, schedule = state_dict.get("schedule"), opt._schedule_key()  # None: written before it was saved
    if unstaggered(saved_schedule) and unstaggered(schedule):  # then how many versions are aligned changes nothing
        saved_schedule = saved_schedule | {"aligned": schedule["aligned"]}
    if saved_schedule is not None and saved_schedule != schedule:
        recorded = saved_schedule if isinstance(saved_schedule, dict) else {}
        differ = [key for key in schedule if recorded.get(key) != schedule[key]]
        raise ValueError(f"Invalid state_dict: saved under the refresh schedule {saved_schedule}, this optimizer's is "
                         f"{schedule} ({', '.join(differ)} differ: start_preconditioning_step, precondition_frequency, "
                         "RuntimeConfig.sync_refreshes or the stagger); its versions were numbered by the saved one: "
                         "resume with the same settings")
    refresher = state_dict["refresher"]
    check_entry(refresher, opt._refresher.STATE_KEYS, "state_dict['refresher']")
    opt._refresher.check_state(refresher)
    for i, (saved, group) in enumerate(zip(state_dict["groups"], opt._groups)):
        if not isinstance(saved, dict):
            raise ValueError(f"Invalid state_dict['groups'][{i}]={type(saved).__name__}: must be a dict of tensors")
        expected = opt._expected_state(i)
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
    for i, (versions, (fset, _)) in enumerate(zip(state_dict["versions"], opt._set_groups)):
        check_arg(isinstance(versions, (list, tuple)) and len(versions) == fset.batch
                  and all(is_int(v) and v >= 0 for v in versions), f"state_dict['versions'][{i}]", versions,
                  f"must be {fset.batch} ints >= 0, the versions in use by the blocks of {fset.name}")
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
        merged = {k: v for k, v in opt.param_groups[i].items() if k != "params"} | {
            k: v for k, v in saved.items() if k != "params"}
        opt.check_hyperparameters(merged, f"state_dict['param_groups'][{i}]")


def check_bound(opt: Any, saved: Any) -> None:
    """An async checkpoint's refreshes in flight were scheduled under its staleness bound and lag (ring
    slots and activation steps): resuming with a smaller one would make them late. ``saved`` is the
    checkpoint's ``bound`` entry (None: written before it was recorded; not checked)."""
    if saved is None or opt.runtime.mode != "async":
        return
    check_arg(isinstance(saved, dict) and is_int(saved.get("staleness")), "state_dict['bound']", saved,
              "must be a dict with the staleness (an int) and lag_steps the checkpoint was written with")
    mine = opt._bound()
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


def check_common_hyperparameters(hyper: dict[str, Any], where: str = "") -> None:
    """The hyperparameters every Asteria optimizer has: lr, betas, eps and weight_decay."""
    lr = hyper["lr"]
    value = float(lr) if is_scalar_tensor(lr) else lr
    check_arg(is_real(value) and value >= 0, key_name(where, "lr"), lr,
              "must be a finite number >= 0 (or a one-element tensor holding one)")
    check_betas(hyper["betas"], key_name(where, "betas"))
    check_positive(hyper["eps"], key_name(where, "eps"))
    check_nonnegative(hyper["weight_decay"], key_name(where, "weight_decay"))
