"""Argument checks shared across the package: hyperparameters (also per param group) and the entries of
a checkpoint. Every error is ``ValueError("Invalid <name>=<value>: <what is allowed>")``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asteria.config import is_int, is_real


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


#: the largest step or version count a checkpoint may hold: the core counts them in signed 64 bits, with room
MAX_COUNT = 2**62


def check_counts(value: Any, name: str, length: int, what: str, minimum: int = 0) -> None:
    """``value`` must be a list (or tuple, or a 1-D integer NumPy array, as older checkpoints hold) of
    ``length`` ints in [``minimum``, 2^62]: ``what`` says what they are."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and np.issubdtype(value.dtype, np.integer):
        value = value.tolist()
    check_arg(isinstance(value, (list, tuple)) and len(value) == length
              and all(is_int(v) and minimum <= v <= MAX_COUNT for v in value), name, value,
              f"must be {length} ints in [{minimum}, 2^62], {what}")


def check_saved_request(saved: Any, batch: int, name: str) -> None:
    """A ``RootRequest.saved()``: (scale, eps, skip_tol, relative_eps), or a prefix of at least (scale, eps) as
    older checkpoints hold it, the scale one number or one per block of the set."""
    ok = isinstance(saved, (list, tuple)) and len(saved) in (2, 3, 4) and all(is_real(v) for v in saved[1:])
    if ok:
        scale = saved[0]
        ok = is_real(scale) or (isinstance(scale, (list, tuple)) and len(scale) == batch
                                and all(is_real(v) for v in scale))
    check_arg(ok, name, saved, f"must be (scale, eps, skip_tol, relative_eps): finite numbers, the scale one or "
              f"{batch} of them (one per block); the last two may be left out")


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


def check_common_hyperparameters(hyper: dict[str, Any], where: str = "") -> None:
    """The hyperparameters every Asteria optimizer has: lr, betas, eps and weight_decay."""
    lr = hyper["lr"]
    value = float(lr) if is_scalar_tensor(lr) else lr
    check_arg(is_real(value) and value >= 0, key_name(where, "lr"), lr,
              "must be a finite number >= 0 (or a one-element tensor holding one)")
    check_betas(hyper["betas"], key_name(where, "betas"))
    check_positive(hyper["eps"], key_name(where, "eps"))
    check_nonnegative(hyper["weight_decay"], key_name(where, "weight_decay"))
