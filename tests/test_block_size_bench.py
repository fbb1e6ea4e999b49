"""The block-size benchmark (bench/block_size.py) in a short run: one bench per block size, the table's
ratios against the first size, and its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "block_size.py"


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"})


def test_a_short_run_benches_each_block_size_and_compares_with_the_first(tmp_path):
    done = run("--hidden", "64", "--mlp", "256", "--dims", "256", "128", "--seeds", "0", "--steps", "4",
               "--frequency", "2", "--batch-size", "2", "--seq-len", "32", "--configs", "shampoo-sync",
               "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {dim: json.loads((tmp_path / f"dim{dim}-seed0" / "results.json").read_text()) for dim in (256, 128)}
    assert [r["config"]["max_preconditioner_dim"] for r in runs.values()] == [256, 128]
    lines = (tmp_path / "block_size.txt").read_text().splitlines()
    assert lines[0].split()[:4] == ["config", "dim", "seed", "val"] and len(lines) == 3
    first, second = (line.split() for line in lines[1:])
    assert first[:3] == ["shampoo-sync", "256", "0"] and first[4] == "1.000x" and first[6] == "1.00x"
    val = [r["runs"]["shampoo-sync"]["final_val_loss"] for r in runs.values()]
    assert second[:3] == ["shampoo-sync", "128", "0"] and float(second[3]) == pytest.approx(val[1], abs=1e-4)
    assert float(second[4].rstrip("x")) == pytest.approx(val[1] / val[0], abs=1e-3)
    # the MLP's 256 dimension is one block at 256 and two at 128: different preconditioners, different losses
    assert val[0] != val[1]


@pytest.mark.parametrize("argv, message", [
    (["--hidden", "100"], "argument --hidden: invalid value 100: must be a multiple of 64"),
    (["--steps", "0"], "argument --steps: invalid value 0: must be >= 1"),
    (["--dims", "0"], "argument --dims: invalid value [0]"),
])
def test_bad_arguments_are_refused_by_name(argv, message, tmp_path):
    done = run(*argv, "--out", str(tmp_path))
    assert done.returncode == 2 and message in done.stderr, done.stderr
