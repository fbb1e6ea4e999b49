"""Reports over finished runs: a verdict line (steps and time to AdamW's final loss, step cost), each
run's settings, a Markdown table with final loss, steps and time to a target loss, energy per step
relative to AdamW and the normalized loss-reduction efficiency (L_init - L_final) / (E / E_AdamW),
L_init = ln(vocabulary size), and the figures of ``report_plots``.

Where a run has no energy readings (the CPU, or a GPU without NVML's energy counter) the energy
columns say "n/a" and the figures leave energy out; no number is made up.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

from asteria.train.report_plots import join_and, plot_loss, plot_step_times, plt  # noqa: F401 (plt: for bench, tools)
from asteria.train.run_config import ASTERIA_OPTIMIZERS
from asteria.train.runs import SMOOTHING, Run, load_run, steady_warmup


def run_warmup(run: Run) -> int:
    """``steady_warmup`` of the run's own configuration (one sync refresh for runs older than the setting)."""
    config = run.summary.get("config") or {}
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


def run_settings(run: Run) -> dict[str, Any] | None:
    """What the run was: optimizer, mode, model preset, S, f and sync refreshes from its config (None for a
    setting the optimizer does not read: AdamW reads none of them, a sync or peer run no S); None where the
    summary holds no config."""
    config = run.summary.get("config")
    if not config:
        return None
    optimizer = config.get("optimizer")
    asteria_async = optimizer in ASTERIA_OPTIMIZERS and config.get("mode") == "async"
    return {"optimizer": optimizer, "mode": config.get("mode") if optimizer in ASTERIA_OPTIMIZERS else None,
            "model": config.get("model"), "parameters": run.summary.get("parameters"),
            "staleness": config.get("staleness") if asteria_async else None,
            "precondition_frequency": config.get("precondition_frequency") if optimizer != "adamw" else None,
            "sync_refreshes": config.get("sync_refreshes") if asteria_async else None}


def run_startup(run: Run) -> dict[str, Any] | None:
    """An async Asteria run's start-up: its last step (``run_warmup``) and the steps f, 2f ... of the
    ``sync_refreshes`` first versions of every set, which it waits for by design. None for other runs:
    AdamW has none, and sync and peer runs wait for every refresh."""
    settings = run_settings(run)
    if settings is None or settings["staleness"] is None:
        return None
    last, f = run.records[-1]["step"], settings["precondition_frequency"] or 10  # run_warmup's defaults
    count = 1 if settings["sync_refreshes"] is None else settings["sync_refreshes"]
    return {"steps": min(run_warmup(run), last), "refresh_steps": [k * f for k in range(1, count + 1) if k * f <= last]}


def compare(runs: list[Run], target_loss: float | None = None) -> dict[str, Any]:
    """The report's figures per run (the JSON behind the Markdown table) and its verdict."""
    reference = next((r for r in runs if r.label == "adamw"), None)
    diverged_reference = reference is not None and not math.isfinite(reference.summary["final_loss"])
    target_is_adamw = target_loss is None and reference is not None and not diverged_reference
    if target_is_adamw:
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
            "device": s["device"],
            "settings": run_settings(run),
            "startup": run_startup(run),
            "final_loss": s["final_loss"],
            "final_val_loss": s.get("final_val_loss"),
            "steps": run.records[-1]["step"],
            "wall_seconds": run.records[-1]["wall"],
            "median_step_seconds": s.get("median_step_seconds"),
            "max_step_seconds": s.get("max_step_seconds"),
            "steady_max_over_median": steady_max_over_median(run),
            "initial_loss": l_init,
            "vocab_size": s.get("vocab_size"),
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
    figures = {"device": ", ".join(devices), "target_loss": target_loss, "target_is_adamw_final_loss": target_is_adamw,
               "reference": "adamw" if reference is not None else None,
               "reference_run": names[runs.index(reference)] if reference is not None else None, "runs": rows,
               "reference_diverged": diverged_reference, "vocabularies": vocabularies,
               "mixed_vocabularies": len({v for v in vocabularies.values() if v is not None}) > 1}
    return figures | {"verdict": verdict(figures)}


def verdict(figures: dict[str, Any]) -> list[str]:
    """One sentence per run against AdamW (or, without an AdamW run, against the target loss): steps to the
    target, the median step's cost and what the two make of the wall clock. Claims only what the figures
    hold: a run that never reaches the target, a diverged run or a missing reference is said as such."""
    rows, target, ref_name = figures["runs"], figures["target_loss"], figures["reference_run"]
    if target is None:
        if figures["reference_diverged"]:
            return ["AdamW's run diverged (its final loss is not finite), so there is no loss to reach: give "
                    "--target-loss."]
        return ["No AdamW run among these runs and no --target-loss, so there is no loss to reach; the table gives "
                "each run's own figures."]
    goal = (f"AdamW's final loss ({target:.4f})" if figures["target_is_adamw_final_loss"] else
            f"the target loss {target:.4f}")
    if list(rows) == [ref_name]:
        row = rows[ref_name]
        return [f"AdamW alone: it reached {goal} at step {row['steps_to_target']} of {row['steps']}; no other run to "
                "compare it with." if row["steps_to_target"] is not None else
                f"AdamW alone: it did not reach {goal} in its {row['steps']} steps."]
    ref = rows.get(ref_name)
    return [_run_verdict(name, row, ref, goal) for name, row in rows.items() if name != ref_name]


def _run_verdict(name: str, row: dict[str, Any], ref: dict[str, Any] | None, goal: str) -> str:
    """The verdict's sentence for one run; ``ref`` is AdamW's row (None without an AdamW run)."""
    if not math.isfinite(row["final_loss"]):
        return f"{name} diverged (its final loss is {row['final_loss']})."
    vocabularies = (row["vocab_size"], ref["vocab_size"]) if ref is not None else (None,)
    if None not in vocabularies and vocabularies[0] != vocabularies[1]:
        return (f"{name} trained over another vocabulary ({row['vocab_size']} tokens, AdamW {ref['vocab_size']}): its "
                "loss does not compare with AdamW's.")
    steps, ref_steps = row["steps_to_target"], ref["steps_to_target"] if ref else None
    if steps is None:
        text = f"{name} did not reach {goal} in its {row['steps']} steps (its final loss: {row['final_loss']:.4f})"
    else:
        text = f"{name} reached {goal} at step {steps} of {row['steps']}"
    if ref is not None and steps is not None:
        if ref_steps is None:
            text += f"; AdamW did not reach it in its {ref['steps']} steps"
        else:
            ratio = steps / ref_steps
            text += f", AdamW at step {ref_steps}: " + (f"{1 - ratio:.0%} fewer steps" if ratio < 1 else
                                                        f"{ratio - 1:.0%} more steps" if ratio > 1 else "as many steps")
    median, ref_median = row["median_step_seconds"], ref["median_step_seconds"] if ref else None
    if not (median and ref_median):
        return text + "."
    cost = median / ref_median
    where = (("on this CPU" if row["device"] == "cpu" else f"on {row['device']}") if row["device"] == ref["device"]
             else f"({row['device']} vs AdamW's {ref['device']})")
    text += f". Its median step took {cost:.2f}x AdamW's {where}"
    if steps is None or ref_steps is None:
        return text + "."
    estimate = steps / ref_steps * cost
    text += (f", so at median step times it needed {estimate:.2f}x AdamW's time to get there: "
             + ("about even" if abs(estimate - 1) < 0.05 else "faster" if estimate < 1 else "slower")
             + " in wall clock")
    measured = row.get("time_to_target_vs_adamw")
    if measured is not None:
        text += f" (measured: {row['time_to_target_seconds']:.1f} s vs {ref['time_to_target_seconds']:.1f} s"
        if abs(estimate - 1) >= 0.05 and (measured < 1) != (estimate < 1):
            text += ", which also counts start-up and uneven steps; see steady max/median"
        text += ")"
    return text + "."


def _vocabulary_list(vocabularies: dict[str, int | None]) -> str:
    """``label: size`` per run (``n/a`` where the run's summary gives an initial loss bound instead; such a
    run is not counted as another vocabulary)."""
    return ", ".join(f"{name}: {'n/a' if size is None else size}" for name, size in vocabularies.items())


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value if scale == 1 else value * scale, spec)


def _settings_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Each run's optimizer, mode, model, S, f and sync refreshes ("-" where the optimizer does not read one,
    "n/a" where the run's summary holds no config)."""
    lines = ["| run | optimizer | mode | model | S (staleness) | f (refresh interval, steps) | sync refreshes |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        s = row["settings"]
        if s is None:
            lines.append(f"| {name} |" + " n/a |" * 6)
            continue
        model = f"{s['model'] or 'n/a'}" + (f" ({s['parameters'] / 1e6:.2f}M parameters)" if s["parameters"] else "")
        cells = [s["optimizer"], s["mode"], model, s["staleness"], s["precondition_frequency"], s["sync_refreshes"]]
        lines.append(f"| {name} | " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return lines


def _startup_note(rows: dict[str, dict[str, Any]]) -> str:
    """The sentence that reads the step-time plot's early spikes as start-up, per async Asteria run."""
    note = "The step-time plot's first spikes are start-up, not the steady cost: step 1 sets up the model and the "
    groups: dict[tuple[tuple[int, ...], int], list[str]] = {}
    for name, row in rows.items():
        if row["startup"] is not None:
            groups.setdefault((tuple(row["startup"]["refresh_steps"]), row["startup"]["steps"]), []).append(name)
    if not groups:
        return note + "optimizer's state; the median step leaves it out."
    parts = []
    for (refresh_steps, last), names in groups.items():
        waits = (f"waits for its first {len(refresh_steps)} refreshes of every factor set at steps "
                 f"{join_and(refresh_steps)} (sync_refreshes: a late basis costs most while the factors "
                 "are young)" if refresh_steps else "computes its first refreshes")
        parts.append(f"{' and '.join(names)} {waits}, so its steps 1-{last} are shaded there as start-up")
    return (note + "optimizer's state, and " + "; ".join(parts)
            + ". Steady max/median leaves the start-up out, the median step only step 1.")


def write_report(run_dirs: list[Path], out: Path, target_loss: float | None = None) -> Path:
    """Writes ``out/report.md``, ``out/report.json``, ``out/loss.png`` and ``out/step_time.png``;
    returns the Markdown path. ``target_loss`` defaults to AdamW's final loss when an AdamW run is
    among the runs."""
    if target_loss is not None and not (math.isfinite(target_loss) and target_loss > 0):
        raise ValueError(f"Invalid target_loss={target_loss!r}: must be a finite number > 0")
    runs = [load_run(Path(d)) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    figures = compare(runs, target_loss)
    target, rows = figures["target_loss"], figures["runs"]
    goal = "AdamW's loss" if figures["target_is_adamw_final_loss"] else "target"
    plot_loss(runs, list(rows), out / "loss.png", SMOOTHING, target, "AdamW's final loss"
              if figures["target_is_adamw_final_loss"] else "target loss")
    plot_step_times(runs, list(rows), out / "step_time.png", [row["startup"] for row in rows.values()])
    (out / "report.json").write_text(json.dumps(figures, indent=2))
    verdicts = figures["verdict"]
    lines = [
        f"# Training report ({figures['device']})",
        "",
        *([f"**Verdict:** {verdicts[0]}"] if len(verdicts) == 1 else
          ["**Verdict:**", "", *(f"- {v}" for v in verdicts)]),
        "",
        *_settings_table(rows),
        "",
        f"Target loss: {_fmt(target, '.4f')}"
        + (" (AdamW's final loss)" if figures["target_is_adamw_final_loss"] else "")
        + (" (AdamW's run diverged: its final loss is not finite; give --target-loss)"
           if figures["reference_diverged"] and target is None else "")
        + f". Final loss is the mean of the last {SMOOTHING} steps' training loss; steps and time to {goal} are "
          f"those of the first step whose trailing {SMOOTHING}-step mean reaches it (training wall clock, start-up "
          "included). Efficiency is (L_init - L_final) / (E / E_AdamW) with L_init = ln(vocabulary size) and E the "
          "run's GPU energy. Steady max/median counts the steps after the warm-up, (sync_refreshes + 1) x f, as "
          "`asteria bench` does.",
        "",
        *([f"**Runs of different vocabularies** ({_vocabulary_list(figures['vocabularies'])}): a loss is per token of "
           "its run's own vocabulary, so the losses, the target and the times to it compare only between runs of "
           "one vocabulary.", ""] if figures["mixed_vocabularies"] else []),
        f"| run | steps | final loss | val loss | steps to {goal} | time to {goal} (s) | time vs AdamW "
        "| median step (ms) | steady max/median | energy/step vs AdamW | efficiency | refreshes | waits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['steps']} | {row['final_loss']:.4f} | {_fmt(row['final_val_loss'], '.4f')} | "
            f"{_fmt(row['steps_to_target'], 'd')} | {_fmt(row['time_to_target_seconds'], '.1f')} | "
            f"{_fmt(row.get('time_to_target_vs_adamw'), '.2f')} | {_fmt(row['median_step_seconds'], '.1f', 1e3)} | "
            f"{_fmt(row['steady_max_over_median'], '.2f')} | "
            f"{_fmt(row['energy_per_step_vs_adamw'], '.3f')} | {_fmt(row['efficiency'], '.3f')} | "
            f"{_fmt(row['refreshes'], '.0f')} | {_fmt(row['waits'], '.0f')} |")
    lines += ["", _startup_note(rows), "", "![loss](loss.png)", "", "![step time](step_time.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
