"""KL-Shampoo (sync and async) against an independent float64 reference written here from the math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ReferenceOptimizer, regression_data, relative_errors, resume_is_exact, small_mlp, train

import asteria

SIZES = (8, 8, 8)
HYPER = dict(lr=0.003, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
FREQUENCY = 3
INIT = 0.1


class ReferenceKLShampoo(ReferenceOptimizer):
    """2-D weights: S_L <- b S_L + (1-b)/n G Q_R D_R^-1 Q_R^T G^T (and symmetric), eigenvalues re-estimated
    each step in the stale bases, bases refreshed by QR(S Q) after ordering Q's columns by Rayleigh
    quotient; 1-D parameters: Adam. The eigenvalue estimates start at ``init`` (the reference's constant
    0.1), or with ``init=None`` at sqrt(mean g^2) of the first gradient (Asteria's default)."""

    def __init__(self, params, lr, betas, eps, weight_decay, frequency, init=INIT):
        super().__init__(params, lr, betas, eps, weight_decay)
        self.f, self.init = frequency, init
        self.state = [dict(m=np.zeros(tuple(p.shape)), v=np.zeros(tuple(p.shape))) for p in self.params]

    def step(self):
        self.t += 1
        b1, b = self.betas
        for p, s in zip(self.params, self.state, strict=True):
            g = p.grad.double().numpy()
            if g.ndim == 1:
                if self.t > 1:
                    k = self.t - 1
                    s["m"] = b1 * s["m"] + (1 - b1) * g
                    s["v"] = b * s["v"] + (1 - b) * g * g
                    direction = (s["m"] / (1 - b1**k)) / (np.sqrt(s["v"] / (1 - b**k)) + self.eps)
                    self._apply(p, direction)
                continue
            m, n = g.shape
            if self.t == 1:
                s["SL"], s["SR"] = (1 - b) / n * g @ g.T, (1 - b) / m * g.T @ g
                s["QL"], s["QR"] = (np.linalg.eigh(x)[1][:, ::-1] for x in (s["SL"], s["SR"]))
                d = INIT if self.init is None and not np.any(g) else self.init
                d = np.sqrt(np.mean(g * g)) if d is None else d
                s["eL"] = np.minimum(np.full(m, d**-0.5), max(10, min(m, 4000)))
                s["eR"] = np.minimum(np.full(n, d**-0.5), max(10, min(n, 4000)))
                continue
            s["m"] = b1 * s["m"] + (1 - b1) * g
            e = np.outer(s["eL"], s["eR"])
            e = e / (1 + self.eps * e)
            direction = s["QL"] @ ((s["QL"].T @ s["m"] @ s["QR"]) * e) @ s["QR"].T
            inv_r = s["QR"] @ np.diag(s["eR"] ** 2) @ s["QR"].T
            inv_l = s["QL"] @ np.diag(s["eL"] ** 2) @ s["QL"].T
            rotated = s["QL"].T @ g @ s["QR"]
            diag_l = np.mean((rotated * s["eR"][None, :]) ** 2, axis=1)
            diag_r = np.mean((rotated * s["eL"][:, None]) ** 2, axis=0)
            s["SL"] = b * s["SL"] + (1 - b) / n * g @ inv_r @ g.T
            s["SR"] = b * s["SR"] + (1 - b) / m * g.T @ inv_l @ g
            for key, diag in (("eL", diag_l), ("eR", diag_r)):
                d = b / s[key] ** 2 + (1 - b) * diag
                s[key] = np.minimum(1 / np.sqrt(d), max(10, min(len(d), 4000)))
            if (self.t - 1) % self.f == 0:
                for factor, basis, key in (("SL", "QL", "eL"), ("SR", "QR", "eR")):
                    power = s[factor] @ s[basis]
                    order = np.argsort(-np.einsum("ij,ij->j", s[basis], power), kind="stable")
                    s[key] = s[key][order]
                    s[basis] = np.linalg.qr(power[:, order])[0]
            self._apply(p, direction)

    def _apply(self, p, direction):
        w = p.detach().double().numpy() * (1 - self.lr * self.wd) - self.lr * direction
        with torch.no_grad():
            p.copy_(torch.from_numpy(w))


def run_reference(steps: int, init: float | None = INIT) -> list[torch.Tensor]:
    model = small_mlp(sizes=SIZES)
    ref = ReferenceKLShampoo(list(model.parameters()), frequency=FREQUENCY, init=init, **HYPER)
    train(model, ref, steps, data=regression_data(sizes=SIZES))
    return [p.detach().clone() for p in model.parameters()]


def run_kl(steps: int, runtime: asteria.RuntimeConfig, init: float | None = INIT) -> list[torch.Tensor]:
    model = small_mlp(sizes=SIZES)
    with asteria.KLShampoo(model.parameters(), precondition_frequency=FREQUENCY, init_factor=init, runtime=runtime,
                           **HYPER) as opt:
        train(model, opt, steps, data=regression_data(sizes=SIZES))
    return [p.detach().clone() for p in model.parameters()]


def test_sync_matches_float64_reference():
    assert max(relative_errors(run_kl(14, asteria.RuntimeConfig(mode="sync")), run_reference(14))) < 2e-4


def test_async_staleness_zero_matches_reference():
    runtime = asteria.RuntimeConfig(staleness=0, workers=2, stagger=False)
    assert max(relative_errors(run_kl(14, runtime), run_reference(14))) < 2e-4


@pytest.mark.parametrize("runtime", [asteria.RuntimeConfig(mode="sync"),
                                     asteria.RuntimeConfig(staleness=0, workers=2, stagger=False)],
                         ids=["sync", "async"])
def test_init_from_first_gradient_matches_reference(runtime):
    expected = run_reference(14, init=None)
    assert max(relative_errors(run_kl(14, runtime, init=None), expected)) < 2e-4
    assert max(relative_errors(run_reference(14), expected)) > 1e-3  # the two starts differ measurably


def scaled_loss_run(scale: float, init: float | None, steps: int = 12) -> list[torch.Tensor]:
    """KL-Shampoo on the regression with the loss multiplied by ``scale``."""
    model = small_mlp(sizes=SIZES)
    x, y = regression_data(sizes=SIZES)
    with asteria.KLShampoo(model.parameters(), precondition_frequency=FREQUENCY, init_factor=init,
                           runtime=asteria.RuntimeConfig(mode="sync"), **HYPER) as opt:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            start = (step * 32) % 128
            (scale * torch.nn.functional.mse_loss(model(x[start:start + 32]), y[start:start + 32])).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_default_init_makes_the_steps_independent_of_the_loss_scale():
    assert asteria.KLShampoo(small_mlp().parameters()).defaults["init_factor"] is None
    # Up to the clamp of d^(-1/2) from above (a larger loss clamps less), a 1000x larger loss takes the
    # same steps (measured: 0.4% apart) ...
    assert max(relative_errors(scaled_loss_run(1e3, None), scaled_loss_run(1.0, None))) < 1e-2
    # ... while from a constant start the first steps follow the gradient's scale (measured: 38% apart).
    assert max(relative_errors(scaled_loss_run(1e3, INIT), scaled_loss_run(1.0, INIT))) > 1e-1


def test_reference_comparison_can_fail():
    model = small_mlp(sizes=SIZES)
    opt = torch.optim.AdamW(model.parameters(), lr=HYPER["lr"], weight_decay=0.01)
    train(model, opt, 14, data=regression_data(sizes=SIZES))
    assert max(relative_errors(list(model.parameters()), run_reference(14))) > 1e-3


def test_async_worker_count_does_not_change_bits():
    one = run_kl(16, asteria.RuntimeConfig(staleness=2, workers=1, deterministic=True))
    three = run_kl(16, asteria.RuntimeConfig(staleness=2, workers=3, deterministic=True))
    assert all(torch.equal(a, b) for a, b in zip(one, three, strict=True))


@pytest.mark.parametrize("runtime", [asteria.RuntimeConfig(mode="sync"),
                                     asteria.RuntimeConfig(staleness=2, workers=2, deterministic=True)],
                         ids=["sync", "async"])
@pytest.mark.parametrize("before", [FREQUENCY, 8], ids=["at-the-first-basis", "later"])
def test_state_dict_resume_is_bit_for_bit(runtime, before):
    """Also from the step whose refresh gave the first bases: the moments are carried into them within that step,
    so the checkpoint holds them carried (they were carried at the next step's start, which a resume skipped)."""
    def make():
        model = small_mlp(sizes=SIZES)
        return model, asteria.KLShampoo(model.parameters(), precondition_frequency=FREQUENCY, runtime=runtime, **HYPER)

    assert resume_is_exact(make, regression_data(sizes=SIZES), before=before)


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": float("inf")}, "Invalid lr=inf"), ({"betas": (0.9, -0.1)}, r"Invalid betas\[1\]=-0.1"),
    ({"init_factor": 0.0}, "Invalid init_factor=0.0"),
    ({"init_factor": float("nan")}, "Invalid init_factor=nan"), ({"eps": -1.0}, "Invalid eps=-1.0"),
])
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        asteria.KLShampoo(small_mlp().parameters(), **kwargs)
