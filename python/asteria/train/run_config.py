"""What defines a training run: ``RunConfig`` (one field per option of ``asteria train``), its checks and
learning-rate schedule, and which of its settings a checkpoint must share for the run to resume from it.
Apart from the loop that runs it (``loop.py``), so that reading or checking a run's settings needs no
training code."""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import asteria
from asteria.config import MAX_FREQUENCY, MAX_SETS_PER_STEP, MAX_STALENESS, is_int
from asteria.hooks import PREFETCH_POINTS
from asteria.optim.soap import SOAP
from asteria.train import checkpoint
from asteria.train.checkpoint import CheckpointError
from asteria.train.distributed import PARALLEL_MODES
from asteria.train.model import PRESETS
from asteria.train.peers import PEERS

ASTERIA_OPTIMIZERS = ("shampoo", "soap", "kl-shampoo")
OPTIMIZERS = ("adamw", *ASTERIA_OPTIMIZERS, *PEERS)
DEFAULT_LR = {"adamw": 3e-3, "shampoo": 3e-3, "soap": 3e-3, "kl-shampoo": 3e-3} | {
    peer: 3e-3 for peer in PEERS}  # each peer the learning rate of the Asteria optimizer it stands beside
# torch.set_float32_matmul_precision: "high" lets float32 matrix products (the optimizers' factor
# updates and preconditioning; the model runs in bf16 autocast on GPUs) use TF32 tensor cores.
MATMUL_PRECISIONS = ("highest", "high")
LR_SCHEDULES = ("cosine", "constant")
FIRST_BASES = SOAP.FIRST_BASES  # asteria.SOAP's first_basis
MIN_LR_RATIO = 0.1  # where the cosine decay ends, as a fraction of the peak learning rate
# A checkpoint continues only the run it came from: these must be equal to resume. (Not group_bytes: it only batches
# the blocks, and the optimizer's state_dict compares the batches themselves, naming the bound that would match.)
RESUME_MUST_MATCH = ("model", "optimizer", "mode", "placement", "batch_size", "seq_len", "lr", "beta2",
                     "weight_decay", "staleness", "precondition_frequency", "max_preconditioner_dim", "data",
                     "tokenizer", "max_bytes", "val_fraction", "seed", "parallel", "lr_schedule", "warmup_steps",
                     "grad_clip", "sync_refreshes", "stagger", "lag_steps", "stagger_split", "stagger_sets_per_step",
                     "stagger_small", "start_preconditioning_step", "precondition_1d", "first_basis", "deterministic")
# Settings that only the async mode's activation reads, and those only the second-order optimizers read (the
# schedule's, which native mode reads too): a resume of a run without them does not compare them.
ASYNC_ONLY_SETTINGS = ("staleness", "lag_steps")
SECOND_ORDER_SETTINGS = ("precondition_frequency", "max_preconditioner_dim", "placement", "sync_refreshes", "stagger",
                         "stagger_split", "stagger_sets_per_step", "stagger_small", "start_preconditioning_step",
                         "precondition_1d", "first_basis")
# What a checkpoint written before a setting existed was trained with.
LEGACY_SETTINGS = {"lr_schedule": "constant", "warmup_steps": 0, "grad_clip": 0.0, "sync_refreshes": 1, "stagger": None,
                   "lag_steps": None, "late_activation": False, "stagger_split": False, "stagger_sets_per_step": 1,
                   "stagger_small": False,
                   "start_preconditioning_step": None, "precondition_1d": None, "beta2": None, "first_basis": None}


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
    beta2: float | None = None
    lr_schedule: str = "cosine"
    warmup_steps: int | None = None
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    staleness: int = 5
    sync_refreshes: int = 2
    stagger: bool | None = None
    stagger_split: bool | None = None
    stagger_sets_per_step: int = 2
    stagger_small: bool | None = None
    precondition_frequency: int = 10
    start_preconditioning_step: int | None = None
    precondition_1d: bool | None = None
    first_basis: str | None = None
    max_preconditioner_dim: int = 2048
    workers: int | None = None
    placement: str = "auto"
    group_bytes: int | None = None
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
    parallel: str = "ddp"
    local_world_size: int | None = None
    matmul_precision: str = "highest"
    deterministic: bool | None = None
    lag_steps: int | None = None
    deterministic_kernels: bool = False
    prefetch: str = "forward_end"
    late_activation: bool | None = None
    in_flight: int = 1
    queue_order: str = "deadline"
    express_workers: int | None = None
    worker_nice: int = 10
    device_refresh: bool | None = None
    device_share: float = 1.0
    device_sms: int | None = None
    device_threads: int = 1
    device_process: bool | None = None
    stream_priority: int = 0
    peer_path: str | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: {allowed}")

        check(self.model in PRESETS, "model", f"must be one of {tuple(PRESETS)}")
        check(self.optimizer in OPTIMIZERS, "optimizer", f"must be one of {OPTIMIZERS}")
        check(self.mode in ("sync", "async"), "mode", "must be 'sync' or 'async'")
        check(self.optimizer not in PEERS or self.checkpoint_every == 0, "checkpoint_every",
              f"the peer {self.optimizer} is not checkpointed by this CLI: use 0")
        check(self.placement in asteria.config.PLACEMENTS, "placement", f"must be one of {asteria.config.PLACEMENTS}")
        check(self.group_bytes is None or (is_int(self.group_bytes) and self.group_bytes >= 1), "group_bytes",
              "must be None or an int >= 1 (bytes)")
        for name in ("steps", "batch_size", "seq_len", "precondition_frequency", "max_preconditioner_dim", "eval_every",
                     "eval_batches"):
            check(is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "must be an int >= 1")
        for name in ("staleness", "sync_refreshes", "checkpoint_every", "keep_checkpoints", "seed"):
            check(is_int(getattr(self, name)) and getattr(self, name) >= 0, name, "must be an int >= 0")
        check(isinstance(self.device_share, (int, float)) and not isinstance(self.device_share, bool)
              and 0 < self.device_share <= 1, "device_share", "must be a number in (0, 1]")
        check(is_int(self.in_flight) and self.in_flight >= 1, "in_flight", "must be an int >= 1")
        check(self.queue_order in asteria.config.QUEUE_ORDERS, "queue_order",
              f"must be one of {asteria.config.QUEUE_ORDERS}")
        check(self.express_workers is None or (is_int(self.express_workers) and self.express_workers >= 0),
              "express_workers", "must be None (as many as the workers) or an int >= 0")
        check(is_int(self.worker_nice) and 0 <= self.worker_nice <= 19, "worker_nice", "must be an int in [0, 19]")
        check(self.device_sms is None or (is_int(self.device_sms) and self.device_sms >= 1), "device_sms",
              "must be None (the whole GPU) or an int >= 1")
        check(is_int(self.device_threads) and self.device_threads >= 1, "device_threads", "must be an int >= 1")
        check(self.beta2 is None or (isinstance(self.beta2, (int, float)) and not isinstance(self.beta2, bool)
                                     and 0 < self.beta2 < 1), "beta2", "must be None (the optimizer's own) or a "
              "number in (0, 1)")
        check(self.device_refresh is None or isinstance(self.device_refresh, bool), "device_refresh",
              "must be None (the library's choice), True or False")
        check(self.device_process is None or isinstance(self.device_process, bool), "device_process",
              "must be None (the library's choice), True or False")
        check(self.seed < 2**32, "seed", "must be below 2**32 (the data order's generator is seeded from it)")
        check(self.staleness <= MAX_STALENESS, "staleness", f"must be at most {MAX_STALENESS} (each block keeps S + 1 "
              "snapshots in pinned host memory)")
        check(self.precondition_frequency <= MAX_FREQUENCY, "precondition_frequency",
              f"must be at most {MAX_FREQUENCY} steps")
        check(self.stagger is None or isinstance(self.stagger, bool), "stagger", "must be None, True or False")
        check((self.stagger_split is None or isinstance(self.stagger_split, bool))
              and not (self.stagger_split and self.stagger is False),
              "stagger_split", "must be None, True or False, and True only where the schedule is staggered (not "
              "with --no-stagger)")
        check(is_int(self.stagger_sets_per_step) and 1 <= self.stagger_sets_per_step <= MAX_SETS_PER_STEP,
              "stagger_sets_per_step", f"must be an int in [1, {MAX_SETS_PER_STEP}]")
        check((self.stagger_small is None or isinstance(self.stagger_small, bool))
              and not (self.stagger_small and self.stagger is False),
              "stagger_small", "must be None, True or False, and True only where the schedule is staggered (not "
              "with --no-stagger)")
        check(self.lr is None or (isinstance(self.lr, float) and math.isfinite(self.lr) and self.lr > 0), "lr",
              "must be a finite number > 0")
        check(self.lr_schedule in LR_SCHEDULES, "lr_schedule", f"must be one of {LR_SCHEDULES}")
        check(self.warmup_steps is None or (is_int(self.warmup_steps) and 0 <= self.warmup_steps < self.steps),
              "warmup_steps", f"must be None or an int in [0, steps={self.steps})")
        check(isinstance(self.grad_clip, (int, float)) and not isinstance(self.grad_clip, bool)
              and math.isfinite(self.grad_clip) and self.grad_clip >= 0, "grad_clip",
              "must be a finite number >= 0 (0: no clipping)")
        check(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be a number >= 0")
        check(self.workers is None or (is_int(self.workers) and self.workers >= 1), "workers", "must be an int >= 1")
        check(0.0 < self.val_fraction < 1.0, "val_fraction", "must be in (0, 1)")
        check(is_int(self.max_bytes) and 4096 <= self.max_bytes <= 2**62, "max_bytes", "must be an int in [4096, 2^62]")
        check(self.seq_len <= PRESETS.get(self.model, PRESETS["tiny"]).max_seq_len, "seq_len",
              f"model {self.model!r} takes at most {PRESETS.get(self.model, PRESETS['tiny']).max_seq_len} tokens")
        check(self.parallel in PARALLEL_MODES, "parallel", f"must be one of {PARALLEL_MODES}")
        check(self.local_world_size is None or (is_int(self.local_world_size) and self.local_world_size >= 1),
              "local_world_size", "must be an int >= 1 that divides the number of processes (default: torchrun's "
              "LOCAL_WORLD_SIZE)")
        check(self.device in ("cpu", "cuda"), "device", "must be 'cpu' or 'cuda'")
        check(is_int(self.stream_priority) and -64 <= self.stream_priority <= 0
              and (self.stream_priority == 0 or self.device == "cuda"), "stream_priority",
              "must be an int in [-64, 0] (CUDA stream priorities: 0 the lowest; torch clamps to the GPU's range), "
              "and 0 with device='cpu'")
        for name in ("data", "tokenizer"):  # "" would be the current folder
            value = getattr(self, name)
            check(value is None or (isinstance(value, str) and value.strip() != ""), name,
                  "must be a file or folder path (or None: the default)")
        check(self.deterministic is None or isinstance(self.deterministic, bool), "deterministic",
              "must be None (the library's choice), True or False")
        check(isinstance(self.deterministic_kernels, bool), "deterministic_kernels", "must be True or False")
        check(self.start_preconditioning_step is None or (is_int(self.start_preconditioning_step)
                                                          and self.start_preconditioning_step >= 1
                                                          and self.optimizer in ("shampoo", "soap", "adamw")),
              "start_preconditioning_step", "must be None (the optimizer's own) or an int >= 1, and None for "
              "kl-shampoo (its first basis comes from the first gradient) and the peers (they start at the "
              "precondition frequency)")
        check(self.precondition_1d is None or (isinstance(self.precondition_1d, bool)
                                               and self.optimizer in ("shampoo", "soap", "adamw")),
              "precondition_1d", "must be None (the optimizer's own: off), True or False, and None for kl-shampoo "
              "(1-D parameters take Adam's step) and the peers")
        check(self.first_basis is None or (self.first_basis in FIRST_BASES and self.optimizer in ("soap", "adamw")),
              "first_basis", f"must be None (SOAP's own: eigh) or one of {FIRST_BASES}, and None for the optimizers "
              "other than soap")
        check(self.lag_steps is None or (is_int(self.lag_steps) and self.lag_steps >= 0), "lag_steps",
              "must be an int >= 0")
        if self.lag_steps is not None:  # the runtime's own checks (deterministic rule, at most S intervals), now
            asteria.RuntimeConfig(staleness=self.staleness, deterministic=self.deterministic,
                                  lag_steps=self.lag_steps).activation_lag(self.precondition_frequency)
        check(self.prefetch in PREFETCH_POINTS, "prefetch", f"must be one of {PREFETCH_POINTS}")
        check((self.late_activation is None or isinstance(self.late_activation, bool))
              and not (self.late_activation and self.deterministic is not False), "late_activation",
              "must be None (on where allowed), True or False, and True only with deterministic=False "
              "(--no-deterministic: the deterministic rule fixes each step's versions in advance)")
        check(self.matmul_precision in MATMUL_PRECISIONS, "matmul_precision", f"must be one of {MATMUL_PRECISIONS}")
        check(self.device == "cpu" or torch.cuda.is_available(), "device", "CUDA is not available here")

    @property
    def label(self) -> str:
        return self.optimizer if self.optimizer not in ASTERIA_OPTIMIZERS else f"{self.optimizer}-{self.mode}"

    @property
    def learning_rate(self) -> float:
        """The peak learning rate."""
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    @property
    def warmup(self) -> int:
        """Linear warm-up steps: ``warmup_steps``, or 10% of the run (at most 200) by default."""
        return self.warmup_steps if self.warmup_steps is not None else min(200, self.steps // 10)

    def lr_at(self, step: int) -> float:
        """The learning rate of ``step`` (1-based): a linear warm-up to the peak, then constant or a cosine
        decay to ``MIN_LR_RATIO`` of it at the last step. A function of the step (and ``steps``) alone, so a
        run resumed with the same ``steps`` continues the same schedule."""
        peak, warmup = self.learning_rate, self.warmup
        if step <= warmup:
            return peak * step / (warmup + 1)
        if self.lr_schedule == "constant":
            return peak
        progress = (step - warmup) / max(1, self.steps - warmup)
        return peak * (MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def resolved_stagger_split(config: dict[str, Any], processes: int) -> bool:
    """Whether a run's optimizer splits its shape groups for the stagger, from the run's settings (a
    ``RunConfig`` as a dict) as ``make_optimizer`` and the runtime resolve them: ``stagger_split`` where the
    schedule is staggered (async mode, or native with ``--stagger``); None there means on one process."""
    split = config.get("stagger_split")
    if not staggered(config):
        return False
    return split if split is not None else processes == 1


def staggered(config: dict[str, Any]) -> bool:
    """Whether a run's optimizer may stagger its schedule: an Asteria optimizer in async mode (unless
    ``--no-stagger``), or native mode with ``--stagger``."""
    stagger = config.get("stagger")
    if config.get("optimizer") not in ASTERIA_OPTIMIZERS or not (config.get("mode") == "async" or stagger is True):
        return False
    return stagger is not False


def first_preconditioning_step(config: dict[str, Any], legacy: bool = False) -> int:
    """The step of a run's first preconditioner as its optimizer resolves ``start_preconditioning_step``
    (None: the precondition frequency, KL-Shampoo's 1); ``legacy``: a checkpoint written before the setting
    existed, when SOAP started at 1."""
    value = config.get("start_preconditioning_step")
    if value is not None:
        return value
    if config.get("optimizer") == "kl-shampoo" or (legacy and config.get("optimizer") == "soap"):
        return 1
    return config.get("precondition_frequency", 10)


def resolved_precondition_1d(config: dict[str, Any], legacy: bool = False) -> bool:
    """Whether a run's optimizer gives 1-D parameters factors (None: off); ``legacy``: a checkpoint written
    before the setting existed, when Shampoo did."""
    value = config.get("precondition_1d")
    return value if value is not None else legacy and config.get("optimizer") == "shampoo"


def check_resumable(manifest: checkpoint.Manifest, cfg: RunConfig, path: Path) -> None:
    """Raises ``CheckpointError`` naming every setting in which the checkpoint's run differs (a setting
    newer than the checkpoint counts as its default; ``stagger_split`` as it resolves), or when it has done
    more steps than this run's ``steps``; warns when another ``steps`` moves the lr schedule."""
    if cfg.steps < manifest.step:
        raise CheckpointError(f"Invalid checkpoint={str(path)!r}: it has done {manifest.step} steps, beyond this "
                              f"run's steps={cfg.steps}; resume with --steps >= {manifest.step} (a larger value "
                              "extends the run)")
    defaults = {f.name: f.default for f in fields(RunConfig)}
    defaults |= LEGACY_SETTINGS
    saved = {name: manifest.config.get(name, defaults[name]) for name in RESUME_MUST_MATCH}
    this = {name: getattr(cfg, name) for name in RESUME_MUST_MATCH}
    processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    saved["start_preconditioning_step"] = first_preconditioning_step(
        manifest.config, legacy="start_preconditioning_step" not in manifest.config)
    this["start_preconditioning_step"] = first_preconditioning_step(asdict(cfg))
    saved["precondition_1d"] = resolved_precondition_1d(manifest.config,
                                                        legacy="precondition_1d" not in manifest.config)
    this["precondition_1d"] = resolved_precondition_1d(asdict(cfg))
    for config in (saved, this):  # the activation rule as it resolves (None: by the staleness, lag and ranks)
        config["deterministic"] = asteria.RuntimeConfig(
            staleness=config["staleness"], lag_steps=config["lag_steps"],
            deterministic=config["deterministic"]).resolved_deterministic(processes > 1)
    saved["first_basis"] = saved["first_basis"] or "eigh"  # None: SOAP's own
    this["first_basis"] = this["first_basis"] or "eigh"
    saved["stagger_split"] = resolved_stagger_split(saved, processes)
    this["stagger_split"] = resolved_stagger_split(this, processes)
    for config in (saved, this):  # the cut only where the sets are split, the small sets' where staggered
        config["stagger_sets_per_step"] = config["stagger_sets_per_step"] if config["stagger_split"] else None
        config["stagger_small"] = staggered(config) and config["stagger_small"] is not False
    unused = ((*ASYNC_ONLY_SETTINGS, "deterministic") if cfg.mode != "async" or cfg.optimizer not in ASTERIA_OPTIMIZERS
              else ()) + (
        SECOND_ORDER_SETTINGS if cfg.optimizer == "adamw" else ())  # mode and optimizer themselves must match
    if cfg.mode == "sync" and saved["stagger"] is not True and this["stagger"] is not True:
        unused += ("sync_refreshes",)  # it only aligns a staggered schedule (`train` refuses it here otherwise)
    diffs = [f"{name}={saved[name]!r} (this run: {this[name]!r})" for name in RESUME_MUST_MATCH
             if saved[name] != this[name] and name not in unused]
    if diffs:
        raise CheckpointError(f"Invalid checkpoint={str(path)!r}: it was saved with " + ", ".join(diffs) +
                              "; resume only with the settings it was saved with")
    saved_steps = manifest.config.get("steps")
    if is_int(saved_steps) and saved_steps != cfg.steps and manifest.step < cfg.steps:
        before = replace(cfg, steps=max(saved_steps, manifest.step + 1)).lr_at(manifest.step + 1)
        after = cfg.lr_at(manifest.step + 1)
        if not math.isclose(before, after):
            warnings.warn(f"Resuming a run of steps={saved_steps} with steps={cfg.steps}: its lr schedule follows the "
                          f"new length from step {manifest.step + 1} (lr {before:.3g} there becomes {after:.3g})",
                          stacklevel=2)
