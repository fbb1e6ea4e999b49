"""The warm-started roots study (bench/warm_roots.py): its refinement step and root against the math on a small,
well-separated matrix, and a short run on the block-size model."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "warm_roots.py"


def load_script():
    spec = importlib.util.spec_from_file_location("warm_roots", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def well_separated(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A symmetric matrix with eigenvalues 1..n (gaps of 1), its eigenvectors, and a basis turned off them by a
    small random rotation (exp of a skew matrix of norm 1e-2)."""
    gen = torch.Generator().manual_seed(seed)
    vectors, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    values = torch.arange(1, n + 1, dtype=torch.float64)
    skew = torch.randn(n, n, generator=gen, dtype=torch.float64)
    skew = (skew - skew.T) * (1e-2 / torch.linalg.matrix_norm(skew - skew.T))
    return (vectors * values) @ vectors.T, vectors, vectors @ torch.linalg.matrix_exp(skew)


def off_diagonal(matrix: torch.Tensor, basis: torch.Tensor) -> float:
    rotated = basis.T @ matrix @ basis
    return float(torch.linalg.matrix_norm(rotated - torch.diag(rotated.diagonal())) / torch.linalg.matrix_norm(rotated))


def test_refinement_converges_quadratically_where_the_eigenvalues_lie_apart():
    warm = load_script()
    matrix, _, turned = well_separated(24, seed=0)
    basis = turned
    offs = [off_diagonal(matrix, basis)]
    for _ in range(3):
        basis = warm.refine(matrix[None], basis[None], separation=1.0)[0]
        offs.append(off_diagonal(matrix, basis))
    assert offs[0] > 1e-3
    assert offs[1] < offs[0] ** 2 * 10 and offs[2] < 1e-9 and offs[3] < 1e-13  # quadratic, down to float64
    assert float(torch.linalg.matrix_norm(basis.T @ basis - torch.eye(24, dtype=torch.float64))) < 1e-13
    # a pair turns only where its gap exceeds the separation times its coupling: none at 1e9
    still = warm.refine(matrix[None], turned[None], separation=1e9)[0]
    assert off_diagonal(matrix, still) == pytest.approx(offs[0], rel=1e-9)


def test_the_root_from_the_exact_basis_is_the_matrix_root_and_reports_its_off_diagonal():
    warm = load_script()
    matrix, vectors, basis = well_separated(16, seed=1)
    root, off = warm.root_from(matrix[None], vectors[None], eps=1e-12, exponent=-0.25)
    expected = (vectors * (torch.arange(1, 17, dtype=torch.float64) + 1e-12) ** -0.25) @ vectors.T
    assert torch.allclose(root[0], expected, atol=1e-12) and float(off[0]) < 1e-14
    _, stale = warm.root_from(matrix[None], basis[None], eps=1e-12, exponent=-0.25)
    assert float(stale[0]) == pytest.approx(off_diagonal(matrix, basis))


def test_a_short_run_studies_each_chain_and_deletes_the_saved_factors(tmp_path):
    out = tmp_path / "warm"
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "16", "--frequency", "4", "--dim", "256",
                           "--every", "2", "--iterations", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = (out / "warm_roots.txt").read_text().splitlines()
    assert lines[0].split() == ["batch", "refresh", "block", "off-diag", "eigh32", "stale", "k=1", "k=2"]
    rows = [line.split() for line in lines[1:]]
    refreshes = sorted({int(r[1]) for r in rows})
    assert refreshes == [2, 3]  # refreshes 0-3 (steps 4-16): every 2nd after the first, and the last
    for row in rows:
        off, eigh32, stale, *refined = map(float, row[3:])
        assert 0 < off < 1 and 0 <= eigh32 < 0.1 and stale > eigh32 and len(refined) == 2
    assert not (out / "factors").exists()
