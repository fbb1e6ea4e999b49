"""Bytes moved between nodes per 100 steps: Asteria's ownership + hierarchical exchange vs the native
scheme (Distributed Shampoo's DDP mode, which all-gathers every step's preconditioned update across all
ranks), on the same model and topology; and step time per rank count.

Run:  PYTHONPATH=<asteria install> python3 bench/distributed_bytes.py [--steps 100] [--out results.json]

Topology: CPU processes over Gloo, declared as nodes of 2 ranks (RuntimeConfig.local_world_size=2), so
4 processes are 2 nodes x 2 ranks. Ours is measured from runtime_stats() (bytes_inter_node_sent summed
over ranks: block statuses plus the refreshed blocks' data). The native figure is computed exactly
from the parameter shapes: each step every rank's share of the fp32 update must reach every other node,
which is at least P * (nodes - 1) * 4 bytes per step for P parameters with an ideal hierarchical
all-gather (a flat all-gather sends more: P * (W - L) * 4); we compare against that lower bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import asteria
from asteria.distributed import gather_runtime_stats

SIZES = (128, 256, 256, 256, 128)
DIM = 128
FREQUENCY = 10
GLOBAL_BATCH = 64
LOCAL = 2


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.GELU())
    return torch.nn.Sequential(*layers)


def worker(rank: int, world: int, out: str, staleness: int, steps: int) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous-{staleness}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
    net = build_model()
    model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
    config = asteria.RuntimeConfig(mode="async", staleness=staleness, workers=1, timeout_s=120,
                                   local_world_size=min(LOCAL, world))
    opt = asteria.Shampoo(model.parameters(), lr=1e-3, eps=1e-6, max_preconditioner_dim=DIM,
                          precondition_frequency=FREQUENCY, runtime=config)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(SIZES[0], SIZES[-1], generator=gen)
    times = []
    for _ in range(steps):
        x = torch.randn(GLOBAL_BATCH, SIZES[0], generator=gen)
        y = torch.tanh(x @ w)
        xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        times.append(time.perf_counter() - started)
    stats = gather_runtime_stats(opt) if world > 1 else [opt.runtime_stats()]
    opt.close()
    if rank == 0:
        params = sum(p.numel() for p in net.parameters())
        result = {"world": world, "staleness": staleness, "steps": steps, "params": params, "stats": stats,
                  "median_step_seconds": statistics.median(times[FREQUENCY:]),
                  "p99_step_seconds": sorted(times)[int(0.99 * (len(times) - 1))]}
        Path(out, f"result-{world}-{staleness}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def run(world: int, staleness: int, steps: int, out: str) -> dict:
    if world == 1:
        worker(0, 1, out, staleness, steps)
    else:
        mp.start_processes(worker, args=(world, out, staleness, steps), nprocs=world, start_method="spawn")
    return json.loads(Path(out, f"result-{world}-{staleness}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for staleness in (0, 1, 3):
            result = run(4, staleness, args.steps, out)
            nodes = 4 // LOCAL
            ours = sum(s["bytes_inter_node_sent"] for s in result["stats"]) * 100 / args.steps
            native = result["params"] * 4 * (nodes - 1) * 100
            rows.append({"world": 4, "staleness": staleness, "ours_bytes_per_100_steps": ours,
                         "native_bytes_per_100_steps": native, "ratio": ours / native,
                         "exchanges_skipped": sum(s["exchanges_skipped"] for s in result["stats"]),
                         "median_step_seconds": result["median_step_seconds"],
                         "max_staleness_seen": max(s["max_staleness_seen"] for s in result["stats"])})
        for world in (1, 2):
            result = run(world, 1, args.steps, out)
            rows.append({"world": world, "staleness": 1, "median_step_seconds": result["median_step_seconds"]})
    print(f"model {SIZES}, {sum(p.numel() for p in build_model().parameters())} parameters, blocks <= {DIM}, "
          f"refresh every {FREQUENCY} steps, {args.steps} steps, nodes of {LOCAL} ranks")
    for row in rows:
        print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
