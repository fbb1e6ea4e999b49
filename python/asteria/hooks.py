"""``asteria.attach(model, opt)``: module hooks that move the shadow-state pipeline off ``step()``.

Without hooks the optimizer does all of its pipeline work inside ``step()``: it hands finished
snapshots to the workers, then installs the preconditioner versions the schedule activates for the
step. With ``attach``:

- the end of the model's first forward of a step (a forward hook on the root module; ``prefetch``
  places it elsewhere) prefetches the next activation: the versions due are waited for and installed
  on the low-priority side stream while the backward pass runs, so ``step()`` finds them in place
  and the main stream waits only on the copies' events. For Shampoo that is the activation of the
  coming step (unless that step's own refresh is used at once: staleness 0, or the bootstrap refresh
  — then ``step()`` does it); for SOAP and KL-Shampoo, whose coming step reads the bases while
  accumulating, it is the activation of the step just done, which otherwise runs at the start of the
  next ``step()``. At the end of the forward, not its start: by then the forward's kernels are
  queued, so the host's part of an activation (waiting for jobs, and on several ranks publishing into
  the node store and exchanging versions) runs while the GPU computes instead of while it idles
  between steps;
- ``drain_points`` modules that own parameters, spread evenly over the model's module order, get a
  forward hook that drains finished transfers — snapshots whose device-to-host copy has completed go
  to the CPU workers at once (not at the next ``step()``), staging buffers whose copies have completed
  are recycled — and arms a gradient hook on the module's output that drains again when the backward
  pass reaches the module. (A gradient hook on the output, not a full backward hook: it adds no
  autograd nodes and works for modules whose inputs need no gradient, such as embeddings.) Each drain
  hands over everything finished so far, so a few points per pass suffice; a hook on every module
  would cost the training thread, which launches the GPU's kernels, Python time on every layer
  (measured on an H200: several ms per step on a 160M-parameter model).

- with late activation (by default under ``deterministic=False``), the backward drains also mark how far the
  backward pass has been queued, and ``step()`` waits until the GPU has reached the next-to-last mark
  before its last activation. The training thread runs ahead of the GPU: it reaches ``step()`` while
  the GPU still computes most of the backward pass, so without the wait a version that finishes during
  the backward is used a step later. The host waits for the GPU anyway when the loop reads the loss;
  the last stretch of the backward keeps the GPU busy while the host installs and queues the step.

Under the deterministic rule the hooks never change what is computed: the same versions are installed
for the same step, so a run with hooks is bitwise identical to one without (tested). Under
``deterministic=False`` they only change when versions are found finished.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from asteria.config import plain
from asteria.optim.base import SecondOrderOptimizer


class AttachHandle:
    """The hooks ``attach`` registered; ``remove()`` takes every one of them off (idempotent).

    Neither the hooks nor the handle keep the optimizer alive: once it is collected (or closed) the hooks
    left on the model do nothing, and ``optimizer`` is None."""

    def __init__(self, model: nn.Module, optimizer: SecondOrderOptimizer, handles: list[RemovableHandle],
                 late_activation: bool = False) -> None:
        self.model = model
        self._optimizer = weakref.ref(optimizer)
        self._handles = handles
        #: whether this handle turned the optimizer's late activation on (kept after ``remove()``)
        self.late_activation = late_activation

    @property
    def optimizer(self) -> SecondOrderOptimizer | None:
        """The optimizer whose hooks these are; None once it has been collected."""
        return self._optimizer()

    @property
    def num_hooks(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        optimizer = self.optimizer
        if self.late_activation and self._handles and optimizer is not None:  # the drain hooks are not yet removed
            optimizer.late_activation = False
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> AttachHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


DRAIN_POINTS = 8
#: where the activation runs: a hook at the forward's start or end, or ``step()`` itself (after the backward)
PREFETCH_POINTS = ("forward_start", "forward_end", "step")


def attach(model: nn.Module, optimizer: Any, drain_points: int = DRAIN_POINTS,
           prefetch: str = "forward_end", late_activation: bool | None = None) -> AttachHandle:
    """Registers the prefetch and drain hooks of ``optimizer`` (an Asteria optimizer) on ``model``:
    one prefetch hook on the root module (none with ``prefetch="step"``) and drain hooks on
    ``drain_points`` (>= 0) of the modules that own parameters (all of them when there are fewer).

    ``prefetch`` places the activation: ``"forward_end"`` (default; a forward hook), ``"forward_start"``
    (a forward pre-hook) or ``"step"`` (no prefetch hook: ``step()`` activates, after the backward has
    been queued). The host's part of an activation stalls the GPU only where the GPU runs out of queued
    work meanwhile, so the best point is where the host is furthest ahead of the GPU; what is computed
    is the same at every point.

    ``late_activation=True`` (an optimizer with ``mode="async"`` and ``deterministic=False``, and
    ``drain_points >= 1``) makes ``step()`` wait, before its last activation, until the GPU has reached the
    next-to-last backward drain point, so versions that finish during the backward pass are used at this step
    (see the module's docstring). Its cost is the GPU's idle time, if any, while the host installs and queues
    the step after the wait: none measured on an H200 at olmo-160m with 32 x 1024 tokens a step, in a loop
    that reads the loss at every step (it waits for the GPU anyway); in shorter steps the host's queueing
    after the wait may outlast the backward pass's last stretch. A loop that never waits for the GPU loses its
    run-ahead past the backward pass; ``False`` gives it back. ``None`` (default) turns it on wherever it is
    allowed and no other handle has it on.

    Works with any ``nn.Module``, including FSDP2-wrapped ones (the hooks are ordinary module hooks),
    models with tied, frozen or unused parameters, and models of which the optimizer sees only part.
    Returns a handle; ``handle.remove()`` leaves no hook behind.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"Invalid model={type(model).__name__}: must be a torch.nn.Module")
    if not isinstance(optimizer, SecondOrderOptimizer):
        raise ValueError(f"Invalid optimizer={type(optimizer).__name__}: must be an Asteria optimizer "
                         "(asteria.Shampoo, asteria.SOAP or asteria.KLShampoo)")
    if optimizer._closed:
        raise RuntimeError("Invalid attach() of a closed optimizer: its workers are stopped; load its state_dict() "
                           "into a new optimizer and attach that")
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not any(id(p) in owned for p in model.parameters()):
        raise ValueError(f"Invalid model={type(model).__name__}: none of its parameters is the optimizer's (attach "
                         "the model whose parameters the optimizer was built over)")
    drain_points = plain(drain_points)
    if not (isinstance(drain_points, int) and not isinstance(drain_points, bool) and drain_points >= 0):
        raise ValueError(f"Invalid drain_points={drain_points!r}: must be an int >= 0")
    if prefetch not in PREFETCH_POINTS:
        raise ValueError(f"Invalid prefetch={prefetch!r}: must be one of {PREFETCH_POINTS}")
    if late_activation is not None and not isinstance(late_activation, bool):
        raise ValueError(f"Invalid late_activation={late_activation!r}: must be None, True or False")
    runtime = optimizer.runtime
    if late_activation is None:
        late_activation = (runtime.mode == "async" and not runtime.deterministic and drain_points >= 1
                           and not optimizer.late_activation)
    if late_activation:
        if runtime.mode != "async" or runtime.deterministic:
            raise ValueError(f"Invalid late_activation=True for an optimizer with mode={runtime.mode!r}, "
                             f"deterministic={runtime.deterministic}: needs mode='async' and deterministic=False "
                             "(the deterministic rule fixes each step's versions in advance, so waiting brings "
                             "none sooner)")
        if drain_points < 1:
            raise ValueError(f"Invalid drain_points={drain_points!r} with late_activation=True: must be >= 1 "
                             "(the backward drain points mark how far the backward pass has been queued)")
        if optimizer.late_activation:
            raise ValueError("Invalid late_activation=True: the optimizer is already attached with it; remove "
                             "that handle first")

    # The hooks reach the optimizer through a weak reference: the model must not keep it (its workers and
    # host buffers) alive, and once it is collected or closed they have nothing to do.
    target = weakref.ref(optimizer)

    def live() -> Any:
        opt = target()
        return None if opt is None or opt._closed else opt

    def prefetch_hook(module: nn.Module, *args: Any) -> None:
        opt = live()
        if opt is not None and torch.is_grad_enabled():  # a training forward (evaluation under no_grad(): nothing)
            opt.prefetch()

    def drain_in_backward(grad: torch.Tensor) -> None:
        opt = live()
        if opt is not None:
            opt.poll()
            opt.mark_backward(grad.device)

    def drain(module: nn.Module, args: Any, output: Any) -> None:
        opt = live()
        if opt is None:
            return
        opt.poll()
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(drain_in_backward)

    handles = []
    if prefetch == "forward_end":
        handles.append(model.register_forward_hook(prefetch_hook))
    elif prefetch == "forward_start":
        handles.append(model.register_forward_pre_hook(prefetch_hook))
    owners = [module for module in model.modules() if any(True for _ in module.parameters(recurse=False))]
    chosen = sorted({(i * len(owners)) // drain_points for i in range(drain_points)}) if owners else []
    for index in chosen:
        handles.append(owners[index].register_forward_hook(drain))
    if late_activation:
        optimizer.late_activation = True
    return AttachHandle(model, optimizer, handles, late_activation)
