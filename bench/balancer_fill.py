"""``asteria bench`` with the lane balancer's planned fill of the workers
(``asteria.pipeline.balance.WORKER_UTILIZATION``) and the stagger's sets per step
(``asteria.optim.groups.STAGGER_SETS_PER_STEP``) set for one run: the side-by-side of docs/results.md, "The
balancer's fill and the stagger's unit". Both are module constants, not per-optimizer settings, because they
tune the executor's plan rather than the math; a run of each pair of values beside its own AdamW shows what they
trade (the steps' time against refreshes deferred and their install delay).

    python3 bench/balancer_fill.py --worker-utilization 0.85 --sets-per-step 1 -- --model olmo-160m \
      --batch-size 32 --seq-len 1024 --steps 120 --precondition-frequency 10 --configs adamw shampoo-async

Everything after ``--`` goes to ``asteria bench``.
"""

from __future__ import annotations

import argparse

import asteria.optim.groups as groups
import asteria.pipeline.balance as balance
from asteria.train import cli

#: the fills the plan accepts: above 1 it would plan more worker seconds than an interval has
UTILIZATION_RANGE = (0.1, 1.0)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the ``asteria bench`` arguments after them."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-utilization", type=float, default=balance.WORKER_UTILIZATION,
                        help="the share of the workers' interval the plan fills (default: %(default)s)")
    parser.add_argument("--sets-per-step", type=int, default=groups.STAGGER_SETS_PER_STEP,
                        help="the stagger's sets per step, the unit the balancer moves (default: %(default)s)")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the arguments of asteria bench")
    args = parser.parse_args(argv)
    low, high = UTILIZATION_RANGE
    if not low <= args.worker_utilization <= high:
        parser.error(f"--worker-utilization={args.worker_utilization}: give a share of the interval in "
                     f"[{low}, {high}]")
    if args.sets_per_step < 1:
        parser.error(f"--sets-per-step={args.sets_per_step}: give a whole number of sets, at least 1")
    rest = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not rest:
        parser.error("no asteria bench arguments: give them after --")
    return args, rest


def main(argv: list[str] | None = None) -> int:
    args, rest = parse(argv)
    balance.WORKER_UTILIZATION = args.worker_utilization
    groups.STAGGER_SETS_PER_STEP = args.sets_per_step
    print(f"worker utilization {args.worker_utilization}, {args.sets_per_step} stagger set(s) a step", flush=True)
    return cli.main(["bench", *rest])


if __name__ == "__main__":
    raise SystemExit(main())
