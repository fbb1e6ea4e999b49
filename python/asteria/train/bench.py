"""``asteria bench``: every optimizer × mode on the same model, batch, seed and f, side by side.

Writes ``DIR/<config>/`` runs, ``DIR/results.json`` (per config: step-time median, p99, max and
max/median; peak GPU memory; energy per step; final loss; ratios to AdamW) and the report's plots.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from asteria.train.loop import RunConfig, train
from asteria.train.report import write_report

CONFIGS = ("adamw", "shampoo-sync", "shampoo-async", "soap-sync", "soap-async", "kl-shampoo-sync",
           "kl-shampoo-async")
DEFAULT_LR = {"adamw": 3e-3, "shampoo": 3e-3, "soap": 3e-3, "kl-shampoo": 1e-2}


def parse_config(label: str) -> tuple[str, str]:
    """'soap-async' -> ('soap', 'async'); 'adamw' -> ('adamw', 'sync')."""
    if label not in CONFIGS:
        raise ValueError(f"Invalid config={label!r}: must be one of {CONFIGS}")
    if label == "adamw":
        return "adamw", "sync"
    optimizer, mode = label.rsplit("-", 1)
    return optimizer, mode


def run_bench(base: RunConfig, out: Path, configs: tuple[str, ...] = CONFIGS, progress: bool = True) -> dict[str, Any]:
    """Trains each config with ``base``'s model, data and schedule and writes the comparison."""
    out.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for label in configs:
        optimizer, mode = parse_config(label)
        cfg = RunConfig(**(asdict(base) | {"optimizer": optimizer, "mode": mode,
                                            "lr": base.lr or DEFAULT_LR[optimizer]}))
        summaries[label] = train(cfg, out / label, progress=progress)
    reference = summaries.get("adamw")
    rows = {}
    for label, s in summaries.items():
        row = {
            "final_loss": s["final_loss"],
            "median_step_seconds": s["median_step_seconds"],
            "p99_step_seconds": s["p99_step_seconds"],
            "max_step_seconds": s["max_step_seconds"],
            "max_over_median": s["max_step_seconds"] / s["median_step_seconds"],
            "peak_gpu_bytes": s["peak_gpu_bytes"],
            "energy_joules_per_step": s["energy_joules_per_step"],
            "waits": s["runtime_stats"].get("waits"),
            "max_staleness_seen": s["runtime_stats"].get("max_staleness_seen"),
        }
        if reference is not None:
            row["median_step_vs_adamw"] = s["median_step_seconds"] / reference["median_step_seconds"]
            if s["energy_joules_per_step"] and reference["energy_joules_per_step"]:
                row["energy_vs_adamw"] = s["energy_joules_per_step"] / reference["energy_joules_per_step"]
        rows[label] = row
    results = {"device": next(iter(summaries.values()))["device"], "config": asdict(base), "runs": rows}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    write_report([out / label for label in configs], out)
    return results


def format_table(results: dict[str, Any]) -> str:
    lines = [f"device: {results['device']}",
             f"{'config':<18} {'loss':>7} {'median ms':>10} {'p99 ms':>8} {'max ms':>8} {'max/med':>8} "
             f"{'vs adamw':>9} {'J/step':>8} {'peak GB':>8} {'waits':>6}"]
    for label, r in results["runs"].items():
        energy = f"{r['energy_joules_per_step']:.2f}" if r["energy_joules_per_step"] else "-"
        peak = f"{r['peak_gpu_bytes'] / 2**30:.2f}" if r["peak_gpu_bytes"] else "-"
        lines.append(f"{label:<18} {r['final_loss']:>7.4f} {1e3 * r['median_step_seconds']:>10.1f} "
                     f"{1e3 * r['p99_step_seconds']:>8.1f} {1e3 * r['max_step_seconds']:>8.1f} "
                     f"{r['max_over_median']:>8.2f} {r.get('median_step_vs_adamw', float('nan')):>8.2f}x "
                     f"{energy:>8} {peak:>8} {r['waits'] if r['waits'] is not None else '-':>6}")
    return "\n".join(lines)
