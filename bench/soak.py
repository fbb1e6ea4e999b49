"""Soak test (issue 8, item 5): many steps of a small model in async mode with random worker delays.

Every refresh job first sleeps a pseudo-random time (``asteria.testing.set_random_worker_delay``, the
engine's fault-injection API, so the delay happens inside the real worker job), which makes the
activation barrier wait now and then. The script checks
  * the staleness bound at every step: ``opt.staleness()`` and ``runtime_stats()["max_staleness_seen"]``
    never exceed S;
  * that process resources do not grow after warm-up, sampled every ``--sample-every`` steps: host RSS,
    pinned host bytes (the CUDA host allocator's reserved bytes on a GPU, the optimizer's host refresh
    buffers on a CPU), open file descriptors (/proc/self/fd) and threads (/proc/self/status).
    Criterion per resource: the samples after the warm-up (the first ``--warmup`` fraction of the steps)
    are cut into quarters, and the largest value of the last quarter must not exceed the largest of the
    first quarter by more than the tolerance (``--rss-tolerance-mib`` for RSS; zero for the others);
  * that no refresh failed.
It prints a table, writes ``OUT/soak.json`` and ``OUT/soak.png``, and exits with status 1 on any
violation.

    nice python3 bench/soak.py --steps 10000 --out results/soak
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import asteria
from asteria import testing

RESOURCES = ("rss_bytes", "pinned_bytes", "open_fds", "threads")


def read_status(field: str) -> int:
    """A numeric field of /proc/self/status ("VmRSS" in kB is returned in bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            parts = line.split()
            return int(parts[1]) * (1024 if parts[-1] == "kB" else 1)
    raise RuntimeError(f"/proc/self/status has no field {field!r}")


def pinned_bytes(opt: torch.optim.Optimizer, device: torch.device) -> int:
    if device.type == "cuda":
        stats = torch.cuda.host_memory_stats()
        return int(stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0)))
    return int(opt.memory_report()["host"]["total"])


def sample(step: int, opt: torch.optim.Optimizer, device: torch.device) -> dict[str, int]:
    return {
        "step": step,
        "rss_bytes": read_status("VmRSS"),
        "pinned_bytes": pinned_bytes(opt, device),
        "open_fds": len(os.listdir("/proc/self/fd")),
        "threads": read_status("Threads"),
    }


def check_growth(samples: list[dict[str, int]], steps: int, warmup: float,
                 tolerances: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Per resource: the first and last quarter's maxima after warm-up, and whether it grew beyond its
    tolerance. Needs at least four samples after the warm-up."""
    after = [s for s in samples if s["step"] > warmup * steps]
    if len(after) < 4:
        raise ValueError(f"Invalid samples: {len(after)} after warm-up, need >= 4 (more steps or a smaller "
                         f"--sample-every)")
    quarter = len(after) // 4
    first, last = after[:quarter], after[-quarter:]
    verdict = {}
    for name in RESOURCES:
        first_max = max(s[name] for s in first)
        last_max = max(s[name] for s in last)
        verdict[name] = {"first_quarter_max": first_max, "last_quarter_max": last_max,
                         "overall_max": max(s[name] for s in after), "tolerance": tolerances[name],
                         "ok": last_max <= first_max + tolerances[name]}
    return verdict


def make_optimizer(name: str, model: torch.nn.Module, runtime: asteria.RuntimeConfig, frequency: int,
                   max_dim: int) -> torch.optim.Optimizer:
    params = list(model.named_parameters())
    common = dict(precondition_frequency=frequency, max_preconditioner_dim=max_dim, runtime=runtime)
    if name == "shampoo":
        return asteria.Shampoo(params, lr=3e-3, eps=1e-6, **common)
    if name == "soap":
        return asteria.SOAP(params, lr=3e-3, **common)
    return asteria.KLShampoo(params, lr=1e-3, **common)


def plot(samples: list[dict[str, int]], staleness: list[int], budget: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s["step"] for s in samples]
    fig, axes = plt.subplots(5, 1, figsize=(8, 12), sharex=True)
    series = [("rss_bytes", "host RSS (MiB)", 2**20), ("pinned_bytes", "pinned / host buffers (KiB)", 2**10),
              ("open_fds", "open file descriptors", 1), ("threads", "threads", 1)]
    for ax, (key, label, unit) in zip(axes, series):
        ax.plot(steps, [s[key] / unit for s in samples], lw=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[4].plot(range(1, len(staleness) + 1), staleness, lw=0.5)
    axes[4].axhline(budget, color="red", ls="--", lw=1, label=f"bound S={budget}")
    axes[4].set_ylabel("staleness in use")
    axes[4].set_xlabel("step")
    axes[4].legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--optimizer", choices=["shampoo", "soap", "kl-shampoo"], default="shampoo")
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--frequency", type=int, default=5, help="precondition_frequency")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--width", type=int, default=48, help="hidden width of the MLP")
    parser.add_argument("--max-delay-ms", type=float, default=20.0, help="random worker delay per job, upper bound")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps excluded from the check")
    parser.add_argument("--rss-tolerance-mib", type=float, default=1.0,
                        help="RSS growth allowed (a leak of ~200 bytes per step over 10,000 steps exceeds 1 MiB)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads (the model is tiny: more threads only add overhead)")
    parser.add_argument("--out", type=Path, default=Path("results/soak"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 8 * args.sample_every:
        parser.error(f"--steps {args.steps} must be >= 8 x --sample-every {args.sample_every}")

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)
    device = torch.device(args.device)
    width = args.width
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                torch.nn.Tanh(), torch.nn.Linear(width, 4)).to(device)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(1024, 16, generator=gen)
    y = torch.sin(x @ torch.randn(16, 4, generator=gen))
    x, y = x.to(device), y.to(device)
    runtime = asteria.RuntimeConfig(mode="async", staleness=args.staleness, workers=args.workers, timeout_s=120.0)
    name = args.optimizer.replace("kl-shampoo", "kl")
    # max_preconditioner_dim = width: every weight keeps one factor per dimension (Shampoo would otherwise
    # merge a (width, 16) weight into one width * 16 factor).
    opt = make_optimizer(name, model, runtime, args.frequency, max_dim=width)
    testing.set_random_worker_delay(opt, args.max_delay_ms / 1000.0, seed=args.seed)

    samples: list[dict[str, int]] = []
    staleness_seen: list[int] = []
    violations: list[str] = []
    losses: list[float] = []
    started = time.perf_counter()
    with opt:
        bar = tqdm(range(1, args.steps + 1), disable=args.no_progress, mininterval=1.0, desc="soak")
        for step in bar:
            idx = torch.arange((step * 32) % 1024, (step * 32) % 1024 + 32, device=device)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            in_use = opt.staleness()
            worst = opt.runtime_stats()["max_staleness_seen"]
            staleness_seen.append(in_use)
            if in_use > args.staleness or worst > args.staleness:
                violations.append(f"step {step}: staleness {in_use}, max seen {worst} > S={args.staleness}")
            if step % args.sample_every == 0:
                samples.append(sample(step, opt, device))
                losses.append(float(loss.detach()))
                bar.set_postfix(rss_mib=f"{samples[-1]['rss_bytes'] / 2**20:.1f}", loss=f"{losses[-1]:.4f}")
        stats = opt.runtime_stats()
        faults = opt._refresher.engine.stats()["faults_triggered"]
    seconds = time.perf_counter() - started

    tolerances = {"rss_bytes": int(args.rss_tolerance_mib * 2**20), "pinned_bytes": 0, "open_fds": 0, "threads": 0}
    growth = check_growth(samples, args.steps, args.warmup, tolerances)
    for key, verdict in growth.items():
        if not verdict["ok"]:
            violations.append(f"{key} grew: last-quarter max {verdict['last_quarter_max']} > first-quarter max "
                              f"{verdict['first_quarter_max']} + tolerance {verdict['tolerance']}")
    if stats["refresh_failures"]:
        violations.append(f"{stats['refresh_failures']} refreshes failed")

    print(f"\nsoak: {args.optimizer}, {args.steps} steps on {device} in {seconds:.0f} s "
          f"({1000 * seconds / args.steps:.2f} ms/step), S={args.staleness}, f={args.frequency}, "
          f"random worker delay < {args.max_delay_ms} ms on {faults} jobs")
    print(f"{'resource':<14}{'first quarter max':>20}{'last quarter max':>20}{'tolerance':>12}  ok")
    for key, v in growth.items():
        print(f"{key:<14}{v['first_quarter_max']:>20}{v['last_quarter_max']:>20}{v['tolerance']:>12}  {v['ok']}")
    print(f"staleness: max in use {max(staleness_seen)}, max seen by the registry {stats['max_staleness_seen']}, "
          f"bound {args.staleness}; histogram {stats['staleness_histogram']}")
    print(f"refreshes {stats['refreshes']} (failed {stats['refresh_failures']}), barrier waits {stats['waits']} "
          f"({stats['wait_seconds']:.2f} s), loss {losses[0]:.4f} -> {losses[-1]:.4f}")

    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "device": str(device), "host": platform.node(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "seconds": seconds, "ms_per_step": 1000 * seconds / args.steps,
        "growth": growth, "max_staleness_in_use": max(staleness_seen), "runtime_stats": stats,
        "faults_triggered": faults, "losses": losses, "samples": samples, "violations": violations,
        "ok": not violations,
    }
    (args.out / "soak.json").write_text(json.dumps(record, indent=1, default=str))
    plot(samples, staleness_seen, args.staleness, args.out / "soak.png",
         f"soak: {args.optimizer}, {args.steps} steps, S={args.staleness}, delays < {args.max_delay_ms} ms")
    if violations:
        print("VIOLATIONS:\n  " + "\n  ".join(violations[:20]), file=sys.stderr)
        return 1
    print(f"OK: wrote {args.out / 'soak.json'} and {args.out / 'soak.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
