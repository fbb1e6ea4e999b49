"""How evenly the staggered schedule spreads the refresh work over the steps of an interval, with the
large factor sets whole and split (``RuntimeConfig(stagger_split=True)``): per step of one interval after the
sync refreshes, the jobs (blocks refreshed) and their work (sum of dim^3, in units of 1024^3), and the
busiest step against the mean. Builds the optimizers on the CPU without training (nothing is timed).

    python3 bench/stagger_balance.py --model olmo-160m --max-preconditioner-dim 1024 --frequency 10
"""

from __future__ import annotations

import argparse

import asteria
from asteria.train.model import PRESETS, build_model

KINDS = {"shampoo": asteria.Shampoo, "soap": asteria.SOAP, "kl-shampoo": asteria.KLShampoo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="olmo-160m", choices=sorted(PRESETS))
    parser.add_argument("--optimizers", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--max-preconditioner-dim", type=int, default=1024)
    parser.add_argument("--frequency", type=int, default=10)
    args = parser.parse_args()
    model = build_model(args.model, 256, 1024)
    print(f"model {args.model}, max_preconditioner_dim {args.max_preconditioner_dim}, f = {args.frequency}; "
          "per step: jobs / work (1024^3 units)")
    for name in args.optimizers:
        for split in (False, True):
            runtime = asteria.RuntimeConfig(mode="async", workers=1, stagger_split=split)
            with KINDS[name](model.named_parameters(), max_preconditioner_dim=args.max_preconditioner_dim,
                             precondition_frequency=args.frequency, runtime=runtime) as opt:
                per_step = opt.schedule.interval_loads([(s.batch, s.dim) for s, _ in opt._set_groups])
                sets = len(opt._set_groups)
            work = [w / 1024**3 for _, w in per_step]
            mean = sum(work) / len(work)
            cells = " ".join(f"{jobs}/{w:.1f}" for (jobs, _), w in zip(per_step, work))
            print(f"{name:>10} {'split' if split else 'whole':>5} ({sets:2d} sets): {cells} | "
                  f"busiest {max(work):.1f} = {max(work) / mean:.2f}x the mean {mean:.1f}")


if __name__ == "__main__":
    main()
