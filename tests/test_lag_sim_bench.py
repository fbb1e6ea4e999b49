"""bench/shampoo_lag_sim.py at tiny size on the CPU: at lag 0, where its late versions go through the same
path installed at their own step, it is native Shampoo bit for bit; at lag L its runs leave native's only
after the first late install, and the eigenvalue re-estimate changes them from there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import bench_script

import asteria.optim.base as base
from asteria.train.cli import main

RUN = ["--batch-size", "4", "--seq-len", "32", "--eval-batches", "1", "--max-bytes", "200000", "--device", "cpu",
       "--steps", "16", "--eval-every", "16", "--precondition-frequency", "3", "--configs", "shampoo-sync",
       "--seed", "1", "--model", "tiny"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sim():
    return bench_script("shampoo_lag_sim")


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "shampoo-sync" / "metrics.jsonl").read_text().splitlines()]


def test_lag_zero_is_native_and_a_lag_departs_after_the_first_late_install(sim, tmp_path):
    made = base.make_refresher
    assert main(["bench", *RUN, "--out", str(tmp_path / "native")]) == 0
    for name, options in (("l0", ["--lag", "0"]), ("l2", ["--lag", "2"]), ("c2", ["--lag", "2", "--correct"])):
        assert sim.main([*options, "--", *RUN, "--out", str(tmp_path / name)]) == 0
        assert base.make_refresher is made  # the patch does not outlive the run
    native, l0, l2, c2 = (losses(tmp_path / name) for name in ("native", "l0", "l2", "c2"))
    assert l0 == native  # lag 0 runs the late versions' own path (decomposed, kept, installed at once)
    # f = 3, first refresh at step 3, two versions used at their own step (3 and 6): version 3 is snapshotted
    # at step 9 and installed at 11, so step 9's update (the loss of step 10) is the first to differ.
    first = [next(i + 1 for i, (a, b) in enumerate(zip(run, native, strict=True)) if a != b) for run in (l2, c2)]
    assert first == [10, 10]
    assert l2[:11] == c2[:11] and l2[11] != c2[11]  # the re-estimate acts from the install at step 11


def test_bad_lag_is_refused(sim, capsys):
    with pytest.raises(SystemExit):
        sim.main(["--lag", "-1", "--", *RUN])
    assert "Invalid --lag=-1: must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim.main(["--lag", "1", "--aligned", "0", "--", *RUN])
    assert "Invalid --aligned=0: must be >= 1" in capsys.readouterr().err
