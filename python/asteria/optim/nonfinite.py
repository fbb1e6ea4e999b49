"""The non-finite gradient policy of an optimizer's shape groups: a block whose gradient holds NaN or Inf is
skipped for the step (``"skip"``) or stops it (``"raise"``); a block skipped ``max_nonfinite_grad_steps``
times in a row raises. Each group keeps its streaks and totals in its state (so checkpoints carry them)."""

from __future__ import annotations

import torch
from torch import Tensor

from asteria import functional as F
from asteria.config import RuntimeConfig
from asteria.errors import NonFiniteGradientError
from asteria.optim.groups import ShapeGroup

NONFINITE_STREAK = "nonfinite_streak"
NONFINITE_TOTAL = "nonfinite_total"


class NonfiniteGuard:
    """Applies ``runtime``'s policy (read at each call: ``nonfinite_grad_policy`` and
    ``max_nonfinite_grad_steps``) to the gradients of shape groups."""

    def __init__(self, runtime: RuntimeConfig) -> None:
        self.runtime = runtime
        self._probes: dict[int, tuple[Tensor, torch.cuda.Event]] = {}  # group index -> (pinned streaks, copy's event)

    @staticmethod
    def init_group(group: ShapeGroup) -> None:
        """Allocates ``group``'s streak and total counters."""
        group.state[NONFINITE_STREAK] = torch.zeros(group.batch, dtype=torch.int32, device=group.device)
        group.state[NONFINITE_TOTAL] = torch.zeros(group.batch, dtype=torch.int64, device=group.device)

    def gather(self, group: ShapeGroup) -> tuple[Tensor, Tensor, list[bool]]:
        """Stacked gradients with bad blocks zeroed, and the (B,) mask of blocks to update. Which blocks
        have a gradient, as a host list (a non-finite one too: its step is counted, and skipped)."""
        grads, has_grad, present = group.gather_grads()
        finite = F.usable_gradient_rows(grads)
        bad = has_grad & ~finite
        if self.runtime.nonfinite_grad_policy == "raise" and bool(bad.any()):
            block = group.blocks[int(bad.nonzero()[0])]
            raise NonFiniteGradientError(block.name, "policy 'raise' (RuntimeConfig.nonfinite_grad_policy)")
        streak = group.state[NONFINITE_STREAK]
        streak.copy_(torch.where(bad, streak + 1, torch.where(has_grad, 0, streak)))
        group.state[NONFINITE_TOTAL] += bad
        keep = has_grad & finite
        return grads.masked_fill_(F.batch_view(~keep, grads), 0.0), keep, present  # ``grads``: a stacked copy

    def check_streaks(self, groups: list[ShapeGroup]) -> None:
        """Raises when some block skipped too many steps in a row. Called at refresh steps only, and on a GPU
        without making the host wait: each check copies the streaks to pinned host memory on the stream
        and reads the copy of an earlier check once it has landed. A block that crosses the bound is thus
        raised for up to two intervals late; a step in between never changes its parameters, it only
        skips the block."""
        bound = self.runtime.max_nonfinite_grad_steps
        for index, group in enumerate(groups):
            streak = group.state[NONFINITE_STREAK]
            if streak.device.type != "cuda":
                _raise_for_streak(group, streak, bound)
                continue
            probe = self._probes.get(index)
            if probe is not None and not probe[1].query():
                continue  # the last copy is still on its way: read it next time
            if probe is not None:
                _raise_for_streak(group, probe[0], bound)
            host = probe[0] if probe is not None else torch.empty(streak.shape, dtype=streak.dtype, pin_memory=True,
                                                                  device="cpu")
            host.copy_(streak, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(streak.device))
            self._probes[index] = (host, event)

    @staticmethod
    def skips(groups: list[ShapeGroup]) -> int:
        """Block steps skipped for a non-finite gradient so far."""
        return int(sum(int(g.state[NONFINITE_TOTAL].sum()) for g in groups))


def _raise_for_streak(group: ShapeGroup, streak: Tensor, bound: int) -> None:
    worst = int(streak.max())
    if worst >= bound:
        block = group.blocks[int((streak >= bound).nonzero()[0])]
        raise NonFiniteGradientError(block.name, f"{worst} steps in a row skipped (max_nonfinite_grad_steps={bound})")
