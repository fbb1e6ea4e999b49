"""What Shampoo, SOAP and KL-Shampoo share: blocking, batching by shape, the refresh schedule, the
non-finite gradient policy, the decoupled update, statistics and shutdown.

A subclass says which state a shape group holds, how it accumulates statistics from a gradient and
which direction it steps in; the preconditioner refreshes run through one ``Refresher``.
"""

from __future__ import annotations

import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from asteria import _core
from asteria.config import RuntimeConfig
from asteria.errors import NonFiniteGradientError
from asteria.optim import functional as F
from asteria.optim.groups import ShapeGroup, build_shape_groups
from asteria.pipeline.factors import FactorSet, RootRequest
from asteria.optim.validation import (check_arg, check_betas, check_count, check_nonnegative,  # noqa: F401
                                      check_positive, validate_state_dict)
from asteria.pipeline.refresh import Refresher, make_refresher

NONFINITE_STREAK = "nonfinite_streak"
NONFINITE_TOTAL = "nonfinite_total"


class SecondOrderOptimizer(torch.optim.Optimizer):
    """Base of the Asteria optimizers (see the module docstring)."""

    #: whether small adjacent dimensions are merged before blocking (see ``asteria.optim.blocking``)
    MERGE_DIMS = True

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        max_preconditioner_dim: int,
        precondition_frequency: int,
        start_preconditioning_step: int | None,
        runtime: RuntimeConfig | None,
    ) -> None:
        check_count(max_preconditioner_dim, "max_preconditioner_dim")
        check_count(precondition_frequency, "precondition_frequency")
        check_count(start_preconditioning_step, "start_preconditioning_step", optional=True)
        start = precondition_frequency if start_preconditioning_step is None else start_preconditioning_step
        check_arg(runtime is None or isinstance(runtime, RuntimeConfig), "runtime", runtime,
                  "must be None or an asteria.RuntimeConfig")
        super().__init__(params, defaults)
        self.runtime = runtime or RuntimeConfig()
        self.max_preconditioner_dim = max_preconditioner_dim
        self.precondition_frequency = precondition_frequency
        self.start_preconditioning_step = start
        self._step = 0
        self._groups = build_shape_groups(self.param_groups, max_preconditioner_dim, self.MERGE_DIMS)
        self._set_groups: list[tuple[FactorSet, ShapeGroup]] = []
        for group in self._groups:
            group.state[NONFINITE_STREAK] = torch.zeros(group.batch, dtype=torch.int32, device=group.device)
            group.state[NONFINITE_TOTAL] = torch.zeros(group.batch, dtype=torch.int64, device=group.device)
            self._set_groups += [(fset, group) for fset in self._init_group(group)]
        self._refresher: Refresher = make_refresher([s for s, _ in self._set_groups], self.runtime,
                                                    precondition_frequency)
        # Stops the workers when the optimizer is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, self._refresher.close)
        self._check_budgets()

    # ---- what a subclass provides -------------------------------------------------------------
    @abstractmethod
    def _init_group(self, group: ShapeGroup) -> list[FactorSet]:
        """Allocates ``group.state`` and returns the group's factor sets (one per mode, or none)."""

    @abstractmethod
    def _accumulate(self, group: ShapeGroup, grads: Tensor, keep: Tensor, step: int) -> None:
        """Updates the group's statistics from ``grads`` (zero in blocks that are not kept)."""

    @abstractmethod
    def _direction(self, group: ShapeGroup, step: int) -> Tensor | None:
        """The (B, *shape) direction to step against, before the learning rate; ``None`` leaves the
        parameters as they are this step."""

    @staticmethod
    def check_hyperparameters(hyper: dict[str, Any], where: str = "") -> None:
        """Raises ``ValueError`` naming the first invalid hyperparameter of a defaults dict (``where`` = "")
        or of a param group (``where`` = "param_groups[i]")."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's, with the group's hyperparameters checked. Only during construction: the blocks
        are batched once, so a group added later would never be stepped."""
        if getattr(self, "_groups", None) is not None:
            raise ValueError("Invalid add_param_group after construction: an Asteria optimizer batches its blocks "
                             "when it is built; create a new optimizer with every param group instead")
        super().add_param_group(param_group)
        try:
            self.check_hyperparameters(self.param_groups[-1], f"param_groups[{len(self.param_groups) - 1}]")
        except ValueError:
            self.param_groups.pop()
            raise

    def _root_request(self, group: ShapeGroup, step: int) -> RootRequest:
        """What a refresh of ``group``'s factors at ``step`` computes; override for other rules."""
        hyper = self.param_groups[group.group_index]
        return RootRequest(scale=1.0 / (1.0 - hyper["betas"][1] ** step), eps=hyper["eps"])

    # ---- the step ----------------------------------------------------------------------------
    def is_refresh_step(self, step: int) -> bool:
        offset = step - self.start_preconditioning_step
        return offset >= 0 and offset % self.precondition_frequency == 0

    def refresh_version(self, step: int) -> int:
        return (step - self.start_preconditioning_step) // self.precondition_frequency + 1

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step. Raises ``RefreshError`` when a block's refresh failed too often in a row
        and ``NonFiniteGradientError`` under the non-finite gradient policy; the parameters are not
        changed by a step that raises."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self._step + 1
        batches = [self._gather(group) for group in self._groups]
        self._refresher.before_factor_update()
        for group, (grads, keep) in zip(self._groups, batches):
            self._accumulate(group, grads, keep, step)
        if self.is_refresh_step(step):
            self._check_nonfinite_streaks()
            requests = [self._root_request(group, step) for _, group in self._set_groups]
            self._refresher.refresh(step, self.refresh_version(step), requests)
        self._refresher.activate(step)
        for group, (_, keep) in zip(self._groups, batches):
            self._apply(group, keep, step)
        self._step = step
        return loss

    def _gather(self, group: ShapeGroup) -> tuple[Tensor, Tensor]:
        """Stacked gradients with bad blocks zeroed, and the (B,) mask of blocks to update."""
        grads, has_grad = group.gather_grads()
        finite = F.usable_gradient_rows(grads)
        bad = has_grad & ~finite
        if self.runtime.nonfinite_grad_policy == "raise" and bool(bad.any()):
            block = group.blocks[int(bad.nonzero()[0])]
            raise NonFiniteGradientError(block.name, "policy 'raise' (RuntimeConfig.nonfinite_grad_policy)")
        streak = group.state[NONFINITE_STREAK]
        streak.copy_(torch.where(bad, streak + 1, torch.where(has_grad, 0, streak)))
        group.state[NONFINITE_TOTAL] += bad
        keep = has_grad & finite
        return torch.where(F.batch_view(keep, grads), grads, 0.0), keep

    def _check_nonfinite_streaks(self) -> None:
        """Raises when some block skipped too many steps in a row (read at refresh steps only, to keep
        the other steps free of host synchronization)."""
        bound = self.runtime.max_nonfinite_grad_steps
        for group in self._groups:
            streak = group.state[NONFINITE_STREAK]
            if int(streak.max()) >= bound:
                block = group.blocks[int((streak >= bound).nonzero()[0])]
                raise NonFiniteGradientError(block.name, f"{int(streak.max())} steps in a row skipped "
                                             f"(max_nonfinite_grad_steps={bound})")

    def _apply(self, group: ShapeGroup, keep: Tensor, step: int) -> None:
        hyper = self.param_groups[group.group_index]
        direction = self._direction(group, step)
        if direction is None:
            return
        weights = group.gather_params()
        updated = weights * (1.0 - hyper["lr"] * hyper["weight_decay"]) - hyper["lr"] * direction
        group.scatter_params_(torch.where(F.batch_view(keep, weights), updated, weights))

    # ---- checkpoints --------------------------------------------------------------------------
    def _layout(self) -> list[list]:
        return [[g.group_index, list(g.shape), g.batch, [b.name for b in g.blocks]] for g in self._groups]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The optimizer's full state: step, hyperparameters, every shape group's batched tensors
        (factors, preconditioners in use, moments, counters), the version each block uses, and the
        refreshes scheduled but not yet in use (as their snapshots, recomputed on load). With
        ``deterministic=True`` a run resumed from it continues bit for bit."""
        param_groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(range(len(g["params"])))}
                        for g in self.param_groups]
        return {
            "format": "asteria.v1",
            "step": self._step,
            "layout": self._layout(),
            "param_groups": param_groups,
            "groups": [{k: v.detach().clone() for k, v in g.state.items()} for g in self._groups],
            "versions": [list(fset.versions) for fset, _ in self._set_groups],
            "refresher": self._refresher.state(self._step),
            "runtime_mode": self.runtime.mode,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Loads a ``state_dict()`` of an optimizer over the same parameters and blocking; raises
        ``ValueError`` naming what differs otherwise, before anything is changed."""
        validate_state_dict(self, state_dict)
        for saved, group in zip(state_dict["groups"], self._groups):
            for key, tensor in saved.items():
                group.state[key].copy_(tensor)
        for versions, (fset, _) in zip(state_dict["versions"], self._set_groups):
            fset.versions = list(versions)
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._step = state_dict["step"]
        self._refresher.load_state(state_dict["refresher"])

    # ---- reporting and life cycle ---------------------------------------------------------------
    def staleness(self) -> int:
        """Refresh intervals by which the most stale preconditioner in use lags its block's newest
        snapshot (0 before the first refresh)."""
        if self._step < self.start_preconditioning_step:
            return 0
        newest = self.refresh_version(self._step)
        return max((newest - min(fset.versions) for fset, _ in self._set_groups), default=0)

    def runtime_stats(self) -> dict[str, Any]:
        """Refreshes done and failed, the staleness histogram seen, waits (count and seconds), worker busy
        fraction, bytes copied between tiers, and skipped non-finite gradient steps."""
        stats = {"mode": self.runtime.mode, "staleness_budget": self.runtime.staleness, "step": self._step,
                 "blas_core": _core.blas_core()}
        stats.update(self._refresher.stats())
        stats["nonfinite_grad_skips"] = int(sum(int(g.state[NONFINITE_TOTAL].sum()) for g in self._groups))
        return stats

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes of optimizer state per tier and per kind of state."""
        device: dict[str, int] = {}
        for group in self._groups:
            for key, tensor in group.state.items():
                kind = key.rstrip("_0123456789")  # "factor_1" and "factor_0" are one kind
                device[kind] = device.get(kind, 0) + tensor.numel() * tensor.element_size()
        device["total"] = sum(device.values())
        host = {"refresh_buffers": self._refresher.host_bytes()}
        host["total"] = host["refresh_buffers"]
        return {"device": device, "host": host}

    def _check_budgets(self) -> None:
        report = self.memory_report()
        memory = self.runtime.memory
        needs = f"device needs {report['device']['total']} bytes, host needs {report['host']['total']} bytes"
        if memory.gpu_budget is not None and report["device"]["total"] > memory.gpu_budget:
            raise ValueError(f"Invalid gpu_budget={memory.gpu_budget}: too small for this model's state ({needs})")
        if memory.host_budget is not None and report["host"]["total"] > memory.host_budget:
            raise ValueError(f"Invalid host_budget={memory.host_budget}: too small for this model's state ({needs})")

    def close(self) -> None:
        """Stops the refresh workers and releases their buffers. Idempotent; also runs at exit."""
        self._finalizer()

    def __enter__(self) -> SecondOrderOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
