"""bench/step_flops.py: the matrix products of a step that refreshes nothing, against the products the math of
each optimizer makes, and its extension of a preset's slices to the preset's depth."""

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
    assert step_flops.quiet_step_flops([("w", param)], "shampoo") == {"aten.baddbmm_": pair, "aten.bmm": pair}
    assert step_flops.quiet_step_flops([("w", param)], "soap") == {"aten.baddbmm_": pair, "aten.bmm": 3 * pair}


def test_a_presets_count_from_its_slices_is_the_whole_models(monkeypatch):
    """The count from one layer and two, extended to the preset's depth, is that of the whole model."""
    monkeypatch.setattr(models, "PRESETS", dict(models.PRESETS))
    models.PRESETS["tiny-3"] = dataclasses.replace(models.PRESETS["tiny"], num_layers=3)
    extended = step_flops.preset_step_flops("tiny-3", "kl-shampoo")
    whole = step_flops.quiet_step_flops(models.build_model("tiny-3", vocab_size=256, seq_len=64).named_parameters(),
                                        "kl-shampoo")
    assert extended == whole and sum(whole.values()) > 0


@pytest.mark.parametrize("optimizer", ["shampoo", "soap", "kl-shampoo"])
def test_every_optimizer_updates_its_factors_by_one_product_a_side(optimizer):
    """The factors' update, in place (``baddbmm_``, which torch's counter leaves out), counted for each."""
    m, n = 16, 8
    param = torch.nn.Parameter(torch.randn(m, n))
    counts = step_flops.quiet_step_flops([("w", param)], optimizer)
    assert counts["aten.baddbmm_"] == 2 * m * m * n + 2 * m * n * n
    assert counts["aten.bmm"] >= 2 * m * m * n + 2 * m * n * n  # at least the preconditioning's two sides
