"""Where in a run Asteria's loss gap to native opens: the training-loss ratio of each paired seed in
windows of steps, with its mean and standard error over the seeds (``tools/seeds.py`` prints it under
the final-loss comparison and plots it into ``gap.png``). A helper of ``seeds.py``, with no command of its own.

The final validation loss of one 250-step run scatters by about 2% between the two arms of a seed, but
the same runs' training losses in the middle of the run separate much more clearly: a delay in the
preconditioners shows there first, and the cosine schedule's small last steps bring the arms back
together. The windows make that visible, seed by seed and pooled.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from asteria.train.report import plt
from asteria.train.runs import load_run

#: how many windows a run's steps are split into
WINDOWS = 10
#: the key under which ``seeds.gather`` and ``run_seeds`` give each bench row the folder of its run
RUN_DIR = "run_dir"
#: why a seed has no gap when its bench rows came without their run folders (results.json alone)
NO_RUN_FOLDER = "no run folder with its metrics.jsonl"


def losses(rows: list[dict[str, Any]], cache: dict[str, dict[int, float] | str] | None = None
           ) -> dict[int, float] | str:
    """Step -> training loss of the runs of one config and seed (the mean over its runs, on the steps every
    run recorded), or why there is none: a row without a run folder, a run whose files cannot be read (its
    final losses still count), or runs that share no step. ``cache`` keeps each run's series by folder."""
    cache = {} if cache is None else cache
    series = []
    for row in rows:
        if not row.get(RUN_DIR):
            return NO_RUN_FOLDER
        folder = row[RUN_DIR]
        if folder not in cache:
            try:
                cache[folder] = {r["step"]: float(r["loss"]) for r in load_run(Path(folder)).records}
            except (OSError, ValueError) as error:
                cache[folder] = str(error)
        if isinstance(cache[folder], str):
            return cache[folder]
        series.append(cache[folder])
    common = set.intersection(*(set(s) for s in series)) if series else set()
    if not common:
        return "its runs share no step"
    return {step: math.fsum(s[step] for s in series) / len(series) for step in sorted(common)}


def windows(steps: list[int], count: int = WINDOWS) -> list[list[int]]:
    """``steps`` (sorted) split into at most ``count`` consecutive windows of near-equal length."""
    count = max(1, min(count, len(steps)))
    bounds = [round(i * len(steps) / count) for i in range(count + 1)]
    return [steps[bounds[i]:bounds[i + 1]] for i in range(count)]


def seed_gaps(ours: dict[int, float], theirs: dict[int, float], count: int = WINDOWS
              ) -> tuple[list[list[int]], list[float]] | None:
    """Per window of the steps both runs recorded: mean(ours) / mean(theirs) - 1, and the windows' first and
    last steps; None when they share no step or a loss is not finite (a diverged run, named elsewhere)."""
    steps = sorted(set(ours) & set(theirs))
    if not steps:
        return None
    parts = windows(steps, count)
    gaps = []
    for part in parts:
        mine, native = math.fsum(ours[s] for s in part), math.fsum(theirs[s] for s in part)
        if not (math.isfinite(mine) and math.isfinite(native)) or native == 0.0:
            return None
        gaps.append(mine / native - 1.0)
    return [[part[0], part[-1]] for part in parts], gaps


def gap_over_run(per_seed: dict[int, dict[str, list[dict[str, Any]]]],
                 reference: dict[int, dict[str, list[dict[str, Any]]]], pairs: dict[str, str],
                 count: int = WINDOWS) -> dict[str, Any]:
    """For each ``label -> native label`` of ``pairs``: the windows (first and last step) and each seed's gap
    per window, over the seeds whose two runs recorded the same steps. Seeds left out (no run folder, other
    steps, a loss not finite) are listed with the reason; the caller adds the statistics per window."""
    result: dict[str, Any] = {}
    cache: dict[str, dict[int, float] | str] = {}  # a native run paired with several configs is read once
    for label, native in pairs.items():
        found: dict[str, tuple[list[list[int]], list[float]]] = {}
        left_out: dict[str, str] = {}
        for seed in sorted(set(per_seed) & set(reference)):
            if label not in per_seed[seed] or native not in reference[seed]:
                continue
            ours, theirs = losses(per_seed[seed][label], cache), losses(reference[seed][native], cache)
            if isinstance(ours, str) or isinstance(theirs, str):
                left_out[str(seed)] = ours if isinstance(ours, str) else theirs
                continue
            gaps = seed_gaps(ours, theirs, count)
            if gaps is None:
                left_out[str(seed)] = "no common steps, or a loss that is not finite"
            else:
                found[str(seed)] = gaps
        # The windows most seeds share (the first seed's on a tie); a seed of other steps is another experiment.
        spans = max((spans for spans, _ in found.values()), default=[],
                    key=lambda w: sum(other == w for other, _ in found.values()))
        per: dict[str, list[float]] = {}
        for seed, (windows_of_seed, gaps) in found.items():
            if windows_of_seed == spans:
                per[seed] = gaps
            else:
                left_out[seed] = (f"other steps ({windows_of_seed[0][0]}-{windows_of_seed[-1][-1]} against the other "
                                  f"seeds' {spans[0][0]}-{spans[-1][-1]})")
        result[label] = {"native": native, "windows": spans, "per_seed": per,
                         "left_out": dict(sorted(left_out.items(), key=lambda item: int(item[0])))}
    return result


def format_gap(gap: dict[str, Any], baseline_suffix: str = "") -> list[str]:
    """Markdown lines: one row per pair, the mean ± SE of the gap in each window (``stats``: one
    ``seeds.spread_stats`` per window)."""
    lines: list[str] = []
    headed = False
    for label, entry in gap.items():
        reasons = [f"- seed {seed} left out of the gap over the run: {why}" for seed, why in entry["left_out"].items()]
        if not entry["windows"]:
            # Results without their run folders have no gap to show; any other reason is named.
            if any(why != NO_RUN_FOLDER for why in entry["left_out"].values()):
                lines += ["", f"No training-loss gap over the run for {label} vs {entry['native']}{baseline_suffix}:",
                          *reasons]
            continue
        if not headed:
            lines += ["", "Training-loss gap over the run, paired by seed (mean training loss of each window of steps, "
                      "config / native - 1), mean ± standard error over the seeds:", ""]
            headed = True
        heads = " | ".join(f"steps {a}-{b}" for a, b in entry["windows"])
        cells = " | ".join(_cell(stats) for stats in entry["stats"])
        lines += [f"| config | seeds | {heads} |", "|---" * (len(entry["windows"]) + 2) + "|",
                  f"| {label} vs {entry['native']}{baseline_suffix} | {len(entry['per_seed'])} | {cells} |", ""]
        lines += reasons
    return lines


def _cell(stats: dict[str, Any]) -> str:
    if stats["mean"] is None:
        return "n/a"
    se = "" if stats["se"] is None else f" ± {100 * stats['se']:.2f}"
    return f"{100 * stats['mean']:+.2f}{se}%"


def plot_gap(gap: dict[str, Any], path: Path) -> bool:
    """The mean gap per window with its ± SE band and each seed's line, one panel per pair, into ``path``;
    False (nothing written) when no pair has windows."""
    entries = {label: entry for label, entry in gap.items() if entry["windows"]}
    if not entries:
        return False
    fig, axes = plt.subplots(len(entries), 1, figsize=(9, 3.2 * len(entries)), squeeze=False)
    for ax, (label, entry) in zip(axes[:, 0], entries.items()):
        middles = [(a + b) / 2 for a, b in entry["windows"]]
        for seed, gaps in entry["per_seed"].items():
            ax.plot(middles, [100 * g for g in gaps], color="0.75", linewidth=0.7)
        means = [100 * s["mean"] for s in entry["stats"]]
        ses = [100 * (s["se"] or 0.0) for s in entry["stats"]]
        ax.fill_between(middles, [m - e for m, e in zip(means, ses)], [m + e for m, e in zip(means, ses)],
                        alpha=0.3, label="mean ± SE")
        ax.plot(middles, means, marker="o", linewidth=1.5, label=f"mean over {len(entry['per_seed'])} seeds")
        ax.axhline(0.0, color="black", linewidth=0.6)
        ax.set_title(f"{label} vs {entry['native']}: training loss / native - 1 (grey: each seed)", fontsize=9,
                     loc="left")
        ax.set_ylabel("%")
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
