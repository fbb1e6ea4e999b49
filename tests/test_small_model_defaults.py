"""The defaults serve a small model (``bench/small_mlp.py``: the README's Quick start, a 32 -> 64 -> 1 MLP at
lr 3e-3 for 200 steps): each optimizer ends within 2x AdamW's loss."""

from __future__ import annotations

import statistics
import warnings

import pytest
from conftest import bench_script

SEEDS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def mlp():
    return bench_script("small_mlp")


@pytest.fixture(scope="module")
def adamw(mlp):
    return {target: statistics.fmean(mlp.final_loss("adamw", seed, target_scale=target) for seed in SEEDS)
            for target in mlp.TARGETS}


# Shampoo on ``fresh`` guards the merging rule: a 64 x 32 weight merged whole into one 2048-long dimension
# ended 132x AdamW's loss there (its one full-matrix factor rank-deficient under eps = 1e-12); kept as 64 x 32,
# 1.3x. Known limits, in docs/results.md: on ``raw`` Shampoo and SOAP end about 2.3x AdamW's loss, on ``fresh``
# SOAP about 29x and KL-Shampoo 2.5x (the weights must travel far at lr 3e-3).
@pytest.mark.parametrize("name, target", [("shampoo", "unit"), ("soap", "unit"), ("kl-shampoo", "unit"),
                                          ("kl-shampoo", "raw"), ("shampoo", "fresh"),
                                          ("shampoo", "raw")])  # 2.3x with 1-D factors (precondition_1d=True)
def test_each_optimizer_at_its_defaults_ends_within_twice_adamws_loss(mlp, adamw, name, target):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a backlog warning on a busy CI machine changes nothing here
        loss = statistics.fmean(mlp.final_loss(name, seed, target_scale=target) for seed in SEEDS)
    assert loss < 2 * adamw[target], (loss, adamw[target])


def test_the_bench_takes_more_scales_and_refuses_a_bad_one(mlp, capsys):
    assert mlp.main(["--targets", "unit", "--scales", "0.5", "--seeds", "0", "--steps", "12"]) == 0
    out = capsys.readouterr().out
    assert "target x0.5:" in out and out.count("x AdamW's") == 8  # four optimizers, two targets
    with pytest.raises(SystemExit):
        mlp.main(["--scales", "-1"])
    assert "Invalid --scales value -1.0: must be a number > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Invalid peer_path='/nowhere'"):
        mlp.main(["--targets", "unit", "--seeds", "0", "--steps", "2", "--peer-path", "/nowhere"])
    for added, table in (("ds-shampoo", mlp.OPTIMIZERS), ("ds-soap", mlp.OPTIMIZERS), ("x0.5", mlp.TARGETS)):
        table.pop(added)  # the module is shared by this file's tests
