"""Installs from a node store to the GPU, the two ways the distributed refresher does them, side by side
in one process on one GPU:

- ``staged``: the store is pageable shared memory (what happens when CUDA refuses to page-lock it, and
  what every install did before the store was registered): the training thread gathers the blocks into a
  pinned buffer, then one asynchronous copy moves it to the GPU;
- ``direct``: the store is page-locked (``cudaHostRegister``): one DMA copy per block straight from its
  store slot, queued on the low-priority side stream, and the main stream waits for their event.

Also timed, for scale: the owner's publish, a copy of its results (pinned) into the store, on one
thread and on ``--publish-threads`` (``NodeStore.write``; the distributed refresher uses up to 4).

Per install it prints the training thread's time (what the GPU waits for when nothing else is queued)
and the time until the copies have completed, medians over ``--repeats``, with their ratios and the
device. The default size is what one rank installed per step in the ninth session's staggered 2-GPU DDP
run of olmo-160m (about 72 MB: 18 blocks of 1024 x 1024), and the default of one torch CPU thread is what
a training process has under torchrun with several processes (OMP_NUM_THREADS=1).

    python3 bench/store_install.py [--blocks 18] [--dim 1024] [--repeats 30] [--torch-threads 1]
                                   [--publish-threads 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asteria import _core
from asteria.pipeline import streams


def _time(call, repeats: int, warmup: int = 3) -> tuple[float, float]:
    """Median host seconds of ``call()`` and median seconds until the GPU has finished it."""
    host, done = [], []
    for i in range(warmup + repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        returned = time.perf_counter()
        torch.cuda.synchronize()
        if i >= warmup:
            host.append(returned - start)
            done.append(time.perf_counter() - start)
    return statistics.median(host), statistics.median(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=18)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--torch-threads", type=int, default=1, help="torch's intra-op CPU threads")
    parser.add_argument("--publish-threads", type=int, default=4, help="threads of the publish's copy")
    args = parser.parse_args()
    for name in ("blocks", "dim", "repeats", "torch_threads", "publish_threads"):
        if getattr(args, name) < 1:
            parser.error(f"Invalid --{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    torch.set_num_threads(args.torch_threads)
    if not torch.cuda.is_available():
        raise SystemExit("store_install.py needs a CUDA GPU")
    device = torch.device("cuda", 0)
    n, count = args.dim, args.blocks
    store = _core.NodeStore.private_memory([n * n] * count)
    view = torch.from_numpy(store.data())
    view.copy_(torch.randn(view.numel()))
    rows = [view[store.offset(b, 0):][:n * n].view(n, n) for b in range(count)]
    results = torch.randn(count, n * n, pin_memory=True)  # an owner's finished jobs
    target = torch.zeros(count, n, n, device=device)
    index = torch.arange(count, device=device)
    side = streams.SideStream(device)
    expected = torch.stack(rows).to(device)

    def publish(threads: int) -> None:
        for b in range(count):
            store.write(b, 1, results[b], threads)

    def staged() -> None:
        target.index_copy_(0, index, streams.to_device(rows, device))

    def direct() -> None:
        with side.staging():
            for b, row in enumerate(rows):
                target[b].copy_(row, non_blocking=True)
        side.main_waits(side.record())

    figures = {"publish, 1 thread": _time(lambda: publish(1), args.repeats),
               f"publish, {args.publish_threads} threads": _time(lambda: publish(args.publish_threads), args.repeats),
               "staged": _time(staged, args.repeats)}
    assert torch.equal(view[store.offset(count - 1, 1):][:n * n], results[-1]), "the publish copied wrong data"
    assert torch.equal(target, expected), "the staged install copied wrong data"
    target.zero_()
    registration = streams.HostRegistration.register(view, "the benchmark's store", device)
    if registration is None:
        raise SystemExit("CUDA refused to page-lock the store: nothing to compare")
    try:
        figures["direct"] = _time(direct, args.repeats)
        assert torch.equal(target, expected), "the direct install copied wrong data"
    finally:
        registration.close()
    megabytes = count * n * n * 4 / 1e6
    print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; {count} blocks of {n} x {n} "
          f"({megabytes:.1f} MB) per install; {args.torch_threads} torch CPU thread(s); medians of {args.repeats}")
    print("| path | training thread ms | until copied ms | GB/s |")
    print("|---|---|---|---|")
    for name, (host, done) in figures.items():
        print(f"| {name} | {host * 1e3:.2f} | {done * 1e3:.2f} | {megabytes / 1e3 / done:.1f} |")
    (staged_host, staged_done), (direct_host, direct_done) = figures["staged"], figures["direct"]
    print(f"direct vs staged: training thread {staged_host / direct_host:.1f}x less, "
          f"until copied {staged_done / direct_done:.2f}x faster")


if __name__ == "__main__":
    main()
