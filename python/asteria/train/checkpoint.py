"""Crash-safe training checkpoints through torch.distributed.checkpoint (DCP).

Layout of a run's checkpoints (``RUN_DIR/checkpoints/``)::

    step-000000120/            a published checkpoint (complete by construction)
        .metadata              DCP's index
        __0_0.distcp ...       DCP's data, one file per writing rank
        manifest.json          format, step, world size, run config, every file's size and SHA-256
    .tmp-step-000000140/       a checkpoint being written; never read, removed on the next start

A checkpoint is written into a temporary directory, its manifest last, every file and the directory
fsynced, and then published with one ``rename`` (atomic in a POSIX file system) and an fsync of the
parent directory. A crash at any point leaves either the previous checkpoints alone or a complete new
one. Reading validates the manifest (``parse_manifest`` raises ``CheckpointError`` for anything that
is not a well-formed manifest) and every file's size and checksum before DCP reads the data.

Everything DCP stores is a tensor under a flat string key: ``model.<fqn>``, ``optim.rank<r>.<i>``,
``rng.rank<r>.<name>`` and ``state.rank<r>.json`` (the non-tensor skeleton of the optimizer state and
the loop's own state as UTF-8 JSON in a uint8 tensor, with tensors referenced by index). Tensors are
saved as they are, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

FORMAT = "asteria.checkpoint.v1"
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20
TEST_KILL_ENV = "ASTERIA_TEST_KILL"
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}$|^\.metadata$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this run."""


class CorruptCheckpointError(CheckpointError):
    """A published checkpoint whose files do not match its manifest (or that has none): damaged on disk."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    format: str
    step: int
    world_size: int
    files: dict[str, FileEntry]
    config: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps({"format": self.format, "step": self.step, "world_size": self.world_size,
                           "files": {k: {"size": v.size, "sha256": v.sha256} for k, v in sorted(self.files.items())},
                           "config": self.config}, indent=1, sort_keys=True)


def parse_manifest(data: bytes) -> Manifest:
    """Parses a manifest; any input that is not a well-formed one raises ``CheckpointError`` (and
    nothing else)."""
    if not isinstance(data, (bytes, bytearray)):
        raise CheckpointError(f"Invalid manifest: expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"Invalid manifest: {len(data)} bytes, at most {MAX_MANIFEST_BYTES} allowed")
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"Invalid manifest: not UTF-8 JSON ({type(error).__name__}: {error})") from None

    def field(name: str, kind: type, ok=lambda v: True, allowed: str = "") -> Any:
        if name not in doc:
            raise CheckpointError(f"Invalid manifest: missing {name!r}")
        value = doc[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)) or not ok(value):
            raise CheckpointError(f"Invalid manifest: {name}={_short(value)}: must be {allowed or kind.__name__}")
        return value

    if not isinstance(doc, dict):
        raise CheckpointError(f"Invalid manifest: top level is {type(doc).__name__}, must be an object")
    fmt = field("format", str, lambda v: v == FORMAT, repr(FORMAT))
    step = field("step", int, lambda v: v >= 0, "an int >= 0")
    world_size = field("world_size", int, lambda v: 1 <= v <= 1 << 20, "an int in [1, 2**20]")
    raw_files = field("files", dict, lambda v: len(v) > 0, "a non-empty object")
    config = field("config", dict)
    files = {}
    for name, entry in raw_files.items():
        if not _FILE_NAME.match(name) or name == MANIFEST:
            raise CheckpointError(f"Invalid manifest: file name {_short(name)} is not a plain data file name")
        if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
            raise CheckpointError(f"Invalid manifest: entry of {name!r} must be {{'size', 'sha256'}}, got "
                                  f"{_short(entry)}")
        size, digest = entry["size"], entry["sha256"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CheckpointError(f"Invalid manifest: size of {name!r} is {_short(size)}, must be an int >= 0")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise CheckpointError(f"Invalid manifest: sha256 of {name!r} is {_short(digest)}, must be 64 hex digits")
        files[name] = FileEntry(size, digest)
    return Manifest(fmt, step, world_size, files, config)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- non-tensor structure <-> tensors + JSON --------------------------------------------------------
def pack(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A JSON-able skeleton of ``obj`` whose tensors (and numpy arrays) are appended to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        # A DTensor (FSDP2: AdamW's moments) is this rank's state as its local shard; the training loop
        # lays it out as its parameter again when it loads (train/distributed.py).
        tensors.append((obj.to_local() if _is_dtensor(obj) else obj).detach())
        return {"$t": len(tensors) - 1}
    if isinstance(obj, (np.ndarray, np.generic)):
        tensors.append(torch.from_numpy(np.array(obj, copy=True)))
        return {"$np": len(tensors) - 1, "scalar": isinstance(obj, np.generic)}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: pack(v, tensors) for k, v in obj.items()}
        return {"$dict": [[pack(k, tensors), pack(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return [pack(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return {"$tuple": [pack(v, tensors) for v in obj]}
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}: {_short(obj)}")


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def unpack(skeleton: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """The inverse of ``pack``."""
    if isinstance(skeleton, list):
        return [unpack(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "$t" in skeleton:
        return tensors[skeleton["$t"]]
    if "$np" in skeleton:
        array = tensors[skeleton["$np"]].numpy()
        return array[()] if skeleton["scalar"] else array
    if "$float" in skeleton:
        return float(skeleton["$float"])
    if "$dict" in skeleton:
        return {unpack(k, tensors): unpack(v, tensors) for k, v in skeleton["$dict"]}
    if "$tuple" in skeleton:
        return tuple(unpack(v, tensors) for v in skeleton["$tuple"])
    return {k: unpack(v, tensors) for k, v in skeleton.items()}


# ---- files -------------------------------------------------------------------------------------------
def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fault_point(point: str, step: int) -> None:
    """Test-only fault injection: ``ASTERIA_TEST_KILL=<point>@<step>`` SIGKILLs this process when it
    reaches ``point`` at ``step`` (points: train-step, checkpoint-shards, checkpoint-manifest, and under
    torch.distributed set-up-rank<R>, where rank R is set up and its run is about to start)."""
    if os.environ.get(TEST_KILL_ENV) == f"{point}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The random states a resume on ``device`` restores: torch's CPU generator, and ``device``'s own where it is a
    GPU (only it: the states of every visible GPU would fail a resume where fewer are visible)."""
    return {"torch": torch.get_rng_state(), "cuda": [torch.cuda.get_rng_state(device)] if device.type == "cuda" else []}


def restore_rng(rng: dict[str, Any], device: torch.device) -> None:
    """Restores ``rng_state(device)``'s states (also those of checkpoints that kept every visible GPU's)."""
    torch.set_rng_state(rng["torch"])
    saved = rng["cuda"]
    if device.type == "cuda" and saved:
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_rng_state(saved[0] if len(saved) == 1 else saved[index], device)


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without torch.distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs in one process when torch.distributed is not initialized: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def interrupted(error: BaseException | None, depth: int = 0) -> bool:
    """Whether ``error`` is a KeyboardInterrupt or comes from one: its cause or context, or a failure that
    torch.distributed.checkpoint wrapped (``failures`` maps each rank to an (exception, traceback) pair)."""
    if error is None or depth > 8:
        return False
    if isinstance(error, KeyboardInterrupt):
        return True
    failures = getattr(error, "failures", None)
    wrapped = [f[0] for f in failures.values() if isinstance(f, tuple) and f] if isinstance(failures, dict) else []
    return any(interrupted(e, depth + 1) for e in (error.__cause__, error.__context__, *wrapped))


def _save_error(error: BaseException, tmp: Path, step: int, need: int) -> OSError:
    """What a failed write of checkpoint ``step`` into ``tmp`` tells the user: the path and, when the device is
    full (torch's writer reports that only as an unexpected file position), ENOSPC with the bytes. The partial
    folder is removed; the checkpoints published before stay intact."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        free = shutil.disk_usage(tmp.parent).free
    except OSError:
        free = None
    full = getattr(error, "errno", None) == errno.ENOSPC or (free is not None and free < need)
    if full:
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: the checkpoint of step {step} needs about {need} "
                       f"bytes and {free} are free; the checkpoints published before are intact: free space, then "
                       "go on with --resume", str(tmp))
    return OSError(getattr(error, "errno", None) or errno.EIO, f"the checkpoint of step {step} could not be written "
                   f"({error}); the checkpoints published before are intact", str(tmp))


def save(root: Path, step: int, model_state: dict[str, torch.Tensor], rank_state: Any, config: dict[str, Any],
         keep: int = 0) -> Path:
    """Writes and atomically publishes ``root/step-<step>``; every rank calls it (a collective under
    torch.distributed). ``rank_state`` is this rank's own state (optimizer, RNG, loop), any nesting of
    dicts, lists, tuples, scalars, tensors and numpy arrays. Keeps the newest ``keep`` checkpoints
    (0: all). Returns the published directory."""
    import torch.distributed.checkpoint as dcp

    rank, world = rank_and_world()
    final, tmp = root / f"step-{step:09d}", root / f".tmp-step-{step:09d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    tensors: list[torch.Tensor] = []
    skeleton = json.dumps(pack(rank_state, tensors)).encode()
    flat: dict[str, torch.Tensor] = {f"model.{k}": v.detach() for k, v in model_state.items()}
    flat |= {f"optim.rank{rank}.{i}": t for i, t in enumerate(tensors)}
    flat[f"state.rank{rank}.json"] = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
    try:
        with _quiet():
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
    except BaseException as error:  # DCP wraps a writer's error in a CheckpointException (a BaseException)
        if interrupted(error):
            raise
        raise _save_error(error, tmp, step, sum(t.numel() * t.element_size() for t in flat.values())) from error
    _barrier()
    if rank == 0:
        fault_point("checkpoint-shards", step)
        files = {p.name: FileEntry(p.stat().st_size, _sha256(p)) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = Manifest(FORMAT, step, world, files, config)
        staged = tmp / (MANIFEST + ".part")
        with staged.open("w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.rename(staged, tmp / MANIFEST)
        _fsync_path(tmp)
        fault_point("checkpoint-manifest", step)
        if final.exists():  # the same step saved again (a run resumed from an older checkpoint)
            old = root / f".old-step-{step:09d}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            shutil.rmtree(old)
        os.rename(tmp, final)
        _fsync_path(root)
        if keep > 0:
            for stale in published(root)[:-keep]:
                shutil.rmtree(stale)
    _barrier()
    return final


def published(root: Path) -> list[Path]:
    """Published checkpoint directories under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def named_step(path: Path) -> int | None:
    """The step a published checkpoint's folder name says (``step-<9 digits>``; None for any other name)."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def discard_partial(root: Path) -> list[Path]:
    """Removes checkpoints that were being written when a run stopped; returns what it removed."""
    if not root.is_dir():
        return []
    partial = [p for p in root.iterdir() if p.name.startswith((".tmp-step-", ".old-step-"))]
    for p in partial:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
    return partial


def verify(path: Path) -> Manifest:
    """The manifest of a published checkpoint, after checking every file against it."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"Invalid checkpoint={str(path)!r}: not a directory")
    if not manifest_path.is_file():
        raise CorruptCheckpointError(f"Invalid checkpoint={str(path)!r}: no {MANIFEST} (not a complete checkpoint)")
    try:
        manifest = parse_manifest(manifest_path.read_bytes())
    except CheckpointError as error:
        raise CorruptCheckpointError(f"Invalid checkpoint={str(path)!r}: {error}") from None
    present = {p.name for p in path.iterdir() if p.name != MANIFEST}
    if present != set(manifest.files):
        raise CorruptCheckpointError(f"Invalid checkpoint={str(path)!r}: files {sorted(present)} do not match the "
                                     f"manifest's {sorted(manifest.files)}")
    for name, entry in manifest.files.items():
        file = path / name
        size = file.stat().st_size
        if size != entry.size:
            raise CorruptCheckpointError(f"Invalid checkpoint={str(path)!r}: {name} has {size} bytes, the manifest "
                                         f"says {entry.size} (truncated or corrupt)")
        if _sha256(file) != entry.sha256:
            raise CorruptCheckpointError(f"Invalid checkpoint={str(path)!r}: {name} fails its SHA-256 check (corrupt)")
    if named_step(path) not in (None, manifest.step):
        raise CorruptCheckpointError(f"Invalid checkpoint={str(path)!r}: manifest says step {manifest.step}")
    return manifest


def newest_intact(paths: list[Path]) -> Path | None:
    """The newest of ``paths`` (oldest first, as ``published`` lists them) that passes ``verify``."""
    for path in reversed(paths):
        try:
            verify(path)
        except CheckpointError:
            continue
        return path
    return None


@dataclass
class Loaded:
    manifest: Manifest
    model_state: dict[str, torch.Tensor]
    rank_state: Any


def load(path: Path, model_template: dict[str, torch.Tensor] | None = None,
         check: Callable[[Manifest], None] | None = None) -> Loaded:
    """Verifies and reads a checkpoint for this rank (on the CPU). ``check(manifest)`` runs after the
    files are verified and before any data is read (it raises to refuse the checkpoint). The model's
    tensors are read into ``model_template``'s tensors in place when given (an FSDP2 model's own
    ``state_dict()``: each rank reads its shards), else into new full CPU tensors."""
    import torch.distributed.checkpoint as dcp

    manifest = verify(path)
    rank, world = rank_and_world()
    if manifest.world_size != world:
        raise CheckpointError(f"Invalid checkpoint={str(path)!r}: saved by {manifest.world_size} ranks, this run has "
                              f"{world}; resume on {manifest.world_size} processes (torchrun: nodes x "
                              "--nproc-per-node)")
    if check is not None:
        check(manifest)
    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata().state_dict_metadata
    own = (f"optim.rank{rank}.", f"state.rank{rank}.json")
    flat = {}
    for key, meta in metadata.items():
        if key.startswith("model.") or key.startswith(own):
            if not hasattr(meta, "size"):
                raise CheckpointError(f"Invalid checkpoint={str(path)!r}: entry {key!r} is not a tensor")
            if model_template is not None and key.startswith("model."):
                if key[len("model."):] not in model_template:
                    raise CheckpointError(f"Invalid checkpoint={str(path)!r}: its model has {key[len('model.'):]!r}, "
                                          "this one does not")
                flat[key] = model_template[key[len("model."):]]
            else:
                flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if f"state.rank{rank}.json" not in flat:
        raise CheckpointError(f"Invalid checkpoint={str(path)!r}: no state for rank {rank}")
    with _quiet():
        dcp.load(flat, storage_reader=reader)
    prefix = f"optim.rank{rank}."
    tensors = {int(k[len(prefix):]): v for k, v in flat.items() if k.startswith(prefix)}
    skeleton = json.loads(bytes(flat[f"state.rank{rank}.json"].numpy()).decode())
    model_state = {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}
    return Loaded(manifest, model_state, unpack(skeleton, tensors))
