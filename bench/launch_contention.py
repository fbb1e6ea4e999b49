"""What refresh math beside training costs the training thread's kernel launches, by where the math runs.

A "training" thread queues a fixed chain of kernels (``--small`` launches of 256-wide products and elementwise
work, and ``--big`` 4096-wide bf16 products that keep the GPU busy) and waits for it, ``--reps`` times, alone
and beside a second thread or process that refreshes a 2048 x 2048 symmetric matrix in a loop on a stream of its
own. Per arm it prints the median time to queue the chain, the wall time with the wait, how many times the
training thread slept meanwhile (voluntary context switches: a lock, the GIL) and its CPU time, each arm's
ratio to the first "none" arm (measured in the same run), and the side's refreshes a second:
  eigh          torch.linalg.eigh in a thread of this process (cuSOLVER syevd: host round trips inside)
  eigh_nocheck  the same without the info check's read-back (torch._linalg_eigh)
  qr            Householder QR (torch.linalg.qr) in a thread
  matmul        eight float32 products in a thread (no host round trips)
  newton        ten Newton-Schulz-like steps (products only) in a thread
  eigh-process, qr-process  the same math in a child process: a CUDA context of its own (the device lane's
                default, ``asteria.pipeline.lane_process``)
A chain that takes several times as long beside ``eigh`` as beside ``eigh-process``, with hundreds of sleeps,
shows the driver holding the training thread's launches while syevd runs in the same process.

    python3 bench/launch_contention.py                # host-bound chain: launches only
    python3 bench/launch_contention.py --big 100      # with 100 large products a rep: GPU-bound
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time
from typing import Any

import torch

from asteria.train.meters import thread_sched

SIDES = ("none", "eigh", "eigh_nocheck", "qr", "matmul", "newton", "eigh-process", "qr-process", "none")


def sleeps() -> int:
    """The calling thread's voluntary context switches so far (Linux), 0 elsewhere."""
    sched = thread_sched()
    return 0 if sched is None else sched[1]


def chain(reps: int, small: int, big: int) -> dict[str, float]:
    """The medians over ``reps`` of queuing the chain (ms), its wall time with the wait (ms), the sleeps and the
    CPU time (ms)."""
    x, w = torch.randn(256, 256, device="cuda"), torch.randn(256, 256, device="cuda")
    xb = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    rows: dict[str, list[float]] = {"queue": [], "wall": [], "sleeps": [], "cpu": []}
    for _ in range(reps):
        t0, s0, c0 = time.perf_counter(), sleeps(), time.thread_time()
        y = x
        for _ in range(small // 3):
            y = torch.relu(y @ w) * 0.5
        for _ in range(big):
            xb = (xb @ xb) * 0.01
        queued, cpu, slept = time.perf_counter() - t0, time.thread_time() - c0, sleeps() - s0
        torch.cuda.synchronize()
        rows["queue"].append(1e3 * queued)
        rows["wall"].append(1e3 * (time.perf_counter() - t0))
        rows["sleeps"].append(slept)
        rows["cpu"].append(1e3 * cpu)
    return {key: statistics.median(values) for key, values in rows.items()}


def side(kind: str, stop: Any, count: Any, ready: Any) -> None:
    """Refreshes a 2048 x 2048 symmetric matrix by ``kind`` on a stream of its own until ``stop`` is set; sets
    ``ready`` after the first refresh (its context, handles and workspace exist)."""
    stream = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda")
    a = a @ a.mT / 2048 + torch.eye(2048, device="cuda")
    with torch.cuda.stream(stream):
        while not stop.is_set():
            if kind == "eigh":
                torch.linalg.eigh(a)
            elif kind == "eigh_nocheck":
                torch._linalg_eigh(a, "L", True)
            elif kind == "qr":
                torch.linalg.qr(a)
            elif kind == "matmul":
                for _ in range(8):
                    a @ a
            elif kind == "newton":
                y = a / 2048
                for _ in range(10):
                    y = 1.5 * y - 0.5 * y @ y @ y
            stream.synchronize()
            count.value += 1
            ready.set()


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=sorted(set(SIDES)),
                        help="the arms, in order, the first 'none' (the baseline of the ratios)")
    parser.add_argument("--small", type=int, default=600, help="small launches a rep")
    parser.add_argument("--big", type=int, default=0, help="4096-wide bf16 products a rep")
    parser.add_argument("--reps", type=int, default=30)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    if args.sides[0] != "none":
        parser.error(f"--sides {' '.join(args.sides)}: start with 'none', the baseline the ratios are to")
    if not torch.cuda.is_available():
        print("launch_contention: needs a CUDA GPU (it measures kernel launches beside GPU refresh math)",
              file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; chain: {args.small} small launches "
          f"and {args.big} large products a rep, median of {args.reps}")
    chain(3, args.small, args.big)  # warm-up
    spawn = mp.get_context("spawn")
    print(f"{'side':<14} {'queue ms':>9} {'wall ms':>8} {'sleeps':>7} {'cpu ms':>7} {'queue x':>8} {'wall x':>7} "
          "side/s")
    base: dict[str, float] | None = None  # the first arm's: 'none'
    for kind in args.sides:
        stop, count, ready, proc, thread = spawn.Event(), spawn.Value("l", 0), spawn.Event(), None, None
        if kind.endswith("-process"):
            proc = spawn.Process(target=side, args=(kind.removesuffix("-process"), stop, count, ready))
            proc.start()
        elif kind != "none":
            thread = threading.Thread(target=side, args=(kind, stop, count, ready))
            thread.start()
        if not (kind == "none" or ready.wait(300.0)):
            print(f"launch_contention: the side {kind!r} did not refresh once within 300 s", file=sys.stderr)
            return 1
        start, done = time.perf_counter(), count.value
        got = chain(args.reps, args.small, args.big)
        rate = (count.value - done) / (time.perf_counter() - start)
        stop.set()
        for worker in (proc, thread):
            if worker is not None:
                worker.join()
        base = base or got
        ratios = f"{got['queue'] / base['queue']:8.2f}x {got['wall'] / base['wall']:6.2f}x"
        print(f"{kind:<14} {got['queue']:9.1f} {got['wall']:8.1f} {got['sleeps']:7.0f} {got['cpu']:7.1f} {ratios} "
              f"{rate:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
