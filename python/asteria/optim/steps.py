"""Per-block step counts: the steps in which a block's parameter had a gradient.

torch's AdamW and the SOAP reference count ``state["step"]`` per parameter, so that a parameter that
first gets a gradient late (unfrozen mid-run, an expert that no token reached, a task head used now
and then) starts its bias corrections as a fresh parameter would. The optimizers' first-step rules and
bias corrections read these counts; the refresh schedule stays global (``SecondOrderOptimizer.step``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class FirstGradients:
    """Which blocks of a shape group take their first gradient this step (count 1): all of them (``every``),
    or those of ``mask``, a (B,) bool tensor on the device (None: none of them)."""

    every: bool
    mask: Tensor | None = None

    @property
    def none(self) -> bool:
        return not self.every and self.mask is None

    def without(self, keep: Tensor) -> Tensor:
        """The (B,) mask ``keep`` less the blocks that take their first gradient."""
        if self.every:
            return torch.zeros_like(keep)
        return keep if self.mask is None else keep & ~self.mask

    def only(self, keep: Tensor) -> Tensor:
        """The (B,) mask ``keep`` restricted to the blocks that take their first gradient."""
        if self.every:
            return keep
        return torch.zeros_like(keep) if self.mask is None else keep & self.mask


NO_FIRST = FirstGradients(every=False)
ALL_FIRST = FirstGradients(every=True)


class BlockSteps:
    """The step counts of one shape group's blocks, kept on the host.

    While every block has the same count (the common case: every parameter gets a gradient every step)
    each rule reads one Python number, so the step's kernels take scalars as they would with a global
    count; otherwise it reads a (B,) tensor on the group's device, one value per block.
    """

    def __init__(self, batch: int, device: torch.device) -> None:
        self.counts = [0] * batch
        #: the optimizer step at which each block had its first gradient (0: none yet)
        self.first_steps = [0] * batch
        self.device = device
        self._uniform: int | None = 0  # the count every block has (None: they differ)
        self._started_by: int | None = None  # every block's first gradient came by this step (None: not known)
        self._before: tuple[list[int], list[int], int | None] | None = None  # for ``undo``
        self._first: FirstGradients | None = None  # ``first()`` of the current counts (None: not built yet)

    def advance(self, present: list[bool], step: int) -> None:
        """Counts optimizer step ``step`` for the blocks whose parameter has a gradient (``undo`` takes
        it back while no other step has been counted)."""
        self._before = (self.counts, self.first_steps, self._uniform)
        self._first = None
        if self._uniform is not None and all(present):  # the common case, kept in O(1) per rule
            self._uniform += 1
            self.counts = [self._uniform] * len(self.counts)
            if self._uniform == 1:
                self.first_steps = [step] * len(self.counts)
            return
        self.counts = [count + bool(has) for count, has in zip(self.counts, present)]
        self.first_steps = [step if has and not first else first for first, has in zip(self.first_steps, present)]
        self._uniform = self._common()

    def undo(self) -> None:
        """Takes back the last ``advance`` (a step that raised counts nothing)."""
        if self._before is not None:
            self.counts, self.first_steps, self._uniform = self._before
            self._before = None
            self._started_by = None
            self._first = None

    def load(self, counts: list[int], first_steps: list[int]) -> None:
        """Counts and first-gradient steps from a checkpoint."""
        if len(counts) != len(self.counts) or len(first_steps) != len(self.counts):
            raise ValueError(f"Invalid block step counts: {len(counts)} counts and {len(first_steps)} first steps "
                             f"for {len(self.counts)} blocks")
        self.counts = [int(c) for c in counts]
        self.first_steps = [int(f) for f in first_steps]
        self._uniform = self._common()
        self._started_by = None
        self._before = None
        self._first = None

    def started_by(self, step: int) -> bool:
        """Whether every block had its first gradient at ``step`` or before (O(1) once they all did by
        then, the common case)."""
        if self._started_by is not None and self._started_by <= step:
            return True
        started = all(first > 0 for first in self.first_steps)
        self._started_by = max(self.first_steps) if started else None
        return started and self._started_by <= step

    def _common(self) -> int | None:
        first = self.counts[0]
        return first if all(count == first for count in self.counts) else None

    def uniform(self) -> int | None:
        """The count every block has, or None when they differ."""
        return self._uniform

    def of(self, rule: Callable[[int], float]) -> float | Tensor:
        """``rule(count)``: a float when every block has the same count, else a (B,) float32 tensor on the
        device with each block's value. ``rule`` must give a finite number for every count, 0 included
        (blocks without a gradient yet are masked out of the update, but 0 times inf is NaN)."""
        count = self.uniform()
        if count is not None:
            return float(rule(count))
        return to_device([float(rule(c)) for c in self.counts], torch.float32, self.device)

    def first(self) -> FirstGradients:
        """Which blocks take their first gradient this step (count 1)."""
        if self._uniform is not None:
            return ALL_FIRST if self._uniform == 1 else NO_FIRST
        if self._first is None:  # read twice a step (accumulate, apply): copied to the device once
            flags = [count == 1 for count in self.counts]
            self._first = FirstGradients(False, to_device(flags, torch.bool, self.device)) if any(flags) else NO_FIRST
        return self._first


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small tensor of host values on ``device``; to a GPU through pinned memory, without making the
    training thread wait for the copy (the caching host allocator keeps the buffer until it is done)."""
    host = torch.tensor(values, dtype=dtype, device="cpu")
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
