"""Asteria's loss against native's over seeds: ``asteria bench`` repeated per seed, or bench results
already on disk gathered, and the configs compared paired by seed. An experiment tool, kept out of the
package (the library never imports it)::

    python tools/seeds.py run --seeds 1 2 3 --out DIR [--configs ...] [asteria bench's options]
    python tools/seeds.py gather RUNS... [--baseline RUNS...] --out DIR

(importable as ``seeds`` with ``tools/`` on ``sys.path``; ``main(argv)`` is the command).

One 250-step run of a 160M model differs from a repeat with other rounding by several percent of loss,
so "Asteria's loss is within 1% of native's" can only be judged over seeds: ``run`` lands each seed's
``asteria bench`` in ``DIR/seed<S>/``, and ``DIR/seeds.json`` and ``DIR/seeds.md`` gather every config's
final and validation loss per seed, their mean and sample standard deviation, the energy per step
relative to AdamW, and for every ``X-async`` run beside its ``X-sync`` run (``X-async-f<N>``, a run at
another refresh frequency, beside ``X-sync-f<N>`` if there is one, else ``X-sync``) the relative difference
(async / sync - 1) per seed with its mean, standard error, 95% interval, how many seeds had Asteria
behind and whether the interval puts Asteria within 1% of native, and where in the run the gap opens
(``gap.py``: the training-loss gap per tenth of the run, plotted into ``DIR/gap.png``).

``gather`` does the same from bench results already on disk (several calls or machines; several runs of
one seed count as one seed at their mean): native runs of one seed differ by up to a few percent between
runs too, so more runs per seed narrow the interval. With ``--baseline``, every config of RUNS is compared
with the baseline runs' native config instead (the settings in which the two differ are listed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from gap import RUN_DIR, format_gap, gap_over_run, plot_gap

from asteria.config import is_int
from asteria.train.bench import CONFIGS, PEER_CONFIGS, native_pairs, parse_config, run_bench
from asteria.train.checkpoint import interrupted
from asteria.train.cli import add_run_arguments, bench_base, out_dir
from asteria.train.run_config import LEGACY_SETTINGS, RunConfig, resolved_stagger_split
from asteria.train.runs import is_number

#: two-sided 95% quantiles of Student's t for 1 to 30 degrees of freedom (beyond: ``_t95``'s expansion)
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
#: the bound on Asteria's loss relative to native's that the verdict checks (1%)
LOSS_TOLERANCE = 0.01
#: how a baseline's configs are listed beside the runs compared with them
BASELINE = " (baseline)"


def _t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom: the table up to 30, then
    the Cornish-Fisher expansion around the normal's 1.95996 (2.0423 at 30, 1.9799 at 120)."""
    if df <= len(T95):
        return T95[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def spread_stats(values: list[float]) -> dict[str, Any]:
    """Mean, sample standard deviation, standard error of the mean and its 95% interval (None for one
    value), min, max and count of the finite values; ``diverged`` counts the others (a run whose loss went
    to NaN or infinity), and every figure is None when no value is finite."""
    finite = [v for v in values if math.isfinite(v)]
    diverged = len(values) - len(finite)
    if not finite:
        return {"mean": None, "sd": None, "se": None, "ci95": None, "min": None, "max": None, "n": 0,
                "diverged": diverged}
    values = finite
    n = len(values)
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if n > 1 else None
    se = sd / math.sqrt(n) if sd is not None else None
    half = None if se is None else _t95(n - 1) * se
    return {"mean": mean, "sd": sd, "se": se, "ci95": None if half is None else [mean - half, mean + half],
            "min": min(values), "max": max(values), "n": n, "diverged": diverged}


def _verdict(stats: dict[str, Any] | None, diverged: int = 0) -> str | None:
    """Whether Asteria's mean loss is within ``LOSS_TOLERANCE`` of native's: "met" when the 95% interval
    of the paired difference lies at or below it, "not met" when it lies above or an Asteria run
    ``diverged`` where native's did not, else "undecided"."""
    if diverged:
        return "not met"
    if stats is None or stats["ci95"] is None:
        return None
    low, high = stats["ci95"]
    return "met" if high <= LOSS_TOLERANCE else "not met" if low > LOSS_TOLERANCE else "undecided"


def summarize(per_seed: dict[int, dict[str, list[dict[str, Any]]]],
              baseline: dict[int, dict[str, list[dict[str, Any]]]] | None = None) -> dict[str, Any]:
    """Bench rows gathered per seed and config (seed -> label -> the rows of every run of it) into
    per-config statistics over the seeds (each seed counted once, at the mean of its runs) and per
    native/Asteria pair, the per-seed relative differences. Without ``baseline`` each ``X-async`` config
    is paired with the ``X-sync`` config of the same runs; with it, every config is paired with the
    baseline runs' ``X-sync`` (listed as ``X-sync (baseline)``)."""
    sides = {"": per_seed} | ({BASELINE: baseline} if baseline is not None else {})
    seeds = sorted({seed for side in sides.values() for seed in side})

    def labels_of(side: dict[int, dict[str, list[dict[str, Any]]]]) -> list[str]:
        return list(dict.fromkeys(label for seed in sorted(side) for label in side[seed]))

    def seed_mean(side: dict[int, dict[str, list[dict[str, Any]]]], seed: int, label: str,
                  key: str) -> float | None:
        values = [row[key] for row in side.get(seed, {}).get(label, []) if row.get(key) is not None]
        return statistics.fmean(values) if values else None

    configs: dict[str, Any] = {}
    for suffix, side in sides.items():
        for label in labels_of(side):
            row: dict[str, Any] = {"runs": {str(s): len(side[s][label]) for s in sorted(side) if label in side[s]}}
            for key in ("final_loss", "final_val_loss"):
                means = {str(s): seed_mean(side, s, label, key) for s in sorted(side) if label in side[s]}
                row[key] = means
                values = [v for v in means.values() if v is not None]
                row[f"{key}_stats"] = spread_stats(values) if values else None
            energy = [v for v in (seed_mean(side, s, label, "energy_vs_adamw") for s in seeds) if v is not None]
            row["energy_vs_adamw_stats"] = spread_stats(energy) if energy else None
            configs[label + suffix] = row
    pairs: dict[str, Any] = {}
    paired: dict[str, str] = {}
    reference = per_seed if baseline is None else baseline
    natives = labels_of(reference)
    for label in labels_of(per_seed):
        native = native_config(label, natives, asteria_only=baseline is None)
        if native is None:
            continue
        paired[label] = native
        pair: dict[str, Any] = {"native": native + ("" if baseline is None else BASELINE)}
        for key in ("final_loss", "final_val_loss"):
            deltas, diverged = {}, {"asteria": [], "native": []}  # seeds whose run's loss is not finite
            for seed in seeds:
                ours, theirs = seed_mean(per_seed, seed, label, key), seed_mean(reference, seed, native, key)
                if ours is None or not theirs:
                    continue
                if math.isfinite(ours) and math.isfinite(theirs):
                    deltas[str(seed)] = ours / theirs - 1.0
                else:  # a diverged native run says nothing of Asteria's gap; a diverged Asteria run is behind
                    diverged["native" if not math.isfinite(theirs) else "asteria"].append(seed)
            stats = spread_stats(list(deltas.values())) if deltas else None
            pair[key] = {"per_seed": deltas, "stats": stats, "diverged": diverged,
                         "asteria_behind": sum(d > 0 for d in deltas.values()) + len(diverged["asteria"]),
                         "within_tolerance": _verdict(stats, len(diverged["asteria"]))}
        pairs[label] = pair
    if baseline is not None and not pairs:
        raise ValueError(f"Invalid baseline: its configs {natives} hold no native (X-sync) config to compare the "
                         f"runs' {labels_of(per_seed)} with")
    gap = gap_over_run(per_seed, reference, paired)
    for entry in gap.values():
        entry["stats"] = [spread_stats([gaps[w] for gaps in entry["per_seed"].values()])
                          for w in range(len(entry["windows"]))]
    return {"seeds": seeds, "configs": configs, "pairs": pairs, "gap_over_run": gap,
            "loss_tolerance": LOSS_TOLERANCE}


def native_config(label: str, available: list[str], asteria_only: bool) -> str | None:
    """The native config among ``available`` that config ``label`` is compared with: 'X-async' -> 'X-sync'
    (and, with ``asteria_only`` False, 'X-sync' -> 'X-sync'); 'X-async-fN' -> 'X-sync-fN' where such runs
    exist, else 'X-sync' (native at the bench's own f). None: nothing to compare with (AdamW, a label
    of no known config, or no such native run)."""
    try:
        if asteria_only and parse_config(label)[1] != "async":
            return None
        return next((candidate for candidate in native_pairs(label) if candidate in available), None)
    except ValueError:
        return None


#: settings that change neither the optimizer's math nor the data, so runs differing only in them pool
#: (the seed is what is pooled over)
POOLED_SETTINGS = ("seed", "eval_every", "checkpoint_every", "keep_checkpoints")
#: pooled as well under the deterministic rule, where they change only the timing; under the newest-finished
#: rule the timing decides which versions are used
TIMING_SETTINGS = ("workers", "placement", "prefetch")
#: settings that only Asteria-mode runs read: a results file of native and AdamW runs alone pools across
#: them (so native runs pool across sessions whose Asteria defaults differ)
ASTERIA_ONLY_SETTINGS = ("staleness", "deterministic", "lag_steps", "late_activation", "workers", "placement",
                         "prefetch")
#: read by native runs too when they are staggered (``--stagger``), else by Asteria-mode runs only
STAGGER_SETTINGS = ("sync_refreshes", "stagger_split")


def _math_settings(config: dict[str, Any], labels: list[str]) -> dict[str, Any]:
    """The settings that must agree for runs to pool, for a results file of the configs ``labels``; a
    setting newer than the results file counts as the value runs had before it existed (as for resuming a
    checkpoint)."""
    before = {f.name: f.default for f in fields(RunConfig)} | LEGACY_SETTINGS
    config = {k: v for k, v in before.items() if k not in config} | config
    if config.get("deterministic") is None:  # the library's default for a bench run (one process)
        config["deterministic"] = False
    if config.get("late_activation") is None:  # the default: on exactly where allowed (the newest-finished rule)
        config["late_activation"] = not config.get("deterministic", True)
    if config.get("stagger_split") is None:  # the default: on where the schedule is staggered (bench: one process)
        config["stagger_split"] = resolved_stagger_split(config, processes=1)
    pooled = POOLED_SETTINGS + (TIMING_SETTINGS if config.get("deterministic", True) else ())
    if not any(parse_config(label)[1] == "async" for label in labels):
        pooled += ASTERIA_ONLY_SETTINGS + (STAGGER_SETTINGS if config.get("stagger") is not True else ())
    return {k: v for k, v in config.items() if k not in pooled}


def _read_results(file: Path) -> dict[str, Any] | None:
    """A bench ``results.json``'s contents, None for another kind of results.json (``bench/scaling.py``'s);
    ValueError for a file that claims to be one and is malformed."""
    try:
        results = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"Invalid results file {str(file)!r}: {error}") from error
    if not isinstance(results, dict) or not {"runs", "config", "device"} <= results.keys():
        return None
    config, runs = results["config"], results["runs"]
    if not (isinstance(config, dict) and is_int(config.get("seed")) and config["seed"] >= 0
            and isinstance(runs, dict) and runs and all(isinstance(row, dict) for row in runs.values())
            and isinstance(results["device"], str)):
        raise ValueError(f"Invalid results file {str(file)!r}: an `asteria bench` results.json has config.seed "
                         "(an int >= 0), the device's name and runs (config label -> row)")
    for label, row in runs.items():
        try:
            parse_config(label)
        except ValueError as error:
            raise ValueError(f"Invalid results file {str(file)!r}: {error}") from None
        for key in ("final_loss", "final_val_loss", "energy_vs_adamw"):
            value = row.get(key)
            if value is not None and not is_number(value):
                raise ValueError(f"Invalid results file {str(file)!r}: runs[{label!r}][{key!r}]={value!r}: must be "
                                 "a number or null")
    return results


def _with_run_dir(row: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """A bench row with the folder of its run (for the gap over the run), where that run's files are."""
    return row | {RUN_DIR: str(run_dir)} if (run_dir / "metrics.jsonl").is_file() else row


def _code_of(results: dict[str, Any]) -> str:
    """The code fingerprint a bench results.json was written by ("unknown" for results older than it)."""
    return (results.get("software") or {}).get("code", "unknown")


def _some(files: list[str], shown: int = 3) -> str:
    more = f" and {len(files) - shown} more" if len(files) > shown else ""
    return ", ".join(files[:shown]) + more


def gather(paths: list[Path]) -> tuple[dict[int, dict[str, list[dict[str, Any]]]], list[str], dict[str, int],
                                      dict[str, Any]]:
    """Every ``asteria bench`` ``results.json`` at or below ``paths`` (several calls, machines or
    ``run`` outputs; each file once however it is reached), as seed -> label -> rows, the devices they
    ran on, how many files each code fingerprint wrote ("unknown" for results older than it), and the
    settings the runs share (those that must agree for them to pool)."""
    files: list[Path] = []
    for path in paths:
        if not path.exists():
            raise ValueError(f"Invalid run path {str(path)!r}: it does not exist")
        files += [path] if path.is_file() else sorted(path.rglob("results.json"))
    named = {path.resolve() for path in paths if path.is_file()}  # files given as such must be bench results
    per_seed: dict[int, dict[str, list[dict[str, Any]]]] = {}
    devices: list[str] = []
    codes: Counter[str] = Counter()
    settings: dict[Path, dict[str, Any]] = {}
    for file in dict.fromkeys(f.resolve() for f in files):
        results = _read_results(file)
        if results is None and file in named:
            raise ValueError(f"Invalid run path {str(file)!r}: not an `asteria bench` results.json (one has device, "
                             "config and runs)")
        if results is None:  # another tool's results.json below a folder (bench/scaling.py's)
            continue
        settings[file] = _math_settings(results["config"], list(results["runs"]))
        for label, row in results["runs"].items():
            per_seed.setdefault(results["config"]["seed"], {}).setdefault(label, []).append(
                _with_run_dir(row, file.parent / label))
        devices.append(results["device"])
        codes[_code_of(results)] += 1
    if not per_seed:
        raise ValueError(f"Invalid runs={[str(p) for p in paths]}: no `asteria bench` results.json at or below them")
    # Runs of other settings (steps, staggering, ...) are other experiments: never pooled. A setting a file
    # leaves out (one its runs do not read) agrees with every value.
    shared: dict[str, Any] = {}
    holders_of: dict[str, dict[str, list[str]]] = {}
    for file, config in settings.items():
        for key, value in config.items():
            shared.setdefault(key, value)
            holders_of.setdefault(key, {}).setdefault(json.dumps(value), []).append(str(file))
    differ = sorted(key for key, holders in holders_of.items() if len(holders) > 1)
    if differ:
        parts = []
        for key in differ:
            holders = holders_of[key]
            parts.append(f"{key}: " + "; ".join(f"{value} in {_some(files)}" for value, files in holders.items()))
        raise ValueError(f"Invalid runs={[str(p) for p in paths]}: their settings differ in more than "
                         f"{', '.join(POOLED_SETTINGS)} (and {', '.join(TIMING_SETTINGS)} under the deterministic "
                         f"rule): {' | '.join(parts)}; gather the runs of one setting at a time")
    return per_seed, list(dict.fromkeys(devices)), dict(codes), shared


def setting_differences(runs: dict[str, Any], baseline: dict[str, Any]) -> dict[str, list[Any]]:
    """The shared settings in which two sets of runs differ, timing-only settings left out (and those one
    side does not read, e.g. Asteria's against a baseline of native runs alone): key -> [the runs' value,
    the baseline's]."""
    keys = sorted((runs.keys() & baseline.keys()) - set(TIMING_SETTINGS))
    return {key: [runs[key], baseline[key]] for key in keys if runs[key] != baseline[key]}


def _diverged(stats: dict[str, Any]) -> str:
    return f" ({stats['diverged']} diverged)" if stats.get("diverged") else ""


def _fmt(stats: dict[str, Any] | None, spec: str, percent: bool = False) -> str:
    if stats is None:
        return "n/a"
    if stats["mean"] is None:
        return "n/a" + _diverged(stats)
    scale, unit = (100.0, "%") if percent else (1.0, "")
    sd = "" if stats["sd"] is None else f" ± {scale * stats['sd']:{spec}}{unit}"
    return f"{scale * stats['mean']:{'+' if percent else ''}{spec}}{unit}{sd}{_diverged(stats)}"


def _interval(stats: dict[str, Any] | None) -> str:
    if stats is None or stats["ci95"] is None:
        return "n/a"
    low, high = stats["ci95"]
    return f"{100 * low:+.2f}% to {100 * high:+.2f}%"


def format_markdown(summary: dict[str, Any], devices: list[str]) -> str:
    seeds = summary["seeds"]
    lines = [f"# `asteria bench` over seeds {', '.join(map(str, seeds))} ({', '.join(devices)})", ""]
    for key, title in (("code", "Code"), ("baseline_code", "Code of the baseline runs")):
        codes = summary.get(key) or {}
        mixed = " (runs of different code are pooled: check that the math is the same)" if len(codes) > 1 else ""
        if codes:
            lines += [f"{title}: {', '.join(f'{code} ({n} results files)' for code, n in codes.items())}{mixed}.", ""]
    lines += [
             "Each seed counts once, at the mean of its runs; mean ± sample standard deviation over the seeds. "
             "Final loss: the mean of the last 10 steps' training loss.", "",
             *([_baseline_line(summary["baseline_differs_in"]), ""] if "baseline_differs_in" in summary else []),
             "| config | runs | final loss | val loss | energy/step vs AdamW |", "|---|---|---|---|---|"]
    for label, row in summary["configs"].items():
        lines.append(f"| {label} | {sum(row['runs'].values())} | {_fmt(row['final_loss_stats'], '.4f')} | "
                     f"{_fmt(row['final_val_loss_stats'], '.4f')} | {_fmt(row['energy_vs_adamw_stats'], '.3f')} |")
    if summary["pairs"]:
        tolerance = 100 * summary["loss_tolerance"]
        compared = ("Each config against the baseline's native config, paired by seed (config / native - 1)"
                    if "baseline_differs_in" in summary else
                    "Asteria against native, paired by seed (async / sync - 1)")
        lines += ["", f"{compared}, validation loss; mean ± standard "
                  f"error and the 95% interval (Student's t) of the mean difference; within {tolerance:g}%: met when "
                  "the whole interval is at or below it, not met when the whole interval is above it:", "",
                  "| config | per seed | mean ± SE | 95% interval | seeds with Asteria behind | "
                  f"within {tolerance:g}% | final loss, mean ± SE |", "|---|---|---|---|---|---|---|"]
        for label, pair in summary["pairs"].items():
            val, final = pair["final_val_loss"], pair["final_loss"]
            diverged = val.get("diverged", {"asteria": [], "native": []})
            per_seed = ", ".join([f"{seed}: {100 * d:+.1f}%" for seed, d in val["per_seed"].items()]
                                 + [f"{seed}: Asteria diverged" for seed in diverged["asteria"]]
                                 + [f"{seed}: native diverged (left out)" for seed in diverged["native"]]) or "n/a"
            paired = len(val["per_seed"]) + len(diverged["asteria"])
            verdict = val["within_tolerance"] or f"n/a ({paired} paired seeds)"
            lines.append(f"| {label} vs {pair['native']} | {per_seed} | {_fmt_se(val['stats'])} | "
                         f"{_interval(val['stats'])} | {val['asteria_behind']} of {paired} | "
                         f"{verdict} | {_fmt_se(final['stats'])} |")
    lines += format_gap(summary.get("gap_over_run", {}), "" if "baseline_differs_in" not in summary else BASELINE)
    return "\n".join(lines) + "\n"


def _baseline_line(differences: dict[str, list[Any]]) -> str:
    """What separates the runs from the baseline runs they are compared with."""
    first = f"Every config is compared with the native config of the baseline runs (listed as `X-sync{BASELINE}`)"
    if not differences:
        return first + ", whose settings are the same."
    listed = "; ".join(f"{key}: {json.dumps(ours)} against {json.dumps(theirs)}"
                       for key, (ours, theirs) in differences.items())
    return f"{first}. The two differ in these settings (runs against baseline): {listed}."


def _fmt_se(stats: dict[str, Any] | None) -> str:
    if stats is None or stats["mean"] is None:
        return "n/a"
    se = "" if stats["se"] is None else f" ± {100 * stats['se']:.2f}%"
    return f"{100 * stats['mean']:+.2f}%{se}"


def write_summary(per_seed: dict[int, dict[str, list[dict[str, Any]]]], devices: list[str], out: Path,
                  codes: dict[str, int] | None = None,
                  baseline: dict[int, dict[str, list[dict[str, Any]]]] | None = None,
                  differences: dict[str, list[Any]] | None = None,
                  baseline_codes: dict[str, int] | None = None) -> dict[str, Any]:
    """``summarize`` (with the code fingerprints' counts, if given; against ``baseline``'s native runs,
    whose settings differ from the runs' by ``differences`` and whose code is ``baseline_codes``) into
    ``out/seeds.json`` and ``out/seeds.md``."""
    summary = summarize(per_seed, baseline) | {"code": codes or {}}
    if baseline is not None:
        summary |= {"baseline_differs_in": differences or {}, "baseline_code": baseline_codes or {}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "seeds.json").write_text(json.dumps({"device": ", ".join(devices)} | summary, indent=2))
    (out / "seeds.md").write_text(format_markdown(summary, devices))
    if not plot_gap(summary["gap_over_run"], out / "gap.png"):
        (out / "gap.png").unlink(missing_ok=True)  # an earlier report's plot would not be this one's
    return summary | {"device": ", ".join(devices)}


def check_seeds(seeds: list[int]) -> None:
    if not seeds or len(set(seeds)) != len(seeds) or any(not isinstance(s, int) or not 0 <= s < 2**32 for s in seeds):
        raise ValueError(f"Invalid seeds={seeds!r}: must be distinct integers in [0, 2**32) (a run's data order is "
                         "seeded from its seed)")


def run_seeds(base: RunConfig, out: Path, configs: tuple[str, ...], seeds: list[int],
              progress: bool = True) -> dict[str, Any]:
    """``run_bench`` once per seed into ``out/seed<S>``, then the gathered comparison (``seeds.json``,
    ``seeds.md``)."""
    check_seeds(seeds)
    results = {seed: run_bench(replace(base, seed=seed), out / f"seed{seed}", configs, progress=progress)
               for seed in seeds}
    per_seed = {seed: {label: [_with_run_dir(row, out / f"seed{seed}" / label)] for label, row in r["runs"].items()}
                for seed, r in results.items()}
    codes = dict(Counter(_code_of(r) for r in results.values()))
    return write_summary(per_seed, list(dict.fromkeys(r["device"] for r in results.values())), out, codes)


def check_one_seed_option(seed: int | None, seeds: list[int] | None) -> None:
    """``--seed`` and ``--seeds`` both set one run's seed: refuses the two together."""
    if seed is not None and seeds is not None:
        raise ValueError(f"Invalid seed={seed!r} beside seeds={seeds!r}: give one of them")


def run_command(prog: str, body: Callable[[], None]) -> int:
    """Runs ``body`` with the asteria command's exit statuses: 0, 2 with the message for bad input
    (``ValueError``, ``OSError``) and 130 for Ctrl-C. One process only: these tools launch no torchrun."""
    try:
        world = os.environ.get("WORLD_SIZE", "1")
        if world != "1":
            raise ValueError(f"Invalid WORLD_SIZE={world}: {prog} runs on one process, not under torchrun")
        body()
    except (ValueError, OSError) as error:
        if isinstance(error, (TimeoutError, ConnectionError)):  # a stalled run or a lost peer, not bad input
            raise
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except BaseException as error:  # Ctrl-C, also inside a DCP save (which wraps it in a CheckpointException)
        if not interrupted(error):
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0


DESCRIPTION = ("Asteria's loss against native's over seeds, paired by seed: asteria bench run once per seed "
               "(run), or bench results on disk gathered (gather).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seeds.py", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="asteria bench once per seed, then the comparison over the seeds")
    add_run_arguments(run_p, skip=("optimizer", "mode"))
    run_p.add_argument("--out", type=out_dir, required=True)
    run_p.add_argument("--configs", nargs="+", default=list(CONFIGS),
                       help=f"subset of {CONFIGS}, as for asteria bench (-f<N>: at precondition_frequency N; "
                            f"peers: {PEER_CONFIGS})")
    run_p.add_argument("--seeds", type=int, nargs="+", required=True,
                       help="repeat the comparison for each of these seeds (in place of --seed) into OUT/seed<S>, "
                            "and write OUT/seeds.md: every config's loss over the seeds and Asteria's loss "
                            "against native's, paired by seed")
    gather_p = sub.add_parser("gather", help="Asteria's loss against native's over seeds, from bench results on "
                                             "disk")
    gather_p.add_argument("runs", type=Path, nargs="+",
                          help="bench output folders or results.json files (searched recursively; several runs of "
                               "one seed count as that seed once, at their mean)")
    gather_p.add_argument("--baseline", type=Path, nargs="+", default=None,
                          help="bench results of other settings whose native configs every config of RUNS is "
                               "compared with, paired by seed (the settings that differ are listed)")
    gather_p.add_argument("--out", type=out_dir, required=True, help="where seeds.md and seeds.json go")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        if args.command == "run":
            check_one_seed_option(args.seed, args.seeds)
            run_seeds(bench_base(args), args.out, tuple(args.configs), list(args.seeds))
        else:
            per_seed, devices, codes, settings = gather(list(args.runs))
            baseline = differences = baseline_codes = None
            if args.baseline is not None:
                baseline, more_devices, baseline_codes, baseline_settings = gather(list(args.baseline))
                devices = list(dict.fromkeys(devices + more_devices))
                differences = setting_differences(settings, baseline_settings)
            write_summary(per_seed, devices, args.out, codes, baseline, differences, baseline_codes)
        print((args.out / "seeds.md").read_text())
        print(f"results: {args.out / 'seeds.json'}")

    return run_command("seeds.py", body)


if __name__ == "__main__":
    sys.exit(main())
