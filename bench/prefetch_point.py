"""Where ``asteria.attach`` activates, side by side: ``asteria bench`` run once per prefetch point
(``--prefetch forward_start``, ``forward_end`` or ``step``), everything else equal, into ``OUT/<point>``.

Prints per config and point the median and max/median step (wall clock), the CUDA-event median, the
waits and the final loss, with each median's ratio to the first point's. Under the deterministic rule
every point installs the same versions at the same steps (the hooks never change what is computed), so
the losses must agree bit for bit; under ``--no-deterministic`` they may differ. On several processes
use ``bench/scaling.py --prefetch POINT`` once per point.

    python3 bench/prefetch_point.py --out DIR --points forward_end step -- --model olmo-160m --steps 250 ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asteria.hooks import PREFETCH_POINTS
from asteria.train import cli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", nargs="+", default=list(PREFETCH_POINTS), choices=PREFETCH_POINTS,
                        help=f"subset of {PREFETCH_POINTS}")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the arguments of asteria bench")
    args = parser.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    for name in ("--out", "--prefetch"):
        if name in bench_args:
            parser.error(f"Invalid bench arguments: {name} is this script's own")
    results = {}
    for point in args.points:
        code = cli.main(["bench", *bench_args, "--prefetch", point, "--out", str(args.out / point)])
        if code != 0:
            raise SystemExit(f"asteria bench with --prefetch {point} failed (exit {code})")
        results[point] = json.loads((args.out / point / "results.json").read_text())
    first = args.points[0]
    print(f"device: {results[first]['device']}")
    print("| config | point | median ms | vs " + first + " | max/median | CUDA-event median ms | waits | final loss |")
    print("|---|---|---|---|---|---|---|---|")
    for label, base in results[first]["runs"].items():
        for point in args.points:
            row = results[point]["runs"][label]
            gpu = f"{row['gpu_median_step_seconds'] * 1e3:.1f}" if row["gpu_median_step_seconds"] else "–"
            print(f"| {label} | {point} | {row['median_step_seconds'] * 1e3:.1f} "
                  f"| {row['median_step_seconds'] / base['median_step_seconds']:.3f} | {row['max_over_median']:.2f} "
                  f"| {gpu} | {row['waits']} | {row['final_loss']:.4f} |")


if __name__ == "__main__":
    main()
