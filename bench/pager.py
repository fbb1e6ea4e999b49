"""Throughput of the NVMe pager (asteria._core.Pager) on this machine's disk.

For each I/O mode and thread count: writes `--records` records of `--record-kib` KiB (all submitted,
then waited for), then reads them all back through read-ahead into `--buffers` buffers (acquire and
release in schedule order), and prints GB/s and operations/s as a markdown table.

    python bench/pager.py --dir /tmp/asteria_pager_bench --record-kib 4096 --records 64
    python bench/pager.py --dir /tmp/asteria_pager_bench --record-kib 4 --records 4096   # per-request overhead

Buffered-mode reads are served from the page cache when the data fits in memory (the page cache is
not dropped: that would disturb everything else on the machine), so they measure the copy path, not
the disk. O_DIRECT reads always go to the device.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from asteria import _core


def run(directory: str, record_bytes: int, records: int, buffers: int, threads: int, o_direct: bool | None) -> dict:
    pool = torch.zeros(buffers, record_bytes, dtype=torch.uint8)
    sources = [torch.full((record_bytes,), i % 251, dtype=torch.uint8) for i in range(min(records, 16))]
    with _core.Pager(directory, pool, io_threads=threads, o_direct=o_direct) as pager:
        start = time.perf_counter()
        tickets = [pager.write(key, 1, sources[key % len(sources)]) for key in range(records)]
        for ticket in tickets:
            pager.wait(ticket, 600.0)
        write_s = time.perf_counter() - start

        start = time.perf_counter()
        pager.read_ahead(list(range(records)))
        for key in range(records):
            index, version, nbytes = pager.acquire(key, 600.0)
            assert version == 1 and nbytes == record_bytes
            pager.release(index)
        read_s = time.perf_counter() - start
        if int(pool[index, 0]) != (records - 1) % len(sources) % 251:
            raise AssertionError("read back the wrong record")
        stats = pager.stats()
        mode = pager.mode
    total = record_bytes * records
    return {
        "mode": mode,
        "threads": threads,
        "write_gbs": total / write_s / 1e9,
        "write_ops": records / write_s,
        "read_gbs": total / read_s / 1e9,
        "read_ops": records / read_s,
        "hits": stats["read_ahead_hits"],
        "misses": stats["read_ahead_misses"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/asteria_pager_bench",
                        help="directory for the page files (created, then removed)")
    parser.add_argument("--record-kib", type=int, default=4096)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--buffers", type=int, default=8)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["o_direct", "buffered"], choices=["o_direct", "buffered"])
    args = parser.parse_args()
    if os.path.exists(args.dir):
        raise SystemExit(f"Invalid --dir={args.dir!r}: must not exist (the pager creates and removes it)")
    record_bytes = args.record_kib * 1024
    print(f"records: {args.records} x {args.record_kib} KiB = {record_bytes * args.records / 2**20:.0f} MiB, "
          f"{args.buffers} read-ahead buffers, directory {args.dir}")
    print("| mode | io_threads | write GB/s | write ops/s | read GB/s | read ops/s | read-ahead hits/misses |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for threads in args.threads:
            r = run(args.dir, record_bytes, args.records, args.buffers, threads, mode == "o_direct")
            print(f"| {r['mode']} | {r['threads']} | {r['write_gbs']:.2f} | {r['write_ops']:.0f} | "
                  f"{r['read_gbs']:.2f} | {r['read_ops']:.0f} | {r['hits']}/{r['misses']} |")


if __name__ == "__main__":
    main()
