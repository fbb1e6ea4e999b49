"""The refresh of one factor set with torch, wherever the set lives: what native mode computes inside
``step()`` and what the device lane computes beside training, so that both give the same results."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from asteria import functional as F
from asteria.pipeline.factors import FactorSet, RootRequest


@dataclass
class Refreshed:
    """A set's new preconditioners: ``new`` (B, n, n), ``usable`` (B,) bool (the others keep theirs),
    ``order`` (B, n) the old basis' column order each new eigenbasis follows (None for roots, and where
    no block was warm-started), and how many blocks kept their basis under ``skip_tol`` (a 0-d count on the
    set's device, so that no one waits for it before reading ``usable``)."""

    new: Tensor
    usable: Tensor
    order: Tensor | None
    skipped: Tensor


def load_linalg(device: torch.device) -> None:
    """Loads torch's CUDA linear algebra before threads share it: torch loads that library at a process's first
    linalg call on a GPU, and of two threads whose first calls meet there, one fails ("lazy wrapper should be
    called at most once"). A no-op on the CPU and once loaded."""
    if device.type == "cuda":
        torch.linalg.eigh(torch.eye(2, device=device))
        torch.cuda.synchronize(device)


def refresh_set(fset: FactorSet, factors: Tensor, request: RootRequest, current: Tensor, installed: Tensor,
                in_thread: bool = False) -> Refreshed:
    """Refreshes ``fset`` from ``factors`` (a (B, n, n) snapshot or the live factors) with float32 matrix
    products whatever ``torch.set_float32_matmul_precision`` says (see ``float32_matmuls``; a thread beside
    the training thread, ``in_thread``, must leave that global setting alone, and computes its products in
    float64 where the setting would allow less than float32). Roots: the eigendecomposition's
    (scale F + regularization)^exponent, a zero factor's root being the identity (the C++ engine's rule).
    Eigenbases: a full eigendecomposition for blocks without a basis yet (or with a zero factor's identity),
    the warm-started QR refresh from ``current`` (the bases in use; ``installed`` says which blocks have one)
    for the others. Its QR factorization is ``functional.cholesky_qr``'s on a GPU when the refresh runs on the
    training thread (native mode, the start-up refreshes), where the GPU does nothing else and batched Cholesky
    QR takes half the time of Householder QR; beside training (``in_thread``) Householder QR's, which slowed a
    training-like loop as much per block refreshed and refreshed more blocks a second (docs/results.md, "Refresh
    math on the GPU")."""
    if in_thread:
        widen = factors.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
        return _refresh(fset, factors, request, current, installed, widen, False)
    with F.float32_matmuls():
        return _refresh(fset, factors, request, current, installed, False, factors.device.type == "cuda")


def _refresh(fset: FactorSet, factors: Tensor, request: RootRequest, current: Tensor, installed: Tensor,
             widen: bool, cholesky: bool) -> Refreshed:
    if fset.kind == "root":
        return _roots(fset, factors, request, widen)
    return _eigenbases(factors, request.skip_tol, current, installed, widen, fset.first_basis, cholesky)


def _roots(fset: FactorSet, factors: Tensor, request: RootRequest, widen: bool) -> Refreshed:
    scale = request.scale
    if isinstance(scale, tuple):  # the blocks' own step counts differ
        scale = F.batch_view(torch.tensor(scale, dtype=factors.dtype, device=factors.device), factors)
    new, usable = F.inverse_root(factors, fset.exponent, request.eps, scale, widen, request.relative_eps)
    eye = torch.eye(fset.dim, dtype=new.dtype, device=new.device)
    new = torch.where(F.batch_view(F.zero_rows(factors), new), eye, new)
    return Refreshed(new, usable, None, usable.new_zeros((), dtype=torch.long))


def _eigenbases(factors: Tensor, skip_tol: float, current: Tensor, installed: Tensor, widen: bool,
                first_basis: str = "eigh", cholesky: bool = False) -> Refreshed:
    """The column order is None when no block was refreshed from an old basis (the blocks decomposed afresh
    keep theirs: the identity order). ``first_basis="qr"``: the blocks without a basis (or with a zero
    factor's identity) take one QR step from the identity instead, as the C++ engine's chain does."""
    warm = installed & ~F.identity_rows(current)
    if first_basis == "qr":
        eye = torch.eye(current.shape[-1], dtype=current.dtype, device=current.device).expand_as(current)
        start = torch.where(F.batch_view(warm, current), current, eye)
        refreshed, order, usable, skipped = F.qr_refresh(factors, start, skip_tol, widen, cholesky)
        return Refreshed(refreshed, usable, order, skipped.sum())
    if not bool(warm.any()):
        bases, usable = F.eigenbasis(factors)
        return Refreshed(bases, usable, None, usable.new_zeros((), dtype=torch.long))
    refreshed, order, usable, skipped = F.qr_refresh(factors, current, skip_tol, widen, cholesky)
    skipped_count = (skipped & warm).sum()
    if bool(warm.all()):
        return Refreshed(refreshed, usable, order, skipped_count)
    fresh, fresh_usable = F.eigenbasis(factors)
    mask = F.batch_view(warm, fresh)
    kept = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return Refreshed(torch.where(mask, refreshed, fresh), torch.where(warm, usable, fresh_usable),
                     torch.where(warm.unsqueeze(-1), order, kept), skipped_count)
