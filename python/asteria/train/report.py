"""Reports over finished runs: PNG plots (loss vs step, wall clock and energy; step-time series) and
a Markdown table with final loss, time to a target loss, energy per step relative to AdamW and the
normalized loss-reduction efficiency (L_init - L_final) / (E / E_AdamW), L_init = ln(vocabulary size).

Where a run has no energy readings (the CPU, or a GPU without NVML's energy counter) the energy
columns say "n/a"; no number is made up.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

from asteria.config import is_int

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
        losses = [r["loss"] for r in self.records]
        return [sum(losses[max(0, i - SMOOTHING + 1):i + 1]) / (i + 1 - max(0, i - SMOOTHING + 1))
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


def run_warmup(run: Run) -> int:
    """``steady_warmup`` of the run's own configuration (one sync refresh for runs older than the setting)."""
    config = run.summary.get("config", {})
    return steady_warmup(config.get("precondition_frequency", 10), config.get("sync_refreshes", 1))


def steady_max_over_median(run: Run) -> float | None:
    """Max over median step time of the steps after ``run_warmup`` (as ``asteria bench`` counts them);
    None when the run has no step past the warm-up."""
    warmup = run_warmup(run)
    times = [r["step_time"] for r in run.records if r["step"] > warmup and r.get("step_time")]
    return max(times) / statistics.median(times) if times else None


def _unique_labels(runs: list[Run]) -> list[str]:
    """Each run's label, with its folder (relative to the runs' common folder, e.g. ``S0/seed1`` in a
    sweep over seeds) where several runs share a label."""
    labels = [r.label for r in runs]
    paths = [r.path.resolve() for r in runs]
    common = Path(os.path.commonpath(paths)) if len(paths) > 1 else paths[0].parent
    return [label if labels.count(label) == 1 else f"{label} ({path.relative_to(common).as_posix() or path.name})"
            for label, path in zip(labels, paths)]


def compare(runs: list[Run], target_loss: float | None = None) -> dict[str, Any]:
    """The report's figures per run (the JSON behind the Markdown table)."""
    reference = next((r for r in runs if r.label == "adamw"), None)
    diverged_reference = reference is not None and not math.isfinite(reference.summary["final_loss"])
    if target_loss is None and reference is not None and not diverged_reference:
        target_loss = reference.summary["final_loss"]
    ref_energy = reference.summary.get("energy_joules_total") if reference and reference.has_energy else None
    ref_per_step = reference.summary.get("energy_joules_per_step") if ref_energy else None
    rows = {}
    names = _unique_labels(runs)
    for name, run in zip(names, runs):
        s = run.summary
        l_init = math.log(s["vocab_size"]) if "vocab_size" in s else s["initial_loss_bound"]
        reached = run.reach(target_loss) if target_loss is not None else None
        energy = s.get("energy_joules_total") if run.has_energy else None
        row = {
            "final_loss": s["final_loss"],
            "final_val_loss": s.get("final_val_loss"),
            "steps": run.records[-1]["step"],
            "wall_seconds": run.records[-1]["wall"],
            "median_step_seconds": s.get("median_step_seconds"),
            "max_step_seconds": s.get("max_step_seconds"),
            "steady_max_over_median": steady_max_over_median(run),
            "initial_loss": l_init,
            "time_to_target_seconds": reached["wall"] if reached else None,
            "steps_to_target": reached["step"] if reached else None,
            "energy_joules": energy,
            "energy_per_step_vs_adamw": (s["energy_joules_per_step"] / ref_per_step
                                         if energy is not None and ref_per_step else None),
            "efficiency": ((l_init - s["final_loss"]) / (energy / ref_energy)
                           if energy is not None and ref_energy else None),
            "refreshes": s.get("runtime_stats", {}).get("refreshes"),
            "waits": s.get("runtime_stats", {}).get("waits"),
        }
        if reference is not None and reached and reference.reach(target_loss):
            row["time_to_target_vs_adamw"] = reached["wall"] / reference.reach(target_loss)["wall"]
        rows[name] = row
    devices = list(dict.fromkeys(run.summary["device"] for run in runs))
    vocabularies = {name: run.summary.get("vocab_size") for name, run in zip(names, runs)}
    return {"device": ", ".join(devices), "target_loss": target_loss,
            "reference": "adamw" if reference is not None else None, "runs": rows,
            "reference_diverged": diverged_reference, "vocabularies": vocabularies,
            "mixed_vocabularies": len({v for v in vocabularies.values() if v is not None}) > 1}


def _vocabulary_list(vocabularies: dict[str, int | None]) -> str:
    """``label: size`` per run (``n/a`` where the run's summary gives an initial loss bound instead; such a
    run is not counted as another vocabulary)."""
    return ", ".join(f"{name}: {'n/a' if size is None else size}" for name, size in vocabularies.items())


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def plot_loss(runs: list[Run], path: Path) -> None:
    labels = _unique_labels(runs)
    fig, (by_step, by_time, by_energy) = plt.subplots(1, 3, figsize=(15, 4))
    for label, run in zip(labels, runs):
        losses = [r["loss"] for r in run.records]
        by_step.plot([r["step"] for r in run.records], losses, label=label, alpha=0.8)
        by_time.plot([r["wall"] for r in run.records], losses, label=label, alpha=0.8)
        if run.has_energy:
            by_energy.plot([e / 1000 for e in run.cumulative_energy()], losses, label=label, alpha=0.8)
    by_step.set(xlabel="step", ylabel="training loss", title="loss vs step")
    by_time.set(xlabel="training wall clock (s)", ylabel="training loss", title="loss vs wall clock")
    by_energy.set(xlabel="GPU energy (kJ)", ylabel="training loss", title="loss vs energy")
    if not any(run.has_energy for run in runs):
        by_energy.text(0.5, 0.5, "energy n/a\n(no NVML energy counter on this device)", ha="center", va="center",
                       transform=by_energy.transAxes)
    by_step.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step_times(runs: list[Run], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(11, 3.5))
    for label, run in zip(_unique_labels(runs), runs):
        ax.plot([r["step"] for r in run.records], [1e3 * r["step_time"] for r in run.records], label=label,
                linewidth=0.8)
    ax.set(xlabel="step", ylabel="step time (ms)", title="step-time series (wall clock)", yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run_dirs: list[Path], out: Path, target_loss: float | None = None) -> Path:
    """Writes ``out/report.md``, ``out/report.json``, ``out/loss.png`` and ``out/step_time.png``;
    returns the Markdown path. ``target_loss`` defaults to AdamW's final loss when an AdamW run is
    among the runs."""
    if target_loss is not None and not (math.isfinite(target_loss) and target_loss > 0):
        raise ValueError(f"Invalid target_loss={target_loss!r}: must be a finite number > 0")
    runs = [load_run(Path(d)) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    figures = compare(runs, target_loss)
    plot_loss(runs, out / "loss.png")
    plot_step_times(runs, out / "step_time.png")
    (out / "report.json").write_text(json.dumps(figures, indent=2))
    target = figures["target_loss"]
    lines = [
        f"# Training report ({figures['device']})",
        "",
        f"Target loss: {_fmt(target, '.4f')}"
        + (" (AdamW's final loss)" if target_loss is None and target is not None else "")
        + (" (AdamW's run diverged: its final loss is not finite; give --target-loss)"
           if figures["reference_diverged"] and target is None else "")
        + f". Final loss is the mean of the last {SMOOTHING} steps' training loss; time to target is the "
          f"training wall clock at the first step whose trailing {SMOOTHING}-step mean reaches it. Efficiency is "
          "(L_init - L_final) / (E / E_AdamW) with L_init = ln(vocabulary size) and E the run's GPU energy. "
          "Steady max/median counts the steps after the warm-up, (sync_refreshes + 1) x f, as `asteria bench` "
          "does.",
        "",
        *([f"**Runs of different vocabularies** ({_vocabulary_list(figures['vocabularies'])}): a loss is per token of "
           "its run's own vocabulary, so the losses, the target and the times to it compare only between runs of "
           "one vocabulary.", ""] if figures["mixed_vocabularies"] else []),
        "| run | steps | final loss | val loss | time to target (s) | vs AdamW | median step (ms) | steady max/median "
        "| energy/step vs AdamW | efficiency | refreshes | waits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in figures["runs"].items():
        lines.append(
            f"| {name} | {row['steps']} | {row['final_loss']:.4f} | {_fmt(row['final_val_loss'], '.4f')} | "
            f"{_fmt(row['time_to_target_seconds'], '.1f')} | {_fmt(row.get('time_to_target_vs_adamw'), '.2f')} | "
            f"{_fmt(row['median_step_seconds'], '.1f', 1e3)} | "
            f"{_fmt(row['steady_max_over_median'], '.2f')} | "
            f"{_fmt(row['energy_per_step_vs_adamw'], '.3f')} | {_fmt(row['efficiency'], '.3f')} | "
            f"{_fmt(row['refreshes'], '.0f')} | {_fmt(row['waits'], '.0f')} |")
    lines += ["", "![loss](loss.png)", "", "![step time](step_time.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
