"""Where ``asteria.attach`` prefetches, side by side: at the start of the model's forward (a forward
pre-hook, as before the tenth session) or at its end (a forward hook, now), with everything else equal.

Runs ``asteria bench`` with the given arguments twice in this process, once per placement, into
``OUT/start`` and ``OUT/end``, and prints per config the median and max/median step (wall clock), the
CUDA-event median, the waits and the final loss of each, with the ratio end/start. Under the
deterministic rule both placements install the same versions at the same steps (the hooks never change
what is computed), so the losses must agree bit for bit; under ``--no-deterministic`` they may differ.

    python3 bench/prefetch_point.py --out DIR -- --model olmo-160m --steps 250 --configs soap-async ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import asteria
from asteria.pipeline import hooks
from asteria.train import cli


def attach_at_forward_start(model: torch.nn.Module, optimizer: Any,
                            drain_points: int = hooks.DRAIN_POINTS) -> hooks.AttachHandle:
    """``asteria.attach`` with its prefetch hook moved to the start of the forward."""
    handle = hooks.attach(model, optimizer, drain_points)
    handle._handles[0].remove()

    def prefetch(module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            optimizer.prefetch()

    handle._handles[0] = model.register_forward_pre_hook(prefetch)
    return handle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the arguments of asteria bench")
    args = parser.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if "--out" in bench_args:
        parser.error("Invalid bench arguments: --out is this script's own (OUT/start and OUT/end)")
    original = asteria.attach
    results = {}
    for point, attach in (("start", attach_at_forward_start), ("end", original)):
        asteria.attach = attach
        try:
            code = cli.main(["bench", *bench_args, "--out", str(args.out / point)])
        finally:
            asteria.attach = original
        if code != 0:
            raise SystemExit(f"asteria bench with the prefetch at the forward's {point} failed (exit {code})")
        results[point] = json.loads((args.out / point / "results.json").read_text())
    print(f"device: {results['end']['device']}")
    print("| config | median ms start / end | ratio | max/median start / end | CUDA-event median ms start / end "
          "| waits start / end | final loss start / end |")
    print("|---|---|---|---|---|---|---|")
    for label, end in results["end"]["runs"].items():
        start = results["start"]["runs"][label]
        gpu = (f"{start['gpu_median_step_seconds'] * 1e3:.1f} / {end['gpu_median_step_seconds'] * 1e3:.1f}"
               if end["gpu_median_step_seconds"] else "–")
        print(f"| {label} | {start['median_step_seconds'] * 1e3:.1f} / {end['median_step_seconds'] * 1e3:.1f} "
              f"| {end['median_step_seconds'] / start['median_step_seconds']:.3f} "
              f"| {start['max_over_median']:.2f} / {end['max_over_median']:.2f} | {gpu} "
              f"| {start['waits']} / {end['waits']} | {start['final_loss']:.4f} / {end['final_loss']:.4f} |")


if __name__ == "__main__":
    main()
