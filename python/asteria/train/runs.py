"""A finished run as the reports read it: ``summary.json`` and ``metrics.jsonl``, checked entry by entry
so that a report names the first entry it could not read instead of failing inside a table or a figure."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asteria.config import is_int

SMOOTHING = 10  # steps in the trailing mean that "final loss" and "time to target" use


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    records: list[dict[str, Any]]

    @property
    def label(self) -> str:
        return self.summary["label"]

    @property
    def has_energy(self) -> bool:
        return bool(self.records) and all("energy_joules" in r for r in self.records)

    def cumulative_energy(self) -> list[float]:
        total, out = 0.0, []
        for r in self.records:
            total += r["energy_joules"]
            out.append(total)
        return out

    def smoothed(self) -> list[float]:
        """Trailing mean of ``SMOOTHING`` steps' loss, summed as ``statistics.fmean`` sums the summary's
        final loss, so that a run's last value is its final loss exactly and the run reaches it."""
        losses = [r["loss"] for r in self.records]
        return [math.fsum(losses[max(0, i - SMOOTHING + 1):i + 1]) / (i + 1 - max(0, i - SMOOTHING + 1))
                for i in range(len(losses))]

    def reach(self, target: float) -> dict[str, Any] | None:
        """The first record whose trailing-mean loss is at or below ``target``."""
        for record, loss in zip(self.records, self.smoothed()):
            if loss <= target:
                return record
        return None


def load_run(run_dir: Path) -> Run:
    """A finished run's ``summary.json`` and ``metrics.jsonl``; a clear error for anything else."""
    run_dir = Path(run_dir)
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    if not summary_path.is_file() or not metrics_path.is_file():
        raise FileNotFoundError(f"Invalid run={str(run_dir)!r}: no summary.json and metrics.jsonl (not a finished "
                                f"asteria train run)")
    try:
        summary = json.loads(summary_path.read_text())
        records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    except ValueError as error:
        raise ValueError(f"Invalid run={str(run_dir)!r}: unreadable metrics ({error})") from None
    if not records:
        raise ValueError(f"Invalid run={str(run_dir)!r}: no steps recorded")
    _check_run(run_dir, summary, records)
    return Run(run_dir, summary, records)


def is_number(value: Any) -> bool:
    """A Python int or float that is not a bool (NaN and infinities included: a diverged run's loss)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# What the reports read of a run: summary.json's entries and each metrics.jsonl record's, with what they must be.
SUMMARY_ENTRIES = {"label": (lambda v: isinstance(v, str) and v != "", "a config label"),
                   "device": (lambda v: isinstance(v, str) and v != "", "the device's name"),
                   "final_loss": (is_number, "a number")}
OPTIONAL_ENTRIES = {"final_val_loss": (is_number, "a number or null"),
                    "median_step_seconds": (lambda v: is_number(v) and v >= 0, "a number of seconds >= 0"),
                    "max_step_seconds": (lambda v: is_number(v) and v >= 0, "a number of seconds >= 0"),
                    "vocab_size": (lambda v: is_int(v) and v >= 2, "an int >= 2"),
                    "initial_loss_bound": (lambda v: is_number(v) and v > 0, "a number > 0"),
                    "energy_joules_total": (is_number, "a number or null"),
                    "energy_joules_per_step": (is_number, "a number or null"),
                    "runtime_stats": (lambda v: isinstance(v, dict), "an object"),
                    "config": (lambda v: isinstance(v, dict), "an object")}
RECORD_ENTRIES = {"step": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
                  "loss": (is_number, "a number"), "wall": (is_number, "a number of seconds"),
                  "step_time": (lambda v: is_number(v) and v >= 0, "a number of seconds >= 0")}


def _check_run(run_dir: Path, summary: Any, records: list[Any]) -> None:
    """Raises ``ValueError`` naming the first entry of a run's files that the reports could not read."""
    where = f"Invalid run={str(run_dir)!r}"
    if not isinstance(summary, dict):
        raise ValueError(f"{where}: summary.json holds a {type(summary).__name__}, not an object")
    for key, (ok, allowed) in SUMMARY_ENTRIES.items():
        if key not in summary or not ok(summary[key]):
            raise ValueError(f"{where}: summary.json's {key}={summary.get(key, '(missing)')!r}: must be {allowed}")
    for key, (ok, allowed) in OPTIONAL_ENTRIES.items():
        if summary.get(key) is not None and not ok(summary[key]):
            raise ValueError(f"{where}: summary.json's {key}={summary[key]!r}: must be {allowed}")
    if summary.get("vocab_size") is None and summary.get("initial_loss_bound") is None:
        raise ValueError(f"{where}: summary.json has neither vocab_size nor initial_loss_bound")
    for line, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: metrics.jsonl line {line} holds {record!r}, not an object")
        for key, (ok, allowed) in RECORD_ENTRIES.items():
            if key not in record or not ok(record[key]):
                raise ValueError(f"{where}: metrics.jsonl line {line}: {key}={record.get(key, '(missing)')!r}: "
                                 f"must be {allowed}")
        if "energy_joules" in record and not is_number(record["energy_joules"]):
            raise ValueError(f"{where}: metrics.jsonl line {line}: energy_joules={record['energy_joules']!r}: "
                             "must be a number")


def steady_warmup(precondition_frequency: int, sync_refreshes: int) -> int:
    """Steps before the steady state: the first refresh comes by step f, and it and the other sync
    refreshes (``RuntimeConfig.sync_refreshes``) are waited for by design over the intervals after it."""
    return precondition_frequency * (max(1, sync_refreshes) + 1)


#: the cumulative runtime statistics an async run records at the end of its warm-up (``runtime_stats_at_warmup``
#: in summary.json), so that the refresh work per interval counts the steady steps alone: the start-up refreshes
#: run on the GPU, and a whole-run mean would spread the workers' seconds over intervals in which they had no jobs
WORK_COUNTERS = ("refresh_seconds_on_workers", "worker_jobs_ended", "refreshes_superseded", "refreshes_deferred",
                 "device_refresh_seconds", "device_cpu_seconds")
