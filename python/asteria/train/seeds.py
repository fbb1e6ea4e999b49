"""``asteria bench --seeds``: the same comparison repeated over seeds, and Asteria's loss against native's
paired by seed.

One 250-step run of a 160M model differs from a repeat with other rounding by several percent of loss,
so "Asteria's loss is within 1% of native's" can only be judged over seeds: each seed's ``asteria
bench`` lands in ``DIR/seed<S>/``, and ``DIR/seeds.json`` and ``DIR/seeds.md`` gather every config's
final and validation loss per seed, their mean and sample standard deviation, the energy per step
relative to AdamW, and for every ``X-async`` run beside its ``X-sync`` run the relative difference
(async / sync - 1) per seed with its mean, standard deviation and how many seeds had Asteria behind.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from asteria.train.bench import run_bench
from asteria.train.loop import RunConfig


def _spread(values: list[float]) -> dict[str, float | int | None]:
    """Mean, sample standard deviation (None for one value), min, max and count."""
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values), "n": len(values)}


def summarize(per_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The seeds' ``results.json`` contents (seed -> results) gathered per config and per native/Asteria
    pair."""
    seeds = sorted(per_seed)
    labels = list(per_seed[seeds[0]]["runs"])
    configs: dict[str, Any] = {}
    for label in labels:
        runs = {seed: per_seed[seed]["runs"][label] for seed in seeds}
        row: dict[str, Any] = {"final_loss": {str(s): r["final_loss"] for s, r in runs.items()},
                               "final_val_loss": {str(s): r["final_val_loss"] for s, r in runs.items()}}
        row["final_loss_stats"] = _spread(list(row["final_loss"].values()))
        vals = [v for v in row["final_val_loss"].values() if v is not None]
        row["final_val_loss_stats"] = _spread(vals) if vals else None
        energy = [r["energy_vs_adamw"] for r in runs.values() if "energy_vs_adamw" in r]
        row["energy_vs_adamw_stats"] = _spread(energy) if energy else None
        configs[label] = row
    pairs: dict[str, Any] = {}
    for label in labels:
        if not label.endswith("-async") or label.replace("-async", "-sync") not in labels:
            continue
        native = label.replace("-async", "-sync")
        pair: dict[str, Any] = {"native": native}
        for key in ("final_loss", "final_val_loss"):
            deltas = {str(seed): per_seed[seed]["runs"][label][key] / per_seed[seed]["runs"][native][key] - 1.0
                      for seed in seeds if per_seed[seed]["runs"][label][key] is not None
                      and per_seed[seed]["runs"][native][key] is not None}
            pair[key] = {"per_seed": deltas,
                         "stats": _spread(list(deltas.values())) if deltas else None,
                         "asteria_behind": sum(d > 0 for d in deltas.values())}
        pairs[label] = pair
    return {"seeds": seeds, "configs": configs, "pairs": pairs}


def _fmt(stats: dict[str, Any] | None, spec: str, percent: bool = False) -> str:
    if stats is None:
        return "n/a"
    scale, unit = (100.0, "%") if percent else (1.0, "")
    sd = "" if stats["sd"] is None else f" ± {scale * stats['sd']:{spec}}{unit}"
    return f"{scale * stats['mean']:{'+' if percent else ''}{spec}}{unit}{sd}"


def format_markdown(summary: dict[str, Any], device: str) -> str:
    seeds = summary["seeds"]
    lines = [f"# `asteria bench` over seeds {', '.join(map(str, seeds))} ({device})", "",
             "Mean ± sample standard deviation over the seeds. Final loss: the mean of the last 10 steps' "
             "training loss.", "",
             "| config | final loss | val loss | energy/step vs AdamW |", "|---|---|---|---|"]
    for label, row in summary["configs"].items():
        lines.append(f"| {label} | {_fmt(row['final_loss_stats'], '.4f')} | {_fmt(row['final_val_loss_stats'], '.4f')} "
                     f"| {_fmt(row['energy_vs_adamw_stats'], '.3f')} |")
    if summary["pairs"]:
        lines += ["", "Asteria against native, paired by seed (async / sync - 1):", "",
                  "| config | val loss per seed | val loss | final loss | seeds with Asteria behind (val) |",
                  "|---|---|---|---|---|"]
        for label, pair in summary["pairs"].items():
            val = pair["final_val_loss"]
            per_seed = ", ".join(f"{seed}: {100 * d:+.1f}%" for seed, d in val["per_seed"].items()) or "n/a"
            lines.append(f"| {label} vs {pair['native']} | {per_seed} | {_fmt(val['stats'], '.2f', True)} | "
                         f"{_fmt(pair['final_loss']['stats'], '.2f', True)} | "
                         f"{val['asteria_behind']} of {len(val['per_seed'])} |")
    return "\n".join(lines) + "\n"


def run_seeds(base: RunConfig, out: Path, configs: tuple[str, ...], seeds: list[int],
              progress: bool = True) -> dict[str, Any]:
    """``run_bench`` once per seed into ``out/seed<S>``, then the gathered comparison (``seeds.json``,
    ``seeds.md``)."""
    if not seeds or len(set(seeds)) != len(seeds) or any(not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"Invalid seeds={seeds!r}: must be distinct integers >= 0")
    per_seed = {seed: run_bench(replace(base, seed=seed), out / f"seed{seed}", configs, progress=progress)
                for seed in seeds}
    summary = summarize(per_seed)
    device = per_seed[seeds[0]]["device"]
    (out / "seeds.json").write_text(json.dumps({"device": device} | summary, indent=2))
    (out / "seeds.md").write_text(format_markdown(summary, device))
    return summary | {"device": device}
