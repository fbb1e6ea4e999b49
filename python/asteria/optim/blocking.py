"""How parameters are cut into preconditioner blocks.

A parameter is first viewed with its small adjacent dimensions merged (so that a (64, 3, 3, 3)
convolution kernel is preconditioned as 64 x 27) and size-1 dimensions dropped; every dimension
larger than ``max_preconditioner_dim`` is then split into chunks of at most that size. Each block
has one Kronecker factor per dimension; blocks of equal shape are batched together.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


def merge_dims(shape: tuple[int, ...], max_dim: int) -> tuple[int, ...]:
    """Drops size-1 dimensions and merges adjacent ones while their product stays <= ``max_dim``, but never
    into one dimension when there were several: a tensor of order >= 2 keeps a Kronecker factorization
    (its first dimension, then the rest merged). Merged whole, a small matrix would get one full-matrix
    factor over all its entries, which a few hundred gradients leave rank-deficient, so that the inverse
    root under a tiny epsilon amplifies noise (a 64 x 32 weight as one 2048-long dimension trained to a loss
    many times AdamW's) and whose refresh costs O(numel^3)."""
    dims = [size for size in shape if size != 1]
    merged = _merge_adjacent(dims, max_dim)
    if len(merged) == 1 and len(dims) > 1:
        merged = [dims[0], *_merge_adjacent(dims[1:], max_dim)]
    return tuple(merged)


def _merge_adjacent(dims: list[int], max_dim: int) -> list[int]:
    merged: list[int] = []
    for size in dims:
        if merged and merged[-1] * size <= max_dim:
            merged[-1] *= size
        else:
            merged.append(size)
    return merged


def split_dim(size: int, max_dim: int) -> list[slice]:
    """Chunks of at most ``max_dim`` covering ``range(size)``."""
    return [slice(start, min(start + max_dim, size)) for start in range(0, size, max_dim)]


@dataclass(frozen=True)
class Block:
    """One preconditioner block: a region of a parameter viewed as ``merged_shape``."""

    param_index: int                 # position of the parameter in its param group
    name: str                        # "<parameter name>[block i]" for messages
    merged_shape: tuple[int, ...]    # the parameter viewed with merged dimensions
    region: tuple[slice, ...]        # the block inside that view

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.region)

    @property
    def order(self) -> int:
        return len(self.region)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The block's region of ``tensor`` (a parameter or its gradient), as a view."""
        return tensor.view(self.merged_shape)[self.region]


def partition(param: torch.Tensor, param_index: int, name: str, max_dim: int, merge: bool = True) -> list[Block]:
    """Cuts one parameter into blocks; raises ``ValueError`` if it cannot be viewed without a copy.

    With ``merge=False`` only size-1 dimensions are dropped (SOAP keeps a matrix a matrix)."""
    if not param.is_contiguous():
        raise ValueError(f"Invalid parameter {name!r}: it is not contiguous (strides {tuple(param.stride())}); "
                         "Asteria updates parameters through views and needs contiguous storage")
    merged = merge_dims(tuple(param.shape), max_dim) if merge else tuple(d for d in param.shape if d != 1)
    # An empty parameter has a zero-size dimension, which splits into no chunks: no blocks.
    regions = itertools.product(*(split_dim(size, max_dim) for size in merged))
    blocks = [Block(param_index, name, merged, region) for region in regions]
    if len(blocks) > 1:
        blocks = [Block(b.param_index, f"{name}[block {i}]", b.merged_shape, b.region) for i, b in enumerate(blocks)]
    return blocks
