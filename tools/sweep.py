"""One Asteria configuration trained at several staleness bounds S: how the final loss moves with S.
An experiment tool, kept out of the package (the library never imports it)::

    python tools/sweep.py --staleness 0 1 3 5 --out DIR [--seeds 1 2] [--reuse] [asteria train's options]

(importable as ``sweep`` with ``tools/`` on ``sys.path``; ``main(argv)`` is the command).

Writes ``DIR/S<k>/`` runs, ``DIR/sweep.json`` and ``DIR/sweep.md`` (final loss, validation loss,
median step and waits per S, and the spread max - min of the final loss over S <= 5),
``DIR/sweep.png`` (final loss vs S) and the usual report over all runs. With ``reuse`` a run already in
``DIR`` that finished every step with the same configuration is kept, not trained again, so that an
interrupted sweep, or one given more seeds or bounds later, trains only what it lacks.

A single run per S scatters by more than the spread asked of it (< 0.02) on a 160M model at a few
hundred steps: runs of one setting differ by several percent of loss. With ``seeds`` every S is trained
once per seed (``DIR/S<k>/seed<n>/``); each S then has a mean final loss, the spread is taken over the
means, and each S gets its offset (the mean over seeds of each run's deviation from its seed's mean over
S <= 5, so that the seeds' own levels cancel) with a 95% interval. The verdict is "met" when the band
spanned by every S's interval is narrower than the target, "not met" when even the intervals' inner
edges are further apart than it, else "undecided" (per-S intervals, not simultaneous ones).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from seeds import check_one_seed_option, check_seeds, run_command, spread_stats

from asteria.train.cli import add_run_arguments, out_dir, run_config_from_args
from asteria.train.loop import train
from asteria.train.report import plt, write_report
from asteria.train.run_config import RunConfig
from asteria.train.runs import load_run

DEFAULT_STALENESS = (0, 1, 2, 3, 5, 10)
SPREAD_BOUND = 5  # the spread is taken over S <= 5, the range the paper's claim covers
SPREAD_TARGET = 0.02  # the final loss should vary by less than this over S <= SPREAD_BOUND


def _pair_by_seed(rows: dict[int, dict[str, Any]], bounded: list[int], seeds: list[int]) -> None:
    """Adds to every S's row ``final_loss_offset``: the mean over seeds of each run's deviation from its
    seed's own mean over the S <= 5 runs, with its standard error and 95% interval. The seed's level (its
    data order and initialization) cancels, so what remains is how S moves the loss; the offsets differ
    between S exactly as the S means do."""
    if not bounded:
        return
    level = {str(seed): sum(rows[s]["final_loss_per_seed"][str(seed)] for s in bounded) / len(bounded)
             for seed in seeds}
    for row in rows.values():
        row["final_loss_offset"] = spread_stats([row["final_loss_per_seed"][seed] - level[seed] for seed in level])


def _spread_verdict(stats: list[dict[str, Any]]) -> tuple[list[float] | None, str | None]:
    """The band [inner, outer] the spread of the per-S means lies in by the per-S (marginal, not
    simultaneous) 95% intervals of their offsets, and the verdict against ``SPREAD_TARGET``: "met" when
    even the outer edges are closer than it, "not met" when even the inner edges are further apart (or a
    run diverged), else "undecided"; None without intervals."""
    if any(st.get("diverged") for st in stats):
        return None, "not met"  # a loss that is not finite at some S <= 5
    if len(stats) < 2 or any(st["ci95"] is None for st in stats):
        return None, None
    outer = max(st["ci95"][1] for st in stats) - min(st["ci95"][0] for st in stats)
    inner = max(0.0, max(st["ci95"][0] for st in stats) - min(st["ci95"][1] for st in stats))
    verdict = "met" if outer < SPREAD_TARGET else "not met" if inner >= SPREAD_TARGET else "undecided"
    return [inner, outer], verdict


# What ``_aggregate`` reads of a run's summary beyond what ``load_run`` checks
SWEEP_READS = {"runtime_stats": dict, "median_step_seconds": (int, float)}


def _aggregate(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One S's row over its runs (one per seed): mean losses and step time, waits summed over the runs,
    the largest staleness seen."""
    n = len(summaries)
    vals = [m.get("final_val_loss") for m in summaries]
    stats = [m["runtime_stats"] for m in summaries]
    waits = [st.get("waits") for st in stats]
    seen = [st["max_staleness_seen"] for st in stats if st.get("max_staleness_seen") is not None]
    return {"final_loss": sum(m["final_loss"] for m in summaries) / n,
            "final_val_loss": None if None in vals else sum(vals) / n,
            "median_step_seconds": sum(m["median_step_seconds"] for m in summaries) / n,
            "waits": None if None in waits else sum(waits),
            "max_staleness_seen": max(seen) if seen else None}


def finished_run(run_dir: Path, cfg: RunConfig) -> dict[str, Any] | None:
    """The summary of the run in ``run_dir`` when it trained all ``cfg.steps`` steps with exactly ``cfg``
    (every field, the worker count and device included), else None (no run, another configuration, a run
    stopped early, or a summary that cannot be read)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    wanted = json.loads(json.dumps(asdict(cfg)))  # as the summary stores it
    if not isinstance(summary, dict) or summary.get("config") != wanted or summary.get("steps_done") != cfg.steps:
        return None
    try:  # and its files as the sweep's report reads them, every step recorded
        run = load_run(run_dir)
    except (OSError, ValueError):
        return None
    steps = [r["step"] for r in run.records]
    if steps != list(range(1, cfg.steps + 1)) or not all(
            isinstance(summary.get(key), kind) for key, kind in SWEEP_READS.items()):
        return None
    return summary


def run_sweep(base: RunConfig, staleness: tuple[int, ...], out: Path, progress: bool = True,
              seeds: list[int] | None = None, reuse: bool = False) -> dict[str, Any]:
    """Trains ``base`` once per staleness bound (and per seed of ``seeds``) and writes the sweep's report;
    with ``reuse``, runs in ``out`` that finished with the same configuration are kept (see
    ``finished_run``) and every other one is trained afresh."""
    if base.optimizer == "adamw" or base.mode != "async":
        raise ValueError(f"Invalid optimizer={base.optimizer!r} with mode={base.mode!r}: the staleness sweep needs "
                         "an Asteria optimizer in mode 'async'")
    if not staleness:
        raise ValueError("Invalid staleness=(): give at least one bound")
    for s in staleness:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"Invalid staleness={s!r}: each bound must be an int >= 0")
    if seeds is not None:
        check_seeds(seeds)
    values = sorted(set(staleness))
    # Every configuration checked before the first run (e.g. a lag_steps above some S's bound).
    configs = {s: replace(base, staleness=s) for s in values}
    out.mkdir(parents=True, exist_ok=True)
    rows, run_dirs = {}, []
    for s in values:
        summaries = {}
        for seed in seeds or [base.seed]:
            run_dir = out / f"S{s}" if seeds is None else out / f"S{s}" / f"seed{seed}"
            cfg = replace(configs[s], seed=seed)
            summary = finished_run(run_dir, cfg) if reuse else None
            if summary is not None:
                print(f"S={s} seed={seed}: reusing the finished run in {run_dir}", flush=True)
            summaries[seed] = summary or train(cfg, run_dir, progress=progress, overwrite=True)
            run_dirs.append(run_dir)
        rows[s] = _aggregate(list(summaries.values()))
        if seeds is not None:
            rows[s]["final_loss_per_seed"] = {str(seed): m["final_loss"] for seed, m in summaries.items()}
            rows[s]["final_loss_stats"] = spread_stats([m["final_loss"] for m in summaries.values()])
    bounded = [s for s in values if s <= SPREAD_BOUND]
    losses = [rows[s]["final_loss"] for s in bounded]
    # A diverged S (its loss NaN or infinite) has no spread to speak of: None, and the S listed.
    diverged = [s for s in bounded if not math.isfinite(rows[s]["final_loss"])]
    result = {"config": asdict(base), "staleness": values, "seeds": seeds, "runs": {str(s): r for s, r in rows.items()},
              "spread_final_loss_s_le_5": (max(losses) - min(losses)) if losses and not diverged else None,
              "diverged_s": diverged}
    if seeds is not None:
        _pair_by_seed(rows, bounded, seeds)
        band, verdict = _spread_verdict([rows[s]["final_loss_offset"] for s in bounded])
        result |= {"spread_band_s_le_5": band, "spread_target": SPREAD_TARGET, "spread_verdict": verdict}
    (out / "sweep.json").write_text(json.dumps(result, indent=2))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if seeds is None:
        ax.plot(values, [rows[s]["final_loss"] for s in values], "o-", label="final training loss")
    else:
        ax.errorbar(values, [rows[s]["final_loss"] for s in values], capsize=3, fmt="o-",
                    yerr=[rows[s]["final_loss_stats"]["se"] or 0.0 for s in values],
                    label=f"final training loss, mean ± SE over {len(seeds)} seeds")
    if all(rows[s]["final_val_loss"] is not None for s in values):
        ax.plot(values, [rows[s]["final_val_loss"] for s in values], "s--", label="validation loss")
    ax.set(xlabel="staleness bound S (refresh intervals)", ylabel="loss", title=f"{base.label}: loss vs staleness")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=110)
    plt.close(fig)

    spread = result["spread_final_loss_s_le_5"]
    over = "" if seeds is None else f", each S over seeds {', '.join(map(str, seeds))} (means)"
    lines = [f"# Staleness sweep: {base.label}, model {base.model}, {base.steps} steps, "
             f"f={base.precondition_frequency}{over}", "",
             "Activation: " + ("deterministic, each version exactly lag_steps after its snapshot" if base.deterministic
                               else
                               "each block's newest finished version, at most S intervals behind"), "",
             "| S | final loss | val loss | median step (ms) | waits | max staleness seen |"
             + ("" if seeds is None else
                " final loss ± SE over seeds | offset from the seeds' mean over S <= 5 ± SE | its 95% interval |"),
             "|---|---|---|---|---|---|" + ("" if seeds is None else "---|---|---|")]
    for s in values:
        r = rows[s]
        val = "n/a" if r["final_val_loss"] is None else f"{r['final_val_loss']:.4f}"
        line = (f"| {s} | {r['final_loss']:.4f} | {val} | {1e3 * r['median_step_seconds']:.1f} | "
                f"{r['waits']} | {r['max_staleness_seen']} |")
        if seeds is not None:
            st, offset = r["final_loss_stats"], r.get("final_loss_offset")
            se = "n/a" if st["se"] is None else f"{st['mean']:.4f} ± {st['se']:.4f}"
            off = "n/a" if offset is None or offset["se"] is None else f"{offset['mean']:+.4f} ± {offset['se']:.4f}"
            ci = "n/a" if offset is None or offset["ci95"] is None else \
                f"{offset['ci95'][0]:+.4f} to {offset['ci95'][1]:+.4f}"
            line += f" {se} | {off} | {ci} |"
        lines.append(line)
    lines += ["", f"Spread of the final loss over S <= {SPREAD_BOUND}: "
              + (f"n/a (diverged at S = {', '.join(map(str, diverged))})" if diverged else
                 "n/a (no such S)" if spread is None else f"{spread:.4f}")]
    if seeds is not None:
        band = result["spread_band_s_le_5"]
        lines += ["", f"Against the target spread < {SPREAD_TARGET}: "
                  + ("not met (a run diverged)" if result["spread_verdict"] == "not met" and band is None else
                     "n/a (needs two S <= 5 and two seeds)" if band is None else
                     f"{result['spread_verdict']} (the spread lies between {band[0]:.4f} and {band[1]:.4f} by the "
                     "per-S 95% intervals of the offsets, paired by seed; waits count every seed's run)")]
    lines += ["", "![sweep](sweep.png)", ""]
    (out / "sweep.md").write_text("\n".join(lines))
    write_report(run_dirs, out)
    return result


DESCRIPTION = ("One Asteria configuration trained at several staleness bounds S, with a report of the final "
               "loss per S and its spread over S <= 5.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sweep.py", description=DESCRIPTION)
    add_run_arguments(parser, skip=("staleness",))
    parser.add_argument("--staleness", dest="staleness_values", type=int, nargs="+", default=list(DEFAULT_STALENESS),
                        help=f"bounds S to run [default: {' '.join(map(str, DEFAULT_STALENESS))}]")
    parser.add_argument("--out", type=out_dir, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="train every S once per seed (in place of --seed) into OUT/S<k>/seed<n>: per-S means "
                             "with their standard errors, and a verdict on the spread target")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the runs in OUT that finished every step with the same configuration instead of "
                             "training them again (continues an interrupted sweep, or one given more seeds or S)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        check_one_seed_option(args.seed, args.seeds)
        result = run_sweep(run_config_from_args(args), tuple(args.staleness_values), args.out,
                           seeds=None if args.seeds is None else list(args.seeds), reuse=args.reuse)
        spread = result["spread_final_loss_s_le_5"]
        for s, row in result["runs"].items():
            print(f"S={s:>3}: final loss {row['final_loss']:.4f}")
        spread_text = "n/a" if spread is None else f"{spread:.4f}"
        verdict = f" ({result['spread_verdict']} against < {result['spread_target']})" if result.get(
            "spread_verdict") else ""
        print(f"spread over S <= 5: {spread_text}{verdict}; report: {args.out / 'sweep.md'}")

    return run_command("sweep.py", body)


if __name__ == "__main__":
    sys.exit(main())
