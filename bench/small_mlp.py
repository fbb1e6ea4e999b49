"""The README's Quick start on a small model: a 32 -> 64 (tanh) -> 1 MLP fitting y = x @ w (w ~ N(0, 1), 4096
samples), batches of 64 drawn at random, each optimizer at its defaults with lr 3e-3 for 200 steps. It checks
that the defaults serve a model far smaller than the ones they were tuned on: every Asteria optimizer should
end within 2x AdamW's loss. ``--targets`` picks setups (see ``TARGETS``).

Run:  python3 bench/small_mlp.py [--seeds 0 1 2 3] [--steps 200] [--targets raw unit fresh] [--scales 0.43 ...]
                                 [--peer-path .peers]
(``--scales``: more targets, ``raw``'s scaled by each factor; ``--peer-path``: Meta's Distributed Shampoo's
Shampoo and SOAP beside them, from that checkout, with the hyperparameters of the Asteria optimizer each
stands beside)
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


#: target setups: y = x @ w with w ~ N(0, 1) (``raw``), the Quick start's, scaled to unit variance (``unit``),
#: and a ReLU MLP fed fresh samples with noise (``fresh``: where a small matrix merged whole into one dimension,
#: the rule before Kronecker structure was kept, left Shampoo's single full-matrix factor rank-deficient)
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
    named = name in ("shampoo", "soap", "kl-shampoo")  # Asteria's take names (for their messages)
    opt = OPTIMIZERS[name](model.named_parameters() if named else model.parameters())
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
    parser.add_argument("--scales", type=float, nargs="*", default=[],
                        help="more targets: raw's, scaled by each of these factors (> 0)")
    parser.add_argument("--peer-path", default=None,
                        help="a checkout of facebookresearch/optimizers: its Shampoo and SOAP run too")
    args = parser.parse_args(argv)
    if args.peer_path is not None:
        from asteria.train.peers import make_peer  # the bench's peers, at asteria.Shampoo's and asteria.SOAP's settings

        for peer, weight_decay in (("ds-shampoo", 0.0), ("ds-soap", 0.01)):
            OPTIMIZERS[peer] = lambda params, peer=peer, wd=weight_decay: make_peer(
                peer, params, LR, wd, 10, 2048, args.peer_path)
    targets = list(args.targets)
    for scale in args.scales:
        if not scale > 0:
            parser.error(f"Invalid --scales value {scale}: must be a number > 0")
        TARGETS[f"x{scale:g}"] = scale
        targets.append(f"x{scale:g}")
    for target in targets:
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
