"""Refresh work per interval against the block size: the CPU core-seconds one refresh of every factor of a
model costs, at each ``max_preconditioner_dim``, for Shampoo's inverse roots and SOAP's / KL-Shampoo's
warm-started eigenbases.

The model's factors are counted with the library's own blocking rule (``asteria.optim.blocking``) over its
parameters of order >= 2 (1-D ones take Adam's step at the defaults), built on the meta device, so any preset
is counted without its memory. Each factor size is timed once on one core with the C++ numerics the workers
run (``asteria._core.inverse_root``, ``qr_refresh`` from the basis of the factor 10 steps before), best of
``--repeats``, on a full-rank factor with a decaying spectrum (``sample_factor``). The demand is the sum over
factors; with ``--cores`` and ``--interval-s`` it is set against the workers' capacity in an interval
(core-seconds), as "Work against capacity" in docs/results.md does. Timings are this machine's; the ratio
between block sizes carries over to another host.

    python3 bench/refresh_demand.py --model olmo-160m olmo2-1b --max-dims 1024 2048
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core per refresh, as each worker runs

import numpy as np  # noqa: E402
import torch  # noqa: E402

from asteria import _core  # noqa: E402
from asteria.optim.blocking import partition  # noqa: E402
from asteria.train import model as models  # noqa: E402


def factor_sizes(preset: str, max_dim: int) -> collections.Counter[int]:
    """How many factors of each size a refresh of every block of ``preset`` computes (byte vocabulary)."""
    with torch.device("meta"):
        model = models.build_model(preset, vocab_size=256, seq_len=models.PRESETS[preset].max_seq_len)
    sizes: collections.Counter[int] = collections.Counter()
    for index, (name, param) in enumerate(model.named_parameters()):
        if param.dim() < 2:
            continue
        for block in partition(param, index, name, max_dim):
            sizes.update(block.shape)
    return sizes


def sample_factor(n: int, rng: np.random.Generator) -> np.ndarray:
    """A full-rank factor with a decaying spectrum, as a long EMA of G G^T leaves one: X X^T / m over m = 2n
    columns whose scales fall as 1/sqrt(j). (A rank-limited one would flatter the eigensolver: divide and
    conquer deflates repeated eigenvalues.)"""
    m = 2 * n
    x = rng.standard_normal((n, m)).astype(np.float32) / np.sqrt(1.0 + np.arange(m, dtype=np.float32))
    a = x @ x.T / m
    return np.ascontiguousarray((a + a.T) / 2)


def time_refresh(n: int, repeats: int, rng: np.random.Generator) -> dict[str, float]:
    """Seconds of one refresh of an ``n`` factor, best of ``repeats``: the inverse root and the warm QR."""
    a = sample_factor(n, rng)
    q_prev, _, _ = _core.eigenbasis(a)
    b = np.ascontiguousarray(0.9 * a + 0.1 * sample_factor(n, rng))  # the factor 10 steps later
    best = {"root": float("inf"), "qr": float("inf")}
    for _ in range(repeats):
        start = time.perf_counter()
        _core.inverse_root(b, -0.25, 1e-12)
        best["root"] = min(best["root"], time.perf_counter() - start)
        start = time.perf_counter()
        _core.qr_refresh(b, q_prev)
        best["qr"] = min(best["qr"], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["olmo-160m", "olmo2-1b"], choices=sorted(models.PRESETS))
    parser.add_argument("--max-dims", nargs="+", type=int, default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cores", type=int, default=14, help="workers whose capacity to compare with")
    parser.add_argument("--interval-s", type=float, nargs="*", default=[],
                        help="an interval's seconds per model (AdamW's step x f), in --model's order")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    if any(d < 1 for d in args.max_dims):
        parser.error(f"argument --max-dims: invalid value {args.max_dims}: every size must be >= 1")
    if args.repeats < 1 or args.cores < 1:
        parser.error(f"arguments --repeats {args.repeats} and --cores {args.cores}: each must be >= 1")
    if len(args.interval_s) > len(args.model) or any(t <= 0 for t in args.interval_s):
        parser.error(f"argument --interval-s: invalid value {args.interval_s}: at most one per --model, each > 0")
    torch.set_num_threads(1)
    counts = {(m, d): factor_sizes(m, d) for m in args.model for d in args.max_dims}
    rng = np.random.default_rng(0)
    sizes = sorted({n for c in counts.values() for n in c})
    host = platform.processor() or "this host"
    print(f"timing {len(sizes)} factor sizes ({', '.join(map(str, sizes))}) on one core of {host}", flush=True)
    timing = {n: time_refresh(n, args.repeats, rng) for n in sizes}
    for n in sizes:
        print(f"  n={n:<5} inverse root {timing[n]['root'] * 1e3:8.1f} ms   warm QR {timing[n]['qr'] * 1e3:8.1f} ms",
              flush=True)
    rows = []
    print(f"\n{'model':<11} {'max dim':>7} {'factors':>8} {'root core-s':>12} {'QR core-s':>10} {'vs largest dim':>15}"
          + ("  root / capacity   QR / capacity" if args.interval_s else ""))
    for mi, m in enumerate(args.model):
        base = None
        for d in sorted(args.max_dims, reverse=True):
            c = counts[(m, d)]
            root = sum(k * timing[n]["root"] for n, k in c.items())
            qr = sum(k * timing[n]["qr"] for n, k in c.items())
            base = base or root
            row = {"model": m, "max_dim": d, "factors": dict(sorted(c.items())), "root_core_s": root, "qr_core_s": qr}
            line = f"{m:<11} {d:>7} {sum(c.values()):>8} {root:>12.2f} {qr:>10.2f} {root / base:>14.2f}x"
            if mi < len(args.interval_s):
                capacity = args.cores * args.interval_s[mi]
                row["capacity_core_s"] = capacity
                line += f"  {root / capacity:>15.2f}   {qr / capacity:>13.2f}"
            rows.append(row)
            print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"host": platform.node(), "timing": timing, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
