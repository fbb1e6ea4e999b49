"""The report's figures. Training loss is drawn as the trailing mean that "final loss" and "time to target"
read, over the raw curve kept faint, with the target loss and where each run reaches it; validation loss
has its own panel. Only panels with data are drawn: without energy readings (a CPU) there is no energy
panel. The step-time plot shades each run's start-up, whose refreshes are waited for by design, so that
its spikes are not read as the steady cost."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from asteria.train.runs import Run  # noqa: E402


def join_and(items: Sequence[Any]) -> str:
    """``1, 2 and 3``."""
    words = [str(item) for item in items]
    return " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)


def _color(index: int) -> str:
    return f"C{index % 10}"


def _loss_panel(ax: Any, runs: Sequence[Run], labels: Sequence[str], x_of: str, target: float | None,
                target_name: str | None) -> None:
    """Training loss against the record key ``x_of`` (a trailing mean over the faint raw curve); where a
    target is given, its line and a dot where each run's trailing mean first reaches it."""
    for index, (label, run) in enumerate(zip(labels, runs)):
        xs = [r[x_of] for r in run.records]
        smoothed = run.smoothed()
        ax.plot(xs, [r["loss"] for r in run.records], color=_color(index), alpha=0.2, linewidth=0.7)
        ax.plot(xs, smoothed, color=_color(index), linewidth=1.6, label=label)
        if target is not None:
            reached = next((i for i, loss in enumerate(smoothed) if loss <= target), None)
            if reached is not None:
                ax.plot(xs[reached], smoothed[reached], "o", color=_color(index), markersize=6, zorder=3)
                if x_of == "step":
                    ax.annotate(f"step {xs[reached]}", (xs[reached], smoothed[reached]), textcoords="offset points",
                                xytext=(0, 8 + 10 * (index % 4)), ha="center", fontsize=8, color=_color(index))
    if target is not None:
        ax.axhline(target, color="0.35", linestyle="--", linewidth=0.9, label=f"{target_name} ({target:.3f})")


def plot_loss(runs: Sequence[Run], labels: Sequence[str], path: Path, smoothing: int, target: float | None = None,
              target_name: str | None = None) -> list[str]:
    """Writes the loss figure; returns its panels' titles (only those with data)."""
    has_val = any("val_loss" in r for run in runs for r in run.records)
    has_energy = any(run.has_energy for run in runs)
    titles = [f"training loss vs step ({smoothing}-step mean)"]
    titles += ["validation loss vs step"] * has_val + ["training loss vs wall clock"]
    titles += ["training loss vs GPU energy"] * has_energy
    fig, axes = plt.subplots(1, len(titles), figsize=(5 * len(titles), 4.2), squeeze=False)
    panels = dict(zip(titles, axes[0]))
    by_step = panels[titles[0]]
    _loss_panel(by_step, runs, labels, "step", target, target_name)
    by_step.set(xlabel="step", ylabel="training loss")
    by_time = panels["training loss vs wall clock"]
    _loss_panel(by_time, runs, labels, "wall", target, target_name)
    by_time.set(xlabel="training wall clock (s)", ylabel="training loss")
    if has_val:
        ax = panels["validation loss vs step"]
        for index, (label, run) in enumerate(zip(labels, runs)):
            evals = [r for r in run.records if "val_loss" in r]
            ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", color=_color(index),
                    markersize=4, label=label)
        ax.set(xlabel="step", ylabel="validation loss (held-out batches)")
    if has_energy:
        ax = panels["training loss vs GPU energy"]
        for index, (label, run) in enumerate(zip(labels, runs)):
            if run.has_energy:
                energy = [e / 1000 for e in run.cumulative_energy()]
                ax.plot(energy, [r["loss"] for r in run.records], color=_color(index), alpha=0.2, linewidth=0.7)
                ax.plot(energy, run.smoothed(), color=_color(index), linewidth=1.6, label=label)
        ax.set(xlabel="GPU energy (kJ)", ylabel="training loss")
    for title, ax in panels.items():
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.25)
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return titles


def plot_step_times(runs: Sequence[Run], labels: Sequence[str], path: Path,
                    startups: Sequence[dict[str, Any] | None]) -> list[str]:
    """Writes the step-time figure; ``startups`` holds per run None or ``{"steps": the start-up's last
    step, "refresh_steps": the steps of its waited-for start-up refreshes}``. Returns the legend's entries."""
    fig, ax = plt.subplots(figsize=(11, 3.8))
    shaded: set[int] = set()
    for index, (label, run, startup) in enumerate(zip(labels, runs, startups)):
        ax.plot([r["step"] for r in run.records], [1e3 * r["step_time"] for r in run.records], label=label,
                color=_color(index), linewidth=0.8)
        if startup is None:
            continue
        if startup["steps"] not in shaded:
            shaded.add(startup["steps"])
            ax.axvspan(0.5, startup["steps"] + 0.5, color=_color(index), alpha=0.08,
                       label=f"start-up of {label} (steps 1-{startup['steps']})")
        for step in startup["refresh_steps"]:
            ax.axvline(step, color=_color(index), linestyle=":", linewidth=0.9)
        if startup["refresh_steps"]:
            ax.text(startup["refresh_steps"][-1] + 1, 0.97, f"{label}: start-up refreshes waited for\n"
                    f"at steps {join_and(startup['refresh_steps'])}", transform=ax.get_xaxis_transform(),
                    va="top", fontsize=7, color=_color(index))
    set_up = [(index, run.records[0]) for index, run in enumerate(runs) if run.records[0]["step"] == 1
              and run.records[0]["step_time"] > 2 * statistics.median(r["step_time"] for r in run.records)]
    for index, first in set_up:  # a step 1 that stands out: the set-up, in the legend rather than over the curves
        ax.plot(1, 1e3 * first["step_time"], "x", color=_color(index), markersize=7,
                label="step 1: set-up" if index == set_up[0][0] else None)
    ax.set(xlabel="step", ylabel="step time (ms)", title="step-time series (wall clock)", yscale="log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:e}"[0] in "25" else ""))
    ax.tick_params(axis="y", which="both", labelsize=8)
    ax.grid(alpha=0.25, which="both")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [text.get_text() for text in ax.get_legend().get_texts()]
