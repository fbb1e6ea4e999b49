"""Where one optimizer step's device time goes, without the model around it.

Builds a preset's parameters, gives them fixed random gradients and times ``opt.step()`` alone for each
optimizer: AdamW (torch fused) and Shampoo, SOAP and KL-Shampoo in ``mode="sync"`` with a refresh
interval longer than the run, so that after the first step (the bootstrap refresh) every timed step is
the per-step work only — the part every step pays in both modes. Per config it prints the median
step time (CUDA events on a GPU, wall clock on the CPU) and the profiler's device time per operator
over the profiled steps, largest first, with its share of the step.

Usage: python3 bench/opt_step.py --model olmo-160m --max-preconditioner-dim 1024 --tf32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from asteria.train.loop import RunConfig, make_optimizer
from asteria.train.model import build_model

OPTIMIZERS = ("adamw", "shampoo", "soap", "kl-shampoo")


def step_times(opt: torch.optim.Optimizer, grads: list[tuple[torch.nn.Parameter, torch.Tensor]], steps: int,
               cuda: bool) -> list[float]:
    """Seconds of each of ``steps`` calls of ``opt.step()`` with the fixed gradients."""
    times = []
    for _ in range(steps):
        for param, grad in grads:
            param.grad = grad
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            opt.step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    return times


def operator_table(opt: torch.optim.Optimizer, grads: list[tuple[torch.nn.Parameter, torch.Tensor]], steps: int,
                   cuda: bool) -> list[dict[str, Any]]:
    """Per aten operator: device time per step (CPU time without a GPU) and calls per step."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        step_times(opt, grads, steps, cuda)
    rows = []
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        seconds = (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e6
        if seconds > 0:
            rows.append({"op": event.key, "seconds_per_step": seconds / steps, "calls_per_step": event.count / steps})
    return sorted(rows, key=lambda row: -row["seconds_per_step"])


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = build_model(args.model, 256, 64).to(device)
    cfg = RunConfig(model=args.model, optimizer=name, mode="sync", device=device.type,
                    precondition_frequency=10**6, max_preconditioner_dim=args.max_preconditioner_dim)
    opt = make_optimizer(cfg, model)
    generator = torch.Generator(device=device).manual_seed(1)
    grads = [(p, torch.randn(p.shape, device=device, generator=generator) * 1e-2) for p in model.parameters()]
    step_times(opt, grads, args.warmup, cuda)  # the bootstrap refresh, allocation, kernel selection
    times = step_times(opt, grads, args.steps, cuda)
    table = operator_table(opt, grads, args.profile_steps, cuda)
    if hasattr(opt, "close"):
        opt.close()
    return {"config": name, "median_s": statistics.median(times), "max_s": max(times), "operators": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="olmo-160m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-preconditioner-dim", type=int, default=1024)
    parser.add_argument("--tf32", action="store_true", help="TF32 matrix products (as --matmul-precision high)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per config")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--configs", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"device: {where}; model {args.model}, blocks of at most {args.max_preconditioner_dim}, "
          f"tf32 {args.tf32}; torch {torch.__version__}")
    results = []
    for name in args.configs:
        result = run(name, args)
        results.append(result)
        step = result["median_s"]
        print(f"\n=== {name}: opt.step() median {step * 1e3:.2f} ms, max {result['max_s'] * 1e3:.2f} ms ===")
        for row in result["operators"][:args.top]:
            print(f"  {row['op']:<32} {row['seconds_per_step'] * 1e3:8.3f} ms/step  "
                  f"{row['seconds_per_step'] / step:6.1%}  {row['calls_per_step']:6.1f} calls/step")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": where, "results": results}, indent=1))


if __name__ == "__main__":
    main()
