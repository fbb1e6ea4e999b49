"""What Shampoo, SOAP and KL-Shampoo share: blocking, batching by shape, the refresh schedule, the
non-finite gradient policy, the decoupled update, statistics and shutdown.

A subclass says which state a shape group holds, how it accumulates statistics from a gradient and
which direction it steps in; the preconditioner refreshes run through one ``Refresher``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from asteria import _core
from asteria.checks import check_arg, check_count
from asteria.config import MAX_FREQUENCY, RuntimeConfig, plain
from asteria.distributed import topology
from asteria.distributed.topology import same_on_every_rank
from asteria.memory import explain_out_of_memory
from asteria.optim import checkpoint
from asteria.optim.groups import ShapeGroup, build_shape_groups, small_block_dim, split_for_stagger, stagger_runs
from asteria.optim.nonfinite import NonfiniteGuard
from asteria.optim.param_state import ParameterStates, refuse_per_parameter_readers
from asteria.optim.placement import Placement, check_factor_memory, check_host_memory, default_group_bytes
from asteria.optim.refreshers import make_refresher
from asteria.optim.steps import BlockSteps
from asteria.pipeline import streams
from asteria.pipeline.async_refresh import refresh_buffer_bytes
from asteria.pipeline.factors import FactorSet, RootRequest
from asteria.pipeline.refresh import Refresher
from asteria.pipeline.timeline import InstallDelays, Timeline, is_staggered, plan_schedule
from asteria.pipeline.worker_refresh import ring_depth

#: constructor arguments that hold for every group: a param group may not set them
CONSTRUCTOR_ONLY = ("max_preconditioner_dim", "precondition_frequency", "start_preconditioning_step",
                    "precondition_1d", "runtime")


class SecondOrderOptimizer(torch.optim.Optimizer):
    """Base of the Asteria optimizers (see the module docstring)."""

    #: whether small adjacent dimensions are merged before blocking (see ``asteria.optim.blocking``)
    MERGE_DIMS = True
    #: float32 tensors of a block's shape that the optimizer keeps per block (its moments), for the memory
    #: checks made before anything is allocated
    PARAM_MOMENTS = 2
    #: steps from a version's activation to its first use: 0 when the step that activates it steps with
    #: it (Shampoo's roots), 1 when the direction is computed while accumulating, before the step's
    #: refresh (SOAP's and KL-Shampoo's bases). The activation of step t may run anywhere between
    #: step t's refresh and that first use: at the start of step t + 1 (before anything changes, so a
    #: failing or timed-out activation leaves the parameters as they were), or earlier, in the forward
    #: pass, with ``asteria.attach``; the start-up versions' within step t, before its update (which reads
    #: none), so that their results on a GPU (8 GiB at olmo2-1b) are gone before the next forward pass.
    ACTIVATION_LAG = 0
    #: whether a block's first gradient moves it (Shampoo: a grafting step), or only starts its
    #: statistics (SOAP and KL-Shampoo: the first gradient builds the factors and their eigenbasis)
    FIRST_GRADIENT_STEPS = True
    #: hyperparameters that default to betas[1] when None (in the constructor or in a param group)
    BETA2_KEYS: tuple[str, ...] = ()
    #: whether 1-D blocks keep factors (a constructor argument; None: the optimizer offers no choice, never)
    precondition_1d: bool | None = None
    #: hyperparameters added after checkpoints were written without them, with the value those
    #: checkpoints were computed by (a resumed run goes on with the math it started with)
    ADDED_HYPERPARAMETERS: dict[str, Any] = {}

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
        if torch.is_inference_mode_enabled():
            raise RuntimeError(f"Invalid {type(self).__name__}(...) under torch.inference_mode(): its state would be "
                               "inference tensors, which no later step may update; build it outside inference mode")
        check_count(max_preconditioner_dim, "max_preconditioner_dim")
        check_count(precondition_frequency, "precondition_frequency")
        check_arg(precondition_frequency <= MAX_FREQUENCY, "precondition_frequency", precondition_frequency,
                  f"must be at most {MAX_FREQUENCY} steps")
        check_count(start_preconditioning_step, "start_preconditioning_step", optional=True)
        max_preconditioner_dim, precondition_frequency, start_preconditioning_step = plain(
            (max_preconditioner_dim, precondition_frequency, start_preconditioning_step))
        start = precondition_frequency if start_preconditioning_step is None else start_preconditioning_step
        check_arg(runtime is None or isinstance(runtime, RuntimeConfig), "runtime", runtime,
                  "must be None or an asteria.RuntimeConfig")
        super().__init__(params, {k: plain(v) for k, v in defaults.items()})
        # A copy (checked again): the caller's object may be changed or reused for another optimizer.
        self.runtime = RuntimeConfig() if runtime is None else runtime.checked_copy()
        several_ranks = topology(replace(self.runtime, deterministic=True)) is not None
        self.runtime.deterministic = self.runtime.resolved_deterministic(several_ranks)
        self.max_preconditioner_dim = max_preconditioner_dim
        self.precondition_frequency = precondition_frequency
        self.start_preconditioning_step = start
        self._step = 0
        self._pid = os.getpid()  # the process whose threads the workers are (``_check_process``)
        self._closed = False  # close() was called: step() refuses, prefetch() does nothing
        self._busy = threading.Lock()  # held by step(), state_dict() and load_state_dict(): ``_exclusive``
        #: what the refresh engine has seen: only a fresh async optimizer may load a state_dict
        self._used = checkpoint.EngineUse.FRESH
        self._activated_step = 0  # the newest step whose activation has been done
        #: set by ``asteria.attach(late_activation=True)``: ``step()``'s last activation waits for the GPU to
        #: reach the end of the backward pass (``mark_backward``)
        self.late_activation = False
        self._backward = streams.BackwardMarks()
        self._nonfinite = NonfiniteGuard(self.runtime)
        self._placement = Placement(self.runtime, {p.device for group in self.param_groups for p in group["params"]})
        resident = self._placement.resident()
        group_bytes = self.runtime.memory.group_bytes
        if group_bytes is None:
            group_bytes = default_group_bytes(resident)
        self._groups = build_shape_groups(self.param_groups, max_preconditioner_dim, self.MERGE_DIMS, group_bytes)
        check_factor_memory(self._groups, self._refresh_dims, self.PARAM_MOMENTS, self._placement,
                            max_preconditioner_dim)
        #: each param group's parameter list as built (and its length): ``step()`` refuses edits of them
        self._group_params = [(group["params"], len(group["params"])) for group in self.param_groups]
        one_process = not several_ranks
        #: the large factor sets are split for the stagger (``RuntimeConfig.stagger_split``; None: wherever
        #: the schedule is staggered on one process), the small ones by their own work (``stagger_small``)
        self.stagger_split = (self.runtime.stagger_split if self.runtime.stagger_split is not None
                              else self.runtime.stagger_wanted() and one_process)
        self.stagger_small = self.runtime.stagger_small is not False and (self.runtime.stagger_wanted()
                                                                         or self.stagger_split)
        # Where the preconditioners stay on the device of one process, only the refresh units (views of the
        # groups' tensors) are split: the step's math keeps one batch per shape. The other tiers move whole
        # sets, and the refresher of several ranks shares out whole groups' blocks: there the groups are split.
        small = small_block_dim(self._groups, self._refresh_dims) if self.stagger_small else None
        cut = (precondition_frequency, self._refresh_dims, self.runtime.stagger_sets_per_step, small)
        runs = stagger_runs(self._groups, *cut) if self.stagger_split and one_process and resident else None
        if self.stagger_split and runs is None:
            self._groups = split_for_stagger(self._groups, *cut)
        #: the factor sets the schedule refreshes (slices of the groups' sets when split), with their groups
        self._set_groups: list[tuple[FactorSet, ShapeGroup]] = []
        group_sets: list[list[FactorSet]] = []
        for index, group in enumerate(self._groups):
            NonfiniteGuard.init_group(group)
            group.steps = BlockSteps(group.batch, group.device)
            group_sets.append(self._init_group(group))
            if runs is None or len(runs[index]) == 1:
                self._set_groups += [(fset, group) for fset in group_sets[-1]]
            else:  # run by run, each run's modes together: the order the split groups would have
                self._set_groups += [(fset.slice(a, b), group) for a, b in runs[index] for fset in group_sets[-1]]
        self._placement.hold(self._groups, group_sets)
        #: per group, the indices of its factor sets in ``_set_groups``
        self._sets_of = {id(group): [i for i, (_, g) in enumerate(self._set_groups) if g is group]
                         for group in self._groups}
        sets = [s for s, _ in self._set_groups]
        small_sets = [small is not None and s.dim <= small for s in sets]
        self.schedule = plan_schedule(start, precondition_frequency, [float(s.batch) * s.dim**3 for s in sets],
                                      self._staggered(sets, small_sets), self.runtime.sync_refreshes, small_sets)
        self._delays = InstallDelays(self.schedule, [s.name for s in sets], self.runtime.sync_refreshes,
                                     [s.dim for s in sets])
        if self.runtime.mode == "async" and one_process:
            lag = self.runtime.activation_lag(precondition_frequency)
            depth = ring_depth(self.runtime, precondition_frequency, lag)
            check_host_memory(self.runtime, precondition_frequency, refresh_buffer_bytes(sets, depth), self._groups,
                              self.placement)
        try:
            self._refresher: Refresher = make_refresher(sets, self.runtime, precondition_frequency,
                                                        [g for _, g in self._set_groups], resident)
        except RuntimeError as error:  # a pinned or device allocation the checks above could not foresee
            if "out of memory" not in str(error):
                raise
            raise MemoryError(f"{type(self).__name__}: its refresh buffers could not be allocated ({error}); see "
                              "memory_report() of a smaller configuration, and RuntimeConfig.deterministic, lag_steps "
                              "and max_preconditioner_dim for what sizes them") from error
        #: when each version is snapshotted, comes into use and is first read (``asteria.pipeline.timeline``)
        self.timeline = Timeline(self.schedule, self._refresher.rule, self.ACTIVATION_LAG)
        self._placement.serve(self._refresher)
        # Stops the workers when the optimizer is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _close, self._refresher, self._placement)
        #: torch's per-parameter ``state``: here a read-only view of each parameter's step count (the state
        #: itself is kept per block shape: ``state_dict()``)
        self.state = ParameterStates(self)  # type: ignore[assignment]
        try:
            self._placement.fit_gpu_budget()
            self._placement.place_on_nvme()
            self._placement.check_budgets()
        except BaseException:
            self.close()
            raise

    @property
    def placement(self) -> str:
        """Where the preconditioners in use live: ``"device"``, ``"host"`` or ``"device_view"``
        (``MemoryConfig.placement``, with ``"auto"`` resolved)."""
        return self._placement.name

    def _staggered(self, sets: list[FactorSet], small: list[bool]) -> bool:
        """Whether the refresh schedule is staggered (``asteria.pipeline.timeline.is_staggered``): on several
        ranks the replicas of a block must refresh it at the same step, so only where every rank has the same
        factor sets, each of the same class (``small``), hence the same phases (DDP; FSDP2 with even shards)."""
        wanted = self.runtime.stagger_wanted()
        topo = topology(self.runtime)
        shapes = [(s.kind, s.batch, s.dim, apart) for s, apart in zip(sets, small, strict=True)]
        same = None if topo is None or not wanted else same_on_every_rank(topo, shapes)
        return is_staggered(self.runtime.stagger, wanted, same)

    # ---- what a subclass provides -------------------------------------------------------------
    @abstractmethod
    def _init_group(self, group: ShapeGroup) -> list[FactorSet]:
        """Allocates ``group.state`` and returns the group's factor sets (one per mode, or none)."""

    def _factored(self, group: ShapeGroup) -> bool:
        """Whether ``group``'s blocks keep factors: order >= 2, and 1-D ones where ``precondition_1d``."""
        return group.order >= 2 or (group.order == 1 and bool(self.precondition_1d))

    def _refresh_dims(self, group: ShapeGroup) -> list[int]:
        """The dimensions of the factor sets ``_init_group`` makes for ``group`` (one per mode of a factored
        block), known before any state is allocated."""
        return list(group.shape) if self._factored(group) else []

    @abstractmethod
    def _accumulate(self, group: ShapeGroup, grads: Tensor, keep: Tensor, step: int) -> Tensor | None:
        """Updates the group's statistics from ``grads`` (zero in blocks that are not kept). An optimizer
        with ``ACTIVATION_LAG = 1`` returns here the (B, *shape) direction of this step, computed from the
        statistics as they stand between its updates and from the bases of the step before (``None``
        leaves the parameters as they are this step); the others return None and give it in ``_direction``."""

    def _direction(self, group: ShapeGroup, step: int, accumulated: Tensor | None) -> Tensor | None:
        """The (B, *shape) direction to step against, before the learning rate (``None`` leaves the parameters
        as they are): by default ``accumulated``, what ``_accumulate`` returned. An optimizer with
        ``ACTIVATION_LAG = 0`` overrides it to read the preconditioners of this step's activation."""
        return accumulated

    def _forget_derived(self) -> None:
        """Drops what a subclass derived from the blocks' step counts and versions in use (they were loaded
        from a checkpoint, or a step that raised was taken back)."""

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
        for key in CONSTRUCTOR_ONLY:
            if key in param_group:
                raise ValueError(f"Invalid param_groups[{len(self.param_groups)}][{key!r}]={param_group[key]!r}: "
                                 f"{key} is the optimizer's, one for every group (a constructor argument), not a "
                                 "param group's")
        param_group.update({k: plain(v) for k, v in param_group.items() if k not in ("params", "param_names")})
        betas = param_group.get("betas")
        group_betas = isinstance(betas, (tuple, list)) and len(betas) == 2
        for key in self.BETA2_KEYS:  # None, as for the constructor: betas[1]
            if key in param_group and param_group[key] is None:
                param_group[key] = betas[1] if group_betas else self.defaults["betas"][1]
        if group_betas:
            for key in getattr(self, "_follows_beta2", ()):  # defaults that follow this group's betas[1]
                param_group.setdefault(key, betas[1])
        with warnings.catch_warnings():  # torch only warns of a tensor listed twice: refused below, by name
            warnings.filterwarnings("ignore", message=".*duplicate parameters.*")
            super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            seen: dict[int, int] = {}
            for position, param in enumerate(self.param_groups[-1]["params"]):
                if id(param) in seen:
                    raise ValueError(f"Invalid param_groups[{index}]['params']: the tensor at position {position} "
                                     f"(shape {tuple(param.shape)}) is the one at position {seen[id(param)]} again; "
                                     "list each parameter once (its statistics would be counted twice)")
                seen[id(param)] = position
            self.check_hyperparameters(self.param_groups[-1], f"param_groups[{index}]")
        except ValueError:
            self.param_groups.pop()
            raise

    def _check_process(self, call: str) -> None:
        """Raises ``RuntimeError`` after a ``load_state_dict`` that failed midway, and in a process forked after an
        async optimizer was built: its workers are threads of the parent, which a fork does not copy."""
        checkpoint.check_whole(self, call)
        if self.runtime.mode == "async" and os.getpid() != self._pid:
            raise RuntimeError(f"Invalid {call} in a process forked (pid {os.getpid()}) from the one that built this "
                               f"async optimizer (pid {self._pid}): its refresh workers stay in that process; build "
                               "the optimizer in the process that trains (or fork before building it)")

    def _check_param_groups(self) -> None:
        """The hyperparameters as they are at this step: an lr scheduler, or code that edits
        ``param_groups``, may have changed them since they were checked. A learning rate held in a device
        tensor is left to whoever set it (reading it here would wait for the device every step)."""
        if len(self.param_groups) != len(self._group_params) or any(
                group["params"] is not params or len(params) != count
                for group, (params, count) in zip(self.param_groups, self._group_params)):
            raise ValueError(f"Invalid param_groups: their parameters changed after construction (now "
                             f"{len(self.param_groups)} groups of {[len(g['params']) for g in self.param_groups]} "
                             f"parameters, built with {[count for _, count in self._group_params]}); an Asteria "
                             "optimizer batches its blocks when it is built: create a new one over the new parameters")
        for index, group in enumerate(self.param_groups):
            missing = [key for key in self.defaults if key not in group]
            if missing:
                raise ValueError(f"Invalid param_groups[{index}]: {missing} removed after construction; every "
                                 f"group holds {sorted(self.defaults)}")
            lr = group["lr"]
            hyper = group if not (isinstance(lr, Tensor) and lr.device.type != "cpu") else {**group, "lr": 0.0}
            self.check_hyperparameters(hyper, f"param_groups[{index}]")

    def _root_request(self, fset: FactorSet, group: ShapeGroup) -> RootRequest:
        """What a refresh of factor set ``fset`` (of ``group``) computes now (Shampoo's roots, with its
        ``eps`` and ``relative_eps``); override for other rules. The
        factors are EMAs started at zero: each block's is debiased by its own step count (one scale for the
        set while the counts agree); a block without a gradient yet has zero factors, scaled by 1."""
        hyper = self.param_groups[group.group_index]
        beta2 = hyper["betas"][1]

        def scale(count: int) -> float:
            return 1.0 / (1.0 - beta2**count) if count >= 1 else 1.0

        count = group.steps.uniform()
        if count is not None:
            return RootRequest(scale=scale(count), eps=hyper["eps"], relative_eps=hyper["relative_eps"])
        scales = tuple(scale(c) for c in group.steps.counts[fset.offset:fset.offset + fset.batch])
        return RootRequest(scale=scales[0] if len(set(scales)) == 1 else scales, eps=hyper["eps"],
                           relative_eps=hyper["relative_eps"])

    # ---- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step. Raises ``RefreshError`` when a block's refresh failed too often in a row,
        ``TimeoutError`` when a refresh it must use is not done within ``RuntimeConfig.timeout_s``, and
        ``NonFiniteGradientError`` under the non-finite gradient policy; the parameters are not changed
        by a step that raises. A step that raises before its gradients reach the statistics counts
        nothing. One that raises after (a refresh of this step that failed, or that did not finish in
        time) counts as a step without a parameter update: its gradients stay in the statistics and its
        refreshes stay on their way, so nothing computed is lost, and calling ``step()`` again goes on
        with the next step, which uses them. After ``close()`` it raises ``RuntimeError``."""
        if self._closed:
            raise RuntimeError("Invalid step() after close(): this optimizer's workers are stopped; load its "
                               "state_dict() into a new optimizer to go on training")
        with self._exclusive("step()"):
            try:
                return self._step_once(closure)
            except torch.OutOfMemoryError as error:  # torch's account, with this optimizer's share and the remedies
                raise torch.OutOfMemoryError(explain_out_of_memory(error, self)) from error
            except _core.CancelledError as cancelled:
                if not self._closed:
                    raise
                raise RuntimeError(f"Invalid step(): close() was called (from another thread) while this step ran, "
                                   f"and its workers stopped ({cancelled}); load a state_dict() taken before into a "
                                   "new optimizer to go on training") from None

    @contextlib.contextmanager
    def _exclusive(self, call: str) -> Iterator[None]:
        """Holds the optimizer for ``call``: one thread at a time may step it or take or load its state (their
        state would otherwise tear mid-update); a second one is refused at once, before anything changes."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"Invalid concurrent {call}: another thread is inside step(), state_dict() or "
                               f"load_state_dict() of this {type(self).__name__}; drive one optimizer from one "
                               "thread at a time (or hold a lock around its calls)")
        try:
            yield
        finally:
            self._busy.release()

    def _step_once(self, closure: Callable[[], float] | None) -> float | None:
        self._check_process("step()")
        self._check_param_groups()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self._step + 1
        gathered = [self._nonfinite.gather(group) for group in self._groups]
        for group, (_, _, present) in zip(self._groups, gathered):  # once all gathered: a raise there counts nothing
            group.steps.advance(present, step)
        grads, keeps = [stack for stack, _, _ in gathered], [keep for _, keep, _ in gathered]
        del gathered  # ``_step_with`` releases the stacked gradients once the statistics have them
        due = self.schedule.due(step)
        try:
            self._before_statistics(step, due)
        except BaseException:
            for group in self._groups:  # the step did not happen: its counts neither
                group.steps.undo()
            self._forget_derived()
            raise
        try:
            self._step_with(step, grads, keeps, due)
        finally:  # from the first statistics update on, the step has happened (see above)
            self._step = step
            self._used = checkpoint.EngineUse.STEPPED
        return loss

    def _before_statistics(self, step: int, due: list[tuple[int, int]]) -> None:
        """What ``step()`` checks and waits for before the statistics change (a raise here leaves the
        optimizer as it was): the non-finite streaks on refresh steps, and with ``ACTIVATION_LAG`` the
        activation of the step before, whose preconditioners the statistics update reads."""
        self._refresher.before_factor_update()
        if due:
            self._nonfinite.check_streaks(self._groups)
        if self.ACTIVATION_LAG:
            self._activate(self.timeline.activation_read_at(step))

    def _step_with(self, step: int, grads: list[Tensor], keeps: list[Tensor], due: list[tuple[int, int]]) -> None:
        """The rest of ``step()``: the statistics (which empty ``grads``), the refreshes ``due`` at ``step``, the
        activation and the update. The buffers the step read are released even when something here raises."""
        placement = self._placement
        try:
            directions = []  # with ACTIVATION_LAG: each group's, from the statistics and bases before the refresh
            for group, keep in zip(self._groups, keeps, strict=True):
                directions.append(self._accumulate(group, grads.pop(0), keep, step))
                if self.ACTIVATION_LAG:
                    placement.done(group)
            if due:
                items = [(index, version, self._root_request(*self._set_groups[index])) for index, version in due]
                self._counting_installs(step, self._refresher.refresh, step, items)  # native mode installs here
                self._refresher.check_backlog(step)
            if not self.ACTIVATION_LAG or any(version <= self.runtime.sync_refreshes for _, version in due):
                self._activate(step)  # with ACTIVATION_LAG the start-up versions' now (see there)
            for group, keep in zip(self._groups, keeps, strict=True):
                self._apply(group, keep, self._direction(group, step, directions.pop(0)))
                placement.done(group)  # at once: the NVMe tier's few buffers serve the groups in turn
        finally:
            for group in self._groups:  # after a raise: what is still held (a no-op for the groups done)
                placement.done(group)
            placement.tier.end_step()
            self._backward.clear()

    def _activate(self, step: int) -> None:
        """Runs the activation of ``step`` unless done already, and lets the current stream wait for the installs
        (done here or earlier by ``prefetch``) before anything reads them. Under ``deterministic=False`` a step
        that ``prefetch`` activated is activated again here: versions that finished during the forward and backward
        passes are used at once instead of a step later (the deterministic rule would give the same answer twice)."""
        again = self.runtime.mode == "async" and not self.runtime.deterministic
        if step >= 1 and (self._activated_step < step or again):
            if again:
                self._backward.wait()  # with late_activation: versions finished during the backward come too
            self._counting_installs(step, self._refresher.activate, step)
            self._activated_step = step
        self._refresher.ready()

    def _counting_installs(self, step: int, call: Callable[..., None], *args: Any) -> None:
        """``call(*args)`` (a refresh or activation of ``step``), counting each install's delay (``InstallDelays``)."""
        try:
            call(*args)
        finally:  # the installs made before a raise are in use too
            for index, version in self._refresher.take_installs():
                self._delays.record(step, index, version)

    def is_refresh_step(self, step: int) -> bool:
        """Whether some factor set is refreshed at ``step`` (see ``self.schedule`` for each set)."""
        return bool(self.schedule.due(step))

    def refresh_version(self, step: int, index: int = 0) -> int:
        """The newest version of factor set ``index`` snapshotted by ``step`` (0: none yet); unstaggered,
        every set has the same."""
        return self.schedule.version_at(step, index)

    def prefetch(self) -> None:
        """Installs now the preconditioner versions that the next ``step()`` activates (on the side
        stream; the main stream will wait only on those copies), unless that step refreshes a set
        whose version is used at once (staleness 0 or the bootstrap refresh): then ``step()`` does it.
        Called by the hooks of ``asteria.attach``; harmless to call at any time between steps."""
        step = self.timeline.activation_read_at(self._step + 1)
        if self._closed or step < 1 or self._activated_step >= step or self._busy.locked():
            return  # (a step running in another thread activates for itself)
        self._check_process("prefetch()")
        if not self.ACTIVATION_LAG and any(self.timeline.used_at_once(index, version)
                                           for index, version in self.schedule.due(step)):
            return
        self._counting_installs(step, self._refresher.activate, step)
        self._activated_step = step
        self._placement.tier.prefetch()

    def mark_backward(self, device: torch.device) -> None:
        """Notes how far the backward pass has been queued on ``device`` (called by the backward hooks of
        ``asteria.attach``). With ``late_activation`` (``deterministic=False`` only), ``step()`` waits until the
        GPU has reached the next-to-last such point before its last activation: a version that finishes while
        the GPU still computes the backward pass (the training thread runs ahead of it) is then used at this step
        instead of the next. The host waits for the GPU at the step's end anyway, when the loop reads the loss."""
        if self.late_activation:
            self._backward.mark(device)

    def poll(self) -> None:
        """Hands finished snapshots to the workers, recycles staging buffers; never waits (``attach``'s hooks)."""
        if not self._busy.locked():  # a step running in another thread moves them along itself
            self._refresher.poll(self._step)

    def _apply(self, group: ShapeGroup, keep: Tensor, direction: Tensor | None) -> None:
        """The decoupled update of ``group``'s kept blocks along ``direction`` (None: no update)."""
        if direction is None:
            return
        hyper = self.param_groups[group.group_index]
        if not self.FIRST_GRADIENT_STEPS:
            keep = group.steps.first().without(keep)  # (never all first: then there is no direction)
        group.update_params_(direction, hyper["lr"], hyper["weight_decay"], keep)

    # ---- checkpoints (``asteria.optim.checkpoint``) --------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The optimizer's full state: step, hyperparameters, every shape group's batched tensors
        (factors, preconditioners in use, moments, counters), the version each block uses, and the
        refreshes scheduled but not yet in use (as their snapshots, recomputed on load). With
        ``deterministic=True`` a run resumed from it continues bit for bit. On several ranks it is
        ``{"format": "asteria.ranks.v1", "rank<r>": <that state>}``, each rank's part under its own key,
        which ``load_state_dict`` on the same rank takes. It also saves and loads through
        torch.distributed.checkpoint (``dcp.save({"optim": opt})``, ``dcp.load({"optim": opt})``), on one
        process or several. Runs torch's state-dict hooks (``register_state_dict_pre_hook`` / ``_post_hook``)."""
        refuse_per_parameter_readers(self)
        for pre_hook in getattr(self, "_optimizer_state_dict_pre_hooks", {}).values():
            pre_hook(self)
        with self._exclusive("state_dict()"):
            state_dict = checkpoint.take(self)
        for post_hook in getattr(self, "_optimizer_state_dict_post_hooks", {}).values():
            result = post_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Loads a ``state_dict()`` of an optimizer over the same parameters and blocking; raises
        ``ValueError`` naming what differs otherwise, before anything is changed. In async mode the
        optimizer must be fresh (built, not yet stepped or loaded): its refresh engine cannot go back to
        earlier versions, so a resume builds a new optimizer. Its staleness (and the deterministic rule's
        lag) may grow on resume, not shrink: the refreshes in flight were scheduled under the saved bound.
        Runs torch's load-state-dict hooks (``register_load_state_dict_pre_hook`` / ``_post_hook``)."""
        if self._closed:
            raise RuntimeError("Invalid load_state_dict() after close(): this optimizer's workers are stopped; load "
                               "the state_dict into a new optimizer")
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        for pre_hook in getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        state_dict = checkpoint.own_part(self, state_dict)
        with self._exclusive("load_state_dict()"):
            checkpoint.restore(self, state_dict)
        for post_hook in getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values():
            post_hook(self)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} cannot be pickled or copied: it owns refresh workers, host "
                        "buffers and device state; save its state_dict() and load it into a new optimizer")

    # ---- reporting and life cycle ---------------------------------------------------------------
    def staleness(self) -> int:
        """Refresh intervals by which the most stale preconditioner in use lags its block's newest
        snapshot (0 before the first refresh; a deferred refresh takes no snapshot)."""
        # Measured at the newest step whose activation has run (for SOAP and KL-Shampoo, the activation of
        # the last step runs at the start of the next one: these are the versions that step reads).
        return max((min(self.schedule.version_at(self._activated_step, index), self._refresher.newest_version(index))
                    - min(fset.versions) for index, (fset, _) in enumerate(self._set_groups)), default=0)

    def runtime_stats(self) -> dict[str, Any]:
        """Refreshes done and failed (``refresh_errors``: each failed block's last error), staleness seen, waits,
        worker busy fraction, bytes copied between tiers, install delays, skipped non-finite gradient steps.
        ``lag_steps``: the deterministic rule's steps from a snapshot to its use (None: not that rule);
        ``late_activation``: whether ``step()`` waits for the end of the backward pass (``asteria.attach``), and
        ``late_activation_*`` what it cost; ``stagger_split`` and ``stagger_small``: how the sets were cut."""
        runtime = self.runtime
        stats = {"mode": runtime.mode, "staleness_budget": runtime.staleness, "step": self._step,
                 "lag_steps": checkpoint.bound(self)["lag_steps"], "late_activation": self.late_activation,
                 "stagger_split": self.stagger_split, "stagger_small": self.stagger_small,
                 "blas_core": _core.blas_core(), "simd_kernels": _core.simd_kernels()}
        stats.update(self._refresher.stats())
        stats.update(self._delays.stats())
        stats["nonfinite_grad_skips"] = self._nonfinite.skips(self._groups)
        return stats | self._backward.stats()

    def memory_report(self) -> dict[str, Any]:
        """Bytes of optimizer state per tier and per kind of state (``asteria.optim.placement``): ``device``,
        ``host`` (pinned: preconditioners under the host placements, refresh buffers, NVMe read-ahead) and
        ``nvme`` (page files), with the placement and the bytes staged and paged so far."""
        return self._placement.memory_report()

    def close(self) -> None:
        """Stops the refresh workers and closes the NVMe tier (its page files are removed). Idempotent;
        also runs when the optimizer is collected or the interpreter exits. The host buffers that hold
        the refreshes in flight stay until the optimizer is collected, so that ``state_dict()`` still
        saves them (except with the NVMe tier, whose state went with its files: it raises then);
        ``step()`` raises ``RuntimeError``."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> SecondOrderOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(refresher: Refresher, placement: Placement) -> None:
    """Stops the workers before the buffers they use go away, then closes the tier (the NVMe tier's files)."""
    try:
        refresher.close()
    finally:
        placement.close()
