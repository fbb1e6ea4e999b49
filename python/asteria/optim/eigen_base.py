"""What SOAP and KL-Shampoo share on top of the base: factor sets refreshed as eigenbases, whose
installs reorder the state kept in eigen-coordinates, and a direction computed while accumulating
(before this step's refresh changes the bases)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from asteria.optim.base import SecondOrderOptimizer
from asteria.optim.groups import ShapeGroup
from asteria.optim.state_keys import basis_key, factor_key, has_basis_key
from asteria.pipeline.factors import FactorSet, RootRequest


class EigenbasisOptimizer(SecondOrderOptimizer):
    """Base of the optimizers that precondition in the eigenbases of their factors."""

    MERGE_DIMS = False  # a matrix stays a matrix: each of its dimensions gets a basis
    ACTIVATION_LAG = 1  # the direction is computed while accumulating, with the bases of the step before
    FIRST_GRADIENT_STEPS = False  # a block's first gradient builds its factors (and basis) only

    def __init__(self, *args, **kwargs) -> None:
        self._directions: dict[int, Tensor] = {}
        super().__init__(*args, **kwargs)

    def _eigenbasis_sets(self, group: ShapeGroup, reorder: Callable[[int, Tensor, Tensor], None]) -> list[FactorSet]:
        """One factor, basis and installed flag per mode; ``reorder(mode, blocks, order)`` makes the state
        in eigen-coordinates follow a new basis' column order."""
        batch, device = group.batch, group.device
        sets = []
        for mode, dim in enumerate(group.shape):
            factor = group.state[factor_key(mode)] = torch.zeros((batch, dim, dim), device=device)
            basis = group.state[basis_key(mode)] = self._new_preconditioners(group, dim)
            installed = group.state[has_basis_key(mode)] = torch.zeros(batch, dtype=torch.bool, device=device)

            def permute(blocks: Tensor, order: Tensor, mode: int = mode) -> None:
                reorder(mode, blocks, order)

            sets.append(FactorSet(name=f"{group.name}, mode {mode}", factors=factor, preconditioners=basis,
                                  installed=installed, exponent=-0.5, kind="eigenbasis", permute=permute,
                                  block_params=[block.name for block in group.blocks]))
        return sets

    def _root_request(self, fset: FactorSet, group: ShapeGroup) -> RootRequest:
        # The factors' scale does not change an eigenbasis, and eps does not enter one.
        hyper = self.param_groups[group.group_index]
        return RootRequest(scale=1.0, eps=hyper["eps"], skip_tol=hyper["refresh_skip_tol"])

    def _direction(self, group: ShapeGroup, step: int) -> Tensor | None:
        return self._directions.pop(id(group), None)
