"""The ``asteria`` command: ``train`` one run (checkpoints, ``--resume``; on several processes under
torchrun: ``torchrun --nproc-per-node N -m asteria.train.cli train --parallel ddp|fsdp|hsdp ...``), ``demo``
(AdamW vs Asteria Shampoo with a report), ``bench`` (every optimizer x mode side by side) and ``report``
over finished runs. Experiments built on these (staleness sweeps, comparisons over seeds) live in
``tools/``, outside the package."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

import torch

import asteria
from asteria.config import PLACEMENTS, QUEUE_ORDERS
from asteria.hooks import PREFETCH_POINTS
from asteria.train import checkpoint
from asteria.train.bench import CONFIGS, PEER_CONFIGS, format_table, run_bench
from asteria.train.checkpoint import interrupted
from asteria.train.distributed import PARALLEL_MODES
from asteria.train.loop import STOP_REQUESTED, train
from asteria.train.model import PRESETS
from asteria.train.outdir import replacing
from asteria.train.peers import PEERS
from asteria.train.report import write_report
from asteria.train.run_config import (
    ASYNC_ONLY_SETTINGS,
    FIRST_BASES,
    LR_SCHEDULES,
    MATMUL_PRECISIONS,
    OPTIMIZERS,
    RunConfig,
)

OPTIONAL_TYPES = {"lr": float, "beta2": float, "workers": int, "data": str, "tokenizer": str, "local_world_size": int,
                  "warmup_steps": int, "lag_steps": int, "peer_path": str, "start_preconditioning_step": int,
                  "first_basis": str, "device_sms": int, "express_workers": int, "group_bytes": int}
# None (the library's choice), True or False
OPTIONAL_FLAGS = {"stagger", "stagger_split", "stagger_small", "late_activation", "deterministic", "device_refresh",
                  "device_process", "precondition_1d"}
HELP = {
    "group_bytes": "the most preconditioner bytes of one batched shape group (MemoryConfig.group_bytes; default: "
                   "1 GiB on the device, 32 MiB under the host placements): a step's temporaries are each a group's "
                   "parameter size, so the bound keeps them small where the card is nearly full (olmo2-1b on 80 GB)",
    "deterministic": "activate each refresh exactly --lag-steps after its snapshot (reproducible bit for bit; the "
                     "default on several ranks, which need it); --no-deterministic (the default on one process) uses "
                     "each block's newest finished refresh",
    "start_preconditioning_step": "the step of the first preconditioner, Shampoo's root or SOAP's basis (default: "
                                  "the optimizer's own, the precondition frequency; kl-shampoo takes none)",
    "beta2": "the second-moment decay, betas[1]: Shampoo's factors and grafting, SOAP's second moment and factors, "
             "KL-Shampoo's, AdamW's and the peers' alike (default: the optimizer's own: 0.999 for Shampoo and AdamW, "
             "0.95 for SOAP, 0.98 for KL-Shampoo)",
    "first_basis": "how SOAP takes each block's first eigenbasis: eigh (a full eigendecomposition, the default) or "
                   "qr (one step of orthogonal iteration from the identity, as Distributed Shampoo's SOAP does)",
    "precondition_1d": "give 1-D parameters (norm gains, biases) full-matrix factors too, as Distributed Shampoo "
                       "does (shampoo, soap; default: off, they take Adam's step)",
    "lag_steps": "with the deterministic rule, use each refresh this many steps after its snapshot (at most S x "
                 "the frequency; default: one interval), waiting for it if need be",
    "sync_refreshes": "the first N refreshes of each block (the bootstrap is the first) are used at their own "
                      "step, waited for if need be; later ones follow the staleness rule",
    "stagger": "spread the factor sets' refreshes over the steps of each interval (default: in Asteria mode on "
               "one process, unless every version is used at its own step: --staleness 0 or --lag-steps 0); "
               "--no-stagger refreshes every set at the same step, as native mode does",
    "stagger_split": "split shape groups whose factor sets would carry more than 1/(f x --stagger-sets-per-step) of "
                     "an interval's refresh work, so that the stagger spreads the jobs evenly over the steps (the "
                     "same math, smaller batches; default: wherever one process staggers)",
    "stagger_sets_per_step": "with the split, cut the large sets to at most 1/(f x N) of an interval's refresh work: "
                             "a cut set is also the unit the GPU's refresh work takes from the workers (default: 2)",
    "stagger_small": "spread the small blocks' sets (at most half the largest factor's size, the express workers' "
                     "jobs) by their own work, and cut them finer with the split, so that each step brings an even "
                     "share of them (default: on; --no-stagger-small: by their share of all the work)",
    "deterministic_kernels": "torch's deterministic kernels, strictly (an operator without one raises; attention's "
                             "backward takes its deterministic algorithm) with cuBLAS's fixed workspace, so that runs "
                             "of one config differ only by the activation timing of --no-deterministic",
    "in_flight": "with the newest-finished rule, versions of a factor set on their way at once (each a snapshot and "
                 "a result buffer per block in pinned memory); a refresh due beyond that is deferred to its next turn",
    "queue_order": "with the newest-finished rule, the order in which the CPU workers take queued refreshes: "
                   "'deadline' (by the step each is due at) or 'shortest' (the smallest blocks first)",
    "express_workers": "CPU threads beside the workers that take only the refreshes of blocks at most half the "
                       "largest's size, preempting the workers' long roots (default: as many as the workers where "
                       "blocks are that small and the workers pinned; 0: none)",
    "worker_nice": "the CPU workers' and the device lane's threads' Linux nice, 0..19 (the express workers run at "
                   "half of it)",
    "device_refresh": "let the refresh executor compute on the GPU beside the CPU workers (default: where the "
                      "parameters are on a GPU)",
    "device_share": "the share of an interval's wall time the GPU's refresh work may fill when the workers cannot "
                    "keep up (lower: shorter steps, more deferred refreshes)",
    "stream_priority": "the CUDA priority of the stream the run trains on: 0, the default stream's, is CUDA's lowest, "
                       "the device lane's too; a negative number starts training's kernels ahead of the lane's",
    "device_threads": "the GPU refresh work's threads, each on its own stream, so that the small kernels of "
                      "concurrent refreshes overlap (default: 1)",
    "device_process": "compute the GPU refresh work in a child process, whose CUDA context cannot hold the training "
                      "thread's kernel launches as a GPU eigh in the training process does (default: on a GPU)",
    "device_sms": "the GPU's SMs that its refresh work may occupy, through a CUDA green context (default: all of "
                  "them, shared with training)",
    "late_activation": "with --no-deterministic, step() waits until the GPU nearly ends the backward pass before "
                       "its last activation, so refreshes finished meanwhile are used a step sooner (default: on "
                       "for --no-deterministic async runs)",
    "prefetch": "where asteria.attach activates new preconditioner versions: forward_end, forward_start or step "
                "(no hook: in step(), after the backward is queued); the same math at each, only the timing differs",
    "matmul_precision": "float32 matrix products: 'highest' (float32) or 'high' (TF32 tensor cores on GPUs)",
    "model": "model preset (OLMo-2 architecture, random init)",
    "data": "a text file or a folder of them (default: the Python standard library's sources)",
    "tokenizer": "a local HF tokenizer folder (default: bytes, 256 tokens)",
    "checkpoint_every": "write a checkpoint every N steps into OUT/checkpoints (0: never)",
    "keep_checkpoints": "newest checkpoints kept (0: all)",
    "device": "cpu or cuda (default: cuda when available)",
    "peer_path": "for the ds-* optimizers (Meta's Distributed Shampoo, a peer in the bench): the folder of a checkout "
                 "of github.com/facebookresearch/optimizers, which holds distributed_shampoo/",
    "lr": "peak learning rate (default: the optimizer's own)",
    "lr_schedule": "after the warm-up: 'cosine' (decay to 10%% of the peak at the last step) or 'constant'",
    "warmup_steps": "linear learning-rate warm-up steps (default: 10%% of the steps, at most 200)",
    "grad_clip": "clip the global gradient norm to this before each step (0: no clipping)",
    "max_preconditioner_dim": "largest factor side; larger dimensions are split into blocks of at most this",
    "workers": "C++ refresh workers per process (default: one per CPU of its share of the host, less 2 cores)",
    "batch_size": "sequences per step and process (the global batch is this x the number of processes)",
    "parallel": "under torchrun with several processes: ddp (replicated model), fsdp (FSDP2, fully_shard per "
                "decoder layer and the root) or hsdp (the same, sharded within each node and replicated across "
                "nodes: 2 or more nodes of 2 or more ranks)",
    "local_world_size": "ranks per node under torchrun; less than the processes per host simulates several nodes "
                        "(default: torchrun's LOCAL_WORLD_SIZE)",
}


@contextlib.contextmanager
def stop_after_the_step(enabled: bool) -> Iterator[None]:
    """While ``enabled`` (one process, in the main thread), a first Ctrl-C asks the training loop to stop
    after the step in progress (``loop.STOP_REQUESTED``: never inside a checkpoint's write), a second one
    stops at once."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if STOP_REQUESTED.is_set():
            raise KeyboardInterrupt
        STOP_REQUESTED.set()
        print("\nasteria: stopping after this step (Ctrl-C again: at once)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        STOP_REQUESTED.clear()


# Options that only Asteria's async mode reads (native mode computes every refresh inside the step and uses
# it there): the settings a resume ignores without it, and the workers; and those only a second-order
# optimizer reads (AdamW ignores them all).
ASYNC_ONLY = (*ASYNC_ONLY_SETTINGS, "workers", "in_flight", "queue_order", "express_workers", "worker_nice",
              "device_refresh", "device_share", "device_sms", "device_threads", "device_process")
SECOND_ORDER_ONLY = (*ASYNC_ONLY, "sync_refreshes", "precondition_frequency", "max_preconditioner_dim", "prefetch",
                     "start_preconditioning_step", "precondition_1d", "first_basis")


def check_unused_options(cfg: RunConfig, given: set[str], one_process: bool = True) -> None:
    """Refuses, by name, the options of ``asteria train`` that the run would not read, rather than ignoring
    them. ``given`` holds the RunConfig fields set on the command line. Refused: the refresh and activation
    options without async refreshes (a sync run or AdamW), the preconditioner options for AdamW (native mode
    may stagger its own refreshes, aligned after ``--sync-refreshes``), a host placement for either,
    ``--keep-checkpoints`` without ``--checkpoint-every`` and ``--parallel fsdp`` / ``hsdp`` on one process."""
    if "keep_checkpoints" in given and cfg.checkpoint_every == 0:
        raise ValueError(f"Invalid --keep-checkpoints {cfg.keep_checkpoints} without --checkpoint-every: it bounds "
                         "the checkpoints kept, and the run writes none; give --checkpoint-every N too")
    if "parallel" in given and cfg.parallel != "ddp" and one_process:
        raise ValueError(f"Invalid --parallel {cfg.parallel} on one process: it sets how torchrun's processes "
                         "share the model; run under torchrun with 2 or more processes, or leave it out")
    adamw = cfg.optimizer == "adamw"
    peer = cfg.optimizer in PEERS
    if "peer_path" in given and not cfg.optimizer.startswith("ds-"):
        raise ValueError(f"Invalid --peer-path {cfg.peer_path} with --optimizer {cfg.optimizer}: it names the checkout "
                         "of Meta's Distributed Shampoo that the ds-* optimizers import; leave it out")
    if "group_bytes" in given and (adamw or peer):
        raise ValueError(f"Invalid --group-bytes {cfg.group_bytes} with --optimizer {cfg.optimizer}: it bounds the "
                         "shape groups of Asteria's optimizers; leave it out")
    if cfg.mode == "async" and not adamw and not peer:
        return
    what = "--optimizer adamw" if adamw else f"--optimizer {cfg.optimizer}" if peer else "--mode sync"
    unread = SECOND_ORDER_ONLY if adamw else ASYNC_ONLY
    if not adamw and (peer or cfg.stagger is not True):
        unread += ("sync_refreshes",)

    def switch(name: str) -> str:  # the flag as given: --name or --no-name
        return f"--{'' if getattr(cfg, name) else 'no-'}{name.replace('_', '-')}"

    for name in unread:
        if name in given:
            value = getattr(cfg, name)
            flag = switch(name) if isinstance(value, bool) else f"--{name.replace('_', '-')} {value}"
            raise ValueError(f"Invalid {flag} with {what}: "
                             + ("AdamW has no preconditioners" if adamw else
                                f"{'it' if peer else 'native mode'} computes every refresh inside its step and uses "
                                "it there")
                             + (" (and aligns a --stagger after the first --sync-refreshes)"
                                if name == "sync_refreshes" else "") + "; leave it out")

    # The split and the cuts apply only where the schedule is staggered: native mode staggers with --stagger alone.
    unstaggered = adamw or cfg.stagger is not True
    unstaggered_run = what if adamw else f"{what} without --stagger"
    for flag, asked, unused in (
            ("--late-activation", cfg.late_activation is True, what),
            (switch("deterministic"), cfg.deterministic is not None, what),
            (switch("stagger"), (adamw or peer) and "stagger" in given, what),
            (switch("stagger_split"), "stagger_split" in given and unstaggered, unstaggered_run),
            (switch("stagger_small"), "stagger_small" in given and unstaggered, unstaggered_run),
            (f"--stagger-sets-per-step {cfg.stagger_sets_per_step}", "stagger_sets_per_step" in given and unstaggered,
             unstaggered_run)):
        if asked:
            raise ValueError(f"Invalid {flag} with {unused}: it sets how the refreshes are scheduled or activated, "
                             f"which {unused} does not use")
    if cfg.placement not in ("auto", "device"):
        raise ValueError(f"Invalid --placement {cfg.placement} with {what}: "
                         + ("AdamW has no preconditioners" if adamw else
                            f"{'it' if peer else 'native mode'} keeps its preconditioners on the device")
                         + "; use auto or device")


def out_dir(text: str) -> Path:
    """``--out``: a folder path (not empty, not an existing file)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"invalid --out={text!r}: must be a folder path")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"invalid --out={text!r}: it is an existing file, not a folder")
    existing = next((p for p in path.absolute().parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise argparse.ArgumentTypeError(f"invalid --out={text!r}: {str(existing)!r} is an existing file, not a folder")
    return path


#: the values an option takes, shown in its help (RunConfig checks them, naming the value and these)
CHOICES = {"optimizer": OPTIMIZERS, "model": tuple(PRESETS), "mode": ("sync", "async"), "placement": PLACEMENTS,
           "prefetch": PREFETCH_POINTS, "lr_schedule": LR_SCHEDULES, "parallel": PARALLEL_MODES,
           "matmul_precision": MATMUL_PRECISIONS, "device": ("cpu", "cuda"), "first_basis": FIRST_BASES,
           "queue_order": QUEUE_ORDERS}


def add_run_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One option per RunConfig field; RunConfig validates the values (also for the scripts in tools/)."""
    for f in fields(RunConfig):
        if f.name in skip:
            continue
        default = "auto" if f.name == "device" else f.default
        help_text = HELP.get(f.name, "")
        if f.name in CHOICES:
            help_text = f"{help_text}; one of {', '.join(CHOICES[f.name])}".lstrip("; ")
        if "default" not in help_text:  # a help text that explains its default says it once
            help_text = f"{help_text} [default: {default}]".strip()
        if isinstance(f.default, bool) or f.name in OPTIONAL_FLAGS:  # --name / --no-name
            parser.add_argument(f"--{f.name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
            continue
        kind = OPTIONAL_TYPES[f.name] if f.default is None else type(f.default)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None, help=help_text)


def run_config_from_args(args: argparse.Namespace, **overrides) -> RunConfig:
    """The RunConfig of parsed ``add_run_arguments`` options (the device: a GPU where there is one)."""
    values = {f.name: getattr(args, f.name) for f in fields(RunConfig) if getattr(args, f.name, None) is not None}
    values.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    return RunConfig(**(values | overrides))


def bench_base(args: argparse.Namespace) -> RunConfig:
    """The settings a bench's configs share (``run_config_from_args`` of options without --optimizer): AdamW
    stands in as the optimizer, since it takes every optimizer's own settings and reads none; each config's
    RunConfig checks them against its optimizer (a SOAP-only setting beside a Shampoo config is refused)."""
    return run_config_from_args(args, optimizer="adamw")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asteria", description=__doc__.replace("``", ""))
    parser.add_argument("--version", action="version", version=f"asteria {asteria.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser("train", help="train one model with one optimizer")
    add_run_arguments(train_p)
    train_p.add_argument("--out", type=out_dir, required=True, help="run directory")
    train_p.add_argument("--resume", action="store_true",
                         help="continue from the newest complete checkpoint in --out (a fresh start if --out "
                              "holds no run)")
    train_p.add_argument("--overwrite", action="store_true",
                         help="replace an earlier run in --out (its metrics, summary, TensorBoard logs, traces and "
                              "checkpoints); without it such a folder is refused. With --resume: resume where "
                              "a checkpoint exists, else replace the run")
    train_p.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "LAST"), default=None,
                         help="write a torch.profiler trace of these steps per rank, OUT/trace-rank<R>.json.gz "
                              "(a diagnostic that slows them; read it with bench/trace_steps.py)")
    demo_p = sub.add_parser("demo", help="AdamW vs Asteria Shampoo (async), with a report")
    add_run_arguments(demo_p, skip=("optimizer", "mode"))
    demo_p.add_argument("--out", type=out_dir, default=Path("runs/demo"))
    bench_p = sub.add_parser("bench", help="every optimizer x mode side by side: results.json, plots, a table")
    add_run_arguments(bench_p, skip=("optimizer", "mode"))
    bench_p.add_argument("--out", type=out_dir, required=True)
    bench_p.add_argument("--configs", nargs="+", default=list(CONFIGS),
                         help=f"subset of {CONFIGS}; a second-order config followed by -f<N> runs at "
                              "precondition_frequency N instead of --precondition-frequency (e.g. soap-async-f5); "
                              f"peers beside them: {PEER_CONFIGS} (ds-*: Meta's Distributed Shampoo from --peer-path; "
                              "hb-*: heavyball, where installed)")
    report_p = sub.add_parser("report", help="plots and a Markdown table over finished runs")
    report_p.add_argument("runs", type=Path, nargs="+")
    report_p.add_argument("--out", type=out_dir, default=Path("runs/report"))
    report_p.add_argument("--target-loss", type=float, default=None,
                          help="loss for the time-to-target column [default: AdamW's final loss]")
    return parser


def _new_folders(out: Path | None) -> list[Path]:
    """``out`` and those of its parents that do not exist yet, deepest first."""
    if out is None:
        return []
    new = []
    for path in (out.absolute(), *out.absolute().parents):
        if path.exists():
            break
        new.append(path)
    return new


def _remove_if_empty(new: list[Path]) -> None:
    """Removes the folders a refused command created and left empty (subfolders first), so that a refusal
    leaves nothing behind; a folder holding any file stays."""
    if not new or not new[0].is_dir():
        return
    for root, _, _ in sorted(os.walk(new[0]), key=lambda entry: -len(entry[0])):
        with contextlib.suppress(OSError):
            Path(root).rmdir()
    for path in new[1:]:
        with contextlib.suppress(OSError):
            path.rmdir()


def _one_line(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> str:
    """A warning as the command shows it: one line, without the source line that raised it."""
    return f"asteria: {category.__name__}: {message}\n"


def main(argv: list[str] | None = None) -> int:
    """The ``asteria`` command (``argv``: its arguments, default ``sys.argv[1:]``); returns the exit status.
    Run as a command under torchrun, a process that ends without an exception leaves through ``os._exit``
    once its output is flushed (see ``_leave``)."""
    formatwarning = warnings.formatwarning
    warnings.formatwarning = _one_line
    try:
        code = _main(argv)
    finally:
        warnings.formatwarning = formatwarning
    if argv is None and os.environ.get("WORLD_SIZE", "1") != "1":
        _leave(code)
    return code


def _leave(code: int) -> NoReturn:
    """Ends a torchrun worker without the interpreter's finalization. Gloo's worker threads release a finished
    collective's tensors on their own after the caller's wait has returned; when that release comes while the
    interpreter is finalizing, it cannot take the GIL and the process aborts ("terminate called without an
    active exception", SIGABRT), turning a completed run into a failed one. Everything the run writes is closed
    by then (the process group destroyed, files and TensorBoard closed), so only the streams need flushing."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    new = _new_folders(getattr(args, "out", None)) if rank == "0" else []
    try:
        if args.command != "train" and world != "1":
            raise ValueError(f"Invalid command={args.command!r} under torchrun (WORLD_SIZE={world}): only 'train' "
                             "runs on several processes (bench/scaling.py launches torchrun itself)")
        if args.command == "train":
            cfg = run_config_from_args(args)
            given = {f.name for f in fields(RunConfig) if getattr(args, f.name, None) is not None}
            check_unused_options(cfg, given, world == "1")
            with stop_after_the_step(world == "1"):
                summary = train(cfg, args.out, resume=args.resume, overwrite=args.overwrite,
                                profile_steps=tuple(args.profile_steps) if args.profile_steps else None)
            if rank == "0":
                resumed = f" (resumed from {summary['resumed_from']})" if summary["resumed_from"] else ""
                val = "n/a" if summary["final_val_loss"] is None else f"{summary['final_val_loss']:.4f}"
                procs = f" on {summary['distributed']['world_size']} processes" if summary["distributed"] else ""
                print(f"{summary['label']}: {summary['steps_done']} steps{procs}{resumed}, "
                      f"final loss {summary['final_loss']:.4f}, val {val}")
        elif args.command == "demo":
            runs = []
            for optimizer, mode in (("adamw", "sync"), ("shampoo", "async")):
                cfg = run_config_from_args(args, optimizer=optimizer, mode=mode)
                replacing(args.out / cfg.label)
                summary = train(cfg, args.out / cfg.label, overwrite=True)
                print(f"{summary['label']:>14}: final loss {summary['final_loss']:.4f}, "
                      f"val {summary['final_val_loss']:.4f}, median step {1e3 * summary['median_step_seconds']:.1f} ms")
                runs.append(args.out / cfg.label)
            print(f"report: {write_report(runs, args.out)}")
        elif args.command == "bench":
            with stop_after_the_step(True):  # (Ctrl-C: the finished configs are still compared)
                results = run_bench(bench_base(args), args.out, tuple(args.configs))
            print(format_table(results))
            print(f"results: {args.out / 'results.json'}")
            if results["failed"]:
                print(f"asteria: error: {', '.join(results['failed'])} ran out of GPU memory (above)", file=sys.stderr)
                return 1
        else:
            print(f"report: {write_report(args.runs, args.out, args.target_loss)}")
    except (ValueError, OSError) as error:
        if isinstance(error, (TimeoutError, ConnectionError)):  # a stalled run or a lost peer, not bad input
            raise
        where = f" (rank {rank})" if world != "1" else ""
        print(f"asteria: error{where}: {error}", file=sys.stderr)
        _remove_if_empty(new)
        return 2
    except BaseException as error:  # Ctrl-C, also inside a DCP save (which wraps it in a CheckpointException)
        if not interrupted(error):
            raise
        hint = ""
        if args.command == "train":
            hint = (" (pass --resume to continue from its newest checkpoint)"
                    if checkpoint.published(args.out / "checkpoints") else
                    " (no checkpoint to resume from: --overwrite starts it again)")
        elif args.command == "bench" and (args.out / "results.json").exists():  # (this bench's: it removes older)
            with contextlib.suppress(ValueError, KeyError):  # (a second Ctrl-C inside the report: the table is there)
                print(format_table(json.loads((args.out / "results.json").read_text())))
            hint = f" (the configs it finished: {args.out / 'results.json'})"
        print(f"asteria: interrupted{hint}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
