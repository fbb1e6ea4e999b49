"""``asteria bench``: every optimizer x mode on the same model, batch, seed and f, side by side.

Writes ``DIR/<config>/`` runs (every step's wall and CUDA-event time, energy and memory in their
``metrics.jsonl``), ``DIR/results.json`` (per config: step-time median, p99, max and max/median, wall
and CUDA-event; peak GPU memory; energy per step; staleness seen; waits; final loss; ratios to AdamW; an async
config's validation loss against native mode's and its peers' of the same bench),
``DIR/step_time_series.png`` (one panel per config), ``DIR/energy_per_step.png`` and the report
(``report.md``, ``loss.png``, ``step_time.png``).
"""

from __future__ import annotations

import gc
import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from asteria.train.checkpoint import interrupted
from asteria.train.loop import make_optimizer, train
from asteria.train.outdir import replacing
from asteria.train.peers import PEERS
from asteria.train.provenance import software
from asteria.train.report import plt, run_warmup, write_report
from asteria.train.run_config import DEFAULT_LR, RunConfig
from asteria.train.runs import Run, load_run

CONFIGS = ("adamw", "shampoo-sync", "shampoo-async", "soap-sync", "soap-async", "kl-shampoo-sync",
           "kl-shampoo-async")
#: peer implementations a bench may run beside those (``asteria.train.peers``), on request
PEER_CONFIGS = tuple(PEERS)
#: what a bench writes beside its runs' folders
BENCH_FILES = ("results.json", "step_time_series.png", "energy_per_step.png", "report.md", "report.json", "loss.png",
               "step_time.png")


def parse_config(label: str) -> tuple[str, str, int | None]:
    """'soap-async' -> ('soap', 'async', None); 'adamw' -> ('adamw', 'sync', None). A second-order config
    followed by ``-f<N>`` runs with ``precondition_frequency`` N instead of the bench's:
    'soap-async-f5' -> ('soap', 'async', 5) (e.g. Asteria at f = 5 beside native at the bench's f)."""
    base, frequency = label, None
    head, sep, tail = label.rpartition("-f")
    if sep and head in CONFIGS and head != "adamw" and tail.isascii() and tail.isdigit():
        base, frequency = head, int(tail)
    if base in PEER_CONFIGS:
        return base, "sync", None
    if base not in CONFIGS or (frequency is not None and frequency < 1):
        raise ValueError(f"Invalid config={label!r}: must be one of {CONFIGS}, a second-order one optionally "
                         f"followed by -f<N> (N >= 1, its precondition_frequency), e.g. 'soap-async-f5', or a peer "
                         f"{PEER_CONFIGS}")
    if base == "adamw":
        return "adamw", "sync", None
    optimizer, mode = base.rsplit("-", 1)
    return optimizer, mode, frequency


def native_pairs(label: str) -> list[str]:
    """The native configs that config ``label`` compares with, nearest first: native mode at its own f
    (``soap-sync-f5`` for ``soap-async-f5`` or ``soap-sync-f5``), then at the bench's f (``soap-sync``); none for
    AdamW or a peer."""
    optimizer, _, frequency = parse_config(label)
    if optimizer == "adamw" or optimizer in PEER_CONFIGS:
        return []
    plain = f"{optimizer}-sync"
    return ([f"{plain}-f{frequency}"] if frequency else []) + [plain]


def loss_references(labels: list[str]) -> dict[str, list[str]]:
    """Per Asteria config in async mode among ``labels``, the configs of the same bench whose validation loss the
    loss target compares it with, where the bench runs them: native mode of the same optimizer at the same f
    (``soap-sync-f5`` for ``soap-async-f5``), then at the bench's f (``soap-sync``), then the optimizer's peers
    (Distributed Shampoo's, heavyball's, at the bench's f)."""
    present = set(labels)
    references = {}
    for label in labels:
        optimizer, mode, _ = parse_config(label)
        if mode != "async":
            continue
        candidates = (*native_pairs(label), *(peer for peer, of in PEERS.items() if of == optimizer))
        found = [ref for ref in dict.fromkeys(candidates) if ref in present]
        if found:
            references[label] = found
    return references


def relative_loss(loss: float | None, reference: float | None) -> float | None:
    """``loss / reference - 1``; None where either is missing or not a positive finite number."""
    if loss is None or reference is None or not (math.isfinite(loss) and math.isfinite(reference)) or reference <= 0:
        return None
    return loss / reference - 1


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _profile(values: list[float], warmup: int = 1) -> dict[str, float]:
    """Median, p99 and max of the steady steps: those after the first ``warmup`` (the first step
    allocates and compiles; a second-order run's first ``sync_refreshes`` versions, used at their own
    step and waited for by design, come by step start + ``sync_refreshes`` x f - 1, staggered, where
    start <= f is the optimizer's first refresh). The warm-up's own max is kept beside them."""
    steady = values[warmup:] or values
    median = statistics.median(steady)
    return {"median": median, "mean": statistics.fmean(steady), "p99": _percentile(steady, 0.99), "max": max(steady),
            "max_over_median": max(steady) / median, "warmup_max": max(values[:warmup] or [0.0]),
            "slowest_steps": sorted(((v, i + 1) for i, v in enumerate(values) if i >= warmup), reverse=True)[:5]}


def run_config_of(base: RunConfig, label: str) -> RunConfig:
    """The settings of config ``label`` with ``base``'s others (``RunConfig`` checks them; ``config_of`` also
    builds the optimizer once)."""
    optimizer, mode, frequency = parse_config(label)
    return RunConfig(**(asdict(base) | {"optimizer": optimizer, "mode": mode, "lr": base.lr or DEFAULT_LR[optimizer],
                                        "precondition_frequency": frequency or base.precondition_frequency}))


def config_of(base: RunConfig, label: str) -> RunConfig:
    """The run of config ``label`` (e.g. ``soap-async-f5``) with ``base``'s other settings, checked before
    any run: its optimizer is built over a one-layer stand-in on the run's device and closed, so that a
    setting the optimizer refuses (a host placement for CPU parameters, a lag above one config's bound)
    stops the bench before its first run rather than after the configs before it."""
    try:
        cfg = run_config_of(base, label)
        if cfg.optimizer != "adamw":
            made = make_optimizer(cfg, torch.nn.Linear(4, 4, device=cfg.device))
            if hasattr(made, "close"):  # an Asteria optimizer's workers; a peer holds none
                made.close()
    except ValueError as error:
        raise ValueError(f"Invalid config {label!r}: {error}") from None
    return cfg


def refresh_work(stats: dict[str, Any], frequency: int, steps: int, step_seconds: float, pace: str,
                 at_warmup: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The refresh work of one interval (f steps) against what each side has in one, from an async run's
    runtime stats (None for other runs): the workers' job seconds per interval (their CPU time, core-seconds, the
    express workers' jobs included, which share the workers' cores; the refreshes dropped, superseded or deferred,
    counted at the workers' mean job time, since the schedule asked for them) against the workers x the interval's
    time at ``step_seconds`` a step (AdamW's mean step where the bench ran AdamW, ``pace`` "adamw", else the run's
    own), and the device lane's seconds per interval against that time times its threads, with the CPU seconds the
    lane's threads took meanwhile (None where not measured). A ratio above 1 is work that one side cannot finish
    in its interval.

    ``at_warmup``: the counters at the warm-up's last step (summary.json's ``runtime_stats_at_warmup``); the work is
    then that of the steady steps after it (``window`` "steady"). Without them (runs written before they were
    recorded, or resumed past the warm-up) it is the whole run's over all its intervals (``window`` "run"), which
    spreads the workers' seconds over the start-up intervals, whose refreshes ran on the GPU: at 60 steps and f = 10
    that understates the workers' share by about a third."""
    workers = stats.get("workers")
    if not workers:
        return None
    steady = at_warmup is not None and steps > at_warmup["step"]
    base = at_warmup if steady else {}
    delta = lambda key: (stats.get(key) or 0.0) - (base.get(key) or 0.0)  # noqa: E731
    intervals = max(((steps - at_warmup["step"]) if steady else steps) / frequency, 1e-9)
    interval = step_seconds * frequency
    ended = delta("worker_jobs_ended") if "worker_jobs_ended" in stats else None
    if ended is None:  # runs before the workers' job count: every refresh, the lane's included, as the divisor
        ended = stats["refreshes"] + stats.get("refresh_failures", 0)
    worker_seconds = delta("refresh_seconds_on_workers")
    per_job = worker_seconds / ended if ended else 0.0  # every set on the lane: no worker job
    dropped = delta("refreshes_superseded") + delta("refreshes_deferred")
    worker = (worker_seconds + per_job * dropped) / intervals
    device = delta("device_refresh_seconds") / intervals
    device_cpu = delta("device_cpu_seconds") / intervals if stats.get("device_cpu_seconds") is not None else None
    capacity = workers * interval
    threads = stats.get("device_threads") or 1  # absent from runs without a lane, and from older ones
    return {"pace": pace, "window": "steady" if steady else "run", "interval_seconds": interval, "workers": workers,
            "express_workers": stats.get("express_workers") or 0, "worker_core_seconds": worker,
            "worker_capacity_core_seconds": capacity, "worker_ratio": worker / capacity,
            "device_seconds": device, "device_threads": threads, "device_ratio": device / (interval * threads),
            "device_cpu_seconds": device_cpu,
            # the balancer's last plan: the share of each side's interval it filled (above 1: deferred)
            "planned_load": stats.get("planned_load"),
            # (absent from runs written before they were measured)
            "job_latency": {key: stats.get(key) for key in (
                "job_mean_latency_seconds", "job_mean_run_seconds", "small_jobs", "small_job_mean_latency_seconds",
                "small_job_mean_run_seconds")}}


# A record's host measure -> its median by position in the interval profile, that line's label, its meaning and its
# scale in the table (ms for times, a plain count for the sleeps).
HOST_TIMES = {
    "host_step_time": ("host_median_seconds", "host queued", "the host's time to queue the step, step()'s waits "
                       "included", 1e3),
    "host_optimizer_time": ("host_optimizer_median_seconds", "in step()", "the part of it in step()", 1e3),
    "host_cpu_time": ("host_cpu_median_seconds", "host CPU", "the training thread's CPU time meanwhile, CUDA's "
                      "spinning waits included", 1e3),
    "host_runq_time": ("host_runq_median_seconds", "core wait", "the training thread's time runnable but not run: "
                       "every core busy", 1e3),
    "host_sleeps": ("host_sleeps_median", "sleeps", "the training thread's voluntary context switches: on the GIL, "
                    "a lock, a blocking event", 1.0),
}


def interval_profile(records: list[dict[str, Any]], warmup: int, frequency: int) -> dict[str, Any] | None:
    """The median steady step at each position of the interval of f steps (position = step mod f: native mode
    refreshes every set at 0, async mode spreads the sets' snapshots over the interval), the quietest position's,
    and how many seconds an interval's positions add above the quietest: in an async run, the window where the
    device lane's refreshes and the installs land, set apart from the floor that every step pays (the optimizer's
    own step math, the workers' contention). Where the records hold the host's time to queue each step, also its
    median by position: a host time near the step's says the host, not the GPU, set the pace there; likewise the
    part of it in ``step()``, and the training thread's CPU time (below the host's time where the thread slept, on
    the GIL or a lock; CUDA's waits spin and count as CPU time). None where a position has fewer than two steady
    steps."""
    if frequency < 2:
        return None
    by_position: list[list[float]] = [[] for _ in range(frequency)]
    extra = {key: [[] for _ in range(frequency)] for key in HOST_TIMES}
    for record in records[warmup:]:
        by_position[record["step"] % frequency].append(record["step_time"])
        for key, lists in extra.items():
            if key in record:
                lists[record["step"] % frequency].append(record[key])
    if min(len(times) for times in by_position) < 2:
        return None
    medians = [statistics.median(times) for times in by_position]
    quietest = min(medians)

    def by_position_of(key: str) -> list[float] | None:  # (None: records written before it was measured)
        lists = extra[key]
        complete = all(len(h) == len(t) for h, t in zip(lists, by_position, strict=True))
        return [statistics.median(h) for h in lists] if complete else None

    return {"median_seconds": medians, "quietest_seconds": quietest,
            "above_quietest_seconds": sum(medians) - frequency * quietest,
            **{name: by_position_of(key) for key, (name, _, _, _) in HOST_TIMES.items()}}


def peak_gpu_bytes(summary: dict[str, Any]) -> int | None:
    """A run's peak GPU memory (None: not on a GPU): the training process's peak allocation, and what the device
    lane's process held on the same GPU (its slots are the training process's allocations, its math's are not)."""
    lane = (summary.get("memory_report") or {}).get("device", {}).get("lane_cache", 0)
    return summary["peak_gpu_bytes"] + lane if summary["peak_gpu_bytes"] else None


def steady_alloc_retries(records: list[dict[str, Any]], warmup: int) -> int | None:
    """How often the CUDA allocator freed its cached blocks to retry an allocation in the steady steps (None: not on
    a GPU, or no steady steps): each retry synchronizes the device, and they come on a card nearly full."""
    if len(records) <= warmup:
        return None
    before = records[warmup - 1].get("gpu_alloc_retries") if warmup else 0
    after = records[-1].get("gpu_alloc_retries")
    return None if before is None or after is None else after - before


def run_bench(base: RunConfig, out: Path, configs: tuple[str, ...] = CONFIGS, progress: bool = True) -> dict[str, Any]:
    """Trains each config with ``base``'s model, data, batch, seed and schedule (``base.lr`` for all when
    given, else each optimizer's default) and writes the comparison."""
    labels = [parse_config(label) and label for label in configs]  # validates every label before any run
    if len(set(labels)) != len(labels):
        raise ValueError(f"Invalid configs={list(configs)!r}: each config at most once")
    cfgs = {label: config_of(base, label) for label in labels}  # every config checked before the first run
    out.mkdir(parents=True, exist_ok=True)
    for name in BENCH_FILES:  # an earlier bench's: only this one's may be read after it, also where it is cut short
        (out / name).unlink(missing_ok=True)
    runs: dict[str, Run] = {}
    failed: dict[str, str] = {}  # a config the device's memory cannot hold: noted, and the others still run
    stop: BaseException | None = None  # Ctrl-C: the configs finished before it are still compared
    for position, (label, cfg) in enumerate(cfgs.items()):
        message = None
        try:
            replacing(out / label)
            train(cfg, out / label, progress=progress, overwrite=True)  # a bench regenerates its runs
        except torch.OutOfMemoryError as error:
            message = str(error)
        except BaseException as error:
            if not interrupted(error):
                raise
            stop = error
            failed[label] = f"interrupted after {recorded_steps(out / label)} recorded steps"
            failed.update({later: "not run (interrupted)" for later in list(cfgs)[position + 1:]})
            break
        if message is not None:  # (out of the handler: the error's frames, which hold the run's tensors, are gone)
            failed[label] = out_of_memory(message, out / label)
            continue
        runs[label] = load_run(out / label)
    if stop is not None:
        if runs:
            _compare(base, out, cfgs, runs, failed)
        raise stop
    if not runs:
        raise ValueError(f"Invalid configs={list(configs)!r} for --model {base.model} at --batch-size "
                         f"{base.batch_size}: every one ran out of GPU memory ({failed}); a smaller batch, or "
                         "--placement host (the preconditioners in pinned host memory), would take less")
    return _compare(base, out, cfgs, runs, failed)


def _compare(base: RunConfig, out: Path, cfgs: dict[str, RunConfig], runs: dict[str, Run],
             failed: dict[str, str]) -> dict[str, Any]:
    """Writes ``results.json``, the plots and the report of the configs in ``runs``; returns the results."""
    reference = runs.get("adamw")
    ref_profile = _profile([r["step_time"] for r in reference.records], run_warmup(reference)) if reference else None
    ref_loss = reference.summary["final_loss"] if reference else None
    rows = {}
    for label, run in runs.items():
        s, records = run.summary, run.records
        warmup = run_warmup(run)  # each config's own: (sync_refreshes + 1) x its f
        wall = _profile([r["step_time"] for r in records], warmup)
        gpu = _profile([r["gpu_step_time"] for r in records], warmup) \
            if all("gpu_step_time" in r for r in records) else None
        stats = s["runtime_stats"]
        row = {
            "final_loss": s["final_loss"],
            "final_val_loss": s["final_val_loss"],
            "median_step_seconds": wall["median"],
            "p99_step_seconds": wall["p99"],
            "max_step_seconds": wall["max"],
            "warmup_steps": warmup,
            "warmup_max_step_seconds": wall["warmup_max"],
            "slowest_steady_steps": [(step, seconds) for seconds, step in wall["slowest_steps"]],
            # the host's time in step() in each of them: a long one says the optimizer held the training thread
            "slowest_steady_in_step_seconds": [records[step - 1].get("host_optimizer_time")
                                               for _, step in wall["slowest_steps"]],
            "max_over_median": wall["max_over_median"],
            "gpu_median_step_seconds": gpu["median"] if gpu else None,
            "gpu_max_step_seconds": gpu["max"] if gpu else None,
            "gpu_max_over_median": gpu["max_over_median"] if gpu else None,
            "peak_gpu_bytes": peak_gpu_bytes(s),
            "peak_gpu_process_bytes": s.get("peak_gpu_process_bytes"),
            "alloc_retries_steady": steady_alloc_retries(records, warmup),
            "energy_joules_per_step": s["energy_joules_per_step"],
            "energy_device": s.get("energy_device"),
            "max_staleness_seen": stats.get("max_staleness_seen", 0 if stats else None),
            "staleness_histogram": stats.get("staleness_histogram"),
            "waits": stats.get("waits"),
            "wait_seconds": stats.get("wait_seconds"),
            "install_delay_mean_steps": stats.get("install_delay_mean_steps"),
            "install_delay_max_steps": stats.get("install_delay_max_steps"),
            "install_delay_by_side": stats.get("install_delay_by_side"),
            "mean_step_seconds": wall["mean"],
            # what the wall clock pays for the whole run, start-up included
            "mean_step_all_seconds": statistics.fmean(r["step_time"] for r in records),
            "refreshes_superseded": stats.get("refreshes_superseded"),
            "refreshes_deferred": stats.get("refreshes_deferred"),
            "recent_deferrals": stats.get("recent_deferrals"),
            "sets_on_device": stats.get("sets_on_device"),
            "device_busy_fraction": stats.get("device_busy_fraction"),
            "late_activation": {key: stats.get(f"late_activation_{key}") for key in (
                "steps", "host_seconds", "gpu_seconds", "tight_steps", "wait_seconds")},
        }
        pace = ref_profile["mean"] if ref_profile else wall["mean"]
        row["interval_profile"] = interval_profile(records, warmup, cfgs[label].precondition_frequency)
        row["refresh_work"] = refresh_work(stats, cfgs[label].precondition_frequency, len(records), pace,
                                           "adamw" if ref_profile else "own", s.get("runtime_stats_at_warmup"))
        if reference is not None:
            ref = reference.summary
            row["median_step_vs_adamw"] = wall["median"] / ref_profile["median"]
            row["mean_step_vs_adamw"] = wall["mean"] / ref_profile["mean"]
            reached = run.reach(ref_loss) if ref_loss is not None and math.isfinite(ref_loss) else None
            row["wall_to_adamw_loss_seconds"] = reached["wall"] if reached else None
            if s["energy_joules_per_step"] and ref["energy_joules_per_step"]:
                row["energy_vs_adamw"] = s["energy_joules_per_step"] / ref["energy_joules_per_step"]
        rows[label] = row
    for label, references in loss_references(list(rows)).items():
        rows[label]["val_loss_vs"] = {ref: relative_loss(rows[label]["final_val_loss"], rows[ref]["final_val_loss"])
                                      for ref in references}
    results = {"device": next(iter(runs.values())).summary["device"], "config": asdict(base), "runs": rows,
               "failed": failed, "software": software()}
    partial = out / ".results.json.tmp"  # (whole or absent: a second Ctrl-C may land while it is written)
    partial.write_text(json.dumps(results, indent=2))
    partial.replace(out / "results.json")
    _plot_series(runs, out / "step_time_series.png")
    _plot_energy(runs, out / "energy_per_step.png")
    write_report([out / label for label in runs], out)
    return results


def out_of_memory(message: str, run: Path) -> str:
    """What a config that ran out of GPU memory reports in the bench: the steps it recorded (its metrics are
    kept) and torch's account of the memory (``message``, less its advice). Its cached blocks go back to the
    device first, so that the next config starts on an empty one."""
    message = message.split(" If reserved but unallocated")[0].strip()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return f"out of GPU memory after {recorded_steps(run)} recorded steps: {message}"


def recorded_steps(run: Path) -> int:
    """The steps in ``run``'s ``metrics.jsonl`` (a config that did not finish keeps them)."""
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _plot_series(runs: dict[str, Run], path: Path) -> None:
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.8 * len(runs) + 0.6), sharex=True, squeeze=False)
    for ax, (label, run) in zip(axes[:, 0], runs.items()):
        steps = [r["step"] for r in run.records]
        ax.plot(steps, [1e3 * r["step_time"] for r in run.records], label="wall", linewidth=0.8)
        if all("gpu_step_time" in r for r in run.records):
            ax.plot(steps, [1e3 * r["gpu_step_time"] for r in run.records], label="CUDA events", linewidth=0.8)
        ax.set_ylabel("ms")
        ax.set_title(label, fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_energy(runs: dict[str, Run], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(11, 3.5))
    measured = {label: run for label, run in runs.items() if run.has_energy}
    for label, run in measured.items():
        ax.plot([r["step"] for r in run.records], [r["energy_joules"] for r in run.records], label=label,
                linewidth=0.8)
    ax.set(xlabel="step", ylabel="GPU energy per step (J)", title="energy per step (NVML total-energy counter)")
    if measured:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "energy n/a (no NVML energy counter on this device)", ha="center", va="center",
                transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(results: dict[str, Any]) -> str:
    meters = sorted({r["energy_device"] for r in results["runs"].values() if r.get("energy_device")})
    lines = [f"device: {results['device']}" + (f"; energy read from NVML GPU {', '.join(meters)}" if meters else ""),
             f"{'config':<18} {'loss':>7} {'val':>7} {'mean ms':>8} {'median':>8} {'max ms':>8} {'max/med':>8} "
             f"{'gpu med':>8} {'mean/adamw':>10} {'J/step':>8} {'J/adamw':>8} {'peak GB':>8} {'proc GB':>8} "
             f"{'waits':>6} {'dropped':>7} {'delay':>6} {'to adamw s':>10}"]
    for label, r in results["runs"].items():
        energy = f"{r['energy_joules_per_step']:.2f}" if r["energy_joules_per_step"] else "n/a"
        peak = f"{r['peak_gpu_bytes'] / 2**30:.2f}" if r["peak_gpu_bytes"] else "n/a"
        process = r.get("peak_gpu_process_bytes")  # (absent from results written before it was measured)
        process = f"{process / 2**30:.2f}" if process else "n/a"
        gpu = f"{1e3 * r['gpu_median_step_seconds']:.1f}" if r["gpu_median_step_seconds"] else "n/a"
        vs = f"{r['mean_step_vs_adamw']:.2f}x" if r.get("mean_step_vs_adamw") else "n/a"
        energy_vs = f"{r['energy_vs_adamw']:.3f}x" if "energy_vs_adamw" in r else "n/a"
        val = f"{r['final_val_loss']:.4f}" if r["final_val_loss"] is not None else "n/a"
        delay = r.get("install_delay_mean_steps")  # absent from results written before it was measured
        delay = "-" if delay is None else f"{delay:.2f}"
        dropped = [r.get("refreshes_superseded"), r.get("refreshes_deferred")]
        dropped = "-" if all(d is None for d in dropped) else str(sum(d or 0 for d in dropped))
        mean = r.get("mean_step_seconds")
        mean = "n/a" if mean is None else f"{1e3 * mean:.1f}"
        reached = r.get("wall_to_adamw_loss_seconds")
        reached = "-" if reached is None else f"{reached:.1f}"
        waits = r["waits"] if r["waits"] is not None else "-"
        lines.append(f"{label:<18} {r['final_loss']:>7.4f} {val:>7} {mean:>8} {1e3 * r['median_step_seconds']:>8.1f} "
                     f"{1e3 * r['max_step_seconds']:>8.1f} {r['max_over_median']:>8.2f} {gpu:>8} {vs:>10} "
                     f"{energy:>8} {energy_vs:>8} {peak:>8} {process:>8} {waits:>6} "
                     f"{dropped:>7} {delay:>6} {reached:>10}")
    for label, why in results.get("failed", {}).items():
        lines.append(f"{label:<18} {why}")
    lines.append("mean, median, max: the steady steps (after the first (sync_refreshes + 1) x f); dropped: refreshes "
                 "superseded or deferred; delay: the mean number of steps by which a version's first use comes after "
                 "native mode's (0 for native mode itself); to adamw s: training wall clock to AdamW's final loss "
                 "(10-step mean); peak GB: the training process's peak allocation, and what the device lane's process "
                 "held; proc GB: what the driver gave the run's processes at the steps' ends, their CUDA contexts and "
                 "allocator pools included (NVML; n/a where it does not list them)")
    work = {label: r["refresh_work"] for label, r in results["runs"].items() if r.get("refresh_work")}
    if work:
        pace = "AdamW's mean step" if next(iter(work.values()))["pace"] == "adamw" else "each run's own mean step"
        window = ("the steady steps'" if all(w.get("window") == "steady" for w in work.values())
                  else "the whole run's, start-up intervals included, where a run lacks the warm-up's counters")
        lines.append(f"refresh work per interval of f steps against capacity, at {pace} ({window}):")
        for label, w in work.items():
            lines.append(f"  {label:<18} workers {w['worker_core_seconds']:.3g} of "
                         f"{w['worker_capacity_core_seconds']:.3g} core-s ({w['worker_ratio']:.2f}x; "
                         f"{w['workers']} worker{'s' if w['workers'] != 1 else ''}"
                         + (f", {w['express_workers']} express" if w.get("express_workers") else "")
                         + "); device lane "
                         f"{w['device_seconds']:.3g} s of {w['interval_seconds']:.3g} s"
                         + (f" x {w['device_threads']} threads" if w.get("device_threads", 1) > 1 else "")
                         + f" ({w['device_ratio']:.2f}x)"
                         + (f", its threads' CPU {w['device_cpu_seconds']:.3g} s" if w.get("device_cpu_seconds")
                            else ""))
            if plan := w.get("planned_load"):
                lines.append(f"  {'':<18} the balancer's last plan: workers {plan['workers']:.2f}x, device lane "
                             f"{plan['device']:.2f}x their interval")
            jobs = w.get("job_latency") or {}
            if jobs.get("job_mean_run_seconds") is not None:
                small = (f"; the {jobs['small_jobs']} small blocks' {1e3 * jobs['small_job_mean_latency_seconds']:.0f} "
                         f"ms (running {1e3 * jobs['small_job_mean_run_seconds']:.0f})" if jobs["small_jobs"] else "")
                lines.append(f"  {'':<18} worker jobs from submission to end "
                             f"{1e3 * jobs['job_mean_latency_seconds']:.0f} ms (running "
                             f"{1e3 * jobs['job_mean_run_seconds']:.0f}){small}")
    profiles = {label: r["interval_profile"] for label, r in results["runs"].items() if r.get("interval_profile")}
    if profiles:
        lines.append("median steady step by position in the interval (step mod f, ms; native mode refreshes at 0), "
                     "and what the interval's steps add above its quietest position:")
        for label, p in profiles.items():
            lines.append(f"  {label:<18} {' '.join(f'{1e3 * t:.0f}' for t in p['median_seconds'])} | quietest "
                         f"{1e3 * p['quietest_seconds']:.1f}, above it {1e3 * p['above_quietest_seconds']:.0f} ms")
            for key, name, what, scale in HOST_TIMES.values():
                if p.get(key):  # absent from results written before it was measured, and off Linux
                    lines.append(f"  {'  ' + name:<18} {' '.join(f'{scale * t:.0f}' for t in p[key])} ({what})")
    runs = results["runs"]
    sides = {label: [s for s in r.get("install_delay_by_side") or [] if s["installs"]] for label, r in runs.items()}
    _per_run(lines, "install delay by factor side (mean steps after native mode's, and installs):", {
        label: ", ".join(f"{s['side']}: {s['mean_steps']:.2f} ({s['installs']})" for s in by_side)
        for label, by_side in sides.items() if by_side})
    _per_run(lines, "the latest deferred refreshes (step: set version, to the side it would have gone, why; the "
                    "set's versions still on their way):", {
        label: "; ".join(f"{d['step']}: {d['set']} v{d['version']} ({d['side']}, {d.get('reason', '?')}; "
                         + ", ".join(f"v{v} {side}" for v, side in d["in_flight"]) + ")"
                         for d in r["recent_deferrals"][-6:])
        for label, r in runs.items() if r.get("recent_deferrals")})
    _per_run(lines, "validation loss against native mode and the peers (this config's / theirs - 1; the target: "
                    "within 1%):", {
        label: ", ".join(f"vs {ref} " + ("n/a" if gap is None else f"{100 * gap:+.2f}%")
                         for ref, gap in r["val_loss_vs"].items())
        for label, r in runs.items() if r.get("val_loss_vs")})
    _per_run(lines, "the CUDA allocator's retries in the steady steps (it freed its cached blocks to allocate, a "
                    "device sync each; the card is nearly full):", {
        label: str(r["alloc_retries_steady"]) for label, r in runs.items() if r.get("alloc_retries_steady")})
    late = {label: r["late_activation"] for label, r in results["runs"].items()
            if (r.get("late_activation") or {}).get("steps")}
    if late:
        lines.append("step()'s late-activation wait, and after it to the step's end (mean ms; tight: steps whose GPU "
                     "ran out of work, waiting for the host to queue the step):")
        for label, w in late.items():
            spun = w.get("wait_seconds")  # (absent from results written before it was measured)
            waited = f"waited {1e3 * spun:.1f} (spinning), then " if spun is not None else ""
            lines.append(f"  {label:<18} {waited}host queued {1e3 * w['host_seconds']:.1f}, GPU ran "
                         f"{1e3 * w['gpu_seconds']:.1f}; tight {w['tight_steps']} of {w['steps']} steps")
    lines.append("slowest steady steps (step: ms, and the host's ms in step() where measured):")
    for label, r in results["runs"].items():
        in_step = r.get("slowest_steady_in_step_seconds") or [None] * len(r["slowest_steady_steps"])
        slowest = ", ".join(f"{step}: {1e3 * seconds:.0f}" + (f" ({1e3 * held:.0f})" if held is not None else "")
                            for (step, seconds), held in zip(r["slowest_steady_steps"], in_step, strict=True))
        lines.append(f"  {label:<18} warm-up {r['warmup_steps']} steps, max {1e3 * r['warmup_max_step_seconds']:.0f} ms"
                     f" | {slowest}")
    return "\n".join(lines)


def _per_run(lines: list[str], heading: str, texts: dict[str, str]) -> None:
    """A part of the table: ``heading``, then a line for each run that has something to say (none: no part)."""
    if texts:
        lines.append(heading)
        lines.extend(f"  {label:<18} {text}" for label, text in texts.items())
