"""Fault injection for tests and soak runs: reaches the C++ refresh engine of an async optimizer.

The faults act inside the engine's real worker jobs (``RefreshEngine.inject_fault``), so every
failure path runs as it would for a genuine fault: the version fails, the last good preconditioner
stays in use, the failure is counted per block, and past ``max_consecutive_failures`` ``step()``
raises ``asteria.RefreshError``. Not for production use.

Kinds: ``"throw"`` (the job raises inside its numerics), ``"nonfinite"`` (its result is poisoned with
a NaN, which the engine's quality gate rejects), ``"hang"`` (it blocks until ``opt.close()``, or for
``seconds`` if given, then fails), ``"delay"`` (it sleeps ``seconds`` first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from asteria.optim.base import SecondOrderOptimizer

FAULT_KINDS = ("throw", "nonfinite", "hang", "delay", "pause")


@dataclass(frozen=True)
class EngineBlock:
    """One preconditioner block as the engine knows it."""

    id: int           # the engine's block id
    param: str        # the parameter it belongs to
    factor: str       # "block 0 of param group 0, blocks (16, 8), mode 1"
    mode: int         # which of the parameter block's dimensions


def _engine(opt: SecondOrderOptimizer) -> Any:
    if not isinstance(opt, SecondOrderOptimizer):
        raise ValueError(f"Invalid opt={type(opt).__name__}: must be an Asteria optimizer")
    engine = getattr(opt._refresher, "engine", None)
    if engine is None:
        raise ValueError(f"Invalid opt: runs mode {opt.runtime.mode!r}; fault injection needs mode='async'")
    return engine


def engine_blocks(opt: SecondOrderOptimizer, param: str | None = None) -> list[EngineBlock]:
    """The engine's blocks, all or those of parameter ``param``, in engine id order."""
    refresher = opt._refresher
    _engine(opt)
    out = []
    for fset, ids in zip(refresher.sets, refresher.ids):
        mode = int(re.search(r"mode (\d+)", fset.name).group(1))  # "..., mode 1" or "..., mode 1, blocks 0-5"
        for block, block_id in enumerate(ids):
            if param is None or fset.block_params[block] == param:
                out.append(EngineBlock(block_id, fset.block_params[block], fset.describe(block), mode))
    if param is not None and not out:
        names = sorted({b.param for b in engine_blocks(opt)})
        raise ValueError(f"Invalid param={param!r}: no preconditioner block belongs to it; parameters with "
                         f"blocks: {names}")
    return sorted(out, key=lambda b: b.id)


def inject_fault(opt: SecondOrderOptimizer, param: str, kind: str = "throw", version: int | None = None,
                 seconds: float = 0.0, mode: int | None = None) -> list[EngineBlock]:
    """Arms ``kind`` for refresh ``version`` (``None``: every version, until ``clear_faults``) of the
    blocks of ``param`` (only dimension ``mode`` if given). Returns the blocks armed."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"Invalid kind={kind!r}: must be one of {FAULT_KINDS}")
    engine = _engine(opt)
    blocks = [b for b in engine_blocks(opt, param) if mode is None or b.mode == mode]
    if not blocks:
        raise ValueError(f"Invalid mode={mode!r}: parameter {param!r} has no block of that mode")
    for block in blocks:
        engine.inject_fault(block.id, version, kind, seconds)
    return blocks


def set_random_worker_delay(opt: SecondOrderOptimizer, max_delay_s: float, seed: int = 0) -> None:
    """Every refresh job first sleeps a pseudo-random time in [0, ``max_delay_s``) that depends only on
    (seed, block, version); 0 turns it off."""
    _engine(opt).set_random_delay(max_delay_s, seed)


def clear_faults(opt: SecondOrderOptimizer) -> None:
    """Disarms every fault and the random delay."""
    _engine(opt).clear_faults()


def block_status(opt: SecondOrderOptimizer, param: str) -> list[dict[str, Any]]:
    """Per block of ``param``: versions (active, newest snapshot, newest ok), failures (consecutive,
    total) and the last error, as the engine's coherence registry records them."""
    engine = _engine(opt)
    return [engine.status(b.id) | {"factor": b.factor} for b in engine_blocks(opt, param)]
