"""SOAP (sync and async) against an independent float64 reference written here from the published math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    ReferenceOptimizer,
    blob_classification,
    regression_data,
    relative_errors,
    resume_is_exact,
    small_mlp,
    train,
    train_classifier,
)

import asteria

SIZES = (8, 8, 8)  # square weights: the first factors are full rank, so their eigenbases are unique
HYPER = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
FREQUENCY = 3


def debias(beta: float, step: int) -> float:
    return 1.0 - (1.0 - beta) / (1.0 - beta**step)


def eig_desc(matrix: np.ndarray) -> np.ndarray:
    return np.linalg.eigh(matrix)[1][:, ::-1]


class ReferenceSOAP(ReferenceOptimizer):
    """SOAP for 2-D weights (Adam in the eigenbases of L = E[G G^T], R = E[G^T G]) and Adam for 1-D. The first
    gradient only builds the factors; until step ``start`` a weight's bases are the identity (Adam); at
    ``start`` the factors' eigenvectors become the bases, and the second moment is carried into them as the
    squares of their entries weigh it (v'[i, j] = sum_ab QL[a, i]^2 QR[b, j]^2 v[a, b]); every f steps
    after that, one power step and a QR factorization refresh them. ``first="qr"``: the first bases are that
    refresh from the identity instead of the eigenvectors (Distributed Shampoo's rule)."""

    def __init__(self, params, lr, betas, eps, weight_decay, frequency, start, first="eigh"):
        super().__init__(params, lr, betas, eps, weight_decay)
        self.f, self.start, self.first = frequency, start, first
        self.state = [dict(m=np.zeros(tuple(p.shape)), v=np.zeros(tuple(p.shape))) for p in self.params]
        for p, s in zip(self.params, self.state, strict=True):
            if p.dim() == 2:
                s["QL"], s["QR"] = np.eye(p.shape[0]), np.eye(p.shape[1])

    def step(self):
        self.t += 1
        b1, b2 = self.betas
        for p, s in zip(self.params, self.state, strict=True):
            g = p.grad.double().numpy()
            matrix = g.ndim == 2
            if self.t == 1:
                if matrix:
                    s["L"], s["R"] = g @ g.T, g.T @ g
                    if self.start == 1:
                        s["QL"], s["QR"] = self.first_bases(s["L"]), self.first_bases(s["R"])
                continue
            k = self.t - 1
            rotate = (lambda x: s["QL"].T @ x @ s["QR"]) if matrix else (lambda x: x)
            back = (lambda x: s["QL"] @ x @ s["QR"].T) if matrix else (lambda x: x)
            s["m"] = debias(b1, k) * s["m"] + (1 - debias(b1, k)) * g
            s["v"] = debias(b2, k) * s["v"] + (1 - debias(b2, k)) * rotate(g) ** 2
            direction = back(rotate(s["m"]) / np.maximum(np.sqrt(s["v"]), self.eps))
            if matrix:
                beta = debias(b2, k)
                s["L"] = beta * s["L"] + (1 - beta) * g @ g.T
                s["R"] = beta * s["R"] + (1 - beta) * g.T @ g
                if self.t == self.start:
                    s["QL"], s["QR"] = self.first_bases(s["L"]), self.first_bases(s["R"])
                    s["v"] = (s["QL"] ** 2).T @ s["v"] @ s["QR"] ** 2
                elif self.t > self.start and (self.t - self.start) % self.f == 0:
                    for axis, (factor, basis) in enumerate((("L", "QL"), ("R", "QR"))):
                        power = s[factor] @ s[basis]
                        order = np.argsort(-np.einsum("ij,ij->j", s[basis], power), kind="stable")
                        s["v"] = np.take(s["v"], order, axis=axis)
                        s[basis] = np.linalg.qr(power[:, order])[0]
            w = p.detach().double().numpy() * (1 - self.lr * self.wd) - self.lr * direction
            with torch.no_grad():
                p.copy_(torch.from_numpy(w))

    def first_bases(self, factor: np.ndarray) -> np.ndarray:
        if self.first == "eigh":
            return eig_desc(factor)
        order = np.argsort(-np.diag(factor), kind="stable")  # the identity's Rayleigh quotients
        return np.linalg.qr(factor[:, order])[0]


def run_reference(steps: int, start: int = FREQUENCY, first: str = "eigh") -> list[torch.Tensor]:
    model = small_mlp(sizes=SIZES)
    ref = ReferenceSOAP(list(model.parameters()), frequency=FREQUENCY, start=start, first=first, **HYPER)
    train(model, ref, steps, data=regression_data(sizes=SIZES))
    return [p.detach().clone() for p in model.parameters()]


def run_soap(steps: int, runtime: asteria.RuntimeConfig, **kwargs) -> list[torch.Tensor]:
    model = small_mlp(sizes=SIZES)
    with asteria.SOAP(model.parameters(), precondition_frequency=FREQUENCY, runtime=runtime, **HYPER,
                      **kwargs) as opt:
        train(model, opt, steps, data=regression_data(sizes=SIZES))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("start", [None, 1, 5], ids=["default-f", "first-gradient", "later"])
def test_sync_matches_float64_reference(start):
    reference = run_reference(14, FREQUENCY if start is None else start)
    soap = run_soap(14, asteria.RuntimeConfig(mode="sync"), start_preconditioning_step=start)
    assert max(relative_errors(soap, reference)) < 2e-4
    if start != 1:  # the start changes the trajectory: the comparison can tell one from the other
        assert max(relative_errors(soap, run_reference(14, 1))) > 1e-2


@pytest.mark.parametrize("start", [None, 1], ids=["default-f", "first-gradient"])
def test_a_first_basis_from_the_identity_matches_the_reference_sync_and_async(start):
    """``first_basis="qr"``: native mode and the C++ workers (S = 0) both follow the reference, which the
    full eigendecomposition's trajectory does not."""
    reference = run_reference(14, FREQUENCY if start is None else start, first="qr")
    for runtime in (asteria.RuntimeConfig(mode="sync"),
                    asteria.RuntimeConfig(mode="async", staleness=0, workers=2, stagger=False)):
        soap = run_soap(14, runtime, start_preconditioning_step=start, first_basis="qr")
        assert max(relative_errors(soap, reference)) < 2e-4, runtime.mode
    assert max(relative_errors(run_reference(14, FREQUENCY if start is None else start), reference)) > 1e-2


def test_reference_comparison_can_fail():
    """Plain AdamW from the same start lands far from the SOAP reference."""
    model = small_mlp(sizes=SIZES)
    opt = torch.optim.AdamW(model.parameters(), lr=HYPER["lr"], betas=HYPER["betas"], weight_decay=0.01)
    train(model, opt, 14, data=regression_data(sizes=SIZES))
    assert max(relative_errors(list(model.parameters()), run_reference(14))) > 1e-2


def test_async_staleness_zero_matches_sync_and_reference():
    async_ = run_soap(14, asteria.RuntimeConfig(mode="async", staleness=0, workers=2, stagger=False))
    assert max(relative_errors(async_, run_reference(14))) < 2e-4
    assert max(relative_errors(async_, run_soap(14, asteria.RuntimeConfig(mode="sync")))) < 2e-4


def test_async_worker_count_does_not_change_bits():
    one = run_soap(20, asteria.RuntimeConfig(staleness=2, workers=1, deterministic=True))
    three = run_soap(20, asteria.RuntimeConfig(staleness=2, workers=3, deterministic=True))
    assert all(torch.equal(a, b) for a, b in zip(one, three, strict=True))


def test_soap_trains_a_classifier():
    x, labels = blob_classification()
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    with asteria.SOAP(model.parameters(), lr=0.01, precondition_frequency=5,
                      runtime=asteria.RuntimeConfig(staleness=1, workers=1)) as opt:
        train_classifier(model, opt, x, labels)
        stats = opt.runtime_stats()
    assert float((model(x).argmax(1) == labels).float().mean()) > 0.9
    assert stats["refreshes"] > 0 and stats["refresh_failures"] == 0


@pytest.mark.parametrize("runtime", [asteria.RuntimeConfig(mode="sync"),
                                     asteria.RuntimeConfig(staleness=2, workers=2, deterministic=True)],
                         ids=["sync", "async"])
@pytest.mark.parametrize("before", [FREQUENCY, 8], ids=["at-the-first-basis", "later"])
def test_state_dict_resume_is_bit_for_bit(runtime, before):
    """Also from the step whose refresh gave the first bases: the moments are carried into them within that step,
    so the checkpoint holds them carried (they were carried at the next step's start, which a resume skipped)."""
    def make():
        model = small_mlp(sizes=SIZES)
        return model, asteria.SOAP(model.parameters(), precondition_frequency=FREQUENCY, runtime=runtime, **HYPER)

    assert resume_is_exact(make, regression_data(sizes=SIZES), before=before)


@pytest.mark.parametrize("runtime", [asteria.RuntimeConfig(mode="sync"), asteria.RuntimeConfig(staleness=0, workers=1)],
                         ids=["sync", "async"])
def test_refresh_skip_is_counted_and_keeps_the_basis(runtime):
    model = small_mlp(sizes=SIZES)
    # Any basis passes a tolerance of 1: every refresh after the first eigendecomposition is skipped.
    with asteria.SOAP(model.parameters(), precondition_frequency=FREQUENCY, refresh_skip_tol=1.0,
                      runtime=runtime, **HYPER) as opt:
        train(model, opt, FREQUENCY + 1, data=regression_data(sizes=SIZES))  # the first basis is in use
        first = [t.clone() for g in opt._groups for k, t in g.state.items() if k.startswith("basis")]
        train(model, opt, 13 - FREQUENCY, data=regression_data(sizes=SIZES))
        later = [t for g in opt._groups for k, t in g.state.items() if k.startswith("basis")]
        stats = opt.runtime_stats()
    assert stats["refreshes_skipped"] > 0
    assert all(torch.equal(a, b) for a, b in zip(first, later, strict=True))
    default = run_soap(14, runtime)  # tol 0 (the default) never skips: the bases move
    assert not all(torch.equal(a, b) for a, b in zip(default, [p.detach() for p in model.parameters()], strict=True))


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": -1.0}, "Invalid lr=-1.0"), ({"betas": (1.0, 0.9)}, r"Invalid betas\[0\]=1.0"),
    ({"shampoo_beta": 2.0}, "Invalid shampoo_beta=2.0"), ({"eps": 0}, "Invalid eps=0"),
    ({"refresh_skip_tol": -0.1}, "Invalid refresh_skip_tol=-0.1"),
    ({"precondition_1d": "yes"}, "Invalid precondition_1d"),
    ({"first_basis": "QR"}, "Invalid first_basis='QR': must be 'eigh' or 'qr'"),
    ({"precondition_frequency": 0}, "Invalid precondition_frequency=0"),
])
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        asteria.SOAP(small_mlp().parameters(), **kwargs)


@pytest.mark.parametrize("optimizer", [asteria.SOAP, asteria.KLShampoo])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_nan_gradient_is_skipped_and_counted(optimizer, mode):
    model = small_mlp(sizes=SIZES)
    with optimizer(model.parameters(), precondition_frequency=2,
                   runtime=asteria.RuntimeConfig(mode=mode, staleness=0, workers=1)) as opt:
        train(model, opt, 4, data=regression_data(sizes=SIZES))
        before = model[0].weight.detach().clone()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        model[0].weight.grad[1, 1] = float("nan")
        opt.step()
        assert torch.equal(model[0].weight, before)
        train(model, opt, 5, data=regression_data(sizes=SIZES))
        assert opt.runtime_stats()["nonfinite_grad_skips"] == 1
        assert all(torch.isfinite(t).all() for g in opt._groups for t in g.state.values() if t.is_floating_point())
