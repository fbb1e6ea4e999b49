"""A set of equally sized Kronecker factors and the preconditioners computed from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class FactorSet:
    """The factors of one mode of one batch of same-shape blocks.

    Attributes:
        name: where the set comes from, for messages ("group 0, blocks (64, 32), mode 1").
        factors: (B, n, n) statistics, updated every step on the parameter's device.
        roots: (B, n, n) the preconditioners in use (inverse roots), on the same device.
        has_root: (B,) bool, which blocks have received a preconditioner yet.
        exponent: the root's exponent (-1 / (2 * order) for Shampoo).
        block_params: per block, the name of the parameter it belongs to.
        versions: per block, the version in use (0: none yet), kept on the host.
    """

    name: str
    factors: Tensor
    roots: Tensor
    has_root: Tensor
    exponent: float
    block_params: list[str]
    versions: list[int] = field(default_factory=list)

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
        return f"block {block} of {self.name}"


@dataclass(frozen=True)
class RootRequest:
    """What a refresh of one factor set computes: (scale * F)^exponent with ``eps`` regularization."""

    scale: float
    eps: float
