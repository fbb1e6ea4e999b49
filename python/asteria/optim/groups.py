"""Blocks of equal shape from one param group, batched: their gradients and parameters are stacked
so that every per-step operation is one batched kernel instead of a loop over blocks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from asteria import functional as F
from asteria.optim.blocking import Block, partition
from asteria.optim.steps import BlockSteps, to_device


def local(tensor: Tensor) -> Tensor:
    """The tensor this rank holds: a DTensor's local shard (FSDP2 / HSDP blocks it per shard), else itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and hasattr(tensor, "device_mesh") else tensor


@dataclass
class ShapeGroup:
    """Same-shape blocks of one param group on one device, with their stacked optimizer state."""

    group_index: int
    shape: tuple[int, ...]
    device: torch.device
    blocks: list[Block]
    params: list[Tensor]                       # the parameter each block belongs to
    state: dict[str, Tensor] = field(default_factory=dict)
    #: each block's step count (set by the optimizer once the blocks are known)
    steps: BlockSteps | None = None
    # Reused every step in which all blocks have gradients: building a device tensor from a Python
    # list each step would cost a host-to-device copy.
    all_present: Tensor | None = None
    # The blocks' views of plain (non-DTensor) parameters, with the data pointers they were made from:
    # rebuilt only when a parameter's storage moves (``param.data = ...``). Building them costs about
    # 15 us per block and step of the training thread's time, twice a step.
    _param_views: tuple[tuple[int, ...], list[Tensor]] | None = field(default=None, repr=False)

    @property
    def batch(self) -> int:
        return len(self.blocks)

    @property
    def order(self) -> int:
        return len(self.shape)

    @property
    def name(self) -> str:
        return f"param group {self.group_index}, blocks {self.shape}"

    def gather_grads(self) -> tuple[Tensor, Tensor, list[bool]]:
        """Stacked float32 gradients (B, *shape), and which blocks have one this step: as a (B,) bool on
        the device and as a host list.

        Missing gradients (``p.grad is None``) are stacked as zeros.
        """
        present = [param.grad is not None for param in self.params]
        views = [
            block.view(dense(local(param.grad), block.name, local(param))) if param.grad is not None
            else torch.zeros(self.shape, dtype=torch.float32, device=self.device)
            for block, param in zip(self.blocks, self.params)
        ]
        grads = torch.stack(views).to(torch.float32)
        if all(present):
            if self.all_present is None:
                self.all_present = torch.ones(self.batch, dtype=torch.bool, device=self.device)
            return grads, self.all_present, present
        return grads, to_device(present, torch.bool, self.device), present

    def param_views(self) -> list[Tensor]:
        """Each block's view of its parameter (of its local shard for a DTensor)."""
        if any(hasattr(param, "device_mesh") for param in self.params):
            return [block.view(contiguous(local(param.detach()), block.name)) for block, param in
                    zip(self.blocks, self.params)]
        pointers = tuple(param.data_ptr() for param in self.params)
        if self._param_views is None or self._param_views[0] != pointers:
            views = [block.view(contiguous(param.detach(), block.name)) for block, param in
                     zip(self.blocks, self.params)]
            self._param_views = (pointers, views)
        return self._param_views[1]

    def gather_params(self) -> Tensor:
        """A stacked copy of the blocks, in float32 or wider: float64 parameters keep their precision
        (an update of lr 0 leaves them bit for bit), half-precision ones are updated in float32."""
        stacked = torch.stack(self.param_views())
        return stacked.to(torch.promote_types(stacked.dtype, torch.float32))

    def scatter_params_(self, values: Tensor) -> None:
        """Writes (B, *shape) values back into the parameters' blocks, each in its own dtype."""
        torch._foreach_copy_(self.param_views(), list(values.unbind(0)))

    def update_params_(self, direction: Tensor, lr: float, weight_decay: float, keep: Tensor) -> None:
        """The decoupled update of the kept blocks along (B, *shape) ``direction`` (``F.decoupled_update_``).
        Parameters of ``direction``'s dtype are updated through their views (no stacked copy to write back: four
        passes over the group fewer), others (half precision) through a copy in ``direction``'s precision."""
        views = self.param_views()
        if all(view.dtype == direction.dtype for view in views):
            F.decoupled_update_blocks_(views, direction, lr, weight_decay, keep)
        else:
            self.scatter_params_(F.decoupled_update_(self.gather_params(), direction, lr, weight_decay, keep))


def dense(grad: Tensor, name: str, param: Tensor | None = None) -> Tensor:
    """``grad`` as a dense tensor the blocks can view (a contiguous copy when it is strided otherwise);
    raises ``ValueError`` for a sparse gradient, or one whose shape or dtype kind is not its parameter's
    (``param``: set through ``.grad.data``, or the parameter's ``.data`` replaced after construction)."""
    if grad.layout != torch.strided:
        raise ValueError(f"Invalid gradient of {name}: layout {grad.layout} is not supported (sparse gradients, "
                         "e.g. from nn.Embedding(sparse=True)); Asteria needs dense gradients")
    if param is not None and (grad.shape != param.shape or not grad.is_floating_point()):
        raise ValueError(f"Invalid gradient of {name}: {grad.dtype} {tuple(grad.shape)}, for a parameter of "
                         f"{param.dtype} {tuple(param.shape)}: must be a floating-point tensor of the parameter's "
                         "shape (the shape the optimizer was built with)")
    return grad if grad.is_contiguous() else grad.contiguous()


def contiguous(param: Tensor, name: str) -> Tensor:
    """``param`` itself; raises ``ValueError`` when its storage is no longer contiguous (for instance
    ``model.to(memory_format=torch.channels_last)`` after the optimizer was built): the updates are
    written through views."""
    if not param.is_contiguous():
        raise ValueError(f"Invalid parameter {name}: it is not contiguous (strides {tuple(param.stride())}), "
                         "as when its memory format changed after the optimizer was built; Asteria updates "
                         "parameters through views: change the format before building the optimizer")
    return param


def preconditioner_bytes(shape: tuple[int, ...]) -> int:
    """float32 bytes of one block's per-mode (n, n) matrices (a factor, or a preconditioner)."""
    return sum(4 * n * n for n in shape)


def build_shape_groups(param_groups: list[dict], max_dim: int, merge: bool = True,
                       max_group_bytes: int | None = None) -> list[ShapeGroup]:
    """Partitions every parameter and batches blocks by (param group, block shape, device); a group
    whose blocks' preconditioners would take more than ``max_group_bytes`` is split (at least one
    block per group), so that staging one group to the device stays small."""
    groups: dict[tuple, ShapeGroup] = {}
    chunks: dict[tuple, int] = {}
    for group_index, group in enumerate(param_groups):
        names = group.get("param_names") or [None] * len(group["params"])
        for param_index, (param, name) in enumerate(zip(group["params"], names)):
            label = name or f"param_groups[{group_index}][{param_index}] {tuple(param.shape)}"
            if not param.is_floating_point():
                raise ValueError(f"Invalid parameter {label} of dtype {param.dtype}: must be a real floating-point "
                                 "tensor")
            if param.device.type == "meta":
                raise ValueError(f"Invalid parameter {label} on device 'meta': it holds no data; build the "
                                 "optimizer once the model is materialized (e.g. after to_empty() and its init)")
            if local(param).is_inference():
                raise ValueError(f"Invalid parameter {label}: an inference tensor (made under "
                                 "torch.inference_mode()), which no step may update in place; create the model "
                                 "outside inference mode")
            for block in partition(local(param), param_index, label, max_dim, merge):
                base = (group_index, block.shape, param.device)
                key = base + (chunks.get(base, 0),)
                if key in groups and max_group_bytes is not None and \
                        (groups[key].batch + 1) * preconditioner_bytes(block.shape) > max_group_bytes:
                    chunks[base] = chunks.get(base, 0) + 1
                    key = base + (chunks[base],)
                if key not in groups:
                    groups[key] = ShapeGroup(group_index, block.shape, param.device, [], [])
                groups[key].blocks.append(block)
                groups[key].params.append(param)
    return list(groups.values())


def stagger_runs(groups: list[ShapeGroup], interval: int, refresh_dims: Callable[[ShapeGroup], list[int]],
                 sets_per_step: int, small_dim: int | None = None) -> list[list[tuple[int, int]]]:
    """Per group, the runs ``[a, b)`` of consecutive blocks that the staggered schedule should refresh as
    separate factor sets so that it can spread the work evenly: a group whose sets carry more than an even
    share of an interval's refresh work (1 / (``interval`` x ``sets_per_step``) of all sets' batch x dim^3)
    is cut into near-equal runs; a group that fits is one run. A set is refreshed whole at its one step of the
    interval, and one large set would otherwise bring most of a step's jobs at once
    (``RuntimeConfig.stagger_sets_per_step`` says why more than one a step). With ``small_dim``
    (``RuntimeConfig.stagger_small``), a group whose sets are all at most that size is cut by the same share of
    the small groups' work alone: those blocks' jobs take threads of their own (the express workers), and cut by
    a share of all the work their sets are few and large, so that a step that brings one brings many of them.
    ``refresh_dims(group)`` gives the dimensions of the group's factor sets (none: the group has none)."""
    dims = [refresh_dims(group) for group in groups]
    cubes = [[dim**3 for dim in d] for d in dims]
    small = [bool(d) and small_dim is not None and max(d) <= small_dim for d in dims]
    work = [group.batch * sum(c) for group, c in zip(groups, cubes)]
    share = sum(work) / (interval * sets_per_step)
    small_share = sum(w for w, s in zip(work, small) if s) / (interval * sets_per_step)
    runs: list[list[tuple[int, int]]] = []
    for group, c, is_small in zip(groups, cubes, small):
        per_block = max(c, default=0)
        limit = small_share if is_small else share
        if per_block == 0 or group.batch * per_block <= limit:
            runs.append([(0, group.batch)])
            continue
        parts = -(-group.batch // max(1, int(limit // per_block)))
        bounds = [round(i * group.batch / parts) for i in range(parts + 1)]
        runs.append(list(zip(bounds, bounds[1:])))
    return runs


def small_block_dim(groups: list[ShapeGroup], refresh_dims: Callable[[ShapeGroup], list[int]]) -> int:
    """The largest factor size of the small blocks: half the largest factor's, as the express workers take them
    (``RuntimeConfig.resolved_express``)."""
    return max((dim for group in groups for dim in refresh_dims(group)), default=0) // 2


def split_for_stagger(groups: list[ShapeGroup], interval: int, refresh_dims: Callable[[ShapeGroup], list[int]],
                      sets_per_step: int, small_dim: int | None = None) -> list[ShapeGroup]:
    """The groups cut into the runs of ``stagger_runs``, each a shape group of its own (for preconditioners
    that the tiers move set by set: host, device views, NVMe). Only the batching changes, not the math."""
    out: list[ShapeGroup] = []
    for group, runs in zip(groups, stagger_runs(groups, interval, refresh_dims, sets_per_step, small_dim)):
        if len(runs) == 1:
            out.append(group)
            continue
        out += [ShapeGroup(group.group_index, group.shape, group.device, group.blocks[a:b], group.params[a:b])
                for a, b in runs]
    return out
