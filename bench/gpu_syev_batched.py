"""cuSOLVER's batched symmetric eigensolver (``cusolverDnXsyevBatched``) against ``torch.linalg.eigh`` at the block
sizes Shampoo refreshes: throughput, accuracy, and what it costs a training-like loop beside it.

torch sends a batch of matrices larger than 32 to cuSOLVER's ``syevd`` one matrix at a time, and one ``syevd`` of a
2048 block is latency-bound (about 26 ms on an H200, batched or not: docs/results.md, "Refresh math on the
GPU"), so the device lane refreshes at most about 38 blocks of 2048 a second however many wait. ``XsyevBatched``
(cuSOLVER 11.7, CUDA 12.6.2 on; torch does not call it above n = 32) decomposes a whole batch in one call. If it
overlaps the matrices' latency-bound phases, the lane's rate grows with the batch; this bench says whether it does.

It calls the library through ctypes on torch's tensors and stream (the library torch loaded, found in the process's
maps, else in the nvidia wheels' folders). For each n and batch B: milliseconds per block of ``torch.linalg.eigh`` and
of ``XsyevBatched`` (CUDA events, median of repeats after two warm-ups), and the batched result's accuracy on
Shampoo-like factors (an EMA of low-rank outer products over a decaying spectrum): the largest residual
|F V - V diag(w)| / |F| and loss of orthogonality |V^T V - I| / sqrt(n), and the relative error of the inverse fourth
root built from it against float64 ``eigh``'s (``eigh``'s float32 error beside it). Then a training-like loop (bf16
products and elementwise passes) alone and beside a child process (as the device lane runs its math) refreshing
batches of 2048 blocks with each method: the loop's mean step, and the blocks refreshed a second with it and without.

    python3 bench/gpu_syev_batched.py --sizes 1024 2048 --batches 1 4 16 --out results/gpu_syev_batched.json
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_refresh_math import drifting_factors, exact_root, time_cuda, timed_training_steps  # noqa: E402

CUDA_R_32F, CUDA_R_64F = 0, 1
EIG_MODE_VECTOR, FILL_LOWER = 1, 0


def cusolver_library() -> ctypes.CDLL:
    """The libcusolver that torch uses: the one mapped into this process after a CUDA ``eigh``, else the first one
    in the nvidia wheels' folders."""
    torch.linalg.eigh(torch.eye(40, device="cuda"))
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcusolver.so" in line})
    if not paths:
        roots = [os.path.join(p, "nvidia") for p in sys.path if os.path.isdir(os.path.join(p, "nvidia"))]
        paths = sorted(path for root in roots for path in glob.glob(f"{root}/**/libcusolver.so*", recursive=True))
    if not paths:
        raise SystemExit("no libcusolver.so is loaded or in the nvidia wheels (torch may link cuSOLVER statically)")
    print(f"cuSOLVER: {paths[0]}", flush=True)
    lib = ctypes.CDLL(paths[0])
    if not hasattr(lib, "cusolverDnXsyevBatched"):
        raise SystemExit(f"{paths[0]} has no cusolverDnXsyevBatched (it needs cuSOLVER 11.7, CUDA 12.6.2 or later)")
    return lib


def check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} returned cusolverStatus {status}")


class SyevBatched:
    """``XsyevBatched`` for batches of ``batch`` n x n matrices of ``dtype`` on ``stream``, with its handle and
    workspaces made once. ``__call__(a)`` decomposes the symmetric (batch, n, n) tensor ``a`` in place: it returns the
    eigenvalues (ascending) and the eigenvectors as columns (cuSOLVER writes them column-major, which row-major torch
    reads as their transpose)."""

    def __init__(self, lib: ctypes.CDLL, n: int, batch: int, dtype: torch.dtype, stream: torch.cuda.Stream) -> None:
        self.lib, self.n, self.batch = lib, n, batch
        self.type = {torch.float32: CUDA_R_32F, torch.float64: CUDA_R_64F}[dtype]
        self.handle, self.params = ctypes.c_void_p(), ctypes.c_void_p()
        check(lib.cusolverDnCreate(ctypes.byref(self.handle)), "cusolverDnCreate")
        check(lib.cusolverDnSetStream(self.handle, ctypes.c_void_p(stream.cuda_stream)), "cusolverDnSetStream")
        check(lib.cusolverDnCreateParams(ctypes.byref(self.params)), "cusolverDnCreateParams")
        self.w = torch.empty(batch, n, device="cuda", dtype=dtype)
        self.info = torch.zeros(batch, device="cuda", dtype=torch.int32)
        probe = torch.empty(batch, n, n, device="cuda", dtype=dtype)
        device_bytes, host_bytes = ctypes.c_size_t(), ctypes.c_size_t()
        check(lib.cusolverDnXsyevBatched_bufferSize(
            self.handle, self.params, EIG_MODE_VECTOR, FILL_LOWER, ctypes.c_int64(n), self.type,
            ctypes.c_void_p(probe.data_ptr()), ctypes.c_int64(n), self.type, ctypes.c_void_p(self.w.data_ptr()),
            self.type, ctypes.byref(device_bytes), ctypes.byref(host_bytes), ctypes.c_int64(batch)),
            "cusolverDnXsyevBatched_bufferSize")
        self.device_work = torch.empty(max(device_bytes.value, 1), device="cuda", dtype=torch.uint8)
        self.host_work = ctypes.create_string_buffer(max(host_bytes.value, 1))
        self.device_bytes, self.host_bytes = device_bytes.value, host_bytes.value

    def __call__(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert a.shape == (self.batch, self.n, self.n) and a.is_contiguous()
        check(self.lib.cusolverDnXsyevBatched(
            self.handle, self.params, EIG_MODE_VECTOR, FILL_LOWER, ctypes.c_int64(self.n), self.type,
            ctypes.c_void_p(a.data_ptr()), ctypes.c_int64(self.n), self.type, ctypes.c_void_p(self.w.data_ptr()),
            self.type, ctypes.c_void_p(self.device_work.data_ptr()), ctypes.c_size_t(self.device_bytes),
            self.host_work, ctypes.c_size_t(self.host_bytes), ctypes.c_void_p(self.info.data_ptr()),
            ctypes.c_int64(self.batch)), "cusolverDnXsyevBatched")
        return self.w, a.mT

    def close(self) -> None:
        """Destroys the handle and its parameters (the workspaces go with the object)."""
        check(self.lib.cusolverDnDestroyParams(self.params), "cusolverDnDestroyParams")
        check(self.lib.cusolverDnDestroy(self.handle), "cusolverDnDestroy")


def accuracy(factor: torch.Tensor, w: torch.Tensor, v: torch.Tensor, eps: float = 1e-12) -> dict[str, float]:
    """Residual, orthogonality and root error (against float64 eigh's root) of the eigenpairs (w, v) of ``factor``."""
    f, w64, v64 = factor.double(), w.double(), v.double()
    n = f.shape[-1]
    residual = (f @ v64 - v64 * w64[..., None, :]).norm(dim=(-2, -1)) / f.norm(dim=(-2, -1))
    orth = (v64.mT @ v64 - torch.eye(n, device=f.device, dtype=f.dtype)).norm(dim=(-2, -1)) / n ** 0.5
    exact = exact_root(factor, eps).double()
    root = (v64 * (w64.clamp_min(0) + eps).pow(-0.25)[..., None, :]) @ v64.mT
    error = (root - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))
    return {"residual": float(residual.max()), "orth": float(orth.max()), "root_error": float(error.max())}


def method_rows(lib: ctypes.CDLL, sizes: list[int], batches: list[int], repeats: int) -> list[dict]:
    rows = []
    stream = torch.cuda.current_stream()
    for n in sizes:
        for batch in batches:
            _, factor = drifting_factors(batch, n, torch.device("cuda"), seed=n + batch)
            solver = SyevBatched(lib, n, batch, torch.float32, stream)
            work = factor.clone()
            eigh_s = time_cuda(lambda: torch.linalg.eigh(factor), repeats)
            batched_s = time_cuda(lambda: solver(work.copy_(factor)), repeats)
            w, v = solver(work.copy_(factor))
            if int(solver.info.abs().max()) != 0:
                raise RuntimeError(f"XsyevBatched info {solver.info.tolist()} at n={n}, batch={batch}")
            ew, ev = torch.linalg.eigh(factor)
            row = {"n": n, "batch": batch, "eigh_ms_per_block": 1e3 * eigh_s / batch,
                   "batched_ms_per_block": 1e3 * batched_s / batch, "speedup": eigh_s / batched_s,
                   "workspace_mib": solver.device_bytes / 2**20,
                   "batched": accuracy(factor, w, v), "eigh": accuracy(factor, ew, ev)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            solver.close()
    return rows


def side_loop(method: str, n: int, batch: int, ready: Event, stop: Event, done: Synchronized) -> None:
    """A child process's refresh loop, as the device lane runs it (a process and CUDA context of its own): ``method``
    on ``batch`` blocks of ``n`` until ``stop``, counting the blocks done."""
    _, factor = drifting_factors(batch, n, torch.device("cuda"), seed=7)
    solver = None if method == "eigh" else SyevBatched(cusolver_library(), n, batch, torch.float32,
                                                        torch.cuda.current_stream())
    work = torch.empty_like(factor)

    def refresh() -> None:
        if solver is None:
            torch.linalg.eigh(factor)
        else:
            solver(work.copy_(factor))

    refresh()
    torch.cuda.synchronize()
    ready.set()
    while not stop.is_set():
        refresh()
        torch.cuda.synchronize()
        with done.get_lock():
            done.value += batch
    if solver is not None:
        solver.close()


def interference_rows(n: int, batch: int, steps: int) -> list[dict]:
    """The training-like loop alone, then beside a child process refreshing batches with each method; each method's
    rate with nothing beside it (over 2 s) and beside the loop."""
    weights = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(24)]
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)

    def steps_timed() -> list[float]:
        return timed_training_steps(weights, x, steps)

    def rate_over(done: Synchronized, body: Callable[[], object]) -> tuple[float, object]:
        count, t0 = done.value, time.perf_counter()
        result = body()
        return (done.value - count) / (time.perf_counter() - t0), result

    alone = steps_timed()
    rows = [{"method": "none", "mean_step_ms": 1e3 * statistics.mean(alone), "blocks_per_s": 0.0}]
    spawn = mp.get_context("spawn")
    for name in ("eigh", "syevBatched"):
        ready, stop, done = spawn.Event(), spawn.Event(), spawn.Value("q", 0)
        child = spawn.Process(target=side_loop, args=(name, n, batch, ready, stop, done), daemon=True)
        child.start()
        try:
            if not ready.wait(timeout=300):
                raise RuntimeError(f"the {name} process did not start its loop within 300 s")
            rate_alone, _ = rate_over(done, lambda: time.sleep(2.0))
            rate, times = rate_over(done, steps_timed)
        finally:
            stop.set()
            child.join(timeout=120)
        rows.append({"method": name, "mean_step_ms": 1e3 * statistics.mean(times),
                     "median_step_ms": 1e3 * statistics.median(times), "blocks_per_s": rate,
                     "blocks_per_s_alone": rate_alone})
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--interference-batch", type=int, default=8, help="blocks of 2048 a refresh call takes")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this bench needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    lib = cusolver_library()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "methods": method_rows(lib, args.sizes, args.batches, args.repeats),
              "interference": interference_rows(2048, args.interference_batch, args.steps)}
    print("n batch | eigh ms/block | batched ms/block | speedup | root error batched / eigh")
    for r in result["methods"]:
        print(f"{r['n']} {r['batch']} | {r['eigh_ms_per_block']:.2f} | {r['batched_ms_per_block']:.2f} | "
              f"{r['speedup']:.2f}x | {r['batched']['root_error']:.2e} / {r['eigh']['root_error']:.2e}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
