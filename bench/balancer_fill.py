"""``asteria bench`` with the lane balancer's planned fill of the workers
(``asteria.pipeline.balance.WORKER_UTILIZATION``) set for one run: the side-by-side of docs/results.md, "The
balancer's fill and the stagger's unit". The fill is a module constant, not a per-optimizer setting, because it
tunes the executor's plan rather than the math; a run of each value beside its own AdamW shows what it trades (the
steps' time against refreshes deferred and their install delay). The stagger's unit, the other half of that
comparison, is ``asteria bench``'s own ``--stagger-sets-per-step``.

    python3 bench/balancer_fill.py --worker-utilization 0.85 -- --stagger-sets-per-step 1 --model olmo-160m \
      --batch-size 32 --seq-len 1024 --steps 120 --precondition-frequency 10 --configs adamw shampoo-async

Everything after ``--`` goes to ``asteria bench``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import asteria.pipeline.balance as balance
from asteria.train import cli

#: the fills the plan accepts: above 1 it would plan more worker seconds than an interval has
UTILIZATION_RANGE = (0.1, 1.0)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], Path]:
    """This script's options, the ``asteria bench`` arguments after them, and the bench's output folder. The bench's
    arguments are checked here, before the fill changes, so that a bad one fails before anything runs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-utilization", type=float, default=balance.WORKER_UTILIZATION,
                        help="the share of the workers' interval the plan fills (default: %(default)s)")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the arguments of asteria bench")
    args = parser.parse_args(argv)
    low, high = UTILIZATION_RANGE
    if not low <= args.worker_utilization <= high:
        parser.error(f"--worker-utilization={args.worker_utilization}: give a share of the interval in "
                     f"[{low}, {high}]")
    rest = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not rest:
        parser.error("no asteria bench arguments: give them after --")
    return args, rest, Path(cli.build_parser().parse_args(["bench", *rest]).out)


def main(argv: list[str] | None = None) -> int:
    """Runs the bench under the fill, and records it beside the bench's results (``balancer_fill.json``): the
    runs' own configs hold the stagger's unit, not the fill."""
    args, rest, out = parse(argv)
    balance.WORKER_UTILIZATION = args.worker_utilization
    print(f"worker utilization {args.worker_utilization}", flush=True)
    code = cli.main(["bench", *rest])
    if code == 0:
        (out / "balancer_fill.json").write_text(json.dumps({"worker_utilization": args.worker_utilization}))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
