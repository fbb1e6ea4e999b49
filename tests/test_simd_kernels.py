"""The numerics' own vector kernels (cpp/asteria/linalg/simd.h): picked by the CPU, capped by ASTERIA_MAX_SIMD,
named in runtime_stats(), and computing the same roots under each cap."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="the kernels are picked at run time on x86-64 only")

KERNELS = ("avx512", "avx2", "baseline")

# In a fresh process (the choice is made once): the kernels named, the runtime_stats entry of an optimizer, and
# the largest relative error of inverse fourth roots against float64 numpy on sizes whose sweeps have remainders.
PROBE = """
import numpy as np, torch, asteria
from asteria import _core
opt = asteria.Shampoo(torch.nn.Linear(8, 4).named_parameters(), lr=0.1)
stats = opt.runtime_stats()
opt.close()
worst = 0.0
rng = np.random.default_rng(0)
for n in (37, 130, 261):
    x = rng.standard_normal((n, 2 * n))
    a = (x @ x.T / (2 * n) + 0.1 * np.eye(n))
    values, vectors = np.linalg.eigh(a)
    reference = (vectors * values ** -0.25) @ vectors.T
    root, _ = _core.inverse_root(np.ascontiguousarray(a, dtype=np.float32), -0.25, 1e-12)
    worst = max(worst, float(np.abs(root - reference).max() / np.abs(reference).max()))
print(_core.simd_kernels(), stats["simd_kernels"], worst)
"""


def _probe(cap: str | None) -> subprocess.CompletedProcess[str]:
    environ = {key: value for key, value in os.environ.items() if key != "ASTERIA_MAX_SIMD"}
    if cap is not None:
        environ["ASTERIA_MAX_SIMD"] = cap
    return subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, timeout=300)


def test_each_cap_picks_the_widest_kernels_under_it_and_computes_the_same_roots() -> None:
    runs = {cap: _probe(cap) for cap in (None, *KERNELS)}
    for cap, run in runs.items():
        assert run.returncode == 0, f"ASTERIA_MAX_SIMD={cap}: {run.stderr[-2000:]}"
    picked = {cap: run.stdout.split() for cap, run in runs.items()}
    widest = picked[None][0]
    assert widest in KERNELS
    assert picked["avx512"][0] == widest
    assert picked["avx2"][0] == ("baseline" if widest == "baseline" else "avx2")
    assert picked["baseline"][0] == "baseline"
    for cap, (kernels, in_stats, worst) in picked.items():
        assert in_stats == kernels, cap
        assert float(worst) < 1e-5, f"ASTERIA_MAX_SIMD={cap} ({kernels}): relative error {worst}"


def test_a_cap_that_names_no_kernels_fails_the_import() -> None:
    run = _probe("sse4")
    assert run.returncode != 0
    assert "ValueError: Invalid ASTERIA_MAX_SIMD='sse4': must be avx512, avx2 or baseline" in run.stderr
