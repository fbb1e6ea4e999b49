"""The batched per-step math (``asteria.functional``) against formulas written here, in float64."""

from __future__ import annotations

import pytest
import torch

import asteria
from asteria import functional as F
from asteria.optim.kl_shampoo import inv_sqrt_key
from asteria.pipeline import streams


def test_masked_emas_update_kept_blocks_and_leave_the_others_bit_for_bit():
    torch.manual_seed(0)
    state = torch.randn(4, 3, 5, dtype=torch.float64)
    update = torch.randn(4, 3, 5, dtype=torch.float64)
    keep = torch.tensor([True, False, True, False])
    update[~keep] = 0.0  # as the optimizers hand them over
    beta = 0.9
    ema = F.masked_ema_(state.clone(), update, beta, keep)
    square = F.masked_ema_square_(state.clone(), update, beta, keep)
    torch.testing.assert_close(ema[keep], beta * state[keep] + (1 - beta) * update[keep])
    torch.testing.assert_close(square[keep], beta * state[keep] + (1 - beta) * update[keep] ** 2)
    assert torch.equal(ema[~keep], state[~keep]) and torch.equal(square[~keep], state[~keep])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_decoupled_update_steps_kept_blocks_and_leaves_the_others_bit_for_bit(dtype, weight_decay):
    torch.manual_seed(3)
    weights = torch.randn(4, 3, 5, dtype=dtype)
    direction = torch.randn(4, 3, 5, dtype=dtype)
    keep = torch.tensor([True, False, False, True])
    lr = 0.05
    updated = F.decoupled_update_(weights.clone(), direction, lr, weight_decay, keep)
    torch.testing.assert_close(updated[keep], weights[keep] * (1 - lr * weight_decay) - lr * direction[keep])
    assert torch.equal(updated[~keep], weights[~keep])


@pytest.mark.parametrize("shape", [(6,), (6, 4), (3, 4, 5)])
def test_mode_products_grams_and_means_match_the_unfolding(shape):
    torch.manual_seed(1)
    x = torch.randn(2, *shape, dtype=torch.float64)
    letters = "ijk"[:len(shape)]
    for mode, dim in enumerate(shape):
        matrix = torch.randn(2, dim, dim, dtype=torch.float64)
        # Contract dimension ``mode`` of x with the matrix's columns: (M x_(mode)), folded back.
        out = letters.replace(letters[mode], "z")
        expected = torch.einsum(f"bz{letters[mode]},b{letters}->b{out}", matrix, x)
        torch.testing.assert_close(F.apply_mode(x, matrix, mode), expected)
        unfolded = x.movedim(mode + 1, 1).reshape(2, dim, -1)
        left, right = F.gram_operands(x, mode)
        torch.testing.assert_close(left @ right, unfolded @ unfolded.mT)
        torch.testing.assert_close(F.mode_mean(x, mode), unfolded.mean(dim=-1))


def test_copy_leading_rows_on_the_cpu_copies_the_basis_rows():
    slab = torch.randn(3, 6, 4)
    target = torch.zeros(3, 4, 4)
    assert streams.copy_leading_rows_(target, slab, extra_row=5) is None  # the CPU path asks for no extra row
    assert torch.equal(target, slab[:, :4])


def test_kl_shampoo_matrix_estimates_match_the_general_formula():
    """The matrix path (two batched matrix-vector products) gives the mean over the other mode of
    (rotated ⊙ d_other^(-1/2))^2, as the general path (and the reference) define it."""
    torch.manual_seed(2)
    layer = torch.nn.Linear(6, 5, bias=False)
    opt = asteria.KLShampoo(layer.parameters(), runtime=asteria.RuntimeConfig(mode="sync"))
    with opt:
        for _ in range(3):
            opt.zero_grad()
            layer(torch.randn(8, 6)).square().sum().backward()
            opt.step()
        group = opt._groups[0]
        rotated = torch.randn(group.batch, *group.shape)
        fast = opt._estimates(group, rotated)
        general = [F.mode_mean((rotated * opt._inv_sqrt_outer(group, skip=mode)) ** 2, mode) for mode in range(2)]
        assert group.state[inv_sqrt_key(0)].shape == (group.batch, group.shape[0])
        for a, b in zip(fast, general, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", [asteria.SOAP, asteria.KLShampoo, asteria.Shampoo])
def test_native_refreshes_compute_in_float32_whatever_the_matmul_precision(kind, monkeypatch):
    """Native mode's refreshes run with float32 matrix products (as the CPU workers compute) even when
    the run allows TF32, and the run's own setting is back in force after each refresh."""
    from conftest import small_mlp, train

    seen = []
    for name in ("qr_refresh", "eigenbasis", "inverse_root"):
        def spy(*args, _original=getattr(F, name), **kwargs):
            seen.append(torch.get_float32_matmul_precision())
            return _original(*args, **kwargs)
        monkeypatch.setattr(F, name, spy)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        model = small_mlp()
        opt = kind(model.parameters(), precondition_frequency=3, runtime=asteria.RuntimeConfig(mode="sync"))
        train(model, opt, 8)
        assert len(seen) >= 3 and set(seen) == {"highest"}
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_float32_matmuls_restores_the_precision_after_a_raise():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with pytest.raises(RuntimeError, match="inside"), F.float32_matmuls():
            assert torch.get_float32_matmul_precision() == "highest"
            raise RuntimeError("inside")
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def soap_like_power(n: int, seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank-deficient PSD factor with eigenvalues over ten decades (float32), and the old basis a refresh
    starts from: its eigenvectors turned by a small random rotation."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=gen))
    values = torch.cat([torch.logspace(0, -10, rank, dtype=torch.float64), torch.zeros(n - rank, dtype=torch.float64)])
    skew = torch.randn(n, n, dtype=torch.float64, generator=gen) * 1e-2 / n
    return ((q * values) @ q.T).float(), (q @ torch.linalg.matrix_exp(skew - skew.T)).float()


def test_cholesky_qr_is_the_q_of_householder_qr_up_to_column_signs():
    """On power steps as SOAP's refresh takes them (condition numbers far past 1/sqrt(eps) of float64): Q is
    orthonormal, Q^T P is upper triangular (the same nested column spaces), and each column whose R entry stands
    above 1e-6 of ||P|| is float64 Householder QR's column up to its sign."""
    factors, bases = zip(*(soap_like_power(48, seed, rank) for seed, rank in ((0, 48), (1, 30), (2, 12))))
    gen = torch.Generator().manual_seed(7)
    u, v = (torch.linalg.qr(torch.randn(48, 48, dtype=torch.float64, generator=gen))[0] for _ in range(2))
    graded = (u * torch.logspace(0, -12, 48, dtype=torch.float64)) @ v.T  # unshifted, its Gram matrix fails Cholesky
    power = torch.cat([torch.stack(factors) @ torch.stack(bases), graded.float()[None]])
    q, factored = F.cholesky_qr(power)
    assert q.dtype == torch.float32 and factored.all()
    assert float((q.mT @ q - torch.eye(48)).abs().max()) < 1e-5
    r = (q.double().mT @ power.double())
    scale = torch.linalg.matrix_norm(power.double())[:, None, None]
    assert float((torch.tril(r, diagonal=-1) / scale).abs().max()) < 1e-6
    householder = torch.linalg.qr(power.double()).Q
    determined = r.diagonal(dim1=-2, dim2=-1).abs() > 1e-6 * scale[:, 0]
    alignment = (q.double() * householder).sum(-2).abs()
    assert determined.sum() >= 70  # of 138 nonzero singular values over ten decades and more
    assert float((1 - alignment[determined]).abs().max()) < 1e-6  # float32 Householder QR's own: 2.5e-7


def test_qr_refresh_by_cholesky_qr_matches_householder_and_keeps_the_rules_for_odd_blocks():
    """The same refresh either way (the order, the usable and skipped masks, the basis up to column signs where
    the factor is nonzero); a zero factor, which Cholesky QR cannot factor, takes Householder QR's basis, and a
    non-finite one keeps its old basis."""
    factors, bases = zip(*(soap_like_power(32, seed, rank) for seed, rank in ((3, 32), (4, 20), (5, 8))))
    factor, basis = torch.stack(factors + (torch.zeros(32, 32), factors[0])), torch.stack(bases + bases[:2])
    factor[4, 0, 0] = float("nan")
    by_cholesky = F.qr_refresh(factor, basis, cholesky=True)
    by_householder = F.qr_refresh(factor, basis, cholesky=False)
    for a, b in zip(by_cholesky[1:], by_householder[1:]):
        assert torch.equal(a, b)
    assert by_cholesky[2].tolist() == [True, True, True, True, False]
    torch.testing.assert_close(by_cholesky[0][3], by_householder[0][3])  # zero factor: Householder's basis
    assert torch.equal(by_cholesky[0][4], basis[4])  # non-finite factor: the old basis stays
    for block in range(3):
        new_c, new_h = by_cholesky[0][block].double(), by_householder[0][block].double()
        f = factor[block].double()
        off = [torch.linalg.matrix_norm(m - torch.diag(m.diagonal())) / torch.linalg.matrix_norm(m)
               for m in (new_c.T @ f @ new_c, new_h.T @ f @ new_h)]
        assert float(abs(off[0] - off[1])) < 1e-6
        leading = slice(0, (8, 20, 8)[block] // 2)  # columns of the factor's range, well above its rounding
        assert float((1 - (new_c * new_h).sum(0).abs()[leading]).abs().max()) < 1e-4


def test_usable_gradient_rows_reject_blocks_whose_squared_norm_overflows_float32():
    """Entries whose squares are finite but whose sum is not (4096 x 1e36 > 3.4e38) are rejected with NaN and
    Inf; an ordinary block and a zero one pass, and so do the same entries scaled down (the NaN left out)."""
    grads = torch.zeros(5, 64, 64)
    grads[0].normal_()
    grads[2].fill_(1e18)
    grads[3, 5, 7] = float("nan")
    grads[4, 0, 0] = float("inf")
    assert F.usable_gradient_rows(grads).tolist() == [True, True, False, False, False]
    assert F.usable_gradient_rows(grads[:, :4, :4] * 1e-3).tolist() == [True, True, True, True, False]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_the_update_through_block_views_equals_the_stacked_one_bit_for_bit(dtype, weight_decay):
    """Blocks cut from the columns of two parameters (strided views), some not kept: updated through their views,
    the parameters hold the numbers of the stacked copy's update written back."""
    torch.manual_seed(4)
    params = [torch.randn(3, 8, dtype=dtype), torch.randn(3, 4, dtype=dtype)]
    views = lambda ps: [ps[0][:, :4], ps[0][:, 4:], ps[1]]  # noqa: E731
    direction = torch.randn(3, 3, 4, dtype=dtype)
    keep = torch.tensor([True, False, True])
    stacked, before = [p.clone() for p in params], [p.clone() for p in params]
    updated = F.decoupled_update_(torch.stack(views(stacked)), direction, 0.05, weight_decay, keep)
    torch._foreach_copy_(views(stacked), list(updated.unbind(0)))
    F.decoupled_update_blocks_(views(params), direction, 0.05, weight_decay, keep)
    assert all(torch.equal(a, b) for a, b in zip(params, stacked))
    assert torch.equal(params[0][:, 4:], before[0][:, 4:]) and not torch.equal(params[1], before[1])
