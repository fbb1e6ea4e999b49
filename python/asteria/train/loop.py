"""One training run: model, data, optimizer, metrics (JSON lines and TensorBoard), progress bar,
checkpoints and resume."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import asteria
from asteria.train import checkpoint
from asteria.train.checkpoint import CheckpointError
from asteria.train.data import PackedData, load_documents, load_tokenizer
from asteria.train.meters import EnergyMeter, StepTimer, rss_bytes
from asteria.train.model import PRESETS, build_model, parameter_count

OPTIMIZERS = ("adamw", "shampoo", "soap", "kl-shampoo")
DEFAULT_LR = {"adamw": 3e-3, "shampoo": 3e-3, "soap": 3e-3, "kl-shampoo": 3e-3}
# A checkpoint continues only the run it came from: these must be equal to resume.
RESUME_MUST_MATCH = ("model", "optimizer", "mode", "placement", "batch_size", "seq_len", "lr", "weight_decay",
                     "staleness", "precondition_frequency", "data", "tokenizer", "max_bytes", "val_fraction", "seed")


@dataclass(kw_only=True)
class RunConfig:
    """Everything that defines a run (the CLI has one option per field)."""

    model: str = "tiny"
    optimizer: str = "shampoo"
    mode: str = "async"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 64
    lr: float | None = None
    weight_decay: float = 0.0
    staleness: int = 5
    precondition_frequency: int = 10
    workers: int | None = None
    placement: str = "auto"
    device: str = "cpu"
    data: str | None = None
    tokenizer: str | None = None
    max_bytes: int = 2_000_000
    val_fraction: float = 0.05
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: {allowed}")

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        check(self.model in PRESETS, "model", f"must be one of {tuple(PRESETS)}")
        check(self.optimizer in OPTIMIZERS, "optimizer", f"must be one of {OPTIMIZERS}")
        check(self.mode in ("sync", "async"), "mode", "must be 'sync' or 'async'")
        check(self.placement in asteria.config.PLACEMENTS, "placement", f"must be one of {asteria.config.PLACEMENTS}")
        for name in ("steps", "batch_size", "seq_len", "precondition_frequency", "eval_every", "eval_batches"):
            check(is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "must be an int >= 1")
        for name in ("staleness", "checkpoint_every", "keep_checkpoints", "seed"):
            check(is_int(getattr(self, name)) and getattr(self, name) >= 0, name, "must be an int >= 0")
        check(self.lr is None or (isinstance(self.lr, float) and math.isfinite(self.lr) and self.lr > 0), "lr",
              "must be a finite number > 0")
        check(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be a number >= 0")
        check(self.workers is None or (is_int(self.workers) and self.workers >= 1), "workers", "must be an int >= 1")
        check(0.0 < self.val_fraction < 1.0, "val_fraction", "must be in (0, 1)")
        check(is_int(self.max_bytes) and self.max_bytes >= 4096, "max_bytes", "must be an int >= 4096")
        check(self.seq_len <= PRESETS.get(self.model, PRESETS["tiny"]).max_seq_len, "seq_len",
              f"model {self.model!r} takes at most {PRESETS.get(self.model, PRESETS['tiny']).max_seq_len} tokens")
        check(self.device in ("cpu", "cuda"), "device", "must be 'cpu' or 'cuda'")
        check(self.device == "cpu" or torch.cuda.is_available(), "device", "CUDA is not available here")

    @property
    def label(self) -> str:
        return "adamw" if self.optimizer == "adamw" else f"{self.optimizer}-{self.mode}"

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]


def make_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                 fused=True if cfg.device == "cuda" else None)
    memory = asteria.MemoryConfig(placement=cfg.placement if cfg.mode == "async" else "device")
    runtime = asteria.RuntimeConfig(mode=cfg.mode, staleness=cfg.staleness, workers=cfg.workers, memory=memory)
    kind = {"shampoo": asteria.Shampoo, "soap": asteria.SOAP, "kl-shampoo": asteria.KLShampoo}[cfg.optimizer]
    return kind(model.named_parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                precondition_frequency=cfg.precondition_frequency, runtime=runtime)


def check_resumable(manifest: checkpoint.Manifest, cfg: RunConfig, path: Path) -> None:
    """Raises ``CheckpointError`` naming every setting in which the checkpoint's run differs."""
    saved = manifest.config
    diffs = [f"{name}={saved.get(name)!r} (this run: {getattr(cfg, name)!r})" for name in RESUME_MUST_MATCH
             if saved.get(name) != getattr(cfg, name)]
    if diffs:
        raise CheckpointError(f"Invalid checkpoint={str(path)!r}: it was saved with " + ", ".join(diffs) +
                              "; resume only with the settings it was saved with")


def _restore(path: Path, cfg: RunConfig, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    loaded = checkpoint.load(path)
    check_resumable(loaded.manifest, cfg, path)
    state = loaded.rank_state
    try:
        model.load_state_dict(loaded.model_state)
    except RuntimeError as error:
        raise CheckpointError(f"Invalid checkpoint={str(path)!r}: its model does not fit this one: {error}") from None
    try:
        opt.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"Invalid checkpoint={str(path)!r}: its optimizer state does not fit this "
                              f"{type(opt).__name__}: {error}") from None
    torch.set_rng_state(state["rng"]["torch"])
    if torch.cuda.is_available() and state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["loop"]


def _read_records(path: Path, up_to: int) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if record.get("step", up_to + 1) <= up_to:
            records.append(record)
    return records


def train(cfg: RunConfig, out: Path, progress: bool = True, resume: bool = False) -> dict[str, Any]:
    """Trains and writes ``out/metrics.jsonl``, ``out/summary.json``, TensorBoard logs and, every
    ``cfg.checkpoint_every`` steps, ``out/checkpoints/step-N``. With ``resume`` it continues from the
    newest complete checkpoint in ``out`` (or starts afresh when there is none)."""
    from torch.utils.tensorboard import SummaryWriter

    out.mkdir(parents=True, exist_ok=True)
    ckpt_root = out / "checkpoints"
    if not resume and checkpoint.published(ckpt_root):
        raise ValueError(f"Invalid out={str(out)!r}: it holds checkpoints of an earlier run; pass --resume to "
                         f"continue it, or choose another --out")
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    tokenizer = load_tokenizer(cfg.tokenizer)
    data = PackedData(tokenizer.encode(load_documents(cfg.data, cfg.max_bytes)), cfg.seq_len, cfg.val_fraction,
                      cfg.seed, source=f"data={cfg.data!r}")
    model = build_model(cfg.model, tokenizer.vocab_size, cfg.seq_len).to(device)
    opt = make_optimizer(cfg, model)
    # The shadow-state pipeline's hooks: refresh installs are prefetched during the forward pass.
    hooks = asteria.attach(model, opt) if isinstance(opt, asteria.optim.base.SecondOrderOptimizer) else None
    loop = {"step": 0, "cursor": 0, "wall": 0.0}
    resumed_from = None
    if resume:
        checkpoint.discard_partial(ckpt_root)
        found = checkpoint.published(ckpt_root)
        if found:
            loop = _restore(found[-1], cfg, model, opt)
            resumed_from = str(found[-1])
    records = _read_records(out / "metrics.jsonl", loop["step"])
    _atomic_write(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))

    writer = SummaryWriter(str(out / "tensorboard"), purge_step=loop["step"] + 1 if resumed_from else None)
    energy, timer = EnergyMeter(device), StepTimer(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step, cursor, wall = loop["step"], loop["cursor"], loop["wall"]
    bar = tqdm(range(step + 1, cfg.steps + 1), desc=cfg.label, disable=not progress, leave=False, mininterval=0.5)
    try:
        with (out / "metrics.jsonl").open("a") as log:
            for step in bar:
                t0 = time.perf_counter()
                joules = energy.joules()
                batch = data.batch(cursor, cfg.batch_size).to(device, non_blocking=True)
                cursor += cfg.batch_size
                timer.begin()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    loss = model.loss(batch)
                loss.backward()
                checkpoint.fault_point("train-step", step)
                opt.step()
                opt.zero_grad(set_to_none=True)
                gpu_seconds = timer.finish()
                loss_value = loss.item()  # synchronizes, so the step time below is the whole step
                step_time = time.perf_counter() - t0
                wall += step_time
                record: dict[str, Any] = {"step": step, "loss": loss_value, "step_time": step_time, "wall": wall,
                                          "rss_bytes": rss_bytes()}
                if gpu_seconds is not None:
                    record["gpu_step_time"] = gpu_seconds
                    record["gpu_allocated_bytes"] = torch.cuda.memory_allocated(device)
                    record["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
                if joules is not None:
                    record["energy_joules"] = energy.joules() - joules
                if hasattr(opt, "staleness"):
                    record["staleness"] = opt.staleness()
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    record["val_loss"] = evaluate(model, data, device, cfg.batch_size, cfg.eval_batches)
                log.write(json.dumps(record) + "\n")
                for key in ("loss", "val_loss", "step_time", "staleness", "energy_joules", "gpu_peak_bytes"):
                    if key in record:
                        writer.add_scalar(key, record[key], step)
                bar.set_postfix(loss=f"{loss_value:.3f}", step_ms=f"{1e3 * step_time:.0f}",
                                stale=record.get("staleness", "-"))
                records.append(record)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    log.flush()
                    os.fsync(log.fileno())
                    _save(ckpt_root, cfg, model, opt, {"step": step, "cursor": cursor, "wall": wall})
    finally:
        writer.close()
        if hooks is not None:
            hooks.remove()
    summary = _summary(cfg, device, records, opt, tokenizer.vocab_size, parameter_count(model), resumed_from)
    if hasattr(opt, "close"):
        opt.close()
    _atomic_write(out / "summary.json", json.dumps(summary, indent=2))
    return summary


def _save(root: Path, cfg: RunConfig, model: torch.nn.Module, opt: torch.optim.Optimizer,
          loop: dict[str, Any]) -> Path:
    rank, world = checkpoint.rank_and_world()
    state = {
        "optimizer": opt.state_dict(),
        "loop": loop,
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        "rank": rank,
        "world_size": world,
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
        "runtime_stats": opt.runtime_stats() if hasattr(opt, "runtime_stats") else {},
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
