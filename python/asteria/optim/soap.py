"""SOAP (Vyas et al. 2024): Adam run in the eigenbasis of Shampoo's factors, on Asteria's refresh runtime."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from asteria import functional as F
from asteria.checks import check_arg, check_betas, check_common_hyperparameters, check_nonnegative, check_unit, key_name
from asteria.config import RuntimeConfig
from asteria.optim.eigen_base import EigenbasisOptimizer
from asteria.optim.groups import ShapeGroup
from asteria.optim.state_keys import factor_key
from asteria.pipeline.factors import FactorSet

EXP_AVG = "exp_avg"          # first moment, in the parameter's own coordinates
EXP_AVG_SQ = "exp_avg_sq"    # second moment, in the eigenbasis


def debiased(beta: float, step: int) -> float:
    """The EMA weight that makes an exponential average started at zero unbiased at ``step`` >= 1."""
    return 1.0 - (1.0 - beta) / (1.0 - beta**step)


class SOAP(EigenbasisOptimizer):
    """SOAP: per block, Kronecker factors L_i of the gradient; Adam's moments live in their eigenbasis
    Q_i (G' = G ×_i Q_i^T), and the Adam direction is rotated back. The first step only builds the
    factors; Adam runs in plain coordinates until ``start_preconditioning_step``, whose factors give the
    first eigenbasis; from then on every ``precondition_frequency`` steps the
    bases are refreshed by one warm-started power step and a QR factorization, with the second
    moment reordered to the new eigenvalue order — on the C++ workers in ``mode="async"``, inside
    ``step()`` in ``mode="sync"``. Averages are debiased EMAs; weight decay is decoupled.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: (beta1, beta2) of Adam in the eigenbasis.
        shampoo_beta: decay of the factors (default: ``betas[1]``, a param group's own when it sets
            ``betas``).
        eps: Adam's epsilon (a floor under the root of the second moment).
        weight_decay: decoupled weight decay.
        max_preconditioner_dim: largest factor dimension; larger dimensions are split into blocks.
        precondition_frequency: steps between basis refreshes (f).
        start_preconditioning_step: the step of the first basis (default: f, as Distributed Shampoo starts).
            Before it, Adam in the parameter's own coordinates; its second moment is then carried into the
            basis. 1 takes the first basis from the first gradient alone, which at f = 50 ended 6-8% higher
            in validation loss on a 160M language model (docs/results.md).
        precondition_1d: rotate 1-D parameters too (default: plain Adam for them).
        refresh_skip_tol: skip a block's basis refresh when its old basis diagonalizes the factor up to
            this off-diagonal ratio ||Q^T F Q - diag||_F / ||Q^T F Q||_F (0: never; skips are counted
            in ``runtime_stats()["refreshes_skipped"]``).
        runtime: an ``asteria.RuntimeConfig``. With ``deterministic=False`` (one process) each block
            takes its newest finished basis; the second moment follows it through the composed column
            orders of any versions passed over.
        first_basis: how each block's first basis is taken from its factor: ``"eigh"``, its full
            eigendecomposition, or ``"qr"``, one step of orthogonal iteration from the identity, the rule of
            Distributed Shampoo's SOAP (every basis then comes from the one before by that same step). Later
            bases warm-start from the one in use either way. On small CPU models ``"qr"`` ended within the
            scatter of ``"eigh"`` (docs/results.md, "SOAP's first basis").
    """

    BETA2_KEYS = ("shampoo_beta",)

    def __init__(
        self,
        params: Iterable,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        max_preconditioner_dim: int = 2048,
        precondition_frequency: int = 10,
        start_preconditioning_step: int | None = None,
        precondition_1d: bool = False,
        refresh_skip_tol: float = 0.0,
        runtime: RuntimeConfig | None = None,
        first_basis: str = "eigh",
    ) -> None:
        check_betas(betas)
        #: param groups with their own betas and no shampoo_beta take their betas[1] (``add_param_group``)
        self._follows_beta2 = self.BETA2_KEYS if shampoo_beta is None else ()
        shampoo_beta = betas[1] if shampoo_beta is None else shampoo_beta
        check_arg(isinstance(precondition_1d, bool), "precondition_1d", precondition_1d, "must be a bool")
        self.precondition_1d = precondition_1d
        check_arg(first_basis in self.FIRST_BASES, "first_basis", first_basis, "must be 'eigh' or 'qr'")
        self.first_basis = first_basis
        defaults = dict(lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
                        refresh_skip_tol=refresh_skip_tol)
        self.check_hyperparameters(defaults)
        super().__init__(params, defaults, max_preconditioner_dim=max_preconditioner_dim,
                         precondition_frequency=precondition_frequency,
                         start_preconditioning_step=start_preconditioning_step,
                         runtime=runtime)

    @staticmethod
    def check_hyperparameters(hyper: dict[str, Any], where: str = "") -> None:
        name = lambda key: key_name(where, key)  # noqa: E731
        check_common_hyperparameters(hyper, where)
        check_unit(hyper["shampoo_beta"], name("shampoo_beta"), "must be None or in [0, 1)")
        check_nonnegative(hyper["refresh_skip_tol"], name("refresh_skip_tol"))

    def _init_group(self, group: ShapeGroup) -> list[FactorSet]:
        batch, device = group.batch, group.device
        group.state[EXP_AVG] = torch.zeros((batch, *group.shape), dtype=torch.float32, device=device)
        group.state[EXP_AVG_SQ] = torch.zeros((batch, *group.shape), dtype=torch.float32, device=device)
        if not self._factored(group):
            return []
        return self._eigenbasis_sets(
            group, lambda mode, blocks, order: F.permute_mode_(group.state[EXP_AVG_SQ], blocks, order, mode))

    def _bases(self, group: ShapeGroup) -> list[Tensor | None]:
        if not self._factored(group):
            return [None] * group.order
        return self._placement.read(group)

    def _into_basis(self, group: ShapeGroup, mode: int, blocks: Tensor, weights: Tensor) -> None:
        second = group.state[EXP_AVG_SQ]  # the first moment is kept in plain coordinates: it needs nothing
        second[blocks] = F.project(second[blocks], [weights if m == mode else None for m in range(group.order)])

    def _accumulate(self, group: ShapeGroup, grads: Tensor, keep: Tensor, step: int) -> Tensor | None:
        """Adam's moments in the bases of the step before, the direction from them, then the factors."""
        self._enter_first_bases(group, step)
        hyper = self.param_groups[group.group_index]
        factors = [group.state[factor_key(m)] for m in range(group.order)] if self._factored(group) else []
        steps = group.steps
        first = steps.first()  # a block's first gradient only builds its factors: it never meets its own projection
        if first.every:
            F.update_factors_(factors, grads, 0.0, keep)
            return None
        beta1, beta2 = hyper["betas"]
        # Debiased by each block's own count of steps (s = count - 1 after the first); the factors of a block
        # at its first gradient take it whole (weight 0 on the zeros before).
        moments = first.without(keep)
        bases = self._bases(group)
        F.masked_ema_(group.state[EXP_AVG], grads, steps.of(lambda c: debiased(beta1, max(c - 1, 1))), moments)
        rotated = F.project(grads, bases)
        if first.mask is not None:
            rotated = rotated.masked_fill(F.batch_view(first.mask, rotated), 0.0)  # (may be ``grads`` itself)
        F.masked_ema_square_(group.state[EXP_AVG_SQ], rotated, steps.of(lambda c: debiased(beta2, max(c - 1, 1))),
                             moments)
        del rotated  # (a temporary of the group's size: 4 GiB at 1B)
        direction = self._step_direction(group, bases, hyper["eps"])
        shampoo_beta = hyper["shampoo_beta"]
        F.update_factors_(factors, grads, steps.of(lambda c: debiased(shampoo_beta, c - 1) if c >= 2 else 0.0), keep)
        return direction

    @staticmethod
    def _step_direction(group: ShapeGroup, bases: list[Tensor | None], eps: float) -> Tensor:
        """Adam's direction in the eigenbases ``bases``, rotated back: the first moment projected and divided
        by the root of the second (kept in the bases), floored at ``eps``."""
        denom = group.state[EXP_AVG_SQ].sqrt().clamp_min_(eps)
        # The quotient over ``denom``: the projection may be the state itself (no basis in any mode).
        return F.project(torch.div(F.project(group.state[EXP_AVG], bases), denom, out=denom), bases, back=True)
