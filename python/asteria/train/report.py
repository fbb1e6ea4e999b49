"""Reports over finished runs: a Markdown table and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def write_report(run_dirs: list[Path], out: Path) -> Path:
    """Writes ``out/report.md``, ``out/loss.png`` and ``out/step_time.png``; returns the Markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    runs = [load_run(d) for d in run_dirs]
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for summary, records in runs:
        steps = [r["step"] for r in records]
        by_step.plot(steps, [r["loss"] for r in records], label=summary["label"], alpha=0.8)
        by_time.plot([r["wall"] for r in records], [r["loss"] for r in records], label=summary["label"], alpha=0.8)
    by_step.set(xlabel="step", ylabel="training loss", title="loss vs step")
    by_time.set(xlabel="wall clock (s)", ylabel="training loss", title="loss vs wall clock")
    by_step.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 3.5))
    for summary, records in runs:
        ax.plot([r["step"] for r in records], [1e3 * r["step_time"] for r in records], label=summary["label"])
    ax.set(xlabel="step", ylabel="step time (ms)", title="step-time profile", yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=120)
    plt.close(fig)

    lines = [
        f"# Training report ({runs[0][0]['device']})",
        "",
        "| run | final loss | val loss | median step (ms) | max step (ms) | max/median | wall (s) "
        "| refreshes | waits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for summary, _ in runs:
        stats = summary.get("runtime_stats", {})
        median, peak = summary["median_step_seconds"], summary["max_step_seconds"]
        lines.append(
            f"| {summary['label']} | {summary['final_loss']:.4f} | {summary['final_val_loss']:.4f} | "
            f"{1e3 * median:.1f} | {1e3 * peak:.1f} | {peak / median:.2f} | {summary['wall_seconds']:.1f} | "
            f"{stats.get('refreshes', '-')} | {stats.get('waits', '-')} |"
        )
    lines += ["", "![loss](loss.png)", "", "![step time](step_time.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
