"""Symmetric factors in half the memory: the lower triangle of each n x n block, row by row (the order of
``torch.tril_indices``), as the C++ engine's packed snapshot buffers hold it."""

from __future__ import annotations

import torch
from torch import Tensor

_INDEX: dict[tuple[int, torch.device], Tensor] = {}


def packed_size(n: int) -> int:
    return n * (n + 1) // 2


def lower_index(n: int, device: torch.device) -> Tensor:
    """The flat positions i * n + j (i >= j) of the lower triangle of an n x n matrix, on ``device``."""
    key = (n, torch.device(device))
    index = _INDEX.get(key)
    if index is None:
        rows, cols = torch.tril_indices(n, n, device=device)
        index = _INDEX[key] = rows * n + cols
    return index


def pack(factors: Tensor) -> Tensor:
    """(B, n, n) symmetric blocks as (B, n (n + 1) / 2): their lower triangles."""
    n = factors.shape[-1]
    return factors.reshape(factors.shape[0], n * n).index_select(1, lower_index(n, factors.device))


def unpack(packed: Tensor, n: int) -> Tensor:
    """The (B, n, n) symmetric blocks whose lower triangles ``packed`` (B, n (n + 1) / 2) holds."""
    full = torch.zeros(packed.shape[0], n * n, dtype=packed.dtype, device=packed.device)
    full.index_copy_(1, lower_index(n, packed.device), packed)
    full = full.view(packed.shape[0], n, n)
    return full + full.mT.triu(1)
