"""The refresh-demand benchmark (bench/refresh_demand.py) in a short run: its factor counts against a count
written from the blocking rule, the demand as counts times the timed sizes, and its refusals."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from asteria.train.model import PRESETS

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "refresh_demand.py"


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})


def expected_factors(max_dim: int) -> Counter:
    """The tiny preset's matrices (byte vocabulary, untied embedding and head, SwiGLU MLP), each dimension cut
    into chunks of at most ``max_dim``: one factor per dimension of each block."""
    p = PRESETS["tiny"]
    h, m, layers = p.hidden_size, p.intermediate_size, p.num_layers
    shapes = [(256, h), (256, h)] + layers * [(h, h)] * 4 + layers * [(m, h), (m, h), (h, m)]
    sizes: Counter = Counter()
    for rows, cols in shapes:
        row_chunks = [min(max_dim, rows - i) for i in range(0, rows, max_dim)]
        col_chunks = [min(max_dim, cols - j) for j in range(0, cols, max_dim)]
        for r in row_chunks:
            for c in col_chunks:
                sizes.update([r, c])
    return sizes


def test_a_short_run_counts_the_factors_and_sums_their_times(tmp_path):
    out = tmp_path / "demand.json"
    done = run("--model", "tiny", "--max-dims", "64", "128", "--repeats", "1", "--interval-s", "0.5",
               "--cores", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    timing = {int(n): t for n, t in result["timing"].items()}
    rows = {row["max_dim"]: row for row in result["rows"]}
    for max_dim in (64, 128):
        row = rows[max_dim]
        factors = {int(n): k for n, k in row["factors"].items()}
        assert factors == dict(expected_factors(max_dim))
        assert row["root_core_s"] == pytest.approx(sum(k * timing[n]["root"] for n, k in factors.items()))
        assert row["qr_core_s"] == pytest.approx(sum(k * timing[n]["qr"] for n, k in factors.items()))
        assert row["capacity_core_s"] == pytest.approx(2 * 0.5)
    assert all(t["root"] > 0 and t["qr"] > 0 and math.isfinite(t["root"]) for t in timing.values())
    assert "vs largest dim" in done.stdout and "root / capacity" in done.stdout


@pytest.mark.parametrize("argv, message", [
    (["--max-dims", "0"], "argument --max-dims: invalid value [0]"),
    (["--repeats", "0"], "arguments --repeats 0 and --cores 14: each must be >= 1"),
    (["--model", "tiny", "--interval-s", "1", "2"], "at most one per --model"),
])
def test_bad_arguments_are_refused_by_name(argv, message):
    done = run(*argv)
    assert done.returncode == 2 and message in done.stderr, done.stderr
