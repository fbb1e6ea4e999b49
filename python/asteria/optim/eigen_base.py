"""What SOAP and KL-Shampoo share on top of the base: factor sets refreshed as eigenbases, whose
installs reorder the state kept in eigen-coordinates, and a direction computed while accumulating
(before this step's refresh changes the bases), which ``_accumulate`` returns.

A block steps in the identity basis of its zero factors until the first basis of a factor with a gradient
in it comes into use, and meanwhile keeps its state in plain coordinates: when its first gradient comes
after the first refresh (a parameter unfrozen late, an expert no token reached), or when the first refresh
is not used at once (``sync_refreshes=0`` under the deterministic rule's lag). When that first real basis
Q comes into use, the state is carried into it (``_into_basis``) as the squares of Q's entries weigh it: a
coordinate's second moment in the new basis is sum_a Q[a, i]^2 E[g_a^2], exact when the old coordinates
are uncorrelated. Blocks whose first real basis is used the step after their first gradient (the bootstrap
refresh, the usual case) have no state yet and are left alone."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

import torch
from torch import Tensor

from asteria.optim.base import SecondOrderOptimizer
from asteria.optim.groups import ShapeGroup
from asteria.optim.state_keys import basis_key, factor_key, has_basis_key
from asteria.optim.steps import to_device
from asteria.pipeline import streams
from asteria.pipeline.factors import FactorSet, RootRequest


class EigenbasisOptimizer(SecondOrderOptimizer):
    """Base of the optimizers that precondition in the eigenbases of their factors."""

    MERGE_DIMS = False  # a matrix stays a matrix: each of its dimensions gets a basis
    ACTIVATION_LAG = 1  # the direction is computed while accumulating, with the bases of the step before
    FIRST_GRADIENT_STEPS = False  # a block's first gradient builds its factors (and basis) only
    FIRST_BASES = ("eigh", "qr")  # the rules for a block's first basis (FactorSet.first_basis)
    first_basis = "eigh"  # the rule this optimizer takes; SOAP lets the user choose

    def __init__(self, *args, **kwargs) -> None:
        #: per factor set (index), per block: whether its first basis from a factor with a gradient is still to come
        self._awaiting: dict[int, list[bool]] = {}
        self._settled: set[int] = set()  # id(group): no block of it awaits a first basis any more
        self._seen: dict[int, list[int]] = {}  # per factor set: its versions in use when last looked at
        #: (id(group), mode) -> (B,) bool on the device: the blocks whose installs are not reordered (see below)
        self._unordered: dict[tuple[int, int], Tensor] = {}
        super().__init__(*args, **kwargs)

    @abstractmethod
    def _into_basis(self, group: ShapeGroup, mode: int, blocks: Tensor, weights: Tensor) -> None:
        """Carries the state that ``group`` keeps in eigen-coordinates of dimension ``mode`` from plain
        coordinates into the first real bases of ``blocks``, given ``weights`` = Q ** 2 (b, n, n). Each
        subclass defines it (torch's Optimizer is no ABC, so nothing enforces that at construction: the
        body makes a missing one fail at the first carry instead of skipping it)."""
        raise NotImplementedError(f"{type(self).__name__}._into_basis")

    def _real_basis(self, index: int, group: ShapeGroup) -> list[bool]:
        """Per block of factor set ``index``: whether its basis in use comes from a factor that held the
        block's first gradient."""
        fset, firsts = self._set_groups[index][0], group.steps.first_steps
        return [version >= 1 and 0 < firsts[fset.offset + block] <= self.schedule.snapshot_step(index, version)
                for block, version in enumerate(fset.versions)]

    def _enter_first_bases(self, group: ShapeGroup, step: int) -> None:
        """Before the statistics of ``step`` change: the blocks of ``group`` whose first real basis came
        into use since the last step get their state carried into it (see the module's docstring) when they
        took steps before it, that is when it came later than the step after their first gradient (the
        bootstrap refresh, used at once, comes then). O(1) once no block of the group awaits one."""
        if id(group) in self._settled:
            return
        bases, changed = None, False
        for index in self._sets_of[id(group)]:
            fset = self._set_groups[index][0]
            if self._seen.get(index) == fset.versions:
                continue  # only a new version in use can be a block's first real basis
            self._seen[index] = list(fset.versions)
            changed |= index not in self._awaiting
            awaiting = self._awaiting.setdefault(index, [True] * fset.batch)
            firsts = group.steps.first_steps[fset.offset:fset.offset + fset.batch]
            arrived = []
            for block, real in enumerate(self._real_basis(index, group)):
                if awaiting[block] and real:
                    awaiting[block], changed = False, True
                    if step > firsts[block] + 1:  # else its state is still empty (or isotropic)
                        arrived.append(block)
            if arrived:
                bases = bases or self._placement.read(group)
                blocks = streams.indices_to_device([fset.offset + block for block in arrived], group.device)
                self._into_basis(group, fset.mode, blocks, bases[fset.mode][blocks].square())
        if changed:
            self._mark_unordered(group)

    def _direction(self, group: ShapeGroup, step: int, accumulated: Tensor | None) -> Tensor | None:
        """The base's, once the first real bases that came into use during ``step`` are carried into (the next
        step would do it first thing otherwise): a checkpoint taken between the two steps then holds the carried
        state, as ``load_state_dict``, which sees only the versions in use, takes it to."""
        self._enter_first_bases(group, step + 1)
        return accumulated

    def _mark_unordered(self, group: ShapeGroup) -> None:
        """Keeps, per dimension of ``group``, the device mask of the blocks still awaiting their first real
        basis; their installs skip the column reordering. Their state is in plain coordinates, which the
        carry maps into the new basis whole: a reordering first would scramble it (under the newest-finished
        rule an activation may pass over the first real version, and the order composed through it is that
        of the next one, relative to the first). Settles the group once no block awaits."""
        awaiting_any = False
        for mode in range(group.order):
            flags = [False] * group.batch
            for index in self._sets_of[id(group)]:
                fset = self._set_groups[index][0]
                if fset.mode == mode:
                    flags[fset.offset:fset.offset + fset.batch] = self._awaiting.get(index, [True] * fset.batch)
            key = (id(group), mode)
            if any(flags):
                awaiting_any = True
                self._unordered[key] = to_device(flags, torch.bool, group.device)
            else:
                self._unordered.pop(key, None)
        if not awaiting_any:
            self._settled.add(id(group))

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """The base's, then which blocks still await their first real basis, from the loaded versions and
        first-gradient steps (a checkpoint without first steps: none, its state is taken as carried)."""
        super().load_state_dict(state_dict)
        exact = bool(state_dict.get("block_first_steps"))
        self._settled.clear()
        self._seen.clear()
        for index, (fset, group) in enumerate(self._set_groups):
            real = self._real_basis(index, group)
            self._awaiting[index] = [exact and not ok for ok in real]
        for group in self._groups:
            if self._sets_of[id(group)]:
                self._mark_unordered(group)

    def _eigenbasis_sets(self, group: ShapeGroup, reorder: Callable[[int, Tensor, Tensor], None]) -> list[FactorSet]:
        """One factor, basis and installed flag per mode; ``reorder(mode, blocks, order)`` makes the state
        in eigen-coordinates follow a new basis' column order."""
        batch, device = group.batch, group.device
        # The refresher (kept by the optimizer's finalizer) holds these closures: they must not hold the
        # optimizer, or one dropped without close() would never be collected and its workers never stop.
        masks = self._unordered
        sets = []
        for mode, dim in enumerate(group.shape):
            factor = group.state[factor_key(mode)] = torch.zeros((batch, dim, dim), dtype=torch.float32, device=device)
            basis = group.state[basis_key(mode)] = self._placement.new_preconditioners(group, dim)
            installed = group.state[has_basis_key(mode)] = torch.zeros(batch, dtype=torch.bool, device=device)

            def permute(blocks: Tensor, order: Tensor, mode: int = mode) -> None:
                unordered = masks.get((id(group), mode))
                if unordered is not None:  # blocks awaiting their first real basis keep their columns
                    kept = torch.arange(order.shape[-1], device=order.device).expand_as(order)
                    order = torch.where(unordered[blocks].unsqueeze(-1), kept, order)
                reorder(mode, blocks, order)

            sets.append(FactorSet(name=f"{group.name}, mode {mode}", mode=mode, factors=factor, preconditioners=basis,
                                  installed=installed, exponent=-0.5, kind="eigenbasis", permute=permute,
                                  block_params=[block.name for block in group.blocks], first_basis=self.first_basis))
        return sets

    def _root_request(self, fset: FactorSet, group: ShapeGroup) -> RootRequest:
        # The factors' scale does not change an eigenbasis, and eps does not enter one.
        hyper = self.param_groups[group.group_index]
        return RootRequest(scale=1.0, eps=hyper["eps"], skip_tol=hyper["refresh_skip_tol"])
