"""Shampoo (sync and async) against an independent float64 reference written here from the math."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import NOISE_FACTOR, ReferenceOptimizer, relative_errors, relative_rounding_noise, small_mlp, train

import asteria


def reference_root(matrix: np.ndarray, exponent: float, eps: float, relative_eps: float = 0.0) -> np.ndarray:
    """(matrix + ridge)^exponent, the spectrum first shifted up to zero where round-off left it negative; the
    ridge is eps plus relative_eps times the largest eigenvalue."""
    eigenvalues, vectors = np.linalg.eigh(matrix)
    shifted = eigenvalues + max(0.0, -eigenvalues.min())
    eigenvalues = shifted + eps + relative_eps * shifted.max()
    return (vectors * eigenvalues**exponent) @ vectors.T


def reference_blocks(shape: tuple[int, ...], max_dim: int) -> tuple[tuple[int, ...], list[tuple[slice, ...]]]:
    """Merged view of a parameter and its blocks, written independently of asteria.optim.blocking: adjacent
    dimensions merge while their product fits ``max_dim``, except that a tensor of order >= 2 whose entries
    all fit keeps its first dimension apart (a Kronecker factorization, not one full-matrix factor)."""
    dims = [size for size in shape if size > 1]
    merged: list[int] = []
    if len(dims) > 1 and math.prod(dims) <= max_dim:
        merged = [dims[0], math.prod(dims[1:])]
    else:
        for size in dims:
            if merged and merged[-1] * size <= max_dim:
                merged[-1] *= size
            else:
                merged.append(size)
    regions: list[tuple[slice, ...]] = [()]
    for size in merged:
        regions = [r + (slice(a, min(a + max_dim, size)),) for r in regions for a in range(0, size, max_dim)]
    return tuple(merged), regions


@pytest.mark.parametrize("shape, max_dim, merged", [
    ((64, 3, 3, 3), 2048, (64, 27)),  # a convolution kernel: out channels x receptive field
    ((64, 32), 2048, (64, 32)),  # a small matrix stays a matrix
    ((3, 3, 64, 64), 2048, (576, 64)),
    ((4, 1, 8), 6, (4, 8)),
    ((1, 1, 5), 6, (5,)),
    ((2, 3, 5), 6, (6, 5)),
])
def test_merged_views(shape, max_dim, merged):
    from asteria.optim.blocking import merge_dims

    assert merge_dims(shape, max_dim) == merged == reference_blocks(shape, max_dim)[0]


def mode_unfold(x: np.ndarray, mode: int) -> np.ndarray:
    return np.moveaxis(x, mode, 0).reshape(x.shape[mode], -1)


def mode_multiply(x: np.ndarray, matrix: np.ndarray, mode: int) -> np.ndarray:
    return np.moveaxis(np.tensordot(matrix, np.moveaxis(x, mode, 0), axes=1), 0, mode)


def grafted_direction(s: dict, b1: float, b2: float, t: int, grafting_eps: float) -> np.ndarray:
    """The bias-corrected momentum times each mode's root, rescaled to the norm of Adam's direction (Adam's
    itself before the first roots); ``s`` holds the block's moments "m", "v" and its "roots" (or None)."""
    m_hat = s["m"] / (1 - b1**t)
    adam = m_hat / (np.sqrt(s["v"] / (1 - b2**t)) + grafting_eps)
    if s["roots"] is None:
        return adam
    direction = m_hat
    for mode, root in enumerate(s["roots"]):
        direction = mode_multiply(direction, root, mode)
    return direction * np.linalg.norm(adam) / np.linalg.norm(direction)


class ReferenceShampoo(ReferenceOptimizer):
    """Shampoo with Adam grafting in float64 numpy, one block at a time; a 1-D block has no factor (Adam's
    direction) unless ``precondition_1d``."""

    def __init__(self, params, lr, betas, eps, relative_eps, weight_decay, frequency, start, max_dim,
                 grafting_eps=1e-8, precondition_1d=False):
        super().__init__(params, lr, betas, eps, weight_decay)
        self.relative_eps, self.frequency, self.start, self.grafting_eps = relative_eps, frequency, start, grafting_eps
        self.blocks = []
        for p in self.params:
            merged, regions = reference_blocks(tuple(p.shape), max_dim)
            for region in regions:
                dims = [r.stop - r.start for r in region]
                factored = dims if len(dims) >= 2 or precondition_1d else []
                self.blocks.append(dict(param=p, merged=merged, region=region,
                                        factors=[np.zeros((d, d)) for d in factored], roots=None,
                                        m=np.zeros(dims), v=np.zeros(dims)))

    def step(self):
        self.t += 1
        t, (b1, b2) = self.t, self.betas
        refresh = t >= self.start and (t - self.start) % self.frequency == 0
        updates = []
        for s in self.blocks:
            p = s["param"]
            g = p.grad.double().numpy().reshape(s["merged"])[s["region"]]
            w = p.detach().double().numpy().reshape(s["merged"])[s["region"]]
            order = len(s["factors"])
            for mode in range(order):
                unfolded = mode_unfold(g, mode)
                s["factors"][mode] = b2 * s["factors"][mode] + (1 - b2) * unfolded @ unfolded.T
            s["m"] = b1 * s["m"] + (1 - b1) * g
            s["v"] = b2 * s["v"] + (1 - b2) * g * g
            if refresh and order:
                s["roots"] = [reference_root(f / (1 - b2**t), -1.0 / (2 * order), self.eps, self.relative_eps)
                              for f in s["factors"]]
            direction = grafted_direction(s, b1, b2, t, self.grafting_eps)
            updates.append((s, w * (1 - self.lr * self.wd) - self.lr * direction))
        for s, w in updates:
            with torch.no_grad():
                s["param"].view(s["merged"])[s["region"]] = torch.from_numpy(w).to(s["param"].dtype)


HYPER = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-6, relative_eps=1e-3, weight_decay=0.01)


def run_reference(steps: int, max_dim: int = 16, **hyper) -> list[torch.Tensor]:
    model = small_mlp()
    ref = ReferenceShampoo(list(model.parameters()), frequency=3, start=2, max_dim=max_dim, **(HYPER | hyper))
    train(model, ref, steps)
    return [p.detach().clone() for p in model.parameters()]


def run_asteria(steps: int, runtime: asteria.RuntimeConfig, max_dim: int = 16,
                scale: float = 1.0, **hyper) -> list[torch.Tensor]:
    model = small_mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    with asteria.Shampoo(model.parameters(), precondition_frequency=3, start_preconditioning_step=2,
                         max_preconditioner_dim=max_dim, runtime=runtime, **(HYPER | hyper)) as opt:
        train(model, opt, steps)
    return [p.detach().clone() for p in model.parameters()]


def assert_close(actual: list[torch.Tensor], expected: list[torch.Tensor], rtol: float) -> None:
    for err, e in zip(relative_errors(actual, expected), expected, strict=True):
        assert err < rtol, f"relative error {err:.2e} >= {rtol:.0e} for a parameter of shape {tuple(e.shape)}"


@pytest.mark.parametrize("max_dim, precondition_1d", [
    (16, False), (16, True),  # order 2 + order 1 (the biases: Adam's direction, or a full-matrix factor)
    (6, True),  # split blocks
    (2048, False)])  # every entry in one block
def test_sync_matches_float64_reference(max_dim, precondition_1d):
    def run(scale: float) -> list[torch.Tensor]:
        return run_asteria(14, asteria.RuntimeConfig(mode="sync"), max_dim=max_dim, scale=scale,
                           precondition_1d=precondition_1d)

    # The biases' rank-deficient factors amplify float32 rounding by (eps = 1e-6)^(-1/2) along their null
    # space, by an amount torch's CPU kernels decide: the tolerance is at least this run's own rounding noise.
    tolerance = max(2e-4, NOISE_FACTOR * relative_rounding_noise(run))
    assert_close(run(1.0), run_reference(14, max_dim=max_dim, precondition_1d=precondition_1d), rtol=tolerance)


@pytest.mark.parametrize("precondition_1d", [False, True])
def test_async_staleness_zero_matches_reference_and_sync(precondition_1d):
    sync = run_asteria(14, asteria.RuntimeConfig(mode="sync"), precondition_1d=precondition_1d)
    async_ = run_asteria(14, asteria.RuntimeConfig(mode="async", staleness=0, workers=2, stagger=False),
                         precondition_1d=precondition_1d)
    assert_close(async_, run_reference(14, precondition_1d=precondition_1d), rtol=2e-4)
    assert_close(async_, sync, rtol=3e-4)  # two fp32 eigensolvers (torch's and LAPACK's)


def test_relative_eps_zero_matches_its_reference_and_the_comparison_tells_them_apart():
    """relative_eps=0 (eps alone, Distributed Shampoo's rule) against its own reference, through the C++
    engine; and the reference at relative_eps=1e-3 is far from it, so the tests above see the ridge."""
    runtime = asteria.RuntimeConfig(mode="async", staleness=0, workers=2, stagger=False)
    plain = run_asteria(14, runtime, relative_eps=0.0)
    assert_close(plain, run_reference(14, relative_eps=0.0), rtol=2e-4)
    assert max(relative_errors(plain, run_reference(14))) > 1e-2


def test_the_comparisons_tell_a_preconditioned_bias_from_adams():
    """The reference with 1-D factors is far from the run without them: the parametrized tests above see
    ``precondition_1d``."""
    sync = run_asteria(14, asteria.RuntimeConfig(mode="sync"))
    assert max(relative_errors(sync, run_reference(14, precondition_1d=True))) > 1e-2


def test_reference_differs_from_adam_only_run():
    """The comparison above can fail: a run that never preconditions is far from the reference."""
    model = small_mlp()
    with asteria.Shampoo(model.parameters(), precondition_frequency=3, start_preconditioning_step=1000,
                         max_preconditioner_dim=16, runtime=asteria.RuntimeConfig(mode="sync"), **HYPER) as opt:
        train(model, opt, 14)
    reference = run_reference(14)
    errors = [float((p.detach() - r).norm() / r.norm()) for p, r in zip(model.parameters(), reference, strict=True)]
    assert max(errors) > 1e-2
