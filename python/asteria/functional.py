"""The per-step math of the second-order optimizers as small pure functions on batched blocks.

Every tensor here carries a leading batch dimension B (blocks of one shape stacked together).
Functions ending in ``_`` update their first argument in place; the others allocate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


def batch_view(vector: Tensor, like: Tensor) -> Tensor:
    """``vector`` (B,) reshaped to broadcast against ``like`` (B, ...)."""
    return vector.view((-1,) + (1,) * (like.dim() - 1))


def finite_rows(x: Tensor) -> Tensor:
    """(B,) bool: which blocks hold only finite numbers."""
    return torch.isfinite(x).reshape(x.shape[0], -1).all(dim=1)


def usable_gradient_rows(grads: Tensor) -> Tensor:
    """(B,) bool: which blocks' gradients may enter the statistics: every entry finite and the squared
    Frobenius norm finite in float32. The second rejects a finite gradient whose outer products
    would overflow (|g| ~ 1e20): every entry of G G^T and of G * G is bounded by ||G||_F^2."""
    norms = torch.linalg.vector_norm(grads.reshape(grads.shape[0], -1), dim=1)  # one read, no temporary
    return torch.isfinite(norms * norms)


def mode_matrix(x: Tensor, mode: int) -> Tensor:
    """Unfolds (B, d_0, ..., d_k) along dimension ``mode`` into (B, d_mode, prod(others))."""
    return x.movedim(mode + 1, 1).reshape(x.shape[0], x.shape[mode + 1], -1)


def gram_operands(x: Tensor, mode: int) -> tuple[Tensor, Tensor]:
    """Two operands whose batched product is the mode-``mode`` Gram matrix X_(mode) X_(mode)^T of
    (B, d_0, ..., d_k). For the first and the last mode they are views of a contiguous ``x`` (the last
    mode as (B, rest, d_k) transposed), so no unfolded copy is made; the other modes unfold."""
    if 0 < mode == x.dim() - 2:
        flat = x.reshape(x.shape[0], -1, x.shape[-1])
        return flat.mT, flat
    unfolded = mode_matrix(x, mode)
    return unfolded, unfolded.mT


def mode_mean(x: Tensor, mode: int) -> Tensor:
    """(B, d_mode): the mean of (B, d_0, ..., d_k) over every dimension but the batch and ``mode``."""
    others = [d for d in range(1, x.dim()) if d != mode + 1]
    return x.mean(dim=others) if others else x


def per_block(value: float | Tensor, like: Tensor) -> float | Tensor:
    """A number for every block: ``value`` itself, or a (B,) tensor of one per block shaped to broadcast
    against ``like`` (B, ...)."""
    return value if not isinstance(value, Tensor) else batch_view(value, like)


def masked_ema_(state: Tensor, update: Tensor, beta: float | Tensor, keep: Tensor) -> Tensor:
    """state <- beta * state + (1 - beta) * update for kept blocks; others unchanged. One pass over
    ``state`` (a lerp towards ``update`` by 1 - beta, by 0 where not kept). ``beta``: one for every block,
    or a (B,) tensor of one per block (as in every function here that takes a ``float | Tensor``).

    ``update`` must be finite in blocks that are not kept (the caller zeroes bad gradients).
    """
    weight = torch.where(keep, 1.0 - beta, 0.0).to(state.dtype)
    return state.lerp_(update, batch_view(weight, state))


def masked_ema_square_(state: Tensor, update: Tensor, beta: float | Tensor, keep: Tensor) -> Tensor:
    """state <- beta * state + (1 - beta) * update^2 for kept blocks, without forming update^2.

    ``update`` must be zero in blocks that are not kept (the caller zeroes bad gradients).
    """
    decay = torch.where(keep, beta, 1.0).to(state.dtype)
    state.mul_(batch_view(decay, state))
    if isinstance(beta, Tensor):
        return state.addcmul_(update * batch_view(1.0 - beta, update), update)
    return state.addcmul_(update, update, value=1.0 - beta)


def decoupled_update_(weights: Tensor, direction: Tensor, lr: float, weight_decay: float, keep: Tensor) -> Tensor:
    """weights <- weights (1 - lr weight_decay) - lr direction in kept blocks, others unchanged bit for bit;
    two passes over the block (a per-block decay, then a per-block step through ``addcmul_``), one without weight
    decay (a decay of exactly 1 would change no bit).

    ``direction`` must be finite in blocks that are not kept (0 times NaN is NaN).
    """
    decay, step = update_coefficients(weights.dtype, lr, weight_decay, keep)
    if decay is not None:
        weights.mul_(batch_view(decay, weights))
    return weights.addcmul_(direction, batch_view(step, weights))


def decoupled_update_blocks_(blocks: list[Tensor], direction: Tensor, lr: float, weight_decay: float,
                             keep: Tensor) -> None:
    """``decoupled_update_`` of B tensors of ``direction``'s dtype (the parameters' views of their blocks) along
    (B, *shape) ``direction``: the same numbers bit for bit, without a stacked copy of the blocks to update and
    write back."""
    decay, step = update_coefficients(direction.dtype, lr, weight_decay, keep)
    if decay is not None:
        torch._foreach_mul_(blocks, list(decay.unbind(0)))
    torch._foreach_addcmul_(blocks, list(direction.unbind(0)), list(step.unbind(0)))


def update_coefficients(dtype: torch.dtype, lr: float, weight_decay: float, keep: Tensor) -> tuple[Tensor | None,
                                                                                                     Tensor]:
    """(B,) per-block decay (None without weight decay) and step of the decoupled update, in ``dtype``: 1 and 0
    where a block is not kept."""
    decays = isinstance(weight_decay, Tensor) or weight_decay != 0.0  # (a tensor lr is never read on the host)
    one = torch.ones((), dtype=dtype, device=keep.device)  # (Python scalars alone would make float32 coefficients)
    decay = torch.where(keep, one * (1.0 - lr * weight_decay), one) if decays else None
    return decay, torch.where(keep, one * -lr, 0.0 * one)


def gram_ema_(factor: Tensor, x: Tensor, mode: int, beta: float | Tensor, keep: Tensor,
              weight: float = 1.0) -> Tensor:
    """factor <- beta factor + (1 - beta) weight X_(mode) X_(mode)^T for kept blocks, the EMA fused into the
    batched product. ``x`` must be zero in blocks that are not kept (their decay is 1)."""
    decay = batch_view(torch.where(keep, beta, 1.0).to(factor.dtype), factor)
    left, right = gram_operands(x, mode)
    if isinstance(beta, Tensor):  # one weight per block: on the left operand (a scaled copy of the block)
        return factor.mul_(decay).baddbmm_(left * batch_view((1.0 - beta) * weight, left), right)
    return factor.mul_(decay).baddbmm_(left, right, alpha=(1.0 - beta) * weight)


def update_factors_(factors: list[Tensor], grad: Tensor, beta2: float | Tensor, keep: Tensor) -> None:
    """Kronecker factor EMA, one factor per mode: F_i <- beta2 F_i + (1 - beta2) G_(i) G_(i)^T."""
    for mode, factor in enumerate(factors):
        gram_ema_(factor, grad, mode, beta2, keep)


def apply_mode(x: Tensor, matrix: Tensor, mode: int) -> Tensor:
    """Mode-``mode`` product of (B, d_0, ..., d_k) with (B, d_mode, d_mode): contracts that dimension.
    The first and the last mode multiply a contiguous ``x`` in place of its unfolding (from the left, or
    by the transpose from the right), so neither the input nor the result is copied to move a dimension."""
    if mode == 0:
        return torch.bmm(matrix, x.reshape(x.shape[0], x.shape[1], -1)).view(x.shape)
    if mode == x.dim() - 2:
        return torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), matrix.mT).view(x.shape)
    moved = x.movedim(mode + 1, 1)
    shape = moved.shape
    product = torch.bmm(matrix, moved.reshape(shape[0], shape[1], -1)).view(shape)
    return product.movedim(1, mode + 1)


def precondition(x: Tensor, roots: list[Tensor]) -> Tensor:
    """x multiplied by each mode's (symmetric) root: the Shampoo direction."""
    if len(roots) == 2:
        return torch.bmm(torch.bmm(roots[0], x), roots[1])
    for mode, root in enumerate(roots):
        x = apply_mode(x, root, mode)
    return x


def block_norms(x: Tensor) -> Tensor:
    """(B,) Frobenius norm of each block."""
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1)


def graft_(direction: Tensor, target: Tensor) -> Tensor:
    """Rescales each block of ``direction`` in place to the norm of the same block of ``target``."""
    scale = block_norms(target) / block_norms(direction).clamp_min(torch.finfo(direction.dtype).tiny)
    return direction.mul_(batch_view(scale, direction))


def adam_direction(momentum: Tensor, second_moment: Tensor, bias1: float | Tensor, bias2: float | Tensor,
                   eps: float) -> Tensor:
    """Bias-corrected Adam direction m_hat / (sqrt(v_hat) + eps) = m / (sqrt(v bias1^2 / bias2) + eps bias1), in
    one new tensor of the block's size: both corrections go into the denominator (three passes), which the
    quotient then overwrites, so the momentum is neither copied nor changed."""
    scale, shift = bias1 * bias1 / bias2, eps * bias1
    denominator = (second_moment * per_block(scale, second_moment)).sqrt_().add_(per_block(shift, second_moment))
    return torch.div(momentum, denominator, out=denominator)


def regularize_eigenvalues(eigenvalues: Tensor, eps: float, relative_eps: float = 0.0) -> Tensor:
    """mu + eps + relative_eps * max(mu), mu = lambda shifted up to zero where its smallest value is negative
    (round-off on a semi-definite matrix). The relative term bounds the condition number whatever the
    factor's scale."""
    shifted = eigenvalues + (-eigenvalues.amin(dim=-1, keepdim=True)).clamp_min(0.0)
    if relative_eps == 0.0:
        return shifted + eps
    return shifted + (eps + relative_eps * shifted.amax(dim=-1, keepdim=True))


def product(a: Tensor, b: Tensor, widen: bool = False) -> Tensor:
    """``a @ b``; with ``widen``, computed in float64 and rounded back: a float32 product whatever precision
    torch's global matmul setting allows (TF32), for threads that must not change that setting."""
    if widen and a.dtype == torch.float32:
        return (a.double() @ b.double()).to(a.dtype)
    return a @ b


def inverse_root(factor: Tensor, exponent: float, eps: float, scale: float,
                 widen: bool = False, relative_eps: float = 0.0) -> tuple[Tensor, Tensor]:
    """(scale * F + regularization)^exponent of a batch of symmetric matrices by eigendecomposition
    (``regularize_eigenvalues``).

    Works in float32 and retries in float64 when ``torch.linalg.eigh`` fails. Returns the roots and
    a (B,) bool of which are usable (finite input and finite output); unusable rows hold identity.
    ``widen``: the root's product at least in float32 (see ``product``).
    """
    eye = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
    usable_input = finite_rows(factor)
    matrix = torch.where(batch_view(usable_input, factor), factor * scale, eye)
    try:
        eigenvalues, vectors = torch.linalg.eigh(matrix)
    except RuntimeError:  # torch.linalg.LinAlgError: no convergence in float32
        eigenvalues, vectors = torch.linalg.eigh(matrix.double())
    powers = regularize_eigenvalues(eigenvalues, eps, relative_eps).pow(exponent)
    roots = product(vectors * powers.unsqueeze(-2), vectors.mT, widen).to(factor.dtype)
    usable = usable_input & finite_rows(roots)
    return torch.where(batch_view(usable, roots), roots, eye), usable


@contextlib.contextmanager
def float32_matmuls() -> Iterator[None]:
    """Float32 matrix products inside (``torch.set_float32_matmul_precision("highest")``), the previous
    precision restored after. For the native refreshes: with ``"high"`` a GPU computes the power step
    of the warm-started eigenbasis refresh in TF32, whose rounding (about 1e-3 of the largest
    eigenvalue) swamps the directions of the small eigenvalues, so each refresh would scramble the
    basis there. The CPU workers compute in float32; so must the baseline they are compared with."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def eigenbasis(factor: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvectors (as columns, by descending eigenvalue) of a batch of symmetric matrices, and a (B,)
    bool of which are usable; unusable rows hold identity. float64 retry when float32 fails. A zero
    matrix gets the identity (see ``identity_rows``)."""
    eye = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
    usable_input = finite_rows(factor)
    matrix = torch.where(batch_view(usable_input, factor), factor, eye)
    try:
        _, vectors = torch.linalg.eigh(matrix)
    except RuntimeError:  # torch.linalg.LinAlgError: no convergence in float32
        _, vectors = torch.linalg.eigh(matrix.double())
    vectors = vectors.flip(-1).to(factor.dtype)
    usable = usable_input & finite_rows(vectors)
    return torch.where(batch_view(usable & ~zero_rows(factor), vectors), vectors, eye), usable


def zero_rows(x: Tensor) -> Tensor:
    """(B,) bool: which blocks are all zeros (the factors of a parameter without a usable gradient yet)."""
    return (x == 0).reshape(x.shape[0], -1).all(dim=1)


def identity_rows(bases: Tensor) -> Tensor:
    """(B,) bool: which bases are exactly the identity, as a zero factor's is: nothing is known of that
    block's directions yet (its parameter had no gradient), so its next refresh is a full
    eigendecomposition rather than a warm start (the C++ engine's rule too)."""
    eye = torch.eye(bases.shape[-1], dtype=bases.dtype, device=bases.device)
    return (bases == eye).reshape(bases.shape[0], -1).all(dim=1)


def cholesky_qr(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """The Q factor of each (n, n) block's QR factorization, by shifted Cholesky QR and two plain passes after it
    (CholeskyQR3, Fukaya et al. 2020) in float64, and a (B,) bool of the blocks it factored. Q spans the same
    nested column spaces as Householder QR's, with R's diagonal positive; the shift keeps the first Gram matrix
    definite however ill-conditioned the block (a SOAP power step's reaches 1e10). It is Gram products, a Cholesky
    factorization and a triangular solve, which a GPU batches, where its Householder QR is latency-bound: 4.9
    against 11.0 ms per 2048 block at a batch of 16 on an H200 (docs/results.md, "Refresh math on the GPU"). A zero
    block has no factorization (its Gram matrix and shift are 0): it is reported unfactored."""
    x = matrix.double()
    n = x.shape[-1]
    eye = torch.eye(n, dtype=x.dtype, device=x.device)
    factored = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    for first in (True, False, False):
        gram = x.mT @ x
        if first:
            trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
            gram = gram + (11 * (2 * n * n + n) * torch.finfo(torch.float64).eps * trace)[..., None, None] * eye
        upper, info = torch.linalg.cholesky_ex(gram, upper=True)
        factored &= info == 0
        upper = torch.where(batch_view(factored, upper), upper, eye)
        x = torch.linalg.solve_triangular(upper, x, upper=True, left=False)
    return x.to(matrix.dtype), factored


def qr_refresh(factor: Tensor, basis: Tensor, skip_tol: float = 0.0, widen: bool = False,
               cholesky: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """SOAP's warm-started eigenbasis refresh: the old basis' columns sorted by their Rayleigh quotients
    diag(Q^T F Q) (descending), one power step F Q, and a QR factorization. With ``skip_tol`` > 0 a
    block whose old basis already diagonalizes F up to that off-diagonal ratio keeps it unchanged.
    ``cholesky``: the QR factorization by ``cholesky_qr`` (Householder QR for the blocks it cannot factor), else
    by torch's Householder QR.

    Returns the new bases, the (B, n) column order applied to the old basis, a (B,) usability mask
    (unusable rows keep the old basis) and a (B,) mask of skipped blocks. ``widen``: the products at least
    in float32 (see ``product``)."""
    power = product(factor, basis, widen)
    estimates = (basis * power).sum(dim=-2)
    order = torch.argsort(estimates, dim=-1, descending=True, stable=True)
    skipped = torch.zeros(factor.shape[0], dtype=torch.bool, device=factor.device)
    if skip_tol > 0:
        rotated = product(basis.mT, power, widen)
        diagonal = torch.linalg.vector_norm(torch.diagonal(rotated, dim1=-2, dim2=-1), dim=-1)
        total = torch.linalg.matrix_norm(rotated)
        off = (total.square() - diagonal.square()).clamp_min(0).sqrt()
        skipped = off <= skip_tol * total
        identity = torch.arange(order.shape[-1], device=order.device).expand_as(order)
        order = torch.where(skipped.unsqueeze(-1), identity, order)
    power = power.gather(-1, order.unsqueeze(-2).expand_as(power))
    usable_input = finite_rows(factor)
    power = torch.where(batch_view(usable_input, power), power, basis)
    if cholesky:
        vectors, factored = cholesky_qr(power)
        if not bool(factored.all()):  # a zero factor's block: Householder QR gives it an orthonormal basis
            vectors = torch.where(batch_view(factored, vectors), vectors, torch.linalg.qr(power).Q)
    else:
        vectors = torch.linalg.qr(power).Q
    vectors = torch.where(batch_view(skipped, vectors), basis, vectors)
    usable = usable_input & finite_rows(vectors)
    return torch.where(batch_view(usable, vectors), vectors, basis), order, usable, skipped


def project(x: Tensor, bases: list[Tensor | None], back: bool = False) -> Tensor:
    """Rotates (B, d_0, ..., d_k) into the eigenbases (x ×_i Q_i^T), or back (x ×_i Q_i); a ``None``
    basis leaves its dimension as it is."""
    for mode, basis in enumerate(bases):
        if basis is not None:
            x = apply_mode(x, basis if back else basis.mT, mode)
    return x


def permute_mode_(x: Tensor, blocks: Tensor, order: Tensor, mode: int) -> None:
    """Reorders dimension ``mode`` of the listed blocks of (B, d_0, ..., d_k) by ``order`` (b, d_mode)."""
    picked = x[blocks]
    index = order.view(order.shape[0], *([1] * mode), order.shape[1], *([1] * (x.dim() - mode - 2)))
    x[blocks] = picked.gather(mode + 1, index.expand_as(picked))
