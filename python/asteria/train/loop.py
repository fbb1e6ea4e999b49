"""One training run of a ``RunConfig`` (``run_config.py``): model, data, optimizer, metrics (JSON lines and
TensorBoard), progress bar, checkpoints and resume; on one process, or on several under torchrun (DDP,
FSDP2 or HSDP: see ``train/distributed.py``)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch
from tqdm import tqdm

import asteria
from asteria.config import is_int
from asteria.train import checkpoint
from asteria.train.checkpoint import CheckpointError
from asteria.train.data import PackedData, load_documents, load_tokenizer
from asteria.train.distributed import (
    SHARDED_MODES,
    DistributedRun,
    check_parallel,
    local_optimizer_state_to_dtensors,
    resolve_layout,
)
from asteria.train.meters import EnergyMeter, ProcessMemoryMeter, StepTimer, rss_bytes, thread_sched
from asteria.train.model import build_model, decoder_layers, next_token_loss, parameter_count
from asteria.train.outdir import claim_out, settle_replaced
from asteria.train.peers import ASTERIA_CLASSES, PEERS, betas_with, make_peer
from asteria.train.profiling import StepProfiler, check_profile_steps
from asteria.train.provenance import software

# The run's settings live in run_config.py; they stay importable from here, beside ``train``, which takes them.
from asteria.train.run_config import ASTERIA_OPTIMIZERS as ASTERIA_OPTIMIZERS
from asteria.train.run_config import ASYNC_ONLY_SETTINGS as ASYNC_ONLY_SETTINGS
from asteria.train.run_config import DEFAULT_LR as DEFAULT_LR
from asteria.train.run_config import LEGACY_SETTINGS as LEGACY_SETTINGS
from asteria.train.run_config import LR_SCHEDULES as LR_SCHEDULES
from asteria.train.run_config import MATMUL_PRECISIONS as MATMUL_PRECISIONS
from asteria.train.run_config import MIN_LR_RATIO as MIN_LR_RATIO
from asteria.train.run_config import OPTIMIZERS as OPTIMIZERS
from asteria.train.run_config import RESUME_MUST_MATCH as RESUME_MUST_MATCH
from asteria.train.run_config import SECOND_ORDER_SETTINGS as SECOND_ORDER_SETTINGS
from asteria.train.run_config import RunConfig, check_resumable
from asteria.train.run_config import resolved_stagger_split as resolved_stagger_split
from asteria.train.runs import WORK_COUNTERS, steady_warmup

#: set by the CLI's first Ctrl-C (one process): the loop stops after the step in progress and its checkpoint
STOP_REQUESTED = threading.Event()


def clip_gradients(model: torch.nn.Module, max_norm: float) -> None:
    """Scales the gradients down to a global norm of ``max_norm``, without a host sync. A non-finite norm
    leaves them as they are, so that the optimizer's own policy meets the bad gradient where it is (an
    Asteria optimizer skips only the blocks that hold it) instead of every gradient turning NaN."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    norm = torch.nn.utils.get_total_norm(grads)
    norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)


def make_optimizer(cfg: RunConfig, model: torch.nn.Module,
                   local_world_size: int | None = None) -> torch.optim.Optimizer:
    """The run's optimizer over ``model``'s parameters (DTensors once FSDP2 has sharded it);
    ``local_world_size`` is the node size of a distributed run."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                 betas=betas_with(torch.optim.AdamW, cfg.beta2),
                                 fused=True if cfg.device == "cuda" else None)
    if cfg.optimizer in PEERS:
        return make_peer(cfg.optimizer, model.parameters(), cfg.learning_rate, cfg.weight_decay,
                         cfg.precondition_frequency, cfg.max_preconditioner_dim, cfg.peer_path, cfg.beta2)
    kind = ASTERIA_CLASSES[cfg.optimizer]
    # the settings whose None leaves the optimizer's own default
    chosen = {name: getattr(cfg, name) for name in ("start_preconditioning_step", "precondition_1d", "first_basis")
              if getattr(cfg, name) is not None}
    return kind(model.named_parameters(), lr=cfg.learning_rate, betas=betas_with(kind, cfg.beta2),
                weight_decay=cfg.weight_decay, precondition_frequency=cfg.precondition_frequency,
                max_preconditioner_dim=cfg.max_preconditioner_dim, runtime=runtime_config(cfg, local_world_size),
                **chosen)


def runtime_config(cfg: RunConfig, local_world_size: int | None = None) -> asteria.RuntimeConfig:
    """The ``asteria.RuntimeConfig`` of a second-order run (the async-only settings in async mode only)."""
    memory = asteria.MemoryConfig(placement=cfg.placement if cfg.mode == "async" else "device",
                                  group_bytes=cfg.group_bytes)
    return asteria.RuntimeConfig(mode=cfg.mode, staleness=cfg.staleness, deterministic=cfg.deterministic,
                                 lag_steps=cfg.lag_steps if cfg.mode == "async" else None,
                                 sync_refreshes=cfg.sync_refreshes, stagger=cfg.stagger, workers=cfg.workers,
                                 # where the schedule is staggered: async mode, or native with --stagger
                                 stagger_split=cfg.stagger_split if cfg.mode == "async" or cfg.stagger is True
                                 else None, stagger_sets_per_step=cfg.stagger_sets_per_step,
                                 stagger_small=cfg.stagger_small if cfg.mode == "async" or cfg.stagger is True
                                 else None,
                                 memory=memory, local_world_size=local_world_size, **(dict(
                                     in_flight=cfg.in_flight, queue_order=cfg.queue_order,
                                     express_workers=cfg.express_workers, worker_nice=cfg.worker_nice,
                                     device_refresh=cfg.device_refresh, device_share=float(cfg.device_share),
                                     device_sms=cfg.device_sms,
                                     device_threads=cfg.device_threads, device_process=cfg.device_process)
                                     if cfg.mode == "async" else {}))


def _restore(path: Path, cfg: RunConfig, model: torch.nn.Module, opt: torch.optim.Optimizer,
             run: DistributedRun | None) -> dict[str, Any]:
    sharded = run is not None and run.parallel in SHARDED_MODES
    loaded = checkpoint.load(path, model_template=model.state_dict() if sharded else None,
                             check=lambda manifest: check_resumable(manifest, cfg, path))
    state = loaded.rank_state
    local = run.layout.local_world_size if run is not None else 1
    if state.get("local_world_size", 1) != local:
        raise CheckpointError(f"Invalid checkpoint={str(path)!r}: saved with local_world_size="
                              f"{state.get('local_world_size', 1)} (ranks per node), this run has {local}; resume "
                              "with the node layout it was saved with")
    try:
        model.load_state_dict(loaded.model_state)
    except RuntimeError as error:
        raise CheckpointError(f"Invalid checkpoint={str(path)!r}: its model does not fit this one: {error}") from None
    optimizer_state = state["optimizer"]
    if sharded and not isinstance(opt, asteria.optim.base.SecondOrderOptimizer):
        optimizer_state = local_optimizer_state_to_dtensors(optimizer_state, opt)
    try:
        opt.load_state_dict(optimizer_state)
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"Invalid checkpoint={str(path)!r}: its optimizer state does not fit this "
                              f"{type(opt).__name__}: {error}") from None
    checkpoint.restore_rng(state["rng"], run.device if run is not None else torch.device(cfg.device))
    return state["loop"]


def _read_records(path: Path, up_to: int) -> list[dict[str, Any]]:
    """The records of steps 1..``up_to`` in the metrics file ``path`` (a resumed run keeps them and goes on
    from there). A line cut short by a crash is dropped; records missing before ``up_to`` (a checkpoint
    whose metrics were lost or edited) raise ``ValueError`` naming the file, before anything changes."""
    if up_to == 0:
        return []
    where = f"Invalid metrics={str(path)!r}"
    if not path.is_file():
        raise ValueError(f"{where}: the run resumes from step {up_to}, and its metrics.jsonl is missing; the "
                         "records of steps 1 to that cannot be restored (--overwrite starts the run again)")
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{where}: unreadable ({error})") from None
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if isinstance(record, dict) and is_int(record.get("step")) and record["step"] <= up_to:
            records.append(record)
    steps = [r["step"] for r in records]
    if steps != list(range(1, up_to + 1)):
        missing = sorted(set(range(1, up_to + 1)) - set(steps))
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise ValueError(f"{where}: the run resumes from step {up_to}, and its records of steps 1 to {up_to} are "
                         + (f"not all there (missing: {shown})" if missing else "out of order or repeated")
                         + "; restore the file as the run left it, or --overwrite to start the run again")
    return records


def train(cfg: RunConfig, out: Path, progress: bool = True, resume: bool = False,
          profile_steps: tuple[int, int] | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Trains and writes ``out/metrics.jsonl``, ``out/summary.json``, TensorBoard logs and, every
    ``cfg.checkpoint_every`` steps, ``out/checkpoints/step-N``. With ``resume`` it continues from the
    newest complete checkpoint in ``out`` (or starts afresh when ``out`` holds no run). A folder that
    holds an earlier run is otherwise refused (``ValueError``), unless ``overwrite`` replaces that run
    (its metrics, summary, TensorBoard logs, traces and checkpoints; with ``resume``, only when it has no
    checkpoint to continue from). With ``profile_steps``
    ``(FIRST, LAST)`` every rank writes a torch.profiler trace of those steps, ``out/trace-rank<R>.json.gz``
    (a diagnostic: it slows the steps it covers; ``bench/trace_steps.py`` reads it).

    Under torchrun (``WORLD_SIZE`` > 1) every process calls this: it joins the process group (NCCL on
    GPUs, Gloo on the CPU), wraps the model (``cfg.parallel``: DDP, FSDP2 or HSDP), reads its own slice of each
    global batch (``cfg.batch_size`` sequences per rank), and rank 0 alone writes the metrics (the loss
    averaged and the energy summed over ranks), TensorBoard, the summary and shows the progress bar.
    Every rank returns the summary."""
    layout = resolve_layout(cfg.local_world_size)  # a bad environment or node size fails before anything runs
    if layout.distributed:
        check_parallel(layout, cfg.parallel)
    profile_steps = check_profile_steps(profile_steps, cfg.steps)
    software()  # fingerprints the code as it is when the run starts (cached: a later reinstall changes nothing)
    if out.exists() and not out.is_dir():
        raise ValueError(f"Invalid out={str(out)!r}: it is an existing file, not a folder")
    if cfg.checkpoint_every and (out / "checkpoints").exists() and not (out / "checkpoints").is_dir():
        raise ValueError(f"Invalid out={str(out)!r}: its 'checkpoints' is a file, where checkpoint_every="
                         f"{cfg.checkpoint_every} writes a folder of checkpoints; remove it or choose another --out")
    newest = checkpoint.published(out / "checkpoints") if resume and out.is_dir() else []
    resumes_after = checkpoint.named_step(newest[-1]) if newest else 0
    if profile_steps is not None and profile_steps[1] <= resumes_after:  # (refused before the run is touched)
        raise ValueError(f"Invalid profile_steps={profile_steps!r}: the run resumes after step {resumes_after}, so "
                         "none of the range's steps would run; choose steps after it")
    out.mkdir(parents=True, exist_ok=True)
    if not (overwrite and layout.rank != 0):  # rank 0 alone replaces an earlier run; the others need not look
        claim_out(out, resume, overwrite)
    try:
        with deterministic_kernels(cfg.deterministic_kernels):
            if not layout.distributed:
                return _train(cfg, out, progress, resume, None, profile_steps)
            run = DistributedRun(layout, cfg.device, cfg.parallel)
            try:
                summary = _train(cfg, out, progress, resume, run, profile_steps)
            except BaseException:
                if run.backend == "gloo":  # NCCL's teardown may wait on the failed collective: the exit ends it
                    run.shutdown()
                raise
            run.shutdown()
            return summary
    except BaseException:
        if layout.rank == 0:
            settle_replaced(out, restore=True)  # a run refused before its first step gives the earlier one back
        raise


@contextlib.contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """With ``enabled``, torch's deterministic kernels (``torch.use_deterministic_algorithms`` in its strict
    form, and cuBLAS's fixed workspace) while the block runs, so that two runs of one configuration differ
    only by what the training itself leaves to chance (the non-deterministic activation rule's timing); the
    previous setting is restored after. Strict, not ``warn_only``: under ``warn_only`` the GPU's flash and
    memory-efficient attention keep their non-deterministic backward passes (they take their deterministic
    ones only in the strict form), and an operator without a deterministic kernel raises, naming itself,
    instead of leaving runs that scatter silently."""
    if not enabled:
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when a cuBLAS handle is made
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _train(cfg: RunConfig, out: Path, progress: bool, resume: bool, run: DistributedRun | None,
           profile_steps: tuple[int, int] | None = None) -> dict[str, Any]:
    """One run on this process (see ``train``). An optimizer it made is closed however the run ends: a
    refused checkpoint, a failed step or Ctrl-C leaves no workers, pinned buffers or torch thread cap."""
    made: list[torch.optim.Optimizer] = []
    try:
        with training_stream(cfg, run):
            return _train_run(cfg, out, progress, resume, run, profile_steps, made)
    except BaseException:
        for opt in made:
            if hasattr(opt, "close"):
                opt.close()
        raise


def training_stream(cfg: RunConfig, run: DistributedRun | None) -> contextlib.AbstractContextManager[None]:
    """The run's training stream (``asteria.training_stream``): its priority is ``cfg.stream_priority``, and
    at 0, the default stream's, the body runs on the current stream."""
    if cfg.stream_priority == 0:
        return contextlib.nullcontext()
    return asteria.training_stream(run.device if run is not None else torch.device(cfg.device), cfg.stream_priority)


@dataclass
class _Parts:
    """What a run trains with, made before its first step."""

    device: torch.device
    vocab_size: int
    data: PackedData
    model: torch.nn.Module
    net: torch.nn.Module  # what the forward pass calls (DDP: the wrapper)
    opt: torch.optim.Optimizer
    hooks: Any  # asteria.attach's hooks (None for an optimizer without preconditioners)
    parameters: int
    layer_parameters: int


def _setup(cfg: RunConfig, run: DistributedRun | None, world: int, made: list[torch.optim.Optimizer]) -> _Parts:
    """Seeds torch, then loads the data and builds the model, its wrapper, the optimizer (into ``made`` at
    once, so that it is closed if what follows fails) and the pipeline's hooks."""
    torch.manual_seed(cfg.seed)
    torch.set_float32_matmul_precision(cfg.matmul_precision)
    device = run.device if run is not None else torch.device(cfg.device)
    tokenizer = load_tokenizer(cfg.tokenizer)
    data = PackedData(tokenizer.encode(load_documents(cfg.data, cfg.max_bytes)), cfg.seq_len, cfg.val_fraction,
                      cfg.seed, source=f"data={cfg.data!r}")
    if len(data.train) < cfg.batch_size * world:
        raise ValueError(f"Invalid batch_size={cfg.batch_size}: data={cfg.data!r} gives {len(data.train)} training "
                         f"sequences of seq_len + 1 = {cfg.seq_len + 1} tokens, fewer than one batch "
                         f"({cfg.batch_size} x {world} processes) would repeat; lower --batch-size or --seq-len, or "
                         "give more --data")
    model = build_model(cfg.model, tokenizer.vocab_size, cfg.seq_len).to(device)
    parameters = parameter_count(model)
    layer_parameters = sum(p.numel() for p in decoder_layers(model).parameters())
    net = run.wrap(model) if run is not None else model
    # Workers default to this rank's share of the host (RuntimeConfig reads torchrun's LOCAL_RANK).
    opt = make_optimizer(cfg, model, local_world_size=run.layout.local_world_size if run is not None else None)
    made.append(opt)
    # The shadow-state pipeline's hooks: refresh installs are prefetched during the forward pass.
    hooks = (asteria.attach(model, opt, prefetch=cfg.prefetch,
                            late_activation=cfg.late_activation if cfg.mode == "async" else False)
             if isinstance(opt, asteria.optim.base.SecondOrderOptimizer) else None)
    return _Parts(device, tokenizer.vocab_size, data, model, net, opt, hooks, parameters, layer_parameters)


def _resume(cfg: RunConfig, out: Path, resume: bool, run: DistributedRun | None,
            parts: _Parts) -> tuple[dict[str, Any], str | None, list[dict[str, Any]]]:
    """Where the run starts: the loop's state (step, data cursor, training wall clock) of the newest
    checkpoint with ``resume`` (else step 0), that checkpoint's path and the metrics records up to its step,
    which the lead rank writes back (the rest of the file, and the summary, are of steps to be run again)."""
    lead = run is None or run.lead
    ckpt_root = out / "checkpoints"
    loop = {"step": 0, "cursor": 0, "wall": 0.0}
    resumed_from = None
    if resume:
        if lead:
            checkpoint.discard_partial(ckpt_root)
        if run is not None:
            run.barrier()
        found = checkpoint.published(ckpt_root)
        if found:
            try:
                loop = _restore(found[-1], cfg, parts.model, parts.opt, run)
            except checkpoint.CorruptCheckpointError as error:  # fail, but say what would resume
                intact = checkpoint.newest_intact(found[:-1])
                if intact is None:
                    raise
                raise checkpoint.CorruptCheckpointError(
                    f"{error}; the newest intact checkpoint is {str(intact)!r}: move {found[-1].name} out of "
                    f"{str(ckpt_root)!r} to resume from it (steps after it are trained again)") from None
            resumed_from = str(found[-1])
    records = _read_records(out / "metrics.jsonl", loop["step"]) if lead else []
    if lead:
        _atomic_write(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        (out / "summary.json").unlink(missing_ok=True)  # the run is under way again: no summary until it ends
    return loop, resumed_from, records


def _train_step(cfg: RunConfig, parts: _Parts, run: DistributedRun | None, step: int, position: int,
                energy: EnergyMeter, timer: StepTimer, profiler: StepProfiler) -> dict[str, Any]:
    """One step on the batch of sequences from ``position``: its loss (on several processes the mean over
    ranks), learning rate, wall and CUDA-event time, the host's time to queue it (before waiting for the GPU to
    end it: where it nears the wall time, the host sets the pace), the part of that in ``step()``, the training
    thread's CPU time meanwhile (below the host's time where the thread slept: on the GIL, a lock or a blocking
    event; CUDA's default waits spin, so they count as CPU time), its wait for a core and its sleeps meanwhile
    (Linux) and energy (None where not measured)."""
    t0, cpu0, sched0 = time.perf_counter(), time.thread_time(), thread_sched()
    # The range ends after the step's synchronization, so each profiled step holds its GPU work.
    with profiler.step(step):  # a no-op outside --profile-steps
        joules = energy.joules()
        batch = parts.data.batch(position, cfg.batch_size).to(parts.device, non_blocking=True)
        timer.begin()
        with torch.autocast(parts.device.type, dtype=torch.bfloat16, enabled=parts.device.type == "cuda"):
            loss = next_token_loss(parts.net(batch[:, :-1]), batch)  # = model.loss(batch), through the wrapper
        loss.backward()
        checkpoint.fault_point("train-step", step)
        if cfg.grad_clip > 0:
            clip_gradients(parts.model, cfg.grad_clip)
        lr = cfg.lr_at(step)
        for group in parts.opt.param_groups:
            group["lr"] = lr
        t_step = time.perf_counter()
        parts.opt.step()
        host_step_seconds = time.perf_counter() - t_step
        parts.opt.zero_grad(set_to_none=True)
        host_seconds = time.perf_counter() - t0  # the host has queued the step; on a GPU it may still run
        host_cpu_seconds = time.thread_time() - cpu0
        sched = thread_sched() if sched0 is not None else None
        gpu_seconds = timer.finish()  # waits for the GPU
        step_joules = None
        if run is None:
            loss_value = loss.item()  # synchronizes, so the step time below is the whole step
        else:  # the mean over ranks and the energy of all ranks' GPUs (one all-reduce)
            loss_value, step_joules = run.reduce_step(loss, None if joules is None else energy.joules() - joules)
        step_time = time.perf_counter() - t0
    if run is None and joules is not None:
        step_joules = energy.joules() - joules
    return {"loss": loss_value, "lr": lr, "step_time": step_time, "host_seconds": host_seconds,
            "host_step_seconds": host_step_seconds, "host_cpu_seconds": host_cpu_seconds,
            "host_sched": None if sched is None else (sched[0] - sched0[0], sched[1] - sched0[1]),
            "gpu_seconds": gpu_seconds, "joules": step_joules}


def _record(cfg: RunConfig, parts: _Parts, run: DistributedRun | None, step: int, wall: float,
            measured: dict[str, Any]) -> dict[str, Any]:
    """The step's metrics line: what ``_train_step`` measured, memory, staleness and, every ``eval_every``
    steps and at the last, the validation loss."""
    device = parts.device
    record: dict[str, Any] = {"step": step, "loss": measured["loss"], "lr": measured["lr"],
                              "step_time": measured["step_time"], "host_step_time": measured["host_seconds"],
                              "host_optimizer_time": measured["host_step_seconds"],
                              "host_cpu_time": measured["host_cpu_seconds"], "wall": wall, "rss_bytes": rss_bytes()}
    if measured["host_sched"] is not None:
        record["host_runq_time"], record["host_sleeps"] = measured["host_sched"]
    if measured["gpu_seconds"] is not None:
        record["gpu_step_time"] = measured["gpu_seconds"]
        stats = torch.cuda.memory_stats(device)  # (read once: torch's memory_allocated() and the like each read it)
        record["gpu_allocated_bytes"] = stats.get("allocated_bytes.all.current", 0)
        record["gpu_peak_bytes"] = stats.get("allocated_bytes.all.peak", 0)
        # what the caching allocator holds, and (cumulative) its frees of its cache to retry an allocation, a device
        # sync each: on a card nearly full, where it gives memory back and maps it again
        record["gpu_reserved_bytes"] = stats.get("reserved_bytes.all.current", 0)
        record["gpu_alloc_retries"] = stats.get("num_alloc_retries", 0)
    if measured["joules"] is not None:
        record["energy_joules"] = measured["joules"]
    if hasattr(parts.opt, "staleness"):
        record["staleness"] = parts.opt.staleness()
    if step % cfg.eval_every == 0 or step == cfg.steps:
        record["val_loss"] = (evaluate(parts.model, parts.data, device, cfg.batch_size, cfg.eval_batches)
                              if run is None else
                              run.evaluate(parts.model, parts.data, cfg.batch_size, cfg.eval_batches))
    return record


def _log(record: dict[str, Any], log: IO[str] | None, writer: Any, bar: tqdm) -> None:
    """The record into the metrics file and TensorBoard (the lead rank's ``log`` and ``writer``; None on the
    others) and onto the progress bar."""
    if log is not None:
        log.write(json.dumps(record) + "\n")
        for key in ("loss", "val_loss", "lr", "step_time", "staleness", "energy_joules", "gpu_peak_bytes"):
            if key in record:
                writer.add_scalar(key, record[key], record["step"])
    bar.set_postfix(loss=f"{record['loss']:.3f}", step_ms=f"{1e3 * record['step_time']:.0f}",
                    stale=record.get("staleness", "-"))


def _checkpoint(root: Path, cfg: RunConfig, parts: _Parts, loop: dict[str, Any], run: DistributedRun | None,
                log: IO[str] | None) -> None:
    """A checkpoint of the step just done, its metrics on disk first (the lead rank's ``log``), so that a
    resume finds every record up to it."""
    if log is not None:
        log.flush()
        os.fsync(log.fileno())
    _save(root, cfg, parts.model, parts.opt, loop, run)


def _train_run(cfg: RunConfig, out: Path, progress: bool, resume: bool, run: DistributedRun | None,
               profile_steps: tuple[int, int] | None, made: list[torch.optim.Optimizer]) -> dict[str, Any]:
    from torch.utils.tensorboard import SummaryWriter

    lead = run is None or run.lead
    world = run.layout.world_size if run is not None else 1
    parts = _setup(cfg, run, world, made)
    device = parts.device
    loop, resumed_from, records = _resume(cfg, out, resume, run, parts)
    if run is not None:  # (every rank set up before an earlier run this one replaces goes)
        checkpoint.fault_point(f"set-up-rank{run.layout.rank}", loop["step"])
        run.barrier()
    if lead:
        settle_replaced(out, restore=False)  # set up: an earlier run this one replaces goes now
    writer = (SummaryWriter(str(out / "tensorboard"), purge_step=loop["step"] + 1 if resumed_from else None)
              if lead else None)
    energy, timer = EnergyMeter(device), StepTimer(device)
    helpers = parts.opt.runtime_stats().get("device_process_ids", []) if hasattr(parts.opt, "runtime_stats") else []
    gpu_memory = ProcessMemoryMeter(device, helpers)
    profiler = StepProfiler(profile_steps, out, run.layout.rank if run is not None else 0, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step, cursor, wall = loop["step"], loop["cursor"], loop["wall"]
    first_step = step
    warmed_up, at_warmup = steady_warmup(cfg.precondition_frequency, cfg.sync_refreshes), None
    # Rank r reads sequences [r*B, (r+1)*B) of each global batch of B*world sequences.
    offset = run.layout.rank * cfg.batch_size if run is not None else 0
    bar = tqdm(range(step + 1, cfg.steps + 1), desc=cfg.label, disable=not (progress and lead), leave=False,
               mininterval=0.5)
    try:
        with (out / "metrics.jsonl").open("a") if lead else contextlib.nullcontext() as log:
            for step in bar:
                measured = _train_step(cfg, parts, run, step, cursor + offset, energy, timer, profiler)
                cursor += cfg.batch_size * world
                wall += measured["step_time"]
                record = _record(cfg, parts, run, step, wall, measured)
                if (used := gpu_memory.read()) is not None:
                    record["gpu_process_bytes"] = used
                _log(record, log, writer, bar)
                records.append(record)
                if step == warmed_up and hasattr(parts.opt, "runtime_stats"):  # (after the step's timing)
                    stats = parts.opt.runtime_stats()
                    at_warmup = {"step": step} | {key: stats[key] for key in WORK_COUNTERS if key in stats}
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    _checkpoint(out / "checkpoints", cfg, parts, {"step": step, "cursor": cursor, "wall": wall},
                                run, log)
                if run is None and STOP_REQUESTED.is_set():
                    if cfg.checkpoint_every and step % cfg.checkpoint_every:  # (the step is kept: --resume goes on)
                        _checkpoint(out / "checkpoints", cfg, parts, {"step": step, "cursor": cursor, "wall": wall},
                                    run, log)
                    raise KeyboardInterrupt(f"stopped after step {step}")
    finally:
        profiler.close()  # the trace of a range the run did not reach the end of
        if writer is not None:
            writer.close()
        if parts.hooks is not None:
            parts.hooks.remove()
    return _finish(cfg, out, parts, run, records, energy, resumed_from, first_step, at_warmup)


def _finish(cfg: RunConfig, out: Path, parts: _Parts, run: DistributedRun | None, records: list[dict[str, Any]],
            energy: EnergyMeter, resumed_from: str | None, first_step: int,
            at_warmup: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's summary, written by the lead rank into ``out/summary.json`` once the optimizer is closed;
    ``at_warmup``: the refresh work's counters at the warm-up's last step (``runs.WORK_COUNTERS``)."""
    opt, hooks = parts.opt, parts.hooks
    summary = _summary(cfg, parts.device, records, opt, parts.vocab_size, parts.parameters, resumed_from)
    summary["energy_device"] = energy.nvml_device  # the GPU whose counter was read (its PCI bus id)
    summary["runtime_stats_at_warmup"] = at_warmup
    # What the run's hooks did (removed by now, so the optimizer's own flag is off again).
    summary["late_activation"] = hooks is not None and hooks.late_activation
    summary["software"] = software()
    summary["distributed"] = (run.summary(parts.model, opt, max(0, cfg.steps - first_step), parts.parameters,
                                          parts.layer_parameters)
                              if run is not None else None)
    if hasattr(opt, "close"):
        opt.close()  # before the summary is written: a reader of summary.json finds the workers gone
    if run is None or run.lead:
        _atomic_write(out / "summary.json", json.dumps(summary, indent=2))
    return summary


def _save(root: Path, cfg: RunConfig, model: torch.nn.Module, opt: torch.optim.Optimizer,
          loop: dict[str, Any], run: DistributedRun | None) -> Path:
    rank, world = checkpoint.rank_and_world()
    state = {
        "optimizer": opt.state_dict(),
        "loop": loop,
        "rng": checkpoint.rng_state(run.device if run is not None else torch.device(cfg.device)),
        "rank": rank,
        "world_size": world,
        "local_world_size": run.layout.local_world_size if run is not None else 1,
    }
    return checkpoint.save(root, loop["step"], model.state_dict(), state, asdict(cfg), keep=cfg.keep_checkpoints)


def _summary(cfg: RunConfig, device: torch.device, records: list[dict[str, Any]], opt: torch.optim.Optimizer,
             vocab_size: int, parameters: int, resumed_from: str | None) -> dict[str, Any]:
    step_times = [r["step_time"] for r in records]
    steady = step_times[1:] or step_times  # the first step compiles and allocates: not a steady step
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    energies = [r["energy_joules"] for r in records if "energy_joules" in r]
    return {
        "config": asdict(cfg),
        "label": cfg.label,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "vocab_size": vocab_size,
        "parameters": parameters,
        "initial_loss_bound": math.log(vocab_size),
        "steps_done": records[-1]["step"] if records else 0,
        "resumed_from": resumed_from,
        "final_loss": statistics.fmean(r["loss"] for r in records[-10:]) if records else None,
        "final_val_loss": vals[-1] if vals else None,
        "wall_seconds": records[-1]["wall"] if records else 0.0,
        "median_step_seconds": statistics.median(steady) if steady else None,
        "p99_step_seconds": sorted(steady)[min(len(steady) - 1, int(0.99 * len(steady)))] if steady else None,
        "max_step_seconds": max(steady) if steady else None,
        "energy_joules_per_step": statistics.fmean(energies) if energies and len(energies) == len(records) else None,
        "energy_joules_total": sum(energies) if energies and len(energies) == len(records) else None,
        "peak_gpu_bytes": max((r.get("gpu_peak_bytes", 0) for r in records), default=0) or None,
        # (the driver's view: the run's processes' contexts and allocator pools, as of each step's end)
        "peak_gpu_process_bytes": max((r.get("gpu_process_bytes", 0) for r in records), default=0) or None,
        "runtime_stats": opt.runtime_stats() if hasattr(opt, "runtime_stats") else {},
        "memory_report": opt.memory_report() if hasattr(opt, "memory_report") else {},
    }


def _atomic_write(path: Path, text: str) -> None:
    staged = path.with_name(path.name + ".part")
    staged.write_text(text)
    os.replace(staged, path)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: PackedData, device: torch.device, batch_size: int,
             max_batches: int) -> float:
    """Mean loss over the held-out sequences (the same ones every time)."""
    model.eval()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        losses = [float(model.loss(b.to(device))) for b in data.val_batches(batch_size, max_batches)]
    model.train()
    return statistics.fmean(losses)
