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

Then a training-like loop (bf16 matrix products and elementwise work on the main stream) is timed alone and
beside Python threads that refresh blocks, each on its own stream, for each method, SM partition and thread
count: the step-time inflation, the refreshes per second achieved beside it and with nothing beside it, and
the training time lost per block refreshed (the lost share of the wall clock over the rate). A partition
(``--green-sms``, 0: none) is a CUDA green context holding the threads' streams: their kernels may occupy only
its SMs, while training keeps every SM. It asks whether the device lane (``RuntimeConfig.device_sms``) can
refresh beside training without lengthening its steps by the refresh time, as it does on a plain stream, since
``eigh``'s kernels are small and many (26 ms a 2048 block, batched or not). ``--train-priority -1`` runs the
training-like loop on a high-priority stream instead of the default stream, whose priority is CUDA's lowest,
the refresh streams' too: the block scheduler then starts the refreshes' thread blocks only where training's
have none waiting.

    python3 bench/gpu_refresh_math.py --sizes 768 2048 --batches 1 16 --out results/gpu_refresh_math.json
    python3 bench/gpu_refresh_math.py --no-methods-table --green-sms 0 16 32 66 --lane-threads 1 2 \
        --interference-methods eigh power_qr
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


def timed_training_steps(weights: list[torch.Tensor], x: torch.Tensor, steps: int) -> list[float]:
    """Wall seconds of ``steps`` training-like steps on the current stream, after three untimed ones."""
    for _ in range(3):
        training_step(weights, x)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        training_step(weights, x)
        times.append(time.perf_counter() - t0)
    return times


def side_streams(device: torch.device, sms: int, count: int) -> tuple[list[torch.cuda.Stream], object]:
    """``count`` streams for the refresh threads: plain ones at CUDA's lowest priority (the default stream's
    too) for ``sms`` 0, else streams of one green context of ``sms`` SMs (returned with them, to keep alive)."""
    if sms == 0:
        return [torch.cuda.Stream(device=device, priority=0) for _ in range(count)], None
    green = torch.cuda.green_contexts.GreenContext.create(num_sms=sms, device_id=device.index or 0)
    streams = [green.Stream() for _ in range(count)]
    if len({s.cuda_stream for s in streams}) < count:
        print(f"warning: the green context of {sms} SMs gave {len({s.cuda_stream for s in streams})} distinct "
              f"streams for {count} threads", flush=True)
    return streams, green


def refresh_threads(fn, streams: list[torch.cuda.Stream], batch: int, body) -> tuple[float, object]:
    """Runs ``body()`` while one thread per stream refreshes blocks with ``fn`` on it; returns the blocks
    refreshed per second over the body's run, and the body's result."""
    stop = threading.Event()
    done = [0] * len(streams)
    warm = threading.Barrier(len(streams) + 1, timeout=300)  # each thread has its solver handle and workspace

    def work(i: int) -> None:
        with torch.cuda.stream(streams[i]):
            fn()
            streams[i].synchronize()
            warm.wait()
            while not stop.is_set():
                fn()
                streams[i].synchronize()
                done[i] += batch

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(streams))]
    for thread in threads:
        thread.start()
    warm.wait()
    started = time.perf_counter()
    result = body()
    stop.set()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - started), result


def interference(device: torch.device, n: int, batch: int, steps: int, partitions: list[int],
                 thread_counts: list[int], names: list[str], train_priority: int) -> list[dict]:
    """Training-like steps alone, then beside refresh threads, for each method, SM partition (0: none) and
    count of refresh threads sharing it; also each partition's refresh rate with nothing beside it. The steps
    run on a stream of CUDA priority ``train_priority`` (0: the default stream's, the lowest; the refresh
    threads' streams always have 0)."""
    weights = [torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) / 64 for _ in range(24)]
    x = torch.randn(8192, 4096, device=device, dtype=torch.bfloat16)
    old, new = drifting_factors(batch, n, device, seed=1)
    _, basis = torch.linalg.eigh(old)
    methods = {
        "eigh": lambda: torch.linalg.eigh(new),
        "power_qr": lambda: root_from(power_qr(new, basis), new),
        "power_cholqr3": lambda: root_from(power_cholqr3(new, basis), new),
    }

    train_stream = torch.cuda.Stream(device=device, priority=train_priority)
    torch.cuda.synchronize(device)  # the inputs are made: every stream may read them

    def timed_steps() -> list[float]:
        with torch.cuda.stream(train_stream):
            return timed_training_steps(weights, x, steps)

    alone = timed_steps()
    rows = [{"method": "none", "sms": 0, "threads": 0, "train_priority": train_priority,
             "median_step_s": statistics.median(alone),
             "mean_step_s": statistics.mean(alone), "max_step_s": max(alone), "blocks_per_s": 0.0,
             "blocks_per_s_alone": 0.0}]
    print(rows[-1], flush=True)
    for name in names:
        fn = methods[name]
        for sms in partitions:
            for count in thread_counts:
                streams, green = side_streams(device, sms, count)
                rate_alone, _ = refresh_threads(fn, streams, batch, lambda: time.sleep(2.0))
                rate, times = refresh_threads(fn, streams, batch, timed_steps)
                mean = statistics.mean(times)
                lost = 1 - rows[0]["mean_step_s"] / mean  # the share of the wall clock training lost
                rows.append({"method": name, "sms": sms, "threads": count, "train_priority": train_priority,
                             "median_step_s": statistics.median(times), "mean_step_s": mean, "max_step_s": max(times),
                             "blocks_per_s": rate, "blocks_per_s_alone": rate_alone,
                             # training time lost per block refreshed beside it (a plain stream's eigh: about
                             # its own duration)
                             "training_ms_lost_per_block": 1e3 * lost / rate if rate > 0 else None})
                print(rows[-1], flush=True)
                del streams, green
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[768, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--interference-n", type=int, default=2048)
    parser.add_argument("--interference-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--green-sms", type=int, nargs="+", default=[0],
                        help="SM partitions (CUDA green contexts) for the refresh threads beside training; 0: none")
    parser.add_argument("--lane-threads", type=int, nargs="+", default=[1],
                        help="refresh threads (one stream each) sharing each partition")
    parser.add_argument("--train-priority", type=int, default=0,
                        help="CUDA priority of the training-like loop's stream (negative: ahead of the refreshes')")
    parser.add_argument("--interference-methods", nargs="+", default=["eigh", "power_qr", "power_cholqr3"],
                        choices=["eigh", "power_qr", "power_cholqr3"])
    parser.add_argument("--methods-table", action=argparse.BooleanOptionalAction, default=True,
                        help="time the methods alone first (--no-methods-table: the interference only)")
    parser.add_argument("--out", default=None)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "methods": method_table(args.sizes, args.batches, args.repeats, device) if args.methods_table else []}
    result["interference"] = interference(device, args.interference_n, args.interference_batch, args.steps,
                                          args.green_sms, args.lane_threads, args.interference_methods,
                                          args.train_priority)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
