"""How much a late preconditioner costs an optimizer: the tiny OLMo-2 preset trained for a fixed number
of steps on the embedded corpus, natively (sync) and under Asteria's activation rules, with optional
random worker delays that make versions arrive later. Prints each run's final loss (mean of the last 10
steps) with the staleness the registry saw. CPU, a few minutes on 2 cores.

Run:  python3 bench/staleness_lag.py --optimizer soap --steps 150 \
          --runs sync nd:0 nd:3 nd:3:0.08 nd:3:0.25 nd:3:0.6 det:1 det:3
      python3 bench/staleness_lag.py --optimizer shampoo --runs sync det:0 --seeds 1 2 3   # sync vs async, no lag

A run is ``sync``, ``nd:S[:DELAY]`` (deterministic=False, staleness S, workers sleeping up to DELAY
seconds per job), ``det:S`` (the deterministic rule: every version used exactly S intervals late) or
``lag:L`` (the deterministic rule with ``RuntimeConfig.lag_steps=L``: every version used exactly L steps
late, S = 5), optionally followed by ``+stagger`` or ``+flat`` (``RuntimeConfig.stagger`` True or False; by default
async runs are staggered and sync runs are not):

      python3 bench/staleness_lag.py --optimizer kl-shampoo --runs sync sync+stagger det:0 --seeds 1 2 3 4
      python3 bench/staleness_lag.py --optimizer soap --runs sync lag:1 lag:3 det:1 --seeds 1 2 3 4
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import asteria
from asteria.testing import set_random_worker_delay
from asteria.train.data import default_corpus
from asteria.train.model import build_model

OPTIMIZERS = {"shampoo": asteria.Shampoo, "soap": asteria.SOAP, "kl-shampoo": asteria.KLShampoo}


def parse_run(spec: str, sync_refreshes: int = 2) -> tuple[asteria.RuntimeConfig, float]:
    base, _, layout = spec.partition("+")
    if layout not in ("", "stagger", "flat"):
        raise ValueError(f"Invalid run={spec!r}: a suffix must be '+stagger' or '+flat'")
    runtime, delay = _parse_rule(base, sync_refreshes, spec)
    if layout:
        runtime = dataclasses.replace(runtime, stagger=layout == "stagger")
    return runtime, delay


def _parse_rule(rule: str, sync_refreshes: int, spec: str) -> tuple[asteria.RuntimeConfig, float]:
    kind, *rest = rule.split(":")
    try:
        if kind == "sync" and not rest:
            return asteria.RuntimeConfig(mode="sync"), 0.0
        if kind in ("nd", "det") and 1 <= len(rest) <= (2 if kind == "nd" else 1):
            delay = float(rest[1]) if len(rest) == 2 else 0.0
            runtime = asteria.RuntimeConfig(mode="async", staleness=int(rest[0]), deterministic=kind == "det",
                                            workers=2 if delay else 1, sync_refreshes=sync_refreshes)
            return runtime, delay
        if kind == "lag" and len(rest) == 1:
            return asteria.RuntimeConfig(mode="async", staleness=5, lag_steps=int(rest[0]), workers=1,
                                         sync_refreshes=sync_refreshes), 0.0
    except ValueError:
        pass
    raise ValueError(f"Invalid run={spec!r}: must be 'sync', 'nd:S[:DELAY]', 'det:S' or 'lag:L'")


def train(args: argparse.Namespace, spec: str, seed: int = 0) -> str:
    runtime, delay = parse_run(spec, args.sync_refreshes)
    tokens = torch.tensor(list(b"".join(default_corpus(400_000))[:300_000]), dtype=torch.long)
    seq, batch = 64, 16
    starts = torch.randint(0, len(tokens) - seq - 1, (args.steps, batch),
                           generator=torch.Generator().manual_seed(seed + 1))
    torch.manual_seed(seed)
    model = build_model("tiny", 256, seq)
    opt = OPTIMIZERS[args.optimizer](model.named_parameters(), lr=args.lr, precondition_frequency=args.frequency,
                                     runtime=runtime)
    if delay:
        set_random_worker_delay(opt, delay, seed=3)
    losses = []
    for step in range(args.steps):
        loss = model.loss(torch.stack([tokens[i:i + seq + 1] for i in starts[step].tolist()]))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    stats = opt.runtime_stats() if runtime.mode == "async" else {}
    opt.close()
    return (f"{spec:14s} seed {seed}  final loss {sum(losses[-10:]) / 10:.4f}   max staleness seen "
            f"{stats.get('max_staleness_seen', 0)}, superseded {stats.get('refreshes_superseded', 0)}, "
            f"waits {stats.get('waits', 0)} ({stats.get('wait_seconds', 0.0):.2f} s), "
            f"mean install delay {stats.get('install_delay_mean_steps', 0.0):.2f} steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="soap")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--frequency", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sync-refreshes", type=int, default=2,
                        help="versions per set used at their own step (RuntimeConfig.sync_refreshes)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="model seed s (batches drawn with seed s + 1); every run is repeated per seed")
    parser.add_argument("--runs", nargs="+", default=["sync", "nd:3", "nd:3:0.25", "det:1", "det:3"])
    args = parser.parse_args()
    for spec in args.runs:
        parse_run(spec)  # every spec checked before the first run starts
    print(f"{args.optimizer}, tiny preset, {args.steps} steps, f={args.frequency}, lr={args.lr}, "
          f"sync_refreshes={args.sync_refreshes}")
    for seed in args.seeds:
        for spec in args.runs:
            print(train(args, spec, seed), flush=True)


if __name__ == "__main__":
    main()
