"""Shampoo with Adam grafting, as in Meta's Distributed Shampoo, on Asteria's refresh runtime."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from asteria import functional as F
from asteria.checks import (
    check_arg,
    check_betas,
    check_common_hyperparameters,
    check_nonnegative,
    check_positive,
    check_unit,
    key_name,
)
from asteria.config import RuntimeConfig
from asteria.optim.base import SecondOrderOptimizer
from asteria.optim.groups import ShapeGroup
from asteria.optim.state_keys import factor_key, has_root_key, root_key
from asteria.optim.steps import to_device
from asteria.pipeline.factors import FactorSet

GRAFTINGS = ("adam", "none")
MOMENTUM = "momentum"
GRAFTING_SECOND_MOMENT = "grafting_second_moment"


class Shampoo(SecondOrderOptimizer):
    """Shampoo: per block, Kronecker factors L_i <- beta2 L_i + (1 - beta2) G_(i) G_(i)^T every step;
    every ``precondition_frequency`` steps their inverse roots
    (L_i_hat + (eps + relative_eps lambda_max(L_i_hat)) I)^(-1/(2 * order)) are refreshed (on the C++
    workers in ``mode="async"``, inside ``step()`` in ``mode="sync"``); the step direction is the
    bias-corrected momentum multiplied by each mode's root, rescaled per block to the norm of the Adam
    direction (grafting), with decoupled weight decay.

    Args:
        params: parameters or param groups (named parameters give named error messages).
        lr: learning rate.
        betas: (beta1, beta2): momentum of the gradient, and the factors' EMA.
        eps: added to the factors' eigenvalues before the root.
        relative_eps: times each factor's largest eigenvalue, also added: it bounds a root's condition
            number by (1 + 1/relative_eps)^(1/(2 * order)) whatever the gradients' scale. A factor that
            has seen few or small gradients (a small model, a short run) keeps near-zero eigenvalues whose
            directions ``eps`` alone amplifies by up to eps^(-1/(2 * order)). 0 (``eps`` alone, as in
            Distributed Shampoo) by default: on olmo-160m 1e-5 cost 11% in validation loss.
        weight_decay: decoupled weight decay.
        max_preconditioner_dim: largest factor dimension; larger dimensions are split into blocks.
        precondition_frequency: steps between refreshes (f).
        start_preconditioning_step: first refresh step (default: f); before it, the grafting direction.
        precondition_1d: give 1-D parameters (biases, norm gains) a full-matrix factor too, as Distributed
            Shampoo does. Off by default, as in ``SOAP`` and ``KLShampoo``: they take the grafting direction
            (Adam's). A vector's factor is a sum of rank-1 terms whose root has exponent -1/2, so its small
            eigenvalues are amplified far more than a matrix's two -1/4 roots amplify theirs; on a small MLP
            that left Shampoo at 2.3x AdamW's loss (docs/results.md, "Shampoo's 1-D parameters").
        grafting: ``"adam"`` (per-block norm of the Adam direction) or ``"none"``.
        grafting_beta2: Adam grafting's second-moment decay (default: ``betas[1]``, a param group's own
            when it sets ``betas``).
        grafting_eps: Adam grafting's epsilon.
        runtime: an ``asteria.RuntimeConfig``; ``None`` for the defaults (async, staleness 5).
    """

    BETA2_KEYS = ("grafting_beta2",)
    ADDED_HYPERPARAMETERS = {"relative_eps": 0.0}
    #: checkpoints written before ``precondition_1d`` was saved hold 1-D parameters' factors
    PRECONDITION_1D_BEFORE = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-12,
        relative_eps: float = 0.0,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 2048,
        precondition_frequency: int = 10,
        start_preconditioning_step: int | None = None,
        precondition_1d: bool = False,
        grafting: str = "adam",
        grafting_beta2: float | None = None,
        grafting_eps: float = 1e-8,
        runtime: RuntimeConfig | None = None,
    ) -> None:
        check_betas(betas)
        check_arg(isinstance(precondition_1d, bool), "precondition_1d", precondition_1d, "must be a bool")
        self.precondition_1d = precondition_1d
        #: param groups with their own betas and no grafting_beta2 take their betas[1] (``add_param_group``)
        self._follows_beta2 = self.BETA2_KEYS if grafting_beta2 is None else ()
        grafting_beta2 = betas[1] if grafting_beta2 is None else grafting_beta2
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, relative_eps=relative_eps, weight_decay=weight_decay,
                        grafting=grafting, grafting_beta2=grafting_beta2, grafting_eps=grafting_eps)
        self.check_hyperparameters(defaults)
        self._informed_groups: set[int] = set()  # id(group): every block's roots in use are informed (``_informed``)
        super().__init__(params, defaults, max_preconditioner_dim=max_preconditioner_dim,
                         precondition_frequency=precondition_frequency,
                         start_preconditioning_step=start_preconditioning_step, runtime=runtime)

    @staticmethod
    def check_hyperparameters(hyper: dict[str, Any], where: str = "") -> None:
        name = lambda key: key_name(where, key)  # noqa: E731
        check_common_hyperparameters(hyper, where)
        check_nonnegative(hyper["relative_eps"], name("relative_eps"))
        check_arg(hyper["grafting"] in GRAFTINGS, name("grafting"), hyper["grafting"], f"must be one of {GRAFTINGS}")
        check_unit(hyper["grafting_beta2"], name("grafting_beta2"), "must be None or in [0, 1)")
        check_positive(hyper["grafting_eps"], name("grafting_eps"))

    def _informed(self, group: ShapeGroup) -> Tensor | None:
        """(B,) bool on the device: which blocks' preconditioners in use were all snapshotted once the
        block had had a gradient (a version of a zero factor tells nothing); None when all were, as
        whenever every block had its first gradient by the first refresh."""
        steps = group.steps
        if steps.started_by(self.schedule.start) or id(group) in self._informed_groups:
            return None
        informed = [first > 0 for first in steps.first_steps]
        for index in self._sets_of[id(group)]:
            fset = self._set_groups[index][0]
            for block, version in enumerate(fset.versions):
                first = steps.first_steps[fset.offset + block]
                if version < 1 or self.schedule.snapshot_step(index, version) < first:
                    informed[fset.offset + block] = False
        if all(informed):  # for good: versions only grow, and a first step stays (``_forget_derived`` clears it)
            self._informed_groups.add(id(group))
            return None
        return to_device(informed, torch.bool, group.device)

    def _forget_derived(self) -> None:
        self._informed_groups.clear()

    def _init_group(self, group: ShapeGroup) -> list[FactorSet]:
        batch, device = group.batch, group.device
        group.state[MOMENTUM] = torch.zeros((batch, *group.shape), dtype=torch.float32, device=device)
        group.state[GRAFTING_SECOND_MOMENT] = torch.zeros((batch, *group.shape), dtype=torch.float32, device=device)
        sets = []
        for mode, dim in enumerate(self._refresh_dims(group)):
            factor = group.state[factor_key(mode)] = torch.zeros((batch, dim, dim), dtype=torch.float32, device=device)
            root = group.state[root_key(mode)] = self._placement.new_preconditioners(group, dim)
            has_root = group.state[has_root_key(mode)] = torch.zeros(batch, dtype=torch.bool, device=device)
            sets.append(FactorSet(name=f"{group.name}, mode {mode}", mode=mode, factors=factor, preconditioners=root,
                                  installed=has_root, exponent=-1.0 / (2 * group.order),
                                  block_params=[block.name for block in group.blocks]))
        return sets

    def _accumulate(self, group: ShapeGroup, grads: Tensor, keep: Tensor, step: int) -> None:
        hyper = self.param_groups[group.group_index]
        beta1, beta2 = hyper["betas"]
        if self._factored(group):
            F.update_factors_([group.state[factor_key(m)] for m in range(group.order)], grads, beta2, keep)
        F.masked_ema_(group.state[MOMENTUM], grads, beta1, keep)
        F.masked_ema_square_(group.state[GRAFTING_SECOND_MOMENT], grads, hyper["grafting_beta2"], keep)

    def _direction(self, group: ShapeGroup, step: int, accumulated: None) -> Tensor:
        hyper = self.param_groups[group.group_index]
        beta1, beta2 = hyper["betas"][0], hyper["grafting_beta2"]
        # Each block's bias corrections count its own steps (a block without a gradient yet has zero moments).
        momentum = group.state[MOMENTUM]
        bias1 = group.steps.of(lambda c: 1.0 - beta1 ** max(c, 1))
        if hyper["grafting"] == "adam":
            # Grafting rescales each block's Shampoo direction to the Adam direction's norm, so the momentum's bias
            # correction (one number per block) cancels there: Adam's direction alone takes it, in its denominator.
            fallback = F.adam_direction(momentum, group.state[GRAFTING_SECOND_MOMENT], bias1,
                                        group.steps.of(lambda c: 1.0 - beta2 ** max(c, 1)), hyper["grafting_eps"])
        else:
            momentum = fallback = momentum / F.per_block(bias1, momentum)
        if not self._factored(group):
            return fallback
        shampoo = F.precondition(momentum, self._placement.read(group))
        if hyper["grafting"] == "adam":
            F.graft_(shampoo, fallback)
        ready = group.state[has_root_key(0)]
        for mode in range(1, group.order):
            ready = ready & group.state[has_root_key(mode)]
        informed = self._informed(group)
        if informed is not None:  # a root of a block's zero factor (eps^(-1/2k) I): the fallback until a real one
            ready = ready & informed
        return torch.where(F.batch_view(ready, shampoo), shampoo, fallback, out=shampoo)
