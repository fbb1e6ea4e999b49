"""The bench's and the report's figures over finished runs, from counters and step times made up here: what the
steady steps are, and how much refresh work an interval holds against each side's capacity."""

from __future__ import annotations

import pytest

from asteria.train.bench import refresh_work
from asteria.train.report import steady_max_over_median
from asteria.train.runs import WORK_COUNTERS, Run

#: an async run's final counters: 14 workers, one lane thread, 60 steps of f = 10
FINAL = {"workers": 14, "express_workers": 14, "device_threads": 1, "refreshes": 2546, "refresh_failures": 0,
         "refresh_seconds_on_workers": 640.0, "worker_jobs_ended": 700, "refreshes_superseded": 0,
         "refreshes_deferred": 320, "device_refresh_seconds": 72.0, "device_cpu_seconds": 46.0,
         "planned_load": {"workers": 1.81, "device": 0.98}}
#: the same counters at the warm-up's end (step 30): the start-up refreshes ran on the GPU, the workers had begun
AT_WARMUP = {"step": 30, "refresh_seconds_on_workers": 100.0, "worker_jobs_ended": 100, "refreshes_superseded": 0,
             "refreshes_deferred": 20, "device_refresh_seconds": 30.0, "device_cpu_seconds": 10.0}


def test_the_refresh_work_counts_the_steady_steps_from_the_counters_at_the_warm_ups_end():
    """Three steady intervals of 11.4 s: 540 worker core-s in 600 jobs (0.9 s a job) and 300 refreshes dropped, at
    that job's time, are (540 + 270) / 3 = 270 core-s an interval, against 14 x 11.4 = 159.6; the lane's 42 s are
    14 s an interval."""
    assert set(AT_WARMUP) - {"step"} <= set(WORK_COUNTERS)
    work = refresh_work(FINAL, 10, 60, 1.14, "own", AT_WARMUP)
    assert work["window"] == "steady"
    assert work["worker_core_seconds"] == pytest.approx(270.0)
    assert work["worker_capacity_core_seconds"] == pytest.approx(159.6)
    assert work["worker_ratio"] == pytest.approx(270.0 / 159.6)
    assert work["device_seconds"] == pytest.approx(14.0) and work["device_ratio"] == pytest.approx(14.0 / 11.4)
    assert work["device_cpu_seconds"] == pytest.approx(12.0)
    assert work["planned_load"] == FINAL["planned_load"]  # the balancer's view, beside the counted work


def test_without_the_warm_ups_counters_the_refresh_work_is_the_whole_runs():
    """A run written before the counters were recorded (or resumed past its warm-up): six intervals, the workers'
    640 core-s in 700 jobs and 320 dropped at that mean, (640 + 320 x 640 / 700) / 6; without the workers' job count,
    every refresh (the lane's included) divides, as the bench computed it then."""
    work = refresh_work(FINAL, 10, 60, 1.14, "own")
    assert work["window"] == "run"
    assert work["worker_core_seconds"] == pytest.approx((640.0 + 320 * 640.0 / 700) / 6)
    assert work["device_seconds"] == pytest.approx(12.0)
    older = {key: value for key, value in FINAL.items() if key != "worker_jobs_ended"}
    assert refresh_work(older, 10, 60, 1.14, "own")["worker_core_seconds"] == pytest.approx(
        640.0 / 2546 * (2546 + 320) / 6)
    resumed = refresh_work(FINAL, 10, 60, 1.14, "own", {**AT_WARMUP, "step": 60})  # no steady step after it
    assert resumed["window"] == "run"
    assert refresh_work({**FINAL, "workers": 0}, 10, 60, 1.14, "own") is None  # native mode: no workers


def test_report_steady_max_over_median_skips_the_warm_up(tmp_path):
    """Steps up to (sync_refreshes + 1) x f of the run's own config are the warm-up, as in asteria bench."""
    times = [5.0, 0.1, 0.1, 0.9, 0.1, 0.2, 0.1, 0.3]  # f = 2, sync_refreshes = 1: steps 1-4 are the warm-up
    records = [{"step": i + 1, "step_time": t, "loss": 1.0, "wall": float(i)} for i, t in enumerate(times)]
    run = Run(tmp_path, {"config": {"precondition_frequency": 2, "sync_refreshes": 1}}, records)
    assert steady_max_over_median(run) == pytest.approx(0.3 / 0.15)
    run.summary["config"]["sync_refreshes"] = 3  # warm-up of 8 steps: nothing steady
    assert steady_max_over_median(run) is None
