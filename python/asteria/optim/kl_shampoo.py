"""KL-Shampoo (Lin et al. 2025): Kronecker factors estimated by KL minimization, each through the other
side's inverse, on Asteria's refresh runtime."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from asteria import functional as F
from asteria.checks import check_betas, check_common_hyperparameters, check_nonnegative, check_positive, key_name
from asteria.config import RuntimeConfig
from asteria.optim.eigen_base import EigenbasisOptimizer
from asteria.optim.groups import ShapeGroup
from asteria.optim.state_keys import factor_key
from asteria.pipeline.factors import FactorSet

EXP_AVG = "exp_avg"
ADAM_EXP_AVG_SQ = "adam_exp_avg_sq"  # 1-D parameters only: they take Adam's step
#: the reference implementation's constant starting eigenvalue (Lin et al. 2025, ``init_factor``)
REFERENCE_INIT_FACTOR = 0.1


def inv_sqrt_key(mode: int) -> str:
    return f"eigen_inv_sqrt_{mode}"


class KLShampoo(EigenbasisOptimizer):
    """KL-Shampoo for blocks of order >= 2 (1-D parameters take Adam's step).

    Per block, with eigenbases Q_a and eigenvalue estimates d_a of the factors S_a:
      S_a <- beta S_a + (1 - beta) / prod_{b != a} n_b · G_(a) (⊗_{b != a} Q_b diag(1/d_b) Q_b^T) G_(a)^T
      d_a <- beta d_a + (1 - beta) diag(Q_a^T S-estimate Q_a), re-estimated every step in the stale basis
      direction = (M ×_a Q_a^T) ⊙ ⊗_a d_a^(-1/2) / (1 + eps ⊗_a d_a^(-1/2)), rotated back
    with M the gradient's EMA (beta1); d_a^(-1/2) is clamped at max(10, min(n_a, 4000)). The first step
    builds the factors and their eigenbasis and takes no step; the eigenvalue estimates start at
    ``init_factor``, or by default at (mean g^2)^(1/k) of the block's first gradient (k modes), so
    that the first steps have the gradient's scale whatever the loss' scale (see ``init_factor``);
    every ``precondition_frequency`` steps the bases are refreshed by one power step and a QR
    factorization, on the C++ workers in ``mode="async"`` — there, as in SOAP, the old basis' columns
    are first ordered by their Rayleigh quotients and d follows that order. No grafting; decoupled
    weight decay.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: (beta1 of the gradient's EMA, beta of the factors and eigenvalue estimates).
        eps: damping of the preconditioned step (and Adam's epsilon for 1-D parameters).
        weight_decay: decoupled weight decay.
        max_preconditioner_dim: largest factor dimension; larger dimensions are split into blocks.
        precondition_frequency: steps between basis refreshes (f).
        init_factor: the eigenvalue estimates' starting value; ``None`` (default): every mode's estimates
            start at (mean g^2)^(1/k) of the block's first gradient g (k modes; blocks without a
            first gradient start at the reference's 0.1). The reference implementation starts at a
            constant 0.1; as the estimates move towards the gradient's scale only by their EMA
            (1 - beta per step), a constant far from that scale shrinks or inflates the first few
            hundred steps (on the tiny OLMo-2 preset, whose gradients are about 1e-2 per entry, the
            steps of its matrices stayed 6-25x below AdamW's for 20 steps, up to 8x at step 80).
        refresh_skip_tol: skip a block's basis refresh when its old basis diagonalizes the factor up to
            this off-diagonal ratio ||Q^T F Q - diag||_F / ||Q^T F Q||_F (0: never; skips are counted
            in ``runtime_stats()["refreshes_skipped"]``).
        runtime: an ``asteria.RuntimeConfig``. With ``deterministic=False`` (one process) each block
            takes its newest finished basis; the eigenvalue estimates follow it through the composed
            column orders of any versions passed over.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        max_preconditioner_dim: int = 2048,
        precondition_frequency: int = 10,
        init_factor: float | None = None,
        refresh_skip_tol: float = 0.0,
        runtime: RuntimeConfig | None = None,
    ) -> None:
        check_betas(betas)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        refresh_skip_tol=refresh_skip_tol, init_factor=init_factor)
        self.check_hyperparameters(defaults)
        super().__init__(params, defaults, max_preconditioner_dim=max_preconditioner_dim,
                         precondition_frequency=precondition_frequency, start_preconditioning_step=1,
                         runtime=runtime)

    @staticmethod
    def check_hyperparameters(hyper: dict[str, Any], where: str = "") -> None:
        name = lambda key: key_name(where, key)  # noqa: E731
        check_common_hyperparameters(hyper, where)
        check_nonnegative(hyper["refresh_skip_tol"], name("refresh_skip_tol"))
        if hyper["init_factor"] is not None:  # None: started from the first gradient
            check_positive(hyper["init_factor"], name("init_factor"))

    def _init_group(self, group: ShapeGroup) -> list[FactorSet]:
        batch, device = group.batch, group.device
        group.state[EXP_AVG] = torch.zeros((batch, *group.shape), dtype=torch.float32, device=device)
        if group.order < 2:
            group.state[ADAM_EXP_AVG_SQ] = torch.zeros((batch, *group.shape), dtype=torch.float32, device=device)
            return []
        init_factor = self.param_groups[group.group_index]["init_factor"]
        init = 1.0 / math.sqrt(REFERENCE_INIT_FACTOR if init_factor is None else init_factor)
        for mode, dim in enumerate(group.shape):
            group.state[inv_sqrt_key(mode)] = torch.full((batch, dim), init, dtype=torch.float32, device=device)
        return self._eigenbasis_sets(
            group, lambda mode, blocks, order: F.permute_mode_(group.state[inv_sqrt_key(mode)], blocks, order, 0))

    def _into_basis(self, group: ShapeGroup, mode: int, blocks: Tensor, weights: Tensor) -> None:
        inv_sqrt = group.state[inv_sqrt_key(mode)]  # d^(-1/2): the eigenvalue estimates d of this dimension
        estimates = torch.einsum("ban,ba->bn", weights, inv_sqrt[blocks].pow(-2))
        inv_sqrt[blocks] = estimates.rsqrt()

    def _accumulate(self, group: ShapeGroup, grads: Tensor, keep: Tensor, step: int) -> Tensor | None:
        """The momentum, the direction from it and the eigenvalue estimates before this step's, then the
        factors and the estimates."""
        self._enter_first_bases(group, step)
        hyper = self.param_groups[group.group_index]
        beta1, beta = hyper["betas"]
        first = group.steps.first()  # a block's first gradient builds its factors alone; it takes no step
        if not first.none:
            starting = first.only(keep)
            if group.order >= 2:
                only = grads if first.every else grads * F.batch_view(first.mask, grads)
                self._update_factors(group, only, starting, beta, rotate=False)
                if hyper["init_factor"] is None:
                    self._init_from_gradient(group, only, starting)
            if first.every:
                return None
            keep = first.without(keep)
            grads = grads.masked_fill(F.batch_view(first.mask, grads), 0.0)
        F.masked_ema_(group.state[EXP_AVG], grads, beta1, keep)
        if group.order < 2:
            # Adam's bias corrections count each block's steps after its first (s = count - 1).
            F.masked_ema_square_(group.state[ADAM_EXP_AVG_SQ], grads, hyper["betas"][1], keep)
            return self._adam_direction(group, hyper)
        bases = self._placement.read(group)
        direction = self._step_direction(group, bases, hyper["eps"])
        self._update_factors(group, grads, keep, beta, rotate=True)
        return direction

    @staticmethod
    def _adam_direction(group: ShapeGroup, hyper: dict) -> Tensor:
        """Adam's direction for the blocks of vectors and scalars, which KL-Shampoo does not precondition."""
        beta1, beta2 = hyper["betas"]
        return F.adam_direction(group.state[EXP_AVG], group.state[ADAM_EXP_AVG_SQ],
                                group.steps.of(lambda c: 1.0 - beta1 ** max(c - 1, 1)),
                                group.steps.of(lambda c: 1.0 - beta2 ** max(c - 1, 1)), hyper["eps"])

    def _step_direction(self, group: ShapeGroup, bases: list[Tensor], eps: float) -> Tensor:
        """The momentum in the eigenbases times s / (1 + eps s), s = prod_a d_a^(-1/2) from the eigenvalue
        estimates as they stand (before this step's update), rotated back."""
        # As a division by 1/s + eps = prod_a d_a^(1/2) + eps: two passes over the block (the damped outer
        # product in one addcmul, then the division in place).
        sqrt_d = self._outer(group, [1.0 / group.state[inv_sqrt_key(mode)] for mode in range(group.order)],
                             plus=eps)
        rotated = F.project(group.state[EXP_AVG], bases).div_(sqrt_d)
        del sqrt_d  # (each temporary is the group's size: 4 GiB at 1B)
        return F.project(rotated, bases, back=True)

    def _init_from_gradient(self, group: ShapeGroup, grads: Tensor, keep: Tensor) -> None:
        """Every mode's eigenvalue estimates start at (mean g^2)^(1/order) of the block's first gradient, so
        that their Kronecker product matches its second moment (blocks without one keep the constant)."""
        second_moment = grads.reshape(group.batch, -1).square().mean(dim=1)
        usable = keep & (second_moment > 0)
        d = second_moment.clamp_min(torch.finfo(grads.dtype).tiny) ** (1.0 / group.order)
        for mode in range(group.order):
            inv_sqrt = group.state[inv_sqrt_key(mode)]
            new = (1.0 / d.sqrt()).clamp(max=float(max(10, min(group.shape[mode], 4000))))
            inv_sqrt.copy_(torch.where(usable.unsqueeze(-1), new.unsqueeze(-1).expand_as(inv_sqrt), inv_sqrt))

    def _inv_sqrt_outer(self, group: ShapeGroup, skip: int | None = None) -> Tensor:
        """(B, n_0, ..., n_k): the outer product of every mode's d^(-1/2) (mode ``skip`` left out)."""
        return self._outer(group, [None if mode == skip else group.state[inv_sqrt_key(mode)]
                                   for mode in range(group.order)])

    @staticmethod
    def _outer(group: ShapeGroup, vectors: list[Tensor | None], plus: float | None = None) -> Tensor:
        """The outer product of per-mode (B, n_mode) vectors (None: that mode left out), broadcastable
        against (B, n_0, ..., n_k); with ``plus``, that constant added (fused into the last product)."""
        views = []
        for mode, vector in enumerate(vectors):
            if vector is not None:
                shape = [group.batch] + [1] * group.order
                shape[mode + 1] = group.shape[mode]
                views.append(vector.view(shape))
        out = views[0]
        for view in views[1:-1]:
            out = out * view
        if len(views) == 1:
            return out if plus is None else out + plus
        if plus is None:
            return out * views[-1]
        # The constant as a device scalar filled on the stream: a tensor made from the host value would be
        # copied synchronously and make the training thread wait for the GPU.
        return torch.addcmul(torch.full((), plus, dtype=out.dtype, device=out.device), out, views[-1])

    def _estimates(self, group: ShapeGroup, rotated: Tensor) -> list[Tensor]:
        """Per mode a, the mean over the other modes of (rotated ⊙ ⊗_{b != a} d_b^(-1/2))^2: the eigenvalue
        estimates in the current bases. For matrices this is two batched matrix-vector products of the
        squared rotated gradient with the other side's 1/d (no weighted copies of the block)."""
        if group.order == 2:
            squared = rotated.square()
            inv_d = [group.state[inv_sqrt_key(mode)].square() for mode in range(2)]
            rows, cols = group.shape
            return [torch.bmm(squared, inv_d[1].unsqueeze(-1)).squeeze(-1) / cols,
                    torch.bmm(inv_d[0].unsqueeze(1), squared).squeeze(1) / rows]
        return [F.mode_mean((rotated * self._inv_sqrt_outer(group, skip=mode)) ** 2, mode)
                for mode in range(group.order)]

    def _update_factors(self, group: ShapeGroup, grads: Tensor, keep: Tensor, beta: float, rotate: bool) -> None:
        """The KL factor update (each factor through the other modes' inverse) and, after the first
        step, the eigenvalue estimates in the stale bases; all from the state before this step."""
        bases = self._placement.read(group)
        numel = math.prod(group.shape)
        last = group.order - 1
        # Nothing below reads the factors, so each may take its update as soon as it is computed.
        for mode in range(group.order):
            if rotate:
                others = [None if b == mode else bases[b] for b in range(group.order)]
                projected = F.project(grads, others)
                half = projected * self._inv_sqrt_outer(group, skip=mode)
            else:
                half = grads
            F.gram_ema_(group.state[factor_key(mode)], half, mode, beta, keep, weight=group.shape[mode] / numel)
            del half  # each mode's temporaries (the group's size) go before the next mode's are made
            if rotate and mode < last:
                del projected
        if rotate:
            # The last mode's projection has every mode but the last rotated already, in project()'s
            # order: one more mode product gives project(grads, bases), bit for bit, a matmul saved.
            rotated = F.project(projected, [None] * last + [bases[last]])
            del projected
            estimates = self._estimates(group, rotated)
            for mode, estimate in enumerate(estimates):
                inv_sqrt = group.state[inv_sqrt_key(mode)]
                d = inv_sqrt.pow(-2).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).lerp_(estimate, 1.0 - beta)
                new = d.rsqrt_().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
                new.clamp_(max=float(max(10, min(group.shape[mode], 4000))))
                torch.where(F.batch_view(keep, new), new, inv_sqrt, out=inv_sqrt)

