"""Where a training step's time goes: model (forward + backward) vs optimizer step, host (launch) time
vs device time, and the top operators by host and device time, for several optimizer configs on the
same model and batch.

Run (GPU):  python3 bench/profile_step.py --model olmo-160m --batch-size 8 --seq-len 512 \
                --configs adamw shampoo-sync shampoo-async shampoo-async:f=100000 shampoo-async:w=1
Run (CPU, a quick look):  python3 bench/profile_step.py --model tiny --seq-len 64 --device cpu \
                              --configs shampoo-sync shampoo-async

A config is ``OPTIMIZER-MODE`` with optional ``:f=N`` (precondition frequency, default 10), ``:w=N``
(workers), ``:s=N`` (staleness, default 5), ``:attach=0`` (no hooks), ``:tf32=1`` (TF32 matmuls),
``:det=0`` (non-deterministic activation), ``:dim=N`` (max_preconditioner_dim, default 2048) and ``:gb=N``
(``MemoryConfig.group_bytes`` in MiB: smaller shape groups, so smaller temporaries in the step).
Per config it prints, over the steady steps (after (sync_refreshes + 1) x f warm-up steps, f capped at
10 there): median and max of the whole
step (wall, synchronized each step), of the model part and of ``opt.step()`` (CUDA events), and the
host time spent inside ``opt.step()`` before it returns (launch and Python overhead); then the
profiler's top operators over a few steps. With ``--trace-steps N`` it then traces N consecutive steps,
saves the Chrome trace (``--out/trace-CONFIG.json.gz``) and prints, for a typical and the slowest of
them, each stream's GPU time, the copies, the main stream's idle gaps and slow CUDA runtime calls.
With ``--cprofile N`` it runs N more steps with ``opt.step()`` under cProfile and prints the Python
functions that take the training thread's time there (kernel launches included). Writes
``--out/profile.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import trace_steps

import asteria
from asteria.train.loop import RunConfig, make_optimizer
from asteria.train.model import build_model
from asteria.train.runs import steady_warmup


def parse(spec: str) -> tuple[str, dict[str, Any]]:
    name, *mods = spec.split(":")
    options: dict[str, Any] = {"f": 10, "w": None, "s": 5, "attach": 1, "tf32": 0, "det": 1, "dim": 2048, "gb": 0}
    for mod in mods:
        key, _, value = mod.partition("=")
        if key not in options or not value.isdigit():
            raise ValueError(f"Invalid config={spec!r}: modifiers are f=N, w=N, s=N, attach=0|1, tf32=0|1, det=0|1, "
                             "dim=N, gb=N")
        options[key] = int(value)
    return name, options


def run(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    name, o = parse(spec)
    optimizer, mode = ("adamw", "sync") if name == "adamw" else name.rsplit("-", 1)
    torch.backends.cuda.matmul.allow_tf32 = bool(o["tf32"])
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(args.model, 256, args.seq_len).to(device)
    cfg = RunConfig(model=args.model, optimizer=optimizer, mode=mode, device=args.device, staleness=o["s"],
                    precondition_frequency=o["f"], workers=o["w"], batch_size=args.batch_size,
                    seq_len=args.seq_len, deterministic=bool(o["det"]), max_preconditioner_dim=o["dim"],
                    group_bytes=o["gb"] * 2**20 or None)
    opt = make_optimizer(cfg, model)
    second_order = isinstance(opt, asteria.optim.base.SecondOrderOptimizer)
    hooks = asteria.attach(model, opt) if second_order and o["attach"] else None
    cuda = device.type == "cuda"
    warmup = steady_warmup(min(o["f"], 10), cfg.sync_refreshes)  # as ``asteria bench`` counts it, f capped
    batches = [torch.randint(0, 256, (args.batch_size, args.seq_len), device=device) for _ in range(4)]
    rows: list[dict[str, float]] = []

    def one_step(i: int) -> dict[str, float]:
        if cuda:
            torch.cuda.synchronize()
        with torch.profiler.record_function(f"step {i + 1}"):
            return timed_step(i)

    def timed_step(i: int) -> dict[str, float]:
        t0 = time.perf_counter()
        if cuda:
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model.loss(batches[i % len(batches)])
        loss.backward()
        if cuda:
            e1.record()
        h0 = time.perf_counter()
        opt.step()
        host_opt = time.perf_counter() - h0
        opt.zero_grad(set_to_none=True)
        if cuda:
            e2.record()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        row = {"wall": wall, "host_opt": host_opt}
        if second_order and mode == "async":  # (native mode installs inside step(): no activations counted)
            row["activations"] = float(opt.runtime_stats()["activations"])
        if cuda:
            row |= {"gpu_model": e0.elapsed_time(e1) / 1e3, "gpu_opt": e1.elapsed_time(e2) / 1e3}
        return row

    activations = 0.0
    retries_before = 0  # the caching allocator's frees of its cache to retry an allocation (a device sync each)
    for i in range(warmup + args.steps):
        if i == warmup and cuda:
            retries_before = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
            torch.cuda.reset_peak_memory_stats(device)
        row = one_step(i)
        if "activations" in row:  # blocks whose version changed at this step
            row["activations"], activations = row["activations"] - activations, row["activations"]
        if i >= warmup:
            rows.append(row | {"step": float(i + 1)})
    if cuda:
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries_before
        peak = torch.cuda.max_memory_allocated(device)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    traced = ""
    if args.trace_steps:  # consecutive steady steps, read step by step (bench/trace_steps.py)
        first = warmup + args.steps
        with torch.profiler.profile(activities=activities, with_stack=args.trace_stack) as window:
            for i in range(first, first + args.trace_steps):
                one_step(i)
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"trace-{spec.replace(':', '_').replace('=', '')}.json.gz"
        window.export_chrome_trace(str(path))
        traced = trace_steps.report(trace_steps.steps(trace_steps.load(path)), args.top_steps // 2)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(args.profile_steps):
            one_step(i)
    host_profile = ""
    if args.cprofile:  # where the training thread's time inside opt.step() goes, by Python function
        profiler = cProfile.Profile()
        step_method = opt.step

        def profiled_step(*a: Any, **k: Any) -> Any:
            profiler.enable()
            try:
                return step_method(*a, **k)
            finally:
                profiler.disable()

        opt.step = profiled_step  # type: ignore[method-assign]
        for i in range(args.cprofile):
            one_step(i)
        opt.step = step_method  # type: ignore[method-assign]
        text = io.StringIO()
        stats_view = pstats.Stats(profiler, stream=text)
        text.write(f"opt.step() under cProfile, {args.cprofile} steps, by own time:\n")
        stats_view.sort_stats("tottime").print_stats(args.top)
        text.write("by cumulative time:\n")
        stats_view.sort_stats("cumulative").print_stats(args.top)
        host_profile = text.getvalue()
    if hooks is not None:
        hooks.remove()
    stats = opt.runtime_stats() if second_order else {}
    if hasattr(opt, "close"):
        opt.close()
    summary = {key: {"median": statistics.median(r[key] for r in rows), "max": max(r[key] for r in rows)}
               for key in rows[0] if key != "step"}
    slowest = sorted(rows, key=lambda r: -r["wall"])[:args.top_steps]
    averages = prof.key_averages()
    top_host = averages.table(sort_by="self_cpu_time_total", row_limit=args.top)
    top_device = averages.table(sort_by="self_device_time_total", row_limit=args.top) if cuda else ""
    print(f"\n=== {spec} ===")
    for key, value in summary.items():
        if key == "activations":
            print(f"  {key:>9}: median {value['median']:8.0f}      max {value['max']:8.0f}")
        else:
            print(f"  {key:>9}: median {1e3 * value['median']:8.2f} ms   max {1e3 * value['max']:8.2f} ms")
    if cuda:
        print(f"  steady steps' peak allocation {peak / 2**30:.2f} GiB, allocator retries {retries}")
    print("  slowest steps: " + "; ".join(
        f"{int(r['step'])}: " + ", ".join(f"{k} {v:.0f}" if k == "activations" else f"{k} {1e3 * v:.1f}"
                                         for k, v in r.items() if k != "step") for r in slowest))
    if second_order:
        print(f"  waits {stats.get('waits')} ({stats.get('wait_seconds', 0.0):.3f} s), "
              f"worker busy {stats.get('worker_busy_fraction', 0.0):.2f}, workers {stats.get('workers')}")
    print(traced)
    print(host_profile)
    print(top_host)
    print(top_device)
    return {"summary": summary, "slowest_steps": slowest,
            "steady_peak_bytes": peak if cuda else None, "steady_alloc_retries": retries if cuda else None,
            "runtime_stats": {k: v for k, v in stats.items() if k != "staleness_histogram"},
            "top_host": top_host, "top_device": top_device, "host_profile": host_profile}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="olmo-160m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="steady steps timed per config")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--top-steps", type=int, default=6, help="slowest steady steps listed with their parts")
    parser.add_argument("--trace-steps", type=int, default=0,
                        help="then trace this many consecutive steps and read them step by step (trace_steps.py)")
    parser.add_argument("--cprofile", type=int, default=0,
                        help="then run this many steps with opt.step() under cProfile and print its top functions")
    parser.add_argument("--configs", nargs="+", default=["adamw", "shampoo-sync", "shampoo-async"])
    parser.add_argument("--trace-stack", action="store_true",
                        help="record Python stacks in the trace (names the Python code that launched a kernel)")
    parser.add_argument("--out", type=Path, default=Path("runs/profile"))
    return parser


def main() -> None:
    args = build_parser().parse_args()
    for spec in args.configs:
        parse(spec)  # (a mistyped modifier fails before the first config's minutes)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {device}; model {args.model}, batch {args.batch_size} x {args.seq_len}")
    results = {spec: run(spec, args) for spec in args.configs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps({"device": device, "results": results}, indent=1))


if __name__ == "__main__":
    main()
