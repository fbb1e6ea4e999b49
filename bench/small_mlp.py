"""The README's Quick start on a small model: a 32 -> 64 (tanh) -> 1 MLP fitting y = x @ w (w ~ N(0, 1), 4096
samples), batches of 64 drawn at random, each optimizer at its defaults with lr 3e-3 for 200 steps. It checks
that the defaults serve a model far smaller than the ones they were tuned on: every Asteria optimizer should
end within 2x AdamW's loss. ``--targets`` picks setups (see ``TARGETS``).

Run:  python3 bench/small_mlp.py [--seeds 0 1 2 3] [--steps 200] [--targets raw unit fresh]
Prints each optimizer's final loss (mean of the last 10 steps) per seed and its ratio to AdamW's."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import asteria

LR = 3e-3
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=LR),
    "shampoo": lambda params: asteria.Shampoo(params, lr=LR),
    "soap": lambda params: asteria.SOAP(params, lr=LR),
    "kl-shampoo": lambda params: asteria.KLShampoo(params, lr=LR),
}


#: target setups: the Quick start's (``raw``), its target scaled to unit variance (``unit``), and a ReLU MLP
#: fed fresh samples with noise (``fresh``: where a small matrix merged whole into one dimension, the rule
#: before Kronecker structure was kept, left Shampoo's single full-matrix factor rank-deficient)
TARGETS = {"raw": 1.0, "unit": 32**-0.5, "fresh": 1.0}


def final_loss(name: str, seed: int, steps: int = 200, batch: int = 64, target_scale: str = "raw") -> float:
    """The mean training loss of the last 10 of ``steps`` steps of optimizer ``name`` at its defaults."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 32, generator=gen)
    w = torch.randn(32, 1, generator=gen) * TARGETS[target_scale]
    y = x @ w
    torch.manual_seed(seed)
    hidden = torch.nn.ReLU() if target_scale == "fresh" else torch.nn.Tanh()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), hidden, torch.nn.Linear(64, 1))
    opt = OPTIMIZERS[name](model.named_parameters() if name != "adamw" else model.parameters())
    losses = []
    try:
        for _ in range(steps):
            if target_scale == "fresh":
                xb = torch.randn(batch, 32, generator=gen)
                yb = xb @ w + 0.1 * torch.randn(batch, 1, generator=gen)
            else:
                rows = torch.randint(0, len(x), (batch,), generator=gen)
                xb, yb = x[rows], y[rows]
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        if hasattr(opt, "close"):
            opt.close()
    return statistics.fmean(losses[-10:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=list(TARGETS))
    args = parser.parse_args(argv)
    for target in args.targets:
        print(f"target {target}:")
        results = {}
        for name in OPTIMIZERS:
            started = time.perf_counter()
            results[name] = [final_loss(name, seed, args.steps, target_scale=target) for seed in args.seeds]
            print(f"{name:>11}: final loss {', '.join(f'{v:.4f}' for v in results[name])} "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
        adamw = statistics.fmean(results["adamw"])
        for name, values in results.items():
            print(f"{name:>11}: mean {statistics.fmean(values):.4f}, {statistics.fmean(values) / adamw:.2f}x AdamW's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
