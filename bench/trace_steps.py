"""Per-step reading of a torch.profiler Chrome trace: for each step (a ``record_function`` range named
``step N``), the GPU time of every stream (kernels and copies), the copies by kind, the longest idle
gaps of the main stream and what the other streams did meanwhile, and the slow CUDA runtime calls of
the host. Used by ``bench/profile_step.py --trace-steps``; runs alone on a saved trace too:

    python3 bench/trace_steps.py runs/profile/trace-soap-async.json.gz [--steps 3]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]


def busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def launched(kernel: dict[str, Any], before: dict[str, Any], launches: dict[int, dict[str, Any]],
             ops: list[dict[str, Any]]) -> str:
    """When and from where the host launched ``kernel`` (the one after a gap): launched after the gap began
    means the host was late (host-bound); long before means the stream waited on something."""
    launch = launches.get(kernel.get("args", {}).get("correlation"))
    if launch is None:
        return "launch: ?"
    gap_start = before["ts"] + before["dur"]
    # The innermost enclosing ranges: Python frames (with --trace-stack), operators and annotations.
    inside = [e["name"][:50] for e in ops if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]][-4:]
    return f"launched {(launch['ts'] - gap_start) / 1e3:+.2f} ms from the gap's start in {' > '.join(inside)}"


def steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per ``step N`` range, GPU work assigned by time (each profiled step is synchronized). The
    main stream is the one where the training thread (the range's) launched the most kernels, not the busiest
    one: a device lane's threads may keep their own streams busier."""
    ranges = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("step ")),
                    key=lambda e: e["ts"])
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launches = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")),
                 key=lambda e: e["ts"])
    out = []
    for r in ranges:
        lo, hi = r["ts"], r["ts"] + r["dur"]
        mine = [e for e in gpu if lo <= e["ts"] < hi]
        by_stream: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for e in mine:
            by_stream[e.get("args", {}).get("stream", "?")].append(e)
        ours: dict[Any, int] = defaultdict(int)  # kernels by stream that the training thread launched
        for e in mine:
            launch = launches.get(e.get("args", {}).get("correlation"))
            if e["cat"] == "kernel" and launch is not None and launch.get("tid") == r.get("tid"):
                ours[e.get("args", {}).get("stream", "?")] += 1
        kernel_time = {s: sum(e["dur"] for e in es if e["cat"] == "kernel") for s, es in by_stream.items()}
        main = (max(ours, key=ours.get) if ours else max(kernel_time, key=kernel_time.get) if kernel_time
                else None)
        copies: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for e in mine:
            if e["cat"] == "gpu_memcpy":
                c = copies[f"{e['name']} @stream {e.get('args', {}).get('stream')}"]
                c[0] += 1
                c[1] += e.get("args", {}).get("bytes", 0)
                c[2] += e["dur"]
        gaps = []
        # the main stream's idle time before the optimizer's step began on the host (the forward and backward
        # passes) and after it (a step that made the host wait, for the allocator for instance, shows there)
        step_start = next((e["ts"] for e in ops if lo <= e["ts"] < hi and e["name"].startswith("Optimizer.step")),
                          hi)
        idle = {"model": 0.0, "optimizer": 0.0}
        if main is not None:
            seq = sorted(by_stream[main], key=lambda e: e["ts"])
            for a, b in zip(seq, seq[1:]):
                gap = b["ts"] - (a["ts"] + a["dur"])
                idle["model" if a["ts"] + a["dur"] < step_start else "optimizer"] += max(gap, 0.0) / 1e3
                if gap > 300:
                    others = [e["name"][:50] for e in mine if e.get("args", {}).get("stream") != main
                              and e["ts"] < b["ts"] and e["ts"] + e["dur"] > a["ts"] + a["dur"]]
                    gaps.append((gap, a["name"][:60], b["name"][:60], others[:4] + [launched(b, a, launches, ops)]))
        slow_calls = sorted(((e["dur"], e["name"] + (" (training thread)" if e.get("tid") == r.get("tid")
                                                     else f" (thread {e.get('tid')})"))
                             for e in runtime if lo <= e["ts"] < hi and e["dur"] > 500), reverse=True)
        calls = [e for e in runtime if lo <= e["ts"] < hi and e.get("tid") == r.get("tid")]
        launch_calls = [e["dur"] for e in calls if "Launch" in e["name"]]
        syncs = [e["dur"] for e in calls if e["name"] == "cudaStreamSynchronize"]
        out.append({
            "step": int(r["name"].split()[1]), "wall_ms": r["dur"] / 1e3, "main_stream": main,
            "training_calls": {"n": len(calls), "ms": sum(e["dur"] for e in calls) / 1e3,
                               "launches": len(launch_calls),
                               "launch_mean_us": statistics.fmean(launch_calls) if launch_calls else 0.0,
                               "launch_max_us": max(launch_calls, default=0.0),
                               "stream_syncs": len(syncs), "stream_sync_ms": sum(syncs) / 1e3},
            "main_idle_ms": idle,
            "stream_busy_ms": {s: busy([(e["ts"], e["ts"] + e["dur"]) for e in es]) / 1e3
                               for s, es in by_stream.items()},
            "copies": {k: {"n": v[0], "MB": v[1] / 1e6, "ms": v[2] / 1e3} for k, v in copies.items()},
            "main_gaps_ms": [(g / 1e3, a, b, o) for g, a, b, o in sorted(gaps, reverse=True)[:4]],
            "slow_runtime_calls_ms": [(d / 1e3, n) for d, n in slow_calls[:6]],
        })
    return out


def report(rows: list[dict[str, Any]], show: int = 3) -> str:
    if not rows:
        return "  (no 'step N' ranges in the trace)"
    median = statistics.median(r["wall_ms"] for r in rows)
    lines = [f"  traced steps {rows[0]['step']}..{rows[-1]['step']}: wall median {median:.1f} ms; "
             f"per step: " + " ".join(f"{r['step']}:{r['wall_ms']:.0f}" for r in rows),
             "  the training thread's CUDA runtime calls per step (step: wall ms, main stream busy ms, calls, ms in "
             "them, kernel launches at mean / max us; the main stream's idle ms before and after the optimizer's "
             "step began; the stream synchronizations, the caching allocator's when it frees its cache):"]
    for r in rows:
        c, idle = r["training_calls"], r["main_idle_ms"]
        lines.append(f"    {r['step']}: {r['wall_ms']:.0f}, {r['stream_busy_ms'].get(r['main_stream'], 0.0):.0f}, "
                     f"{c['n']}, {c['ms']:.1f}, {c['launches']} at {c['launch_mean_us']:.0f} / "
                     f"{c['launch_max_us']:.0f}; idle {idle['model']:.1f} / {idle['optimizer']:.1f}; "
                     f"{c['stream_syncs']} syncs, {c['stream_sync_ms']:.1f} ms")
    typical = min(rows, key=lambda r: abs(r["wall_ms"] - median))
    for label, r in [("typical", typical)] + [("slow", r) for r in sorted(rows, key=lambda r: -r["wall_ms"])[:show]]:
        lines.append(f"  [{label}] step {r['step']}: wall {r['wall_ms']:.1f} ms, main stream {r['main_stream']}, "
                     "busy ms by stream " + ", ".join(f"{s}: {v:.1f}" for s, v in r["stream_busy_ms"].items()))
        for name, c in r["copies"].items():
            lines.append(f"      copy {name}: {c['n']} x, {c['MB']:.1f} MB, {c['ms']:.2f} ms")
        for gap, before, after, others in r["main_gaps_ms"]:
            lines.append(f"      main idle {gap:.2f} ms after {before!r} before {after!r}; elsewhere: {others}")
        for dur, name in r["slow_runtime_calls_ms"]:
            lines.append(f"      host {name} {dur:.2f} ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=3, help="slowest steps shown")
    args = parser.parse_args()
    print(report(steps(load(args.trace)), args.steps))


if __name__ == "__main__":
    main()
