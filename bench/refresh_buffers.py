"""Pinned host memory of the refresh buffers against the factors' bytes, from ``memory_report()``, for each
optimizer over a slice of a model preset (the first ``--layers`` decoder layers, byte vocabulary): at the
library's defaults and under the deterministic rule with a long lag (the buffers then hold every version
waiting for its use). The accounting does not depend on the device, so the CPU answers for any.

    python3 bench/refresh_buffers.py --model olmo2-1b --layers 2
"""

from __future__ import annotations

import argparse
import dataclasses

import asteria
from asteria.train import model as models

OPTIMIZERS = {"shampoo": asteria.Shampoo, "soap": asteria.SOAP, "kl-shampoo": asteria.KLShampoo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="olmo2-1b", choices=sorted(models.PRESETS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lag", type=int, default=50, help="the deterministic rule's lag_steps to compare")
    args = parser.parse_args()
    name = f"{args.model}-{args.layers}-layers"
    models.PRESETS[name] = dataclasses.replace(models.PRESETS[args.model], num_layers=args.layers)
    model = models.build_model(name, vocab_size=256, seq_len=1024)
    print(f"{'optimizer':<11} {'rule':<28} {'factors GiB':>11} {'buffers GiB':>11} {'ratio':>6}")
    for label, cls in OPTIMIZERS.items():
        for rule, runtime in (("defaults", None),
                              (f"deterministic, lag {args.lag}", asteria.RuntimeConfig(deterministic=True,
                                                                                       lag_steps=args.lag))):
            with cls(model.named_parameters(), runtime=runtime) as opt:
                report = opt.memory_report()
            factors = report["device"].get("factor", 0) + report["host"].get("factor", 0)
            buffers = report["host"]["refresh_buffers"]
            print(f"{label:<11} {rule:<28} {factors / 2**30:>11.2f} {buffers / 2**30:>11.2f} {buffers / factors:>6.2f}")


if __name__ == "__main__":
    main()
