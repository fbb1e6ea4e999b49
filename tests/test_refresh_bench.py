"""The refresh-engine benchmark (bench/refresh_engine.py, issues 2 and 3) in a short run: every
configuration measured, the ratios and the gemm-time calibration consistent with the rates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "refresh_engine.py"


def test_short_run_records_every_configuration_and_its_gemm_times(tmp_path):
    out = tmp_path / "refresh.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "96", "--blocks", "4", "--cores", "2", "--rounds", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    row = json.loads(out.read_text())["rows"][0]
    names = ("torch-serial", "torch-threads", "torch-root", "asteria", "asteria-qr", "gemm")
    assert all(len(row["rounds"][name]) == 2 and row[name] == max(row["rounds"][name]) > 0 for name in names)
    best_eigh = max(row["torch-serial"], row["torch-threads"])
    assert row["asteria-qr/best-torch-eigh"] == pytest.approx(row["asteria-qr"] / best_eigh)
    for name in ("torch-serial", "torch-threads", "asteria", "asteria-qr"):
        assert row[f"{name} gemm-times"] == pytest.approx(row["gemm"] / row[name])
    # a drifted block's warm-started basis is close to, but not exactly, its eigenbasis
    assert row["eigh-offdiag"] < 1e-10 < row["qr-offdiag"] < 0.5
    assert "gemm-times" in result.stdout and "asteria-qr" in result.stdout
