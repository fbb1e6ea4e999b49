"""What smaller preconditioner blocks cost in loss, on a model the CPU trains in minutes: ``asteria bench`` on
the tiny preset widened to ``--hidden`` with a ``--mlp``-wide SwiGLU MLP (by default 256 and 2048, so that the
MLP's 2048 dimension is one block at ``max_preconditioner_dim`` 2048 and two at 1024), once per block size and
seed, then a table of validation loss and mean step per config against the largest block size.

bench/refresh_demand.py measures the work smaller blocks save; this, what they cost. On the GPU the same
comparison is ``STAGES=dims bash bench/executor_session.sh`` on olmo-160m.

    python3 bench/block_size.py --dims 2048 1024 --seeds 0 1 --steps 300 --out runs/block-size
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from asteria.train import model as models
from asteria.train.cli import main as asteria

PRESET = "block-size"


def run(args: argparse.Namespace) -> dict[tuple[int, int], dict]:
    """Runs the benches; returns (dim, seed) -> the bench's per-config rows."""
    models.PRESETS[PRESET] = dataclasses.replace(models.PRESETS["tiny"], hidden_size=args.hidden,
                                                 intermediate_size=args.mlp, num_heads=args.hidden // 64)
    rows = {}
    for seed in args.seeds:
        for dim in args.dims:
            out = args.out / f"dim{dim}-seed{seed}"
            argv = ["bench", "--model", PRESET, "--device", "cpu", "--batch-size", str(args.batch_size), "--seq-len",
                    str(args.seq_len), "--steps", str(args.steps), "--precondition-frequency", str(args.frequency),
                    "--eval-every", str(min(100, args.steps)), "--eval-batches", "8", "--seed", str(seed),
                    "--max-preconditioner-dim", str(dim), "--configs", *args.configs, "--out", str(out)]
            if asteria(argv) != 0:
                raise SystemExit(f"block_size: the bench of max_preconditioner_dim={dim}, seed={seed} failed")
            rows[(dim, seed)] = json.loads((out / "results.json").read_text())["runs"]
    return rows


def table(rows: dict[tuple[int, int], dict], dims: list[int], seeds: list[int], configs: list[str]) -> list[str]:
    """One line per config, dim and seed: validation loss, mean step, and both against the first dim's."""
    lines = [f"{'config':<16} {'dim':>5} {'seed':>4} {'val loss':>9} {'vs ' + str(dims[0]):>9} {'mean ms':>8} "
             f"{'vs ' + str(dims[0]):>9}"]
    for config in configs:
        for seed in seeds:
            base = rows[(dims[0], seed)][config]
            for dim in dims:
                r = rows[(dim, seed)][config]
                lines.append(f"{config:<16} {dim:>5} {seed:>4} {r['final_val_loss']:>9.4f} "
                             f"{r['final_val_loss'] / base['final_val_loss']:>8.3f}x "
                             f"{1e3 * r['mean_step_seconds']:>8.1f} "
                             f"{r['mean_step_seconds'] / base['mean_step_seconds']:>8.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", nargs="+", type=int, default=[2048, 1024])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--configs", nargs="+", default=["shampoo-sync", "soap-sync"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--frequency", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--mlp", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("runs/block-size"))
    args = parser.parse_args()
    for name in ("steps", "frequency", "batch_size", "seq_len", "hidden", "mlp"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: invalid value {getattr(args, name)}: must be >= 1")
    if any(d < 1 for d in args.dims):
        parser.error(f"argument --dims: invalid value {args.dims}: every size must be >= 1")
    if args.hidden % 64:
        parser.error(f"argument --hidden: invalid value {args.hidden}: must be a multiple of 64 (heads of 64)")
    rows = run(args)
    text = "\n".join(table(rows, args.dims, args.seeds, args.configs))
    print(text)
    (args.out / "block_size.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
