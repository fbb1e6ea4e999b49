"""``optimizer.state`` of the Asteria optimizers, and the refusal of torch's per-parameter checkpoint API.

torch's optimizers keep a dict of tensors per parameter in ``optimizer.state``. Asteria keeps its state per
block shape, stacked over the blocks of many parameters (``state_dict()`` carries it), so its ``state`` is a
read-only view with what is per parameter: the steps in which the parameter had a gradient.

``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (and ``get_state_dict``,
``set_optimizer_state_dict``) rebuild an optimizer's state per parameter FQN from torch's layout. Asteria's
is not in that layout, so they are refused by name, before anything changes. That API also initializes an
optimizer whose ``state`` is empty by taking a step with zero gradients: the view is never empty, so it never
does that to an Asteria optimizer.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor

from asteria.optim.groups import ShapeGroup

# torch.distributed.checkpoint.state_dict's functions that read an optimizer's state per parameter
PER_PARAMETER_READERS = {("torch.distributed.checkpoint.state_dict", "_get_optim_state_dict")}


class ParameterStates(Mapping[Tensor, dict[str, Any]]):
    """``opt.state[p]``: ``{"step": s}``, the steps in which parameter ``p`` had a gradient (as torch's
    optimizers count them), for every parameter of the optimizer; read-only."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = weakref.ref(optimizer)  # no cycle through the view
        #: (the shape groups it indexes, id(parameter) -> (group, position) of its first block): ``_count``
        self._index: tuple[list[ShapeGroup], dict[int, tuple[ShapeGroup, int] | None]] | None = None

    def _owner(self) -> Any:
        optimizer = self._optimizer()
        if optimizer is None:
            raise ReferenceError("this optimizer.state outlived its optimizer")
        return optimizer

    def _params(self) -> list[Tensor]:
        return [p for group in self._owner().param_groups for p in group["params"]]

    def __getitem__(self, param: Tensor) -> dict[str, Any]:
        count = self._count(param) if isinstance(param, Tensor) else None
        if count is None:
            shown = f"tensor of shape {tuple(param.shape)}" if isinstance(param, Tensor) else repr(param)
            raise KeyError(f"not a parameter of this optimizer: {shown}")
        return {"step": count}

    def _count(self, param: Tensor) -> int | None:
        """The steps in which ``param`` had a gradient (its blocks all count the same); None for a tensor
        that is not one of the optimizer's parameters. Where each parameter's first block sits is indexed
        once per layout of the shape groups, so a lookup costs O(1)."""
        optimizer = self._owner()
        index = self._index
        if index is None or index[0] is not optimizer._groups:
            where: dict[int, tuple[ShapeGroup, int] | None] = {
                id(p): None for g in optimizer.param_groups for p in g["params"]}
            for group in optimizer._groups:
                for position, member in enumerate(group.params):
                    if where.get(id(member)) is None:
                        where[id(member)] = (group, position)
            index = self._index = (optimizer._groups, where)
        if id(param) not in index[1]:
            return None
        block = index[1][id(param)]
        return 0 if block is None else block[0].steps.counts[block[1]]

    def __setitem__(self, param: Tensor, value: Any) -> None:
        raise TypeError("Invalid assignment to optimizer.state: it is a read-only view of each parameter's step "
                        "count; the state itself changes through step() and load_state_dict()")

    def __delitem__(self, param: Tensor) -> None:
        self.__setitem__(param, None)

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self._params())

    def __len__(self) -> int:
        return len(self._params())

    def __repr__(self) -> str:
        return f"ParameterStates({len(self)} parameters; the state itself: state_dict())"


def refuse_per_parameter_readers(optimizer: Any, depth: int = 4) -> None:
    """Raises ``TypeError`` when ``state_dict()`` was called (within ``depth`` frames) by one of torch's
    functions that expect the state per parameter (``PER_PARAMETER_READERS``)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in PER_PARAMETER_READERS:
            name = type(optimizer).__name__
            raise TypeError(
                f"Invalid optimizers=({name},) for torch.distributed.checkpoint.state_dict's get_optimizer_state_dict, "
                f"get_state_dict and set_optimizer_state_dict: {name} keeps its state per block shape, not per "
                "parameter FQN; checkpoint the optimizer itself with DCP (dcp.save({'optim': opt}, ...), "
                "dcp.load({'optim': opt}, ...); it is a Stateful) or with opt.state_dict() / opt.load_state_dict()")
        frame = frame.f_back
