"""bench/step_flops.py: the work of a step that refreshes nothing. Its matrix products against the products the
math of each optimizer makes, its count of the bytes the other operations move, and its extension of a preset's
slices to the preset's depth."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import script_module

from asteria.train import model as models

step_flops = script_module(Path(__file__).resolve().parents[1] / "bench" / "step_flops.py")


def test_one_blocks_step_makes_the_products_of_its_math():
    """One m x n block: the factors' update (G G^T and G^T G), then Shampoo's L^-1/4 G R^-1/4; SOAP's three
    rotations (the gradient and the first moment into the eigenbasis, Q_L^T X Q_R, and the direction back)."""
    m, n = 48, 20
    pair = 2 * m * m * n + 2 * m * n * n  # a product on each side of the block
    param = torch.nn.Parameter(torch.randn(m, n))
    assert step_flops.quiet_step_work([("w", param)], "shampoo")["flops"] == {"aten.baddbmm_": pair, "aten.bmm": pair}
    assert step_flops.quiet_step_work([("w", param)], "soap")["flops"] == {"aten.baddbmm_": pair, "aten.bmm": 3 * pair}


def test_a_presets_count_from_its_slices_is_the_whole_models(monkeypatch):
    """The count from one layer and two, extended to the preset's depth, is that of the whole model."""
    monkeypatch.setattr(models, "PRESETS", dict(models.PRESETS))
    models.PRESETS["tiny-3"] = dataclasses.replace(models.PRESETS["tiny"], num_layers=3)
    extended = step_flops.preset_step_work("tiny-3", "kl-shampoo")
    whole = step_flops.quiet_step_work(models.build_model("tiny-3", vocab_size=256, seq_len=64).named_parameters(),
                                       "kl-shampoo")
    assert extended == whole and sum(whole["flops"].values()) > 0 and sum(whole["bytes"].values()) > 0


def test_the_bytes_an_operation_moves():
    """Each tensor read or written counts once per operation: an in-place update reads and writes its tensor (a
    foreach one each of its list's), an ``out=`` tensor is only written, a broadcast operand counts its storage, a
    view and a product move nothing."""
    a, b, out = torch.ones(64, 32), torch.ones(64, 32), torch.empty(64, 32)
    row = torch.ones(1, 32)
    size = a.numel() * 4
    with step_flops.Traffic() as traffic:
        a.add_(b)  # read a and b, write a
        torch.mul(a, row, out=out)  # read a and the row, write out
        a.view(32, 64).t()  # views
        torch.bmm(a[None], b.t()[None])  # a product: counted in FLOPs
        row.expand(64, 32).sum()  # the row's 128 bytes, and the sum's 4
        torch._foreach_mul_([a, b], 2.0)  # read and write both (it returns nothing)
    assert traffic.bytes == {"aten.add_": 3 * size, "aten.mul": 2 * size + 128, "aten.sum": 128 + 4,
                             "aten._foreach_mul_": 4 * size}
    # New tensors only: the product's result and the sum's scalar (the others wrote into tensors they were given)
    assert traffic.allocated == {"aten.bmm": 64 * 64 * 4, "aten.sum": 4}


@pytest.mark.parametrize("optimizer", ["shampoo", "soap", "kl-shampoo"])
def test_every_optimizer_updates_its_factors_by_one_product_a_side(optimizer):
    """The factors' update, in place (``baddbmm_``, which torch's counter leaves out), counted for each."""
    m, n = 16, 8
    param = torch.nn.Parameter(torch.randn(m, n))
    counts = step_flops.quiet_step_work([("w", param)], optimizer)["flops"]
    assert counts["aten.baddbmm_"] == 2 * m * m * n + 2 * m * n * n
    assert counts["aten.bmm"] >= 2 * m * m * n + 2 * m * n * n  # at least the preconditioning's two sides
