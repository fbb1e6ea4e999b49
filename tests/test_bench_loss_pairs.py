"""``asteria bench`` compares each async config's validation loss with native mode's and its peers' of the same
bench: the measure of the loss target, computed where both sides ran."""

from __future__ import annotations

import json
import math

import pytest
from conftest import TINY_RUN

from asteria.train.bench import loss_references, relative_loss
from asteria.train.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_async_config_is_paired_with_its_native_mode_and_its_peers():
    labels = ["adamw", "shampoo-sync", "shampoo-async", "soap-async", "soap-async-f5", "soap-sync-f5", "ds-soap",
              "hb-soap", "kl-shampoo-async", "ds-shampoo", "kl-shampoo-sync", "kl-shampoo-async-f2"]
    assert loss_references(labels) == {
        "shampoo-async": ["shampoo-sync", "ds-shampoo"],
        # native mode at another f is not a pair of the bench's f; native at the same f is
        "soap-async": ["ds-soap", "hb-soap"],
        "soap-async-f5": ["soap-sync-f5", "ds-soap", "hb-soap"],
        "kl-shampoo-async": ["kl-shampoo-sync"],
        "kl-shampoo-async-f2": ["kl-shampoo-sync"],  # no native run at f = 2: native at the bench's f
    }
    assert loss_references(["adamw", "shampoo-sync", "ds-shampoo", "soap-async"]) == {}  # nothing async is paired


@pytest.mark.parametrize(("loss", "reference", "expected"), [
    (1.01, 1.0, 0.01), (0.97, 1.0, -0.03), (None, 1.0, None), (1.0, None, None), (math.nan, 1.0, None),
    (1.0, math.inf, None), (1.0, 0.0, None),
])
def test_the_gap_is_relative_and_absent_where_a_loss_is(loss, reference, expected):
    gap = relative_loss(loss, reference)
    assert gap == (None if expected is None else pytest.approx(expected))


def test_the_bench_reports_the_gap_to_native_mode(tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path), "--steps", "9", "--eval-every", "9", "--configs", "shampoo-async",
                 "shampoo-sync", "soap-async", *TINY_RUN]) == 0
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    val = {label: json.loads((tmp_path / label / "summary.json").read_text())["final_val_loss"] for label in runs}
    assert runs["shampoo-async"]["val_loss_vs"] == {
        "shampoo-sync": pytest.approx(val["shampoo-async"] / val["shampoo-sync"] - 1)}
    assert "val_loss_vs" not in runs["soap-async"] and "val_loss_vs" not in runs["shampoo-sync"]  # no pair ran
    table = capsys.readouterr().out
    gap = runs["shampoo-async"]["val_loss_vs"]["shampoo-sync"]
    assert "validation loss against native mode and the peers (this config's / theirs - 1; the target: within 1%):" \
        in table
    assert f"  shampoo-async      vs shampoo-sync {100 * gap:+.2f}%\n" in table
