"""One training run: model, data, optimizer, metrics (JSON lines and TensorBoard), progress bar."""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import asteria
from asteria.train.data import VOCAB_SIZE, TokenStream, load_corpus
from asteria.train.meters import EnergyMeter, StepTimer
from asteria.train.model import PRESETS, DecoderLM

OPTIMIZERS = ("adamw", "shampoo", "soap", "kl-shampoo")


@dataclass(kw_only=True)
class RunConfig:
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
    device: str = "cpu"
    data: str | None = None
    max_bytes: int = 2_000_000
    eval_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: {allowed}")

        check(self.model in PRESETS, "model", f"must be one of {tuple(PRESETS)}")
        check(self.optimizer in OPTIMIZERS, "optimizer", f"must be one of {OPTIMIZERS}")
        check(self.mode in ("sync", "async"), "mode", "must be 'sync' or 'async'")
        for name in ("steps", "batch_size", "seq_len", "precondition_frequency", "eval_every"):
            check(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be an int >= 1")
        check(self.device in ("cpu", "cuda"), "device", "must be 'cpu' or 'cuda'")
        check(self.device == "cpu" or torch.cuda.is_available(), "device", "CUDA is not available here")

    @property
    def label(self) -> str:
        return "adamw" if self.optimizer == "adamw" else f"{self.optimizer}-{self.mode}"


def make_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr or 3e-3, weight_decay=cfg.weight_decay)
    runtime = asteria.RuntimeConfig(mode=cfg.mode, staleness=cfg.staleness, workers=cfg.workers)
    kind = {"shampoo": asteria.Shampoo, "soap": asteria.SOAP, "kl-shampoo": asteria.KLShampoo}[cfg.optimizer]
    return kind(model.named_parameters(), lr=cfg.lr or 3e-3, weight_decay=cfg.weight_decay,
                precondition_frequency=cfg.precondition_frequency, runtime=runtime)


def train(cfg: RunConfig, out: Path, progress: bool = True) -> dict[str, Any]:
    """Trains and writes ``out/metrics.jsonl``, ``out/summary.json`` and TensorBoard logs."""
    from torch.utils.tensorboard import SummaryWriter

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    model = DecoderLM(PRESETS[cfg.model]).to(device)
    stream = TokenStream(load_corpus(cfg.data, cfg.max_bytes), cfg.seq_len, seed=cfg.seed)
    opt = make_optimizer(cfg, model)
    writer = SummaryWriter(str(out / "tensorboard"))
    energy, timer = EnergyMeter(device), StepTimer(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_times: list[float] = []
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    bar = tqdm(range(1, cfg.steps + 1), desc=cfg.label, disable=not progress, leave=False, mininterval=0.5)
    with (out / "metrics.jsonl").open("w") as log:
        for step in bar:
            batch = stream.batch(cfg.batch_size).to(device)
            joules = energy.joules()
            t0 = time.perf_counter()
            timer.begin()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = model.loss(batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            gpu_seconds = timer.finish()
            loss_value = loss.item()  # synchronizes, so the step time below is the whole step
            step_times.append(time.perf_counter() - t0)
            record: dict[str, Any] = {"step": step, "loss": loss_value, "step_time": step_times[-1],
                                      "wall": time.perf_counter() - started}
            if gpu_seconds is not None:
                record["gpu_step_time"] = gpu_seconds
            if joules is not None:
                record["energy_joules"] = energy.joules() - joules
            if step % cfg.eval_every == 0 or step == cfg.steps:
                record["val_loss"] = evaluate(model, stream, device)
            if hasattr(opt, "staleness"):
                record["staleness"] = opt.staleness()
            records.append(record)
            log.write(json.dumps(record) + "\n")
            for key in ("loss", "val_loss", "step_time", "staleness"):
                if key in record:
                    writer.add_scalar(key, record[key], step)
            bar.set_postfix(loss=f"{loss_value:.3f}", step_ms=f"{1e3 * step_times[-1]:.0f}",
                            stale=record.get("staleness", "-"))
    writer.close()
    steady = step_times[1:] or step_times  # the first step compiles and allocates: not a steady step
    summary = {
        "config": asdict(cfg),
        "label": cfg.label,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "initial_loss_bound": math.log(VOCAB_SIZE),
        "final_loss": statistics.fmean(r["loss"] for r in records[-10:]),
        "final_val_loss": records[-1]["val_loss"],
        "wall_seconds": time.perf_counter() - started,
        "median_step_seconds": statistics.median(step_times),
        "max_step_seconds": max(steady),
        "p99_step_seconds": sorted(steady)[min(len(steady) - 1, int(0.99 * len(steady)))],
        "energy_joules_per_step": (statistics.fmean(r["energy_joules"] for r in records)
                                   if energy.available else None),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "runtime_stats": opt.runtime_stats() if hasattr(opt, "runtime_stats") else {},
    }
    if hasattr(opt, "close"):
        opt.close()
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@torch.no_grad()
def evaluate(model: DecoderLM, stream: TokenStream, device: torch.device, batches: int = 4) -> float:
    model.eval()
    losses = [float(model.loss(stream.batch(16, "val").to(device))) for _ in range(batches)]
    model.train()
    return statistics.fmean(losses)
