"""``asteria sweep``: one configuration trained at several staleness bounds S.

Writes ``DIR/S<k>/`` runs, ``DIR/sweep.json`` and ``DIR/sweep.md`` (final loss, validation loss,
median step and waits per S, and the spread max - min of the final loss over S <= 5),
``DIR/sweep.png`` (final loss vs S) and the usual report over all runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from asteria.train.loop import RunConfig, train
from asteria.train.report import plt, write_report

DEFAULT_STALENESS = (0, 1, 2, 3, 5, 10)
SPREAD_BOUND = 5  # the spread is taken over S <= 5, the range the paper's claim covers


def run_sweep(base: RunConfig, staleness: tuple[int, ...], out: Path, progress: bool = True) -> dict[str, Any]:
    """Trains ``base`` once per staleness bound and writes the sweep's report."""
    if base.optimizer == "adamw" or base.mode != "async":
        raise ValueError(f"Invalid optimizer={base.optimizer!r} with mode={base.mode!r}: the staleness sweep needs "
                         "an Asteria optimizer in mode 'async'")
    if not staleness:
        raise ValueError("Invalid staleness=(): give at least one bound")
    for s in staleness:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"Invalid staleness={s!r}: each bound must be an int >= 0")
    values = sorted(set(staleness))
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for s in values:
        summary = train(replace(base, staleness=s), out / f"S{s}", progress=progress)
        stats = summary["runtime_stats"]
        rows[s] = {"final_loss": summary["final_loss"], "final_val_loss": summary["final_val_loss"],
                   "median_step_seconds": summary["median_step_seconds"], "waits": stats.get("waits"),
                   "max_staleness_seen": stats.get("max_staleness_seen")}
    bounded = [rows[s]["final_loss"] for s in values if s <= SPREAD_BOUND]
    result = {"config": asdict(base), "staleness": values, "runs": {str(s): r for s, r in rows.items()},
              "spread_final_loss_s_le_5": (max(bounded) - min(bounded)) if bounded else None}
    (out / "sweep.json").write_text(json.dumps(result, indent=2))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(values, [rows[s]["final_loss"] for s in values], "o-", label="final training loss")
    if all(rows[s]["final_val_loss"] is not None for s in values):
        ax.plot(values, [rows[s]["final_val_loss"] for s in values], "s--", label="validation loss")
    ax.set(xlabel="staleness bound S (refresh intervals)", ylabel="loss", title=f"{base.label}: loss vs staleness")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=110)
    plt.close(fig)

    spread = result["spread_final_loss_s_le_5"]
    lines = [f"# Staleness sweep: {base.label}, model {base.model}, {base.steps} steps, "
             f"f={base.precondition_frequency}", "",
             "Activation: " + ("deterministic, each version exactly S intervals after its snapshot (the bound is "
                               "also the lag)" if base.deterministic else
                               "each block's newest finished version, at most S intervals behind"), "",
             "| S | final loss | val loss | median step (ms) | waits | max staleness seen |",
             "|---|---|---|---|---|---|"]
    for s in values:
        r = rows[s]
        val = "n/a" if r["final_val_loss"] is None else f"{r['final_val_loss']:.4f}"
        lines.append(f"| {s} | {r['final_loss']:.4f} | {val} | {1e3 * r['median_step_seconds']:.1f} | "
                     f"{r['waits']} | {r['max_staleness_seen']} |")
    lines += ["", f"Spread of the final loss over S <= {SPREAD_BOUND}: "
              + ("n/a (no such S)" if spread is None else f"{spread:.4f}"), "", "![sweep](sweep.png)", ""]
    (out / "sweep.md").write_text("\n".join(lines))
    write_report([out / f"S{s}" for s in values], out)
    return result
