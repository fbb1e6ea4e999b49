"""The C++ numerics as Python sees them (``asteria._core``: inverse_root, eigenbasis, qr_refresh) against
formulas written here in float64 with NumPy, and their bad inputs."""

from __future__ import annotations

import numpy as np
import pytest

from asteria import _core


def spd(n: int, seed: int, dtype=np.float64) -> np.ndarray:
    """A symmetric positive definite matrix with a spread of eigenvalues, exactly symmetric."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 2 * n))
    a = x @ x.T / (2 * n) + 0.1 * np.eye(n)
    return ((a + a.T) / 2).astype(dtype)


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-10), (np.float32, 2e-4)])
def test_inverse_root_matches_the_eigendecomposition_formula(dtype, tol):
    a = spd(12, 1, dtype)
    values, vectors = np.linalg.eigh(a.astype(np.float64))
    scale, eps = 0.5, 1e-3
    expected = vectors @ np.diag((scale * values + eps) ** -0.25) @ vectors.T
    root, info = _core.inverse_root(a, -0.25, eps, scale)
    assert root.dtype == dtype and root.shape == (12, 12)
    assert np.abs(root - expected).max() / np.abs(expected).max() < tol
    assert info["lambda_min"] == pytest.approx(scale * values.min(), rel=1e-4)


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-10), (np.float32, 1e-3)])
def test_relative_eps_adds_a_ridge_proportional_to_the_largest_eigenvalue(dtype, tol):
    """The same formula through the C++ engine's numerics and torch's (``functional.inverse_root``): the ridge
    is eps + relative_eps * lambda_max of the scaled, shifted spectrum, on a rank-deficient matrix whose
    null space it decides."""
    import torch

    from asteria import functional as F
    rng = np.random.default_rng(8)
    x = rng.standard_normal((12, 3))
    a = (x @ x.T).astype(dtype)  # rank 3
    values, vectors = np.linalg.eigh(a.astype(np.float64))
    scale, eps, relative = 2.0, 1e-9, 1e-3
    shifted = scale * values + max(0.0, -scale * values.min())
    expected = vectors @ np.diag((shifted + eps + relative * shifted.max()) ** -0.25) @ vectors.T
    root, _ = _core.inverse_root(a, -0.25, eps, scale, relative_eps=relative)
    assert np.abs(root - expected).max() / np.abs(expected).max() < tol
    torch_root, usable = F.inverse_root(torch.from_numpy(a)[None], -0.25, eps, scale, relative_eps=relative)
    assert bool(usable.all())
    assert np.abs(torch_root[0].numpy() - expected).max() / np.abs(expected).max() < tol
    plain, _ = _core.inverse_root(a, -0.25, eps, scale)  # relative_eps=0: eps alone, far larger roots
    assert np.abs(plain).max() > 10 * np.abs(expected).max()
    with pytest.raises(ValueError, match=r"Invalid relative_eps=-0.1: must be a finite number >= 0"):
        _core.inverse_root(a, -0.25, eps, scale, relative_eps=-0.1)


def test_eigenbasis_and_qr_refresh_match_their_formulas():
    a = spd(10, 2)
    q, values, _ = _core.eigenbasis(a)
    reference = np.linalg.eigvalsh(a)[::-1]  # descending
    np.testing.assert_allclose(values, reference, rtol=1e-10)
    np.testing.assert_allclose(q.T @ a @ q, np.diag(reference), atol=1e-10)
    # qr_refresh: the power step from a rotated basis, its columns sorted by their Rayleigh quotients, then QR
    rotation, _ = np.linalg.qr(np.random.default_rng(3).standard_normal((10, 10)))
    q_prev = q @ (np.eye(10) + 0.05 * (rotation - np.eye(10)))
    q_prev, _ = np.linalg.qr(q_prev)
    new_q, estimates, perm, info = _core.qr_refresh(a, q_prev)
    quotients = np.diag(q_prev.T @ a @ q_prev)
    order = np.argsort(-quotients, kind="stable")
    np.testing.assert_array_equal(perm, order)
    np.testing.assert_allclose(estimates, quotients[order], rtol=1e-12)
    expected, _ = np.linalg.qr((a @ q_prev)[:, order])
    np.testing.assert_allclose(new_q, expected, atol=1e-10)  # Householder QR: LAPACK's signs in both
    assert not info["skipped"] and info["off_diagonal_ratio"] == -1  # not computed without a skip_tol
    # the adaptive skip: the off-diagonal ratio of Q_prev^T A Q_prev against skip_tol
    m = q_prev.T @ a @ q_prev
    ratio = np.linalg.norm(m - np.diag(np.diag(m))) / np.linalg.norm(m)
    _, _, _, info = _core.qr_refresh(a, q_prev, skip_tol=ratio / 2)
    assert not info["skipped"] and info["off_diagonal_ratio"] == pytest.approx(ratio, rel=1e-6)
    kept, estimates, perm, info = _core.qr_refresh(a, q_prev, skip_tol=ratio * 2)
    assert info["skipped"] and np.array_equal(kept, q_prev) and np.array_equal(perm, np.arange(10))
    np.testing.assert_allclose(estimates, quotients, rtol=1e-12)


def test_empty_matrices_give_empty_results_of_the_right_shapes():
    empty = np.zeros((0, 0), np.float32)
    root, _ = _core.inverse_root(empty, -0.25, 1e-6)
    q, values, _ = _core.eigenbasis(empty)
    new_q, estimates, perm, _ = _core.qr_refresh(empty, empty)
    assert root.shape == q.shape == new_q.shape == (0, 0)
    assert values.shape == estimates.shape == perm.shape == (0,)


def test_a_matrix_that_is_not_symmetric_is_refused_by_position():
    a = spd(6, 4, np.float32)
    a[4, 1] += 0.5
    message = r"Invalid a: not symmetric, a\[4, 1\]=.* but a\[1, 4\]=.*1e-4 of the largest \|entry\|"
    with pytest.raises(ValueError, match=message):
        _core.inverse_root(a, -0.25, 1e-6)
    with pytest.raises(ValueError, match=message):
        _core.eigenbasis(a)
    with pytest.raises(ValueError, match=message):
        _core.qr_refresh(a, np.eye(6, dtype=np.float32))
    # rounding-level asymmetry, as a float32 product X X^T may carry, is accepted
    b = spd(6, 4, np.float32)
    b[4, 1] *= 1 + 1e-6
    _core.inverse_root(b, -0.25, 1e-6)


def test_other_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"Invalid a shape \(3, 4\): must be square"):
        _core.inverse_root(np.zeros((3, 4), np.float32), -0.25, 1e-6)
    with pytest.raises(ValueError, match=r"Invalid exponent=0.5: must be a finite number < 0"):
        _core.inverse_root(spd(3, 5, np.float32), 0.5, 1e-6)
    with pytest.raises(ValueError, match=r"Invalid q_prev shape \(3, 3\): must match a's \(4, 4\)"):
        _core.qr_refresh(spd(4, 5, np.float32), np.eye(3, dtype=np.float32))
    nan = spd(4, 6, np.float32)
    nan[2, 2] = np.nan
    with pytest.raises(_core.NumericalError, match=r"non-finite input a\(2, 2\)=nan"):
        _core.inverse_root(nan, -0.25, 1e-6)


def test_each_dtype_is_computed_in_itself_never_converted():
    """float64 matrices stay float64 with any scalar type (a NumPy float64 scalar once sent them to the
    float32 overload, converted); mixed dtypes and non-contiguous arrays are refused, not copied."""
    a = spd(5, 7)
    for scale in (1.0, np.float64(1.0), np.float32(1.0), 1):
        root, _ = _core.inverse_root(a, -0.5, np.float64(1e-9), scale)
        q, values, _ = _core.eigenbasis(a, scale)
        new_q, estimates, _, _ = _core.qr_refresh(a, q, scale, np.float64(0.0))
        assert root.dtype == q.dtype == values.dtype == new_q.dtype == estimates.dtype == np.float64
    with pytest.raises(TypeError):
        _core.qr_refresh(a, np.eye(5, dtype=np.float32))
    with pytest.raises(TypeError):
        _core.inverse_root(np.asfortranarray(spd(5, 8)[:, ::-1]), -0.5, 1e-9)
