"""The ``asteria`` command: ``train`` one run, ``demo`` (AdamW vs Asteria Shampoo with a report),
``bench`` (every optimizer x mode side by side), ``report`` over finished runs."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

import torch

from asteria.train.bench import CONFIGS, format_table, run_bench
from asteria.train.loop import RunConfig, train
from asteria.train.report import write_report


OPTIONAL_TYPES = {"lr": float, "workers": int, "data": str}


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per RunConfig field; RunConfig validates the values."""
    for f in fields(RunConfig):
        kind = OPTIONAL_TYPES[f.name] if f.default is None else type(f.default)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None, help=f"default: {f.default}")


def _run_config(args: argparse.Namespace, **overrides) -> RunConfig:
    values = {f.name: getattr(args, f.name) for f in fields(RunConfig) if getattr(args, f.name, None) is not None}
    return RunConfig(**(values | overrides))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asteria", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser("train", help="train one model with one optimizer")
    _add_run_arguments(train_p)
    train_p.add_argument("--out", type=Path, required=True)
    demo_p = sub.add_parser("demo", help="AdamW vs Asteria Shampoo (async), with a report")
    _add_run_arguments(demo_p)
    demo_p.add_argument("--out", type=Path, default=Path("runs/demo"))
    bench_p = sub.add_parser("bench", help="every optimizer x mode side by side: results.json, plots, a table")
    _add_run_arguments(bench_p)
    bench_p.add_argument("--out", type=Path, required=True)
    bench_p.add_argument("--configs", nargs="+", default=list(CONFIGS), help=f"subset of {CONFIGS}")
    report_p = sub.add_parser("report", help="plots and a Markdown table over finished runs")
    report_p.add_argument("runs", type=Path, nargs="+")
    report_p.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    try:
        if args.command == "train":
            summary = train(_run_config(args), args.out)
            print(f"{summary['label']}: final loss {summary['final_loss']:.4f}, val {summary['final_val_loss']:.4f}")
        elif args.command == "demo":
            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            runs = []
            for optimizer, mode in (("adamw", "sync"), ("shampoo", "async")):
                cfg = _run_config(args, optimizer=optimizer, mode=mode, device=device)
                summary = train(cfg, args.out / cfg.label)
                print(f"{summary['label']:>14}: final loss {summary['final_loss']:.4f}, "
                      f"val {summary['final_val_loss']:.4f}, median step {1e3 * summary['median_step_seconds']:.1f} ms")
                runs.append(args.out / cfg.label)
            print(f"report: {write_report(runs, args.out)}")
        elif args.command == "bench":
            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            results = run_bench(_run_config(args, device=device), args.out, tuple(args.configs))
            print(format_table(results))
            print(f"results: {args.out / 'results.json'}")
        else:
            print(f"report: {write_report(args.runs, args.out)}")
    except (ValueError, FileNotFoundError) as error:
        print(f"asteria: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
