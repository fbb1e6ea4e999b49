"""The soak benchmark (bench/soak.py, issue 8 item 5) in a short run, and its growth criterion."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import BENCH, bench_script

SCRIPT = BENCH / "soak.py"


def load_soak():
    return bench_script("soak")


@pytest.mark.parametrize("optimizer", ["shampoo", "kl-shampoo"])
def test_short_soak_passes_and_records_its_figures(tmp_path, optimizer):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "300", "--sample-every", "10", "--width", "16",
         "--max-delay-ms", "5", "--optimizer", optimizer, "--out", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, timeout=600, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads((tmp_path / "soak.json").read_text())
    assert record["ok"] and not record["violations"]
    assert record["max_staleness_in_use"] <= 2 and record["runtime_stats"]["max_staleness_seen"] <= 2
    assert record["faults_triggered"] > 0  # the random delays ran inside the worker jobs
    assert len(record["samples"]) == 30
    assert set(record["growth"]) == {"rss_bytes", "pinned_bytes", "open_fds", "threads"}
    assert (tmp_path / "soak.png").stat().st_size > 0


def test_growth_check_flags_a_leak_and_passes_a_flat_series():
    soak = load_soak()
    flat = [{"step": s, "rss_bytes": 100 + s % 3, "pinned_bytes": 7, "open_fds": 6, "threads": 5}
            for s in range(10, 410, 10)]
    tolerances = {"rss_bytes": 4, "pinned_bytes": 0, "open_fds": 0, "threads": 0}
    assert all(v["ok"] for v in soak.check_growth(flat, 400, 0.1, tolerances).values())
    leaking = [dict(s, open_fds=6 + s["step"] // 100) for s in flat]  # one descriptor lost every 100 steps
    verdict = soak.check_growth(leaking, 400, 0.1, tolerances)
    assert not verdict["open_fds"]["ok"] and verdict["rss_bytes"]["ok"]
    with pytest.raises(ValueError, match="Invalid samples: 2 after warm-up"):
        soak.check_growth(flat[-2:], 400, 0.1, tolerances)
