"""A set of equally sized Kronecker factors and the preconditioners computed from them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class FactorSet:
    """The factors of one mode of one batch of same-shape blocks.

    Attributes:
        name: where the set comes from, for messages ("group 0, blocks (64, 32), mode 1").
        factors: (B, n, n) statistics, updated every step on the parameter's device.
        preconditioners: (B, n, n) what is in use, on the same device: inverse roots (kind
            ``"root"``) or eigenbases with the vectors as columns (kind ``"eigenbasis"``).
        installed: (B,) bool, which blocks have received a preconditioner yet.
        exponent: the root's exponent (-1 / (2 * order) for Shampoo); unused for eigenbases.
        block_params: per block, the name of the parameter it belongs to.
        kind: ``"root"`` or ``"eigenbasis"``.
        permute: for eigenbases, called as ``permute(blocks, order)`` when new bases are installed:
            (b,) block indices and (b, n) the old basis' column order the new one follows, so that
            state kept in the eigenbasis (SOAP's second moment) can follow the reordering.
        versions: per block, the version in use (0: none yet), kept on the host.
        offset: where the set's first block sits in its shape group (a slice of a larger set: ``slice``).
        mode: the dimension of the blocks whose factor this is.
        first_basis: for eigenbases, how a block's first basis is taken: ``"eigh"`` (a full
            eigendecomposition) or ``"qr"`` (one warm-started QR step from the identity).
    """

    name: str
    factors: Tensor
    preconditioners: Tensor
    installed: Tensor
    exponent: float
    block_params: list[str]
    kind: str = "root"
    permute: Callable[[Tensor, Tensor], None] | None = None
    versions: list[int] = field(default_factory=list)
    offset: int = 0
    mode: int = 0
    first_basis: str = "eigh"

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = [0] * self.batch

    @property
    def batch(self) -> int:
        return self.factors.shape[0]

    @property
    def dim(self) -> int:
        return self.factors.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.factors.device

    def describe(self, block: int) -> str:
        """Block ``block`` of this set, named by its place in the shape group."""
        return f"block {self.offset + block} of {self.name}"

    def slice(self, start: int, stop: int) -> FactorSet:
        """Blocks ``[start, stop)`` as a set of their own on views of this set's tensors, so that what is
        installed into it lands in this set's preconditioners: the unit the staggered schedule refreshes
        when a large set is split (``RuntimeConfig.stagger_split``) while the math keeps reading the whole."""
        permute = None
        if self.permute is not None:
            whole = self.permute

            def permute(blocks: Tensor, order: Tensor) -> None:
                whole(blocks + start, order)

        return FactorSet(name=f"{self.name}, blocks {start}-{stop - 1}", factors=self.factors[start:stop],
                         preconditioners=self.preconditioners[start:stop], installed=self.installed[start:stop],
                         exponent=self.exponent, block_params=self.block_params[start:stop], kind=self.kind,
                         permute=permute, versions=self.versions[start:stop], offset=self.offset + start,
                         mode=self.mode, first_basis=self.first_basis)


@dataclass(frozen=True)
class RootRequest:
    """What a refresh of one factor set computes: (scale * F)^exponent with ``eps`` plus ``relative_eps``
    times the largest eigenvalue added to every eigenvalue (``functional.regularize_eigenvalues``), or
    for eigenbases the refreshed basis of scale * F, kept as it is when its off-diagonal ratio
    ||Q^T F Q - diag||_F / ||Q^T F Q||_F is at most ``skip_tol`` (0: never skip)."""

    scale: float | tuple[float, ...]  # one for the set, or one per block (their own step counts)
    eps: float
    skip_tol: float = 0.0
    relative_eps: float = 0.0

    def for_blocks(self, blocks: list[int]) -> RootRequest:
        """The request for the listed blocks of the set (a per-block scale keeps theirs)."""
        if not isinstance(self.scale, tuple):
            return self
        return RootRequest(tuple(self.scale[b] for b in blocks), self.eps, self.skip_tol, self.relative_eps)

    def saved(self) -> tuple:
        """The request as plain values for a checkpoint (``RootRequest.load`` rebuilds it; a request saved
        before ``relative_eps`` existed loads with 0, the rule it was computed by)."""
        scale = self.scale if isinstance(self.scale, float) else list(self.scale)
        return (scale, self.eps, self.skip_tol, self.relative_eps)

    @staticmethod
    def load(saved: tuple | list) -> RootRequest:
        scale, *rest = saved
        return RootRequest(float(scale) if isinstance(scale, (int, float)) else tuple(map(float, scale)), *rest)

    def submit(self, engine: Any, ids: list[int], version: int, due: int, exponent: float) -> None:
        """Submits the blocks ``ids`` (the set's blocks in order) to the C++ engine: in one call, or one
        per distinct scale."""
        if not isinstance(self.scale, tuple):
            engine.submit(ids, version, due, exponent, self.eps, self.scale, skip_tol=self.skip_tol,
                          relative_eps=self.relative_eps)
            return
        by_scale: dict[float, list[int]] = {}
        for block_id, scale in zip(ids, self.scale, strict=True):
            by_scale.setdefault(scale, []).append(block_id)
        for scale, members in by_scale.items():
            engine.submit(members, version, due, exponent, self.eps, scale, skip_tol=self.skip_tol,
                          relative_eps=self.relative_eps)
