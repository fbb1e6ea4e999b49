"""Scaling of ``asteria train`` over processes: AdamW and native (``sync``) vs Asteria (``async``) SOAP
and KL-Shampoo, under DDP and FSDP2, on 1, 2, 4, 8 processes (one per GPU), same model, per-rank
batch, seed, steps and refresh interval f.

Every run is a child ``torchrun --standalone --nproc-per-node N -m asteria.train.cli train ...``
(started as ``python -m torch.distributed.run``, torchrun's own entry point, with this interpreter),
with ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1`` in its
environment (required on the GPU machines). The 1-process run of a config is shared by both parallel
modes (with one process there is nothing to wrap). Afterwards each run's summary.json and
metrics.jsonl are read and one table is printed; ``OUT/results.json`` and ``OUT/scaling.md`` hold it,
``OUT/<config>/<run>/`` the runs (with ``torchrun.log``).

Columns: median and max step time of rank 0 over the steady steps (after the warm-up, (sync_refreshes + 1)
x f steps, as ``asteria bench`` counts it: allocation, compilation and the refreshes used at their own
step) and their ratio; the median CUDA-event time of those steps; rank 0's optimizer waits (count and
seconds); tokens/s = procs x batch x seq_len / median step;
scaling efficiency = tokens/s / (procs x tokens/s of the same config on 1 process); the optimizer's
inter-node and intra-node bytes per step (measured: ``runtime_stats`` summed over ranks); the gradient
reduction's bytes per step (computed from the algorithm, summed over ranks; see
``asteria/train/distributed.py``); replica max |diff| (DDP: every rank vs rank 0 after the last step;
FSDP2 has no replicas); energy per step (NVML, summed over ranks' GPUs); final loss (mean of the last 10
steps) and the last validation loss; time to a target loss (training wall clock at the first step whose
trailing 10-step mean reaches it; default target: AdamW's final loss at the same procs and parallel mode).

CPU (Gloo; 2 processes declared as 2 nodes of 1 rank, so the optimizer's exchange crosses "nodes"):

    python3 bench/scaling.py --out runs/scaling-cpu --nprocs 1 2 --model tiny --steps 40 --batch-size 4 \\
        --seq-len 64 --workers 1 --local-world-size 1

GPU (NCCL, one process per GPU; on 2 GPUs):

    python3 bench/scaling.py --out runs/scaling --nprocs 1 2 --parallel ddp fsdp --model olmo-160m \\
        --steps 60 --batch-size 8 --seq-len 512

Add ``--local-world-size 2`` on 4 GPUs to run 4 processes as 2 simulated nodes of 2. Where one command
may run only minutes, add ``--skip-done --max-seconds 480`` and repeat it: runs that finished with the
same command line are reused, nothing new starts after 480 s (exit 3), and exit 0 means all are done.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from asteria.train.model import PRESETS
from asteria.train.runs import load_run, steady_warmup

CONFIGS = ("adamw", "soap-sync", "soap-async", "kl-shampoo-sync", "kl-shampoo-async")
PARALLEL = ("ddp", "fsdp")
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SINGLE = "single"  # the parallel column of 1-process runs


def optimizer_args(config: str) -> list[str]:
    """'soap-async' -> --optimizer soap --mode async; 'adamw' -> --optimizer adamw --mode sync."""
    if config not in CONFIGS:
        raise ValueError(f"Invalid config={config!r}: must be one of {CONFIGS}")
    optimizer, mode = ("adamw", "sync") if config == "adamw" else config.rsplit("-", 1)
    return ["--optimizer", optimizer, "--mode", mode]


def default_nprocs(gpus: int) -> list[int]:
    """1 and 2 processes, and 4 and 8 where that many GPUs are present (1 alone on a single GPU)."""
    if gpus == 0:
        return [1, 2]
    return [n for n in (1, 2, 4, 8) if n <= gpus]


def run_name(procs: int, parallel: str) -> str:
    return "p1" if procs == 1 else f"{parallel}-p{procs}"


def validate(args: argparse.Namespace, gpus: int) -> None:
    """Raises ``ValueError`` naming the first bad option value."""
    for config in args.configs:
        optimizer_args(config)
    if len(set(args.configs)) != len(args.configs):
        raise ValueError(f"Invalid configs={args.configs!r}: each config at most once")
    for parallel in args.parallel:
        if parallel not in PARALLEL:
            raise ValueError(f"Invalid parallel={parallel!r}: must be one of {PARALLEL}")
    for procs in args.nprocs:
        if procs < 1:
            raise ValueError(f"Invalid nprocs={procs}: must be >= 1")
        if args.device == "cuda" and procs > gpus:
            raise ValueError(f"Invalid nprocs={procs}: one process per GPU and this machine has {gpus} GPUs")
        if args.local_world_size is not None and procs > 1 and procs % args.local_world_size != 0:
            raise ValueError(f"Invalid local_world_size={args.local_world_size}: must divide every process count "
                             f"above 1 (nprocs {procs})")
    if args.local_world_size is not None and args.local_world_size < 1:
        raise ValueError(f"Invalid local_world_size={args.local_world_size}: must be >= 1")
    if args.model not in PRESETS:
        raise ValueError(f"Invalid model={args.model!r}: must be one of {tuple(PRESETS)}")
    for name in ("steps", "batch_size", "seq_len", "precondition_frequency", "timeout"):
        if getattr(args, name) < 1:
            raise ValueError(f"Invalid {name}={getattr(args, name)}: must be >= 1")
    if args.max_preconditioner_dim is not None and args.max_preconditioner_dim < 1:
        raise ValueError(f"Invalid max_preconditioner_dim={args.max_preconditioner_dim}: must be >= 1")
    if args.lag_steps is not None and not 0 <= args.lag_steps <= args.staleness * args.precondition_frequency:
        raise ValueError(f"Invalid lag_steps={args.lag_steps}: must be in [0, staleness x precondition_frequency = "
                         f"{args.staleness * args.precondition_frequency}]")
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise ValueError(f"Invalid max_seconds={args.max_seconds}: must be a number of seconds > 0")
    if args.target_loss is not None and not args.target_loss > 0:
        raise ValueError(f"Invalid target_loss={args.target_loss}: must be a number > 0")


def train_command(args: argparse.Namespace, config: str, procs: int, parallel: str, out: Path) -> list[str]:
    """The child's command line: torchrun over ``asteria train``."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
            "-m", "asteria.train.cli", "train", "--out", str(out), "--overwrite", *optimizer_args(config),
            "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--seed", str(args.seed),
            "--eval-every", str(args.eval_every or args.steps), "--eval-batches", str(args.eval_batches),
            "--max-bytes", str(args.max_bytes), "--device", args.device,
            "--matmul-precision", args.matmul_precision]
    if procs > 1:
        argv += ["--parallel", parallel]
        if args.local_world_size is not None:
            argv += ["--local-world-size", str(args.local_world_size)]
    # `asteria train` refuses the options a config would not read: the preconditioners' for AdamW, the
    # async refreshes' for native mode.
    second_order, asynchronous = config != "adamw", config.endswith("-async")
    if second_order:
        argv += ["--precondition-frequency", str(args.precondition_frequency)]
    if asynchronous:
        argv += ["--staleness", str(args.staleness)]
    for name, wanted in (("lr", True), ("data", True), ("tokenizer", True), ("max_preconditioner_dim", second_order),
                         ("prefetch", second_order), ("workers", asynchronous), ("lag_steps", asynchronous)):
        if getattr(args, name) is not None and wanted:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.stagger_split is not None and asynchronous:
        argv += ["--stagger-split" if args.stagger_split else "--no-stagger-split"]
    if args.profile_steps is not None:
        argv += ["--profile-steps", *map(str, args.profile_steps)]
    return argv


def child_env(device: str) -> dict[str, str]:
    """This environment plus the GPU machines' NCCL settings; on the CPU one intra-op thread per process
    unless OMP_NUM_THREADS is set (torchrun's own default for several processes, here also for one, so
    that the 1-process baseline computes like each rank)."""
    env = dict(os.environ) | CHILD_ENV
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def finished_with(run_dir: Path, argv: list[str]) -> bool:
    """Whether ``run_dir`` holds a run that finished with this command line (the interpreter and
    ``--overwrite`` aside: runs recorded before the children carried it count too)."""
    def essential(args: list[str]) -> list[str]:
        return [arg for arg in args if arg != "--overwrite"]

    try:
        recorded = json.loads((run_dir / "command.json").read_text())
        return (run_dir / "summary.json").is_file() and essential(recorded) == essential(argv[1:])
    except (OSError, ValueError):
        return False


def launch(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    """Runs one child, its output into ``log``; returns its exit code (124 when it ran past ``timeout``)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        f.write(" ".join(argv) + "\n\n")
        f.flush()
        try:
            return subprocess.run(argv, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\nscaling.py: killed after {timeout} s\n")
            return 124


def measure(run_dir: Path, procs: int, parallel: str, config: str, batch_size: int, seq_len: int,
            frequency: int) -> dict[str, Any]:
    """One row's own figures from a finished run (no cross-run ratios yet). Step times are those after the
    warm-up, counted as ``asteria bench`` counts it: (sync_refreshes + 1) x f steps, with the comparison's f
    for every row (AdamW's runs are not given one: `asteria train` refuses it there)."""
    run = load_run(run_dir)
    s = run.summary
    warmup = steady_warmup(frequency, s.get("config", {}).get("sync_refreshes", 1))
    steady_records = [r for r in run.records if r["step"] > warmup] or run.records
    steady = [r["step_time"] for r in steady_records]
    median = statistics.median(steady)
    gpu = [r["gpu_step_time"] for r in steady_records if r.get("gpu_step_time") is not None]
    stats = s.get("runtime_stats") or {}
    dist = s.get("distributed")
    per_step = dist["optimizer_bytes"]["per_step"] if dist else {}
    grads = dist["gradient_bytes_per_step_computed"] if dist else None
    agreement = dist["replica_agreement"] if dist else None
    return {
        "config": config, "procs": procs, "parallel": parallel, "run": str(run_dir), "device": s["device"],
        "steps": run.records[-1]["step"], "warmup_steps": warmup,
        "median_step_seconds": median, "max_step_seconds": max(steady), "max_over_median": max(steady) / median,
        "gpu_median_step_seconds": statistics.median(gpu) if gpu else None,
        "waits": stats.get("waits"), "wait_seconds": stats.get("wait_seconds"),
        "tokens_per_second": procs * batch_size * seq_len / median,
        "optimizer_inter_node_bytes_per_step": per_step.get("bytes_inter_node_sent") or 0.0,
        "optimizer_intra_node_bytes_per_step": per_step.get("bytes_intra_node_shared") or 0.0,
        "gradient_bytes_per_step_computed": grads["total_sent"] if grads else 0.0,
        "gradient_inter_node_bytes_per_step_computed": grads["inter_node_sent"] if grads else 0.0,
        "nodes": dist["nodes"] if dist else 1,
        "replica_max_abs_diff": agreement["max_abs_diff"] if agreement else None,
        "energy_joules_per_step": s.get("energy_joules_per_step"),
        "final_loss": s["final_loss"],
        "final_val_loss": s.get("final_val_loss"),
        "_run": run,
    }


def finish_rows(rows: list[dict[str, Any]], target_loss: float | None) -> list[dict[str, Any]]:
    """Adds the cross-run columns: scaling efficiency against the same config on 1 process, the target
    loss (``target_loss``, else AdamW's final loss at the same procs and parallel mode) and the time to
    reach it. Returns JSON-able rows."""
    single = {r["config"]: r for r in rows if r["procs"] == 1}
    adamw = {(r["procs"], r["parallel"]): r for r in rows if r["config"] == "adamw"}
    done = []
    for r in rows:
        base = single.get(r["config"])
        r["scaling_efficiency"] = (r["tokens_per_second"] / (r["procs"] * base["tokens_per_second"])
                                   if base is not None else None)
        reference = adamw.get((r["procs"], r["parallel"]))
        target = target_loss if target_loss is not None else (reference["final_loss"] if reference else None)
        reached = r["_run"].reach(target) if target is not None else None
        r["target_loss"] = target
        r["time_to_target_seconds"] = reached["wall"] if reached else None
        r["steps_to_target"] = reached["step"] if reached else None
        done.append({k: v for k, v in r.items() if k != "_run"})
    return done


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


COLUMNS = ("config", "procs", "parallel", "median ms", "max ms", "max/med", "GPU-event median ms", "waits (s)",
           "tokens/s", "efficiency", "opt inter MB/step", "opt intra MB/step", "grad MB/step (computed)",
           "grad inter MB/step", "replica max abs diff", "J/step", "final loss", "val loss", "target",
           "time to target s")


def cells(r: dict[str, Any]) -> list[str]:
    agreement = ("-" if r["procs"] == 1 else "n/a (FSDP2: no replicas)" if r["parallel"] == "fsdp"
                 else _fmt(r["replica_max_abs_diff"], ".3g"))
    waits = "n/a" if r["waits"] is None else f"{r['waits']} ({r['wait_seconds']:.1f})"
    return [r["config"], str(r["procs"]), r["parallel"], _fmt(r["median_step_seconds"], ".1f", 1e3),
            _fmt(r["max_step_seconds"], ".1f", 1e3), _fmt(r["max_over_median"], ".2f"),
            _fmt(r["gpu_median_step_seconds"], ".1f", 1e3), waits,
            _fmt(r["tokens_per_second"], ".0f"), _fmt(r["scaling_efficiency"], ".2f"),
            _fmt(r["optimizer_inter_node_bytes_per_step"], ".3f", 1e-6),
            _fmt(r["optimizer_intra_node_bytes_per_step"], ".3f", 1e-6),
            _fmt(r["gradient_bytes_per_step_computed"], ".2f", 1e-6),
            _fmt(r["gradient_inter_node_bytes_per_step_computed"], ".2f", 1e-6), agreement,
            _fmt(r["energy_joules_per_step"], ".1f"), _fmt(r["final_loss"], ".4f"), _fmt(r["final_val_loss"], ".4f"),
            _fmt(r["target_loss"], ".4f"),
            _fmt(r["time_to_target_seconds"], ".1f")]


def format_table(results: dict[str, Any]) -> str:
    rows = [list(COLUMNS)] + [cells(r) for r in results["rows"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [f"device: {results['device']}"]
    lines += ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              for row in rows]
    for skipped in results.get("not_started", []):
        lines.append(f"NOT STARTED {skipped['config']} procs={skipped['procs']} {skipped['parallel']}")
    for failure in results["failures"]:
        lines.append(f"FAILED {failure['config']} procs={failure['procs']} {failure['parallel']}: exit "
                     f"{failure['returncode']}, log {failure['log']}")
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [f"# Scaling over processes ({results['device']})", "",
             f"Model {s['model']}, {s['steps']} steps, {s['batch_size']} sequences of {s['seq_len']} tokens per "
             f"process and step, f = {s['precondition_frequency']}, S = {s['staleness']}, seed {s['seed']}"
             + (f", local world size {s['local_world_size']} (ranks per simulated node)" if s["local_world_size"]
                else "") + ".",
             f"Command: `{results['command']}`", "",
             "Step times are rank 0's, over the steady steps (after the warm-up, (sync_refreshes + 1) x f steps, as "
             "asteria bench counts it); waits are rank 0's optimizer waits (count and seconds). Efficiency: tokens/s "
             "over procs "
             "x the same config's 1-process tokens/s. Optimizer bytes are measured (runtime_stats summed over "
             "ranks); gradient bytes are computed from the reduction algorithm (ring model, fp32; DDP all-reduce, "
             "FSDP2 all-gathers and reduce-scatter), summed over ranks. Target: AdamW's final loss at the same "
             "procs and parallel mode unless given.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in results["rows"]]
    if results.get("not_started"):
        lines += ["", "Not started (--max-seconds): " + ", ".join(f"{r['config']} {r['procs']} {r['parallel']}"
                                                                  for r in results["not_started"])]
    if results["failures"]:
        lines += ["", "Failed runs:"]
        lines += [f"- {f['config']}, {f['procs']} processes, {f['parallel']}: exit {f['returncode']} "
                  f"(`{f['log']}`)" for f in results["failures"]]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results directory")
    parser.add_argument("--nprocs", type=int, nargs="+", default=None,
                        help="process counts [default: 1 2, and 4 and 8 where that many GPUs are present]")
    parser.add_argument("--parallel", nargs="+", default=list(PARALLEL), help=f"subset of {PARALLEL}")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), help=f"subset of {CONFIGS}")
    parser.add_argument("--local-world-size", type=int, default=None,
                        help="ranks per simulated node (default: torchrun's, all processes on one node)")
    parser.add_argument("--model", default="tiny", help=f"one of {tuple(PRESETS)}")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per process and step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--staleness", type=int, default=5)
    parser.add_argument("--precondition-frequency", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matmul-precision", default="highest", choices=("highest", "high"),
                        help="float32 matrix products: float32 or TF32 (GPUs)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--max-preconditioner-dim", type=int, default=None,
                        help="largest factor side [default: asteria train's]")
    parser.add_argument("--lag-steps", type=int, default=None,
                        help="Asteria runs: use each refresh this many steps after its snapshot (RuntimeConfig."
                             "lag_steps) [default: S intervals]")
    parser.add_argument("--prefetch", default=None, help="second-order runs: where asteria.attach activates "
                        "(asteria train --prefetch) [default: asteria train's]")
    parser.add_argument("--stagger-split", action=argparse.BooleanOptionalAction, default=None,
                        help="Asteria runs: split the large factor sets for the stagger (asteria train "
                             "--stagger-split) [default: asteria train's, on one process only]")
    parser.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "LAST"), default=None,
                        help="every run writes a torch.profiler trace of these steps per rank (asteria train "
                             "--profile-steps): OUT/<config>/<run>/trace-rank<R>.json.gz")
    parser.add_argument("--eval-every", type=int, default=None, help="[default: once, at the last step]")
    parser.add_argument("--eval-batches", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    parser.add_argument("--data", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--target-loss", type=float, default=None,
                        help="loss for the time-to-target column [default: AdamW's at the same procs and mode]")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    parser.add_argument("--skip-done", action="store_true",
                        help="reuse runs in OUT that finished with the same command line (to continue a benchmark "
                             "cut short, e.g. by --max-seconds)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no run after this many seconds; the table covers the runs done (exit 3 when "
                             "some were not started)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    gpus = torch.cuda.device_count()
    if args.device == "auto":
        args.device = "cuda" if gpus else "cpu"
    if args.nprocs is None:
        args.nprocs = default_nprocs(gpus if args.device == "cuda" else 0)
    try:
        validate(args, gpus)
    except ValueError as error:
        print(f"scaling.py: error: {error}", file=sys.stderr)
        return 2
    args.nprocs = sorted(set(args.nprocs))
    args.out.mkdir(parents=True, exist_ok=True)
    env = child_env(args.device)
    rows, failures, skipped = [], [], []
    begun = time.monotonic()
    for procs in args.nprocs:
        for parallel in ([SINGLE] if procs == 1 else args.parallel):
            for config in args.configs:
                run_dir = args.out / config / run_name(procs, parallel)
                argv_ = train_command(args, config, procs, parallel, run_dir)
                if args.skip_done and finished_with(run_dir, argv_):
                    print(f"{config:<17} procs={procs} {parallel:<6} done before: reused", flush=True)
                elif args.max_seconds is not None and time.monotonic() - begun > args.max_seconds:
                    skipped.append({"config": config, "procs": procs, "parallel": parallel})
                    continue
                else:
                    started = time.monotonic()
                    code = launch(argv_, env, run_dir / "torchrun.log", args.timeout)
                    print(f"{config:<17} procs={procs} {parallel:<6} exit {code} in "
                          f"{time.monotonic() - started:.0f} s", flush=True)
                    if code == 0 and (run_dir / "summary.json").exists():
                        (run_dir / "command.json").write_text(json.dumps(argv_[1:]))
                    else:
                        failures.append({"config": config, "procs": procs, "parallel": parallel, "returncode": code,
                                         "log": str(run_dir / "torchrun.log")})
                        continue
                rows.append(measure(run_dir, procs, parallel, config, args.batch_size, args.seq_len,
                                    args.precondition_frequency))
    results = {
        "device": rows[0]["device"] if rows else ("cpu" if args.device == "cpu" else torch.cuda.get_device_name(0)),
        "command": " ".join(["python3 bench/scaling.py", *(sys.argv[1:] if argv is None else argv)]),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": finish_rows(rows, args.target_loss),
        "failures": failures,
        "not_started": skipped,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "scaling.md").write_text(markdown(results))
    print(format_table(results))
    print(f"results: {args.out / 'results.json'}, {args.out / 'scaling.md'}")
    if skipped:
        print(f"{len(skipped)} runs not started (--max-seconds {args.max_seconds}); run the same command with "
              "--skip-done to continue")
    return 1 if failures else 3 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
