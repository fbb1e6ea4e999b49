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


def test_decoupled_update_steps_kept_blocks_and_leaves_the_others_bit_for_bit():
    torch.manual_seed(3)
    weights = torch.randn(4, 3, 5, dtype=torch.float64)
    direction = torch.randn(4, 3, 5, dtype=torch.float64)
    keep = torch.tensor([True, False, False, True])
    lr, weight_decay = 0.05, 0.1
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
