"""bench/trace_steps.py on a small Chrome trace written by hand: which stream it takes for training's, and
whose the slow runtime calls are."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from trace_steps import load, report, steps  # noqa: E402

TRAINING, LANE = 11, 22  # thread ids
MAIN, SIDE = 7, 9        # stream ids


def kernel(ts: float, dur: float, stream: int, correlation: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": f"k{correlation}", "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": correlation}}


def launch(ts: float, tid: int, correlation: int, dur: float = 5.0, name: str = "cudaLaunchKernel") -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "tid": tid,
            "args": {"correlation": correlation}}


def test_the_main_stream_is_the_training_threads_not_the_busiest(tmp_path):
    """A lane thread's stream is busier than training's; training's is still the main one, its idle gap is
    found, and the slow runtime calls say which thread made them."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "step 5", "ts": 0.0, "dur": 10_000.0, "tid": TRAINING}]
    # training: two short kernels with a 4 ms gap between them, the second launched late
    events += [launch(10, TRAINING, 1), kernel(20, 500, MAIN, 1), launch(4_400, TRAINING, 2), kernel(4_520, 500,
                                                                                                    MAIN, 2)]
    # the lane: one long kernel, and a 3 ms wait for it in a copy
    events += [launch(30, LANE, 3), kernel(40, 8_000, SIDE, 3), launch(100, LANE, 4, 3_000, "cudaMemcpyAsync")]
    events += [launch(600, TRAINING, 5, 1_200, "cudaStreamSynchronize")]
    # the optimizer's step begins on the host during the gap: the gap counts as the model part's idle time, and a
    # third kernel 0.2 ms after the second's end as the optimizer's
    events += [launch(4_600, TRAINING, 6), kernel(5_220, 100, MAIN, 6)]
    events += [{"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#Shampoo.step", "ts": 2_000.0,
                "dur": 3_000.0, "tid": TRAINING}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    [row] = steps(load(path))
    assert row["main_stream"] == MAIN
    assert row["stream_busy_ms"] == pytest.approx({MAIN: 1.1, SIDE: 8.0})
    [(gap, before, after, _)] = row["main_gaps_ms"]
    assert (round(gap, 3), before, after) == (4.0, "k1", "k2")
    assert row["slow_runtime_calls_ms"] == [(3.0, f"cudaMemcpyAsync (thread {LANE})"),
                                            (1.2, "cudaStreamSynchronize (training thread)")]
    assert row["training_calls"] == pytest.approx({"n": 4, "ms": 1.215, "launches": 3, "launch_mean_us": 5.0,
                                                   "launch_max_us": 5.0, "stream_syncs": 1, "stream_sync_ms": 1.2})
    assert row["main_idle_ms"] == pytest.approx({"model": 4.0, "optimizer": 0.2})
    text = report([row])
    assert "    5: 10, 1, 4, 1.2, 3 at 5 / 5; idle 4.0 / 0.2; 1 syncs, 1.2 ms" in text
    assert f"main stream {MAIN}" in text
    assert "main idle 4.00 ms after 'k1' before 'k2'" in text
    assert "launched +3.88 ms from the gap's start" in text  # (the host was late: 4400 - 520 us)
