"""Refresh math on the GPU: what each candidate costs per block, how close it comes to ``eigh``, and what
running it on a low-priority stream beside training costs the training stream.

For each block size n and batch B it times, with CUDA events (median of repeats, after a warm-up):
  eigh            torch.linalg.eigh (cuSOLVER; and MAGMA with --magma)
  power+qr        one warm-started power step F @ Q (float32) and a Householder QR (torch.linalg.qr)
  power+cholqr3   the power step, then shifted Cholesky QR three times in float64 (matrix products only,
                  besides an n x n Cholesky)
  root            forming Q diag(d) Q^T from a basis (Shampoo's root from an eigenbasis)
  matmul          one n x n x n float32 product (the calibration)
and the accuracy of the QR refreshes against eigh on factors that drift between refreshes (an EMA with
beta2 = 0.999 over 10 steps of fresh low-rank gradients): the off-diagonal ratio of Q^T F Q and the
relative error of the inverse fourth root built from the refreshed basis and its Rayleigh quotients.

Then a training-like loop (bf16 matrix products and elementwise work on the main stream) is timed alone
and with a Python thread that refreshes blocks on a low-priority stream, for each method: the step-time
inflation and the refreshes per second achieved beside it.

    python3 bench/gpu_refresh_math.py --sizes 768 2048 --batches 1 16 --out results/gpu_refresh_math.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch


def drifting_factors(batch: int, n: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(F_old, F_new): an EMA of low-rank gradient outer products, then 10 more EMA steps of it."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    scales = torch.logspace(0, -4, n)  # a decaying spectrum, as trained weights' gradients have

    def grad() -> torch.Tensor:
        g = torch.randn(batch, n, 64, generator=gen) * scales[:, None]
        return g.to(device)

    factor = torch.zeros(batch, n, n, device=device)
    beta2 = 0.999
    for _ in range(300):
        g = grad()
        factor.mul_(beta2).add_(g @ g.mT, alpha=1 - beta2)
    old = factor.clone()
    for _ in range(10):
        g = grad()
        factor.mul_(beta2).add_(g @ g.mT, alpha=1 - beta2)
    return old, factor


def time_cuda(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, timed with CUDA events after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def power_qr(factor: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    q, _ = torch.linalg.qr(factor @ basis)
    return q


def cholqr(y: torch.Tensor) -> torch.Tensor:
    """One shifted Cholesky QR pass (float64): Y R^-1 with R the Cholesky factor of Y^T Y + s I."""
    n = y.shape[-1]
    gram = y.mT @ y
    shift = 11 * (n * n + n * (n + 1)) * torch.finfo(torch.float64).eps * gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    gram.diagonal(dim1=-2, dim2=-1).add_(shift[..., None])
    r, _ = torch.linalg.cholesky_ex(gram, upper=True)
    return torch.linalg.solve_triangular(r, y, upper=True, left=False)


def power_cholqr3(factor: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    y = (factor @ basis).double()
    return cholqr(cholqr(cholqr(y))).float()


def root_from(basis: torch.Tensor, factor: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Q diag((d + eps)^-1/4) Q^T with d the Rayleigh quotients of ``factor`` in ``basis``."""
    d = ((factor @ basis) * basis).sum(-2).clamp_min(0)
    return (basis * (d + eps).pow(-0.25)[..., None, :]) @ basis.mT


def exact_root(factor: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh(factor.double())
    return ((vecs * (vals.clamp_min(0) + eps).pow(-0.25)[..., None, :]) @ vecs.mT).float()


def off_diagonal(factor: torch.Tensor, basis: torch.Tensor) -> float:
    t = basis.mT.double() @ factor.double() @ basis.double()
    off = t - torch.diag_embed(t.diagonal(dim1=-2, dim2=-1))
    return float((off.norm(dim=(-2, -1)) / t.norm(dim=(-2, -1))).max())


def method_table(sizes: list[int], batches: list[int], repeats: int, device: torch.device) -> list[dict]:
    rows = []
    for n in sizes:
        for batch in batches:
            old, new = drifting_factors(batch, n, device, seed=n + batch)
            _, basis = torch.linalg.eigh(old)
            basis = basis.flip(-1).contiguous()
            row = {"n": n, "batch": batch}
            row["eigh_s"] = time_cuda(lambda: torch.linalg.eigh(new), repeats) / batch
            row["power_qr_s"] = time_cuda(lambda: power_qr(new, basis), repeats) / batch
            row["power_cholqr3_s"] = time_cuda(lambda: power_cholqr3(new, basis), repeats) / batch
            row["root_s"] = time_cuda(lambda: root_from(basis, new), repeats) / batch
            row["matmul_s"] = time_cuda(lambda: new @ basis, repeats) / batch
            exact = exact_root(new)
            for name, fn in (("power_qr", power_qr), ("power_cholqr3", power_cholqr3)):
                q = fn(new, basis)
                row[f"{name}_offdiag"] = off_diagonal(new, q)
                err = (root_from(q, new) - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))
                row[f"{name}_root_rel_err"] = float(err.max())
            row["stale_basis_root_rel_err"] = float(((root_from(basis, new) - exact).norm(dim=(-2, -1))
                                                     / exact.norm(dim=(-2, -1))).max())
            _, fresh = torch.linalg.eigh(new)
            row["eigh_offdiag"] = off_diagonal(new, fresh)
            row["stale_offdiag"] = off_diagonal(new, basis)
            if torch.cuda.is_available():
                try:
                    torch.backends.cuda.preferred_linalg_library("magma")
                    row["eigh_magma_s"] = time_cuda(lambda: torch.linalg.eigh(new), max(3, repeats // 2)) / batch
                finally:
                    torch.backends.cuda.preferred_linalg_library("default")
            rows.append(row)
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def training_step(weights: list[torch.Tensor], x: torch.Tensor) -> None:
    """A stand-in for a transformer step's GPU work: bf16 products and elementwise passes."""
    h = x
    for w in weights:
        h = torch.nn.functional.gelu(h @ w)
        h = h / (h.norm(dim=-1, keepdim=True) + 1)
    h.sum().item()  # the loop reads its loss every step


def interference(device: torch.device, n: int, batch: int, steps: int) -> list[dict]:
    weights = [torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) / 64 for _ in range(24)]
    x = torch.randn(8192, 4096, device=device, dtype=torch.bfloat16)
    old, new = drifting_factors(batch, n, device, seed=1)
    _, basis = torch.linalg.eigh(old)
    methods = {
        "eigh": lambda: torch.linalg.eigh(new),
        "power_qr": lambda: root_from(power_qr(new, basis), new),
        "power_cholqr3": lambda: root_from(power_cholqr3(new, basis), new),
    }

    def timed_steps() -> list[float]:
        for _ in range(3):
            training_step(weights, x)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            training_step(weights, x)
            times.append(time.perf_counter() - t0)
        return times

    alone = timed_steps()
    rows = [{"method": "none", "median_step_s": statistics.median(alone), "mean_step_s": statistics.mean(alone),
             "max_step_s": max(alone), "blocks_per_s": 0.0}]
    for name, fn in methods.items():
        stop = threading.Event()
        done = [0]
        side = torch.cuda.Stream(device=device, priority=0)  # CUDA's lowest priority (the default stream's too)

        def work() -> None:
            with torch.cuda.stream(side):
                while not stop.is_set():
                    fn()
                    side.synchronize()
                    done[0] += batch

        thread = threading.Thread(target=work, daemon=True)
        started = time.perf_counter()
        thread.start()
        times = timed_steps()
        stop.set()
        thread.join()
        elapsed = time.perf_counter() - started
        rows.append({"method": name, "median_step_s": statistics.median(times), "mean_step_s": statistics.mean(times),
                     "max_step_s": max(times), "blocks_per_s": done[0] / elapsed})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[768, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--interference-n", type=int, default=2048)
    parser.add_argument("--interference-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "methods": method_table(args.sizes, args.batches, args.repeats, device)}
    result["interference"] = interference(device, args.interference_n, args.interference_batch, args.steps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
