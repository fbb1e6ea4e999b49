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
and prints the ratios of asteria to the best torch configuration. A calibration row, `gemm` (one n x n
float32 matrix product per block, one thread per core, the faster of torch's BLAS and NumPy's
OpenBLAS), gives each configuration's time in gemm-times under the same load: one power step plus a
Householder QR with Q formed cannot take less than about 2.3 of them (4.7 n^3 flops at gemm speed),
whatever the implementation. Each figure is the best of three timed rounds after a warm-up; the rounds
are interleaved (one of each configuration in turn), and the median of the per-round ratios is printed
too, so that a drift of the host's speed does not favour one side.

    python3 bench/refresh_engine.py --sizes 1024 2048 --blocks 64 16 --out results/refresh_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# NumPy's OpenBLAS (the gemm calibration) at one thread per caller, as the engine's workers run theirs;
# read when the library loads, so before NumPy's import.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from asteria import _core  # noqa: E402

ROUNDS = 3  # timed rounds per configuration (interleaved); each reports its best


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


class TorchSerial:
    """torch.linalg.eigh one block at a time, torch using every core."""

    def __init__(self, blocks: torch.Tensor, cores: int) -> None:
        self.blocks, self.cores = blocks, cores
        torch.set_num_threads(cores)
        torch.linalg.eigh(blocks[0])  # warm-up

    def round(self) -> float:
        torch.set_num_threads(self.cores)
        start = time.perf_counter()
        for block in self.blocks:
            torch.linalg.eigh(block)
        return len(self.blocks) / (time.perf_counter() - start)

    def close(self) -> None:
        pass


class TorchThreads:
    """torch.linalg.eigh (and, with ``with_root``, the inverse root) in one Python thread per core."""

    def __init__(self, blocks: torch.Tensor, cores: int, with_root: bool) -> None:
        self.blocks, self.with_root = blocks, with_root
        self.pool = ThreadPoolExecutor(cores)
        torch.set_num_threads(1)
        list(self.pool.map(self.work, blocks[:cores]))  # warm-up

    def work(self, block: torch.Tensor) -> torch.Tensor:
        values, vectors = torch.linalg.eigh(block)
        if self.with_root:
            return (vectors * (values.clamp_min(0) + 1e-12).pow(-0.25)) @ vectors.mT
        return values

    def round(self) -> float:
        torch.set_num_threads(1)
        start = time.perf_counter()
        list(self.pool.map(self.work, self.blocks))
        return len(self.blocks) / (time.perf_counter() - start)

    def close(self) -> None:
        self.pool.shutdown()


class Gemm:
    """Calibration: one n x n float32 matrix product per block, one Python thread per core at one BLAS
    thread each, through torch's BLAS and through NumPy's OpenBLAS; a round reports the faster."""

    def __init__(self, blocks: torch.Tensor, cores: int) -> None:
        self.blocks, self.arrays = blocks, [b.numpy() for b in blocks]
        self.other = torch.randn(blocks.shape[-1], blocks.shape[-1], generator=torch.Generator().manual_seed(2))
        self.other_array = self.other.numpy()
        self.pool = ThreadPoolExecutor(cores)
        torch.set_num_threads(1)
        list(self.pool.map(self.torch_work, blocks[:cores]))  # warm-up
        list(self.pool.map(self.numpy_work, self.arrays[:cores]))

    def torch_work(self, block: torch.Tensor) -> torch.Tensor:
        return block @ self.other

    def numpy_work(self, block: np.ndarray) -> np.ndarray:
        return block @ self.other_array

    def round(self) -> float:
        torch.set_num_threads(1)
        rates = []
        for work, items in ((self.torch_work, self.blocks), (self.numpy_work, self.arrays)):
            start = time.perf_counter()
            list(self.pool.map(work, items))
            rates.append(len(items) / (time.perf_counter() - start))
        return max(rates)

    def close(self) -> None:
        self.pool.shutdown()


class AsteriaEngine:
    """The RefreshEngine, one job per block: full inverse roots, or (``eigenbasis``) SOAP's warm-started
    refreshes of blocks that drift a little between rounds, after a first full eigendecomposition."""

    def __init__(self, blocks: torch.Tensor, cores: int, eigenbasis: bool = False) -> None:
        count, n = blocks.shape[0], blocks.shape[-1]
        self.blocks, self.eigenbasis, self.version = blocks, eigenbasis, 0
        self.engine = _core.RefreshEngine(workers=cores, staleness=0)
        self.snapshots = torch.empty(1, count, n, n)
        self.results = torch.empty(1, count, n + 2 if eigenbasis else n, n)
        kind = "eigenbasis" if eigenbasis else "root"
        self.ids = [self.engine.add_block(self.snapshots[:, b], self.results[:, b], kind=kind) for b in range(count)]
        self.drift = random_spd(count, n, seed=1)
        self.matrix = blocks
        self.round()  # warms up the workers' workspaces; for eigenbases, the eigh that starts the chain

    def round(self) -> float:
        self.version += 1
        if self.eigenbasis:
            self.matrix = self.blocks + 0.05 * (self.version - 1) * self.drift
        self.engine.begin_snapshot(self.ids, self.version, 600.0)
        self.snapshots[0].copy_(self.matrix)
        start = time.perf_counter()
        self.engine.submit(self.ids, self.version, self.version, -0.5 if self.eigenbasis else -0.25, 1e-12)
        changes = self.engine.activate(self.version, 3600.0)
        rate = len(self.ids) / (time.perf_counter() - start)
        for block, v in changes:
            self.engine.release(block, v)
        return rate

    def quality(self) -> tuple[float, float]:
        """Off-diagonal ratios of the last round's bases and of the exact eigenvectors (a sample of blocks)."""
        n = self.blocks.shape[-1]
        sample = slice(0, min(len(self.ids), 8))
        matrix = self.matrix[sample].double()
        exact = torch.linalg.eigh(matrix)[1]
        return off_diagonal_ratio(matrix, self.results[0, sample, :n].double()), off_diagonal_ratio(matrix, exact)

    def close(self) -> None:
        stats = self.engine.stats()
        self.engine.close()
        assert stats["refreshes_failed"] == 0, stats


def off_diagonal_ratio(matrix: torch.Tensor, basis: torch.Tensor) -> float:
    """Largest ||Q^T A Q - diag||_F / ||Q^T A Q||_F over the blocks: 0 for an exact eigenbasis."""
    rotated = basis.mT @ matrix @ basis
    off = rotated - torch.diag_embed(torch.diagonal(rotated, dim1=-2, dim2=-1))
    return float((torch.linalg.matrix_norm(off) / torch.linalg.matrix_norm(rotated)).max())


def measure(blocks: torch.Tensor, cores: int, rounds: int) -> dict[str, float]:
    """Every configuration's best round, with the rounds interleaved (one round of each in turn), so that
    a drift of the host's speed reaches all of them alike; plus the median over rounds of the paired
    ratios (asteria's round against the best torch eigh of the same pass)."""
    contenders = {
        "torch-serial": TorchSerial(blocks, cores),
        "torch-threads": TorchThreads(blocks, cores, with_root=False),
        "torch-root": TorchThreads(blocks, cores, with_root=True),
        "asteria": AsteriaEngine(blocks, cores),
        "asteria-qr": AsteriaEngine(blocks, cores, eigenbasis=True),
        "gemm": Gemm(blocks, cores),
    }
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    try:
        for _ in range(rounds):
            for name, contender in contenders.items():
                rates[name].append(contender.round())
        qr_offdiag, eigh_offdiag = contenders["asteria-qr"].quality()
    finally:
        for contender in contenders.values():
            contender.close()
    row = {name: max(values) for name, values in rates.items()}
    best_eigh = [max(s, t) for s, t in zip(rates["torch-serial"], rates["torch-threads"])]
    for name in ("asteria", "asteria-qr"):
        row[f"{name}/best-torch-eigh"] = row[name] / max(row["torch-serial"], row["torch-threads"])
        row[f"{name}/best-torch-eigh paired median"] = statistics.median(
            a / b for a, b in zip(rates[name], best_eigh))
    row["asteria/torch-root"] = row["asteria"] / row["torch-root"]
    for name in ("torch-serial", "torch-threads", "asteria", "asteria-qr"):  # time per block in gemm-times
        row[f"{name} gemm-times"] = row["gemm"] / row[name]
    return row | {"qr-offdiag": qr_offdiag, "eigh-offdiag": eigh_offdiag, "rounds": rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--blocks", type=int, nargs="+", default=None, help="blocks per size (default 4 x cores)")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed rounds per configuration, interleaved")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    counts = args.blocks or [4 * args.cores] * len(args.sizes)
    device = f"{cpu_name()}, {args.cores} cores, OpenBLAS kernels {_core.blas_core()}; torch {torch.__version__}"
    print(f"device: {device}")
    rows = []
    for n, count in zip(args.sizes, counts):
        blocks = random_spd(count, n)
        row = {"n": n, "blocks": count} | measure(blocks, args.cores, args.rounds)
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
    for r in rows:
        print(f"n={r['n']}: one block's time in gemm-times (gemm {r['gemm']:.1f} blocks/s): torch-serial "
              f"{r['torch-serial gemm-times']:.2f}, torch-threads {r['torch-threads gemm-times']:.2f}, asteria "
              f"{r['asteria gemm-times']:.2f}, asteria-qr {r['asteria-qr gemm-times']:.2f}")
    for r in rows:
        print(f"n={r['n']}: median over {args.rounds} interleaved rounds of the per-round ratio to the best torch "
              f"eigh: asteria {r['asteria/best-torch-eigh paired median']:.2f}x, "
              f"asteria-qr {r['asteria-qr/best-torch-eigh paired median']:.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
