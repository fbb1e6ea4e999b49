"""A torch.profiler capture of a range of training steps (``asteria train --profile-steps FIRST LAST``).

Each step of the range runs inside a ``record_function`` range named ``step N``, the name
``bench/trace_steps.py`` reads. The capture starts at the first step of the range and stops at the end of
its last one (or when the run ends before it); when the run ends, each rank writes its own Chrome trace,
``trace-rank<R>.json.gz``, next to the run's metrics. Steps outside the range run without a profiler,
but the last step of the range carries the cost of stopping it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch


def check_profile_steps(value: tuple[int, int] | None, steps: int) -> tuple[int, int] | None:
    """``value`` as a ``(first, last)`` pair of steps, checked against the run's ``steps``."""
    if value is None:
        return None
    ok = (isinstance(value, (tuple, list)) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
    if not ok or not 1 <= value[0] <= value[1] <= steps:
        raise ValueError(f"Invalid profile_steps={value!r}: must be two steps FIRST LAST with "
                         f"1 <= FIRST <= LAST <= steps ({steps})")
    return int(value[0]), int(value[1])


class StepProfiler:
    """Profiles the steps ``first..last`` (both included) of a training loop; a no-op for ``None``."""

    def __init__(self, steps: tuple[int, int] | None, out: Path, rank: int, device: torch.device) -> None:
        self.range = steps
        self.path = out / f"trace-rank{rank}.json.gz"
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler: torch.profiler.profile | None = None
        self._stopped: torch.profiler.profile | None = None

    def step(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Runs one training step, inside the capture when ``step`` is in the range (outside it, a null
        context: nothing on the training step's path)."""
        if self.range is None or not self.range[0] <= step <= self.range[1]:
            return contextlib.nullcontext()
        return self._profiled(step)

    @contextlib.contextmanager
    def _profiled(self, step: int) -> Iterator[None]:
        if self._profiler is None and self._stopped is None:
            self._profiler = torch.profiler.profile(activities=self.activities)
            self._profiler.__enter__()
        with torch.profiler.record_function(f"step {step}"):
            yield
        if step == self.range[1]:
            self._stop()

    def _stop(self) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._stopped, self._profiler = self._profiler, None

    def close(self) -> Path | None:
        """Stops a capture still running and writes the trace; returns its path (None: nothing captured)."""
        self._stop()
        if self._stopped is None:
            return None
        stopped, self._stopped = self._stopped, None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stopped.export_chrome_trace(str(self.path))
        return self.path
