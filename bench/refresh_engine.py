"""Refresh-engine throughput: Asteria's C++ engine vs torch.linalg.eigh on the same cores.

For blocks of size n (default 1024 and 2048) it measures blocks per second of
  torch-serial     torch.linalg.eigh one block at a time, torch using every core;
  torch-threads    torch.linalg.eigh in a Python thread pool, one thread per core, torch at 1 thread;
  torch-root       as torch-threads, plus forming the inverse root (Q diag(l^-1/4) Q^T) as a refresh does;
  asteria          the RefreshEngine: one job per block on the C++ workers (1 BLAS thread each),
                   computing the full inverse root, submitted and awaited through the engine's API;
  asteria-qr       the engine's eigenbasis jobs after the first: SOAP's warm-started refresh (one power
                   step and a QR factorization from the previous basis) on blocks that drift a little
                   between refreshes, with the eigenbasis quality (off-diagonal ratio of Q^T A Q)
                   printed beside the exact eigh's;
and prints the ratios of asteria to the best torch configuration. Each figure is the best of three
timed rounds after a warm-up.

    python3 bench/refresh_engine.py --sizes 1024 2048 --blocks 64 16 --out results/refresh_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from asteria import _core


ROUNDS = 3  # each configuration reports its best round


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def random_spd(count: int, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(count, n, n // 2, generator=gen)
    return (g @ g.mT) / n + 1e-3 * torch.eye(n)


def time_torch_serial(blocks: torch.Tensor, cores: int) -> float:
    torch.set_num_threads(cores)
    torch.linalg.eigh(blocks[0])  # warm-up
    start = time.perf_counter()
    for block in blocks:
        torch.linalg.eigh(block)
    return len(blocks) / (time.perf_counter() - start)


def time_torch_threads(blocks: torch.Tensor, cores: int, with_root: bool) -> float:
    torch.set_num_threads(1)

    def work(block: torch.Tensor) -> torch.Tensor:
        values, vectors = torch.linalg.eigh(block)
        if with_root:
            return (vectors * (values.clamp_min(0) + 1e-12).pow(-0.25)) @ vectors.mT
        return values

    with ThreadPoolExecutor(cores) as pool:
        list(pool.map(work, blocks[:cores]))  # warm-up
        rates = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            list(pool.map(work, blocks))
            rates.append(len(blocks) / (time.perf_counter() - start))
        return max(rates)


def time_asteria(blocks: torch.Tensor, cores: int) -> float:
    count, n = blocks.shape[0], blocks.shape[-1]
    engine = _core.RefreshEngine(workers=cores, staleness=0)
    snapshots = torch.empty(1, count, n, n)
    results = torch.empty(1, count, n, n)
    ids = [engine.add_block(snapshots[:, b], results[:, b]) for b in range(count)]
    rates = []
    for version in range(1, ROUNDS + 2):  # the first round warms up the workers' workspaces
        engine.begin_snapshot(ids, version, 600.0)
        snapshots[0].copy_(blocks)
        start = time.perf_counter()
        engine.submit(ids, version, version, -0.25, 1e-12)
        changes = engine.activate(version, 3600.0)
        rates.append(count / (time.perf_counter() - start))
        for block, v in changes:
            engine.release(block, v)
    stats = engine.stats()
    engine.close()
    assert stats["refreshes_failed"] == 0, stats
    return max(rates[1:])


def off_diagonal_ratio(matrix: torch.Tensor, basis: torch.Tensor) -> float:
    """Largest ||Q^T A Q - diag||_F / ||Q^T A Q||_F over the blocks: 0 for an exact eigenbasis."""
    rotated = basis.mT @ matrix @ basis
    off = rotated - torch.diag_embed(torch.diagonal(rotated, dim1=-2, dim2=-1))
    return float((torch.linalg.matrix_norm(off) / torch.linalg.matrix_norm(rotated)).max())


def time_asteria_qr(blocks: torch.Tensor, cores: int) -> tuple[float, float, float]:
    """Blocks/s of warm-started QR refreshes, and the off-diagonal ratios reached by it and by eigh."""
    count, n = blocks.shape[0], blocks.shape[-1]
    engine = _core.RefreshEngine(workers=cores, staleness=0)
    snapshots = torch.empty(1, count, n, n)
    results = torch.empty(1, count, n + 2, n)
    ids = [engine.add_block(snapshots[:, b], results[:, b], kind="eigenbasis") for b in range(count)]
    drift = random_spd(count, n, seed=1)
    rates, matrix = [], blocks
    for version in range(1, ROUNDS + 2):  # version 1 is the full eigendecomposition that starts the chain
        matrix = blocks + 0.05 * (version - 1) * drift
        engine.begin_snapshot(ids, version, 600.0)
        snapshots[0].copy_(matrix)
        start = time.perf_counter()
        engine.submit(ids, version, version, -0.5, 1e-12)
        changes = engine.activate(version, 3600.0)
        if version > 1:
            rates.append(count / (time.perf_counter() - start))
        for block, v in changes:
            engine.release(block, v)
    engine.close()
    sample = slice(0, min(count, 8))
    qr_quality = off_diagonal_ratio(matrix[sample].double(), results[0, sample, :n].double())
    exact = torch.linalg.eigh(matrix[sample].double())[1]
    return max(rates), qr_quality, off_diagonal_ratio(matrix[sample].double(), exact)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--blocks", type=int, nargs="+", default=None, help="blocks per size (default 4 x cores)")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    counts = args.blocks or [4 * args.cores] * len(args.sizes)
    device = f"{cpu_name()}, {args.cores} cores, OpenBLAS kernels {_core.blas_core()}; torch {torch.__version__}"
    print(f"device: {device}")
    rows = []
    for n, count in zip(args.sizes, counts):
        blocks = random_spd(count, n)
        row = {"n": n, "blocks": count}
        row["torch-serial"] = time_torch_serial(blocks, args.cores)
        row["torch-threads"] = time_torch_threads(blocks, args.cores, with_root=False)
        row["torch-root"] = time_torch_threads(blocks, args.cores, with_root=True)
        row["asteria"] = time_asteria(blocks, args.cores)
        row["asteria-qr"], row["qr-offdiag"], row["eigh-offdiag"] = time_asteria_qr(blocks, args.cores)
        best = max(row["torch-serial"], row["torch-threads"])
        row["asteria/best-torch-eigh"] = row["asteria"] / best
        row["asteria/torch-root"] = row["asteria"] / row["torch-root"]
        row["asteria-qr/best-torch-eigh"] = row["asteria-qr"] / best
        rows.append(row)
    header = f"{'n':>5} {'blocks':>6} {'torch-serial':>13} {'torch-threads':>14} {'torch-root':>11} {'asteria':>8} " \
             f"{'vs best eigh':>13} {'vs torch-root':>14} {'asteria-qr':>11} {'qr vs eigh':>11} " \
             f"{'qr offdiag':>11} {'eigh offdiag':>13}"
    print(header)
    for r in rows:
        print(f"{r['n']:>5} {r['blocks']:>6} {r['torch-serial']:>13.2f} {r['torch-threads']:>14.2f} "
              f"{r['torch-root']:>11.2f} {r['asteria']:>8.2f} {r['asteria/best-torch-eigh']:>12.2f}x "
              f"{r['asteria/torch-root']:>13.2f}x {r['asteria-qr']:>11.2f} {r['asteria-qr/best-torch-eigh']:>10.2f}x "
              f"{r['qr-offdiag']:>11.2e} {r['eigh-offdiag']:>13.2e}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
