"""The work of one optimizer step that refreshes nothing, per optimizer over a model preset: the FLOPs of its
matrix products, the bytes its other operations read and write (element-wise passes, copies, reductions) and how long
each takes at a given rate, and the bytes of the tensors it allocates. The step's own cost, before any refresh.

The count runs on the CPU over slices of the preset (one decoder layer, then two; byte vocabulary) and extends
to its depth, since the layers are alike. The step is native mode's second (the first computes the start-up
preconditioners). A tensor's bytes are counted once for each operation that reads it and once for each that writes
it, as if no cache held it: an in-place update reads and writes, a view moves nothing.

    python3 bench/step_flops.py --model olmo2-1b --tflops 280 --gbps 3000
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from inspect import signature
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

import asteria
from asteria.train import model as models

OPTIMIZERS = {"shampoo": asteria.Shampoo, "soap": asteria.SOAP, "kl-shampoo": asteria.KLShampoo}


def baddbmm_in_place_flops(input_shape: Any, batch1_shape: Any, batch2_shape: Any, *args: Any, out_shape: Any = None,
                           **kwargs: Any) -> int:
    """``baddbmm_``'s products (its additions are not counted, as torch's counter counts ``baddbmm``'s)."""
    batch, rows, inner = batch1_shape
    return 2 * batch * rows * inner * batch2_shape[-1]


#: the in-place form the factors' update uses, which torch's counter leaves out (its formulas are for the others)
IN_PLACE = {torch.ops.aten.baddbmm_: baddbmm_in_place_flops}


#: the matrix products whose FLOPs the counter gives (the rest of the step is counted in bytes)
FLOPS = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm,
         torch.ops.aten.baddbmm_, torch.ops.aten.matmul}


#: operations that move no data: allocations without a fill
NO_TRAFFIC = {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like}


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes an operation reads or writes of ``tensor``: its elements, but no more than its storage holds (a
    broadcast view repeats its elements in place)."""
    return min(tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes())


class Traffic(TorchDispatchMode):
    """Bytes read and written, by operator, of the operations that are not matrix products (``FLOPS``) or views;
    and the bytes of the new tensors every operation allocates (what the step asks of the caching allocator)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.allocated: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        new = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given}
        if new:
            self.allocated[str(packet)] += sum(new.values())
        if func.is_view or packet in NO_TRAFFIC or packet in FLOPS:
            return out
        inputs = {k: v for k, v in kwargs.items() if k != "out"}
        read = sum(tensor_bytes(t) for t in tree_leaves((args, inputs)) if isinstance(t, torch.Tensor))
        written = sum(tensor_bytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if not written:  # an in-place operation that returns nothing (``_foreach_mul_``): what it changed
            changed = [value for arg, value in zip(func._schema.arguments, args)
                       if arg.alias_info is not None and arg.alias_info.is_write]
            written = sum(tensor_bytes(t) for t in tree_leaves(changed) if isinstance(t, torch.Tensor))
        self.bytes[str(packet)] += read + written
        return out


def quiet_step_work(params: Any, optimizer: str) -> dict[str, dict[str, int]]:
    """The second step of ``optimizer`` in native mode over ``params`` (named parameters), every gradient a random
    one (the first step computes the preconditioners, the second only uses them): ``{"flops", "bytes",
    "allocated"}``, each by operator (``Traffic`` says what the last two count)."""
    params = list(params)
    cls = OPTIMIZERS[optimizer]
    start = {"start_preconditioning_step": 1} if "start_preconditioning_step" in signature(cls).parameters else {}
    with cls(params, lr=1e-4, precondition_frequency=1000, runtime=asteria.RuntimeConfig(mode="sync"), **start) as opt:
        work: dict[str, dict[str, int]] = {}
        for step in (1, 2):
            for _, param in params:
                param.grad = torch.randn_like(param)
            if step == 1:
                opt.step()
                continue
            with FlopCounterMode(display=False, custom_mapping=IN_PLACE) as counter, Traffic() as traffic:
                opt.step()
            work = {"flops": {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()},
                    "bytes": dict(traffic.bytes), "allocated": dict(traffic.allocated)}
    return work


def preset_slice(model: str, layers: int) -> torch.nn.Module:
    name = f"{model}-{layers}-layers"
    models.PRESETS[name] = dataclasses.replace(models.PRESETS[model], num_layers=layers)
    return models.build_model(name, vocab_size=256, seq_len=64)


def preset_step_work(model: str, optimizer: str) -> dict[str, dict[str, int]]:
    """``quiet_step_work`` of the preset ``model`` at its depth, from its slices of one and two layers."""
    depth = models.PRESETS[model].num_layers
    torch.manual_seed(0)
    first = quiet_step_work(preset_slice(model, 1).named_parameters(), optimizer)
    second = quiet_step_work(preset_slice(model, 2).named_parameters(), optimizer)
    return {kind: {op: first[kind].get(op, 0) + (depth - 1) * (second[kind].get(op, 0) - first[kind].get(op, 0))
                   for op in sorted(first[kind].keys() | second[kind].keys())} for kind in first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="olmo2-1b", choices=sorted(models.PRESETS))
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--tflops", type=float, default=None, help="the products' rate (TFLOP/s) to time them at")
    parser.add_argument("--gbps", type=float, default=None, help="the memory's rate (GB/s) to time the bytes at")
    parser.add_argument("--top", type=int, default=6, help="operators listed by bytes")
    args = parser.parse_args()
    depth = models.PRESETS[args.model].num_layers
    print(f"{args.model} ({depth} layers): the work of a step that refreshes nothing")
    for optimizer in args.optimizers:
        work = preset_step_work(args.model, optimizer)
        flops, moved = sum(work["flops"].values()), sum(work["bytes"].values())
        products = ", ".join(f"{op} {n / 1e12:.2f}" for op, n in work["flops"].items())
        top = sorted(work["bytes"].items(), key=lambda item: -item[1])[:args.top]
        times = ([f"products {1e3 * flops / (args.tflops * 1e12):.0f} ms"] if args.tflops else []) + (
            [f"bytes {1e3 * moved / (args.gbps * 1e9):.0f} ms"] if args.gbps else [])
        allocated = sum(work["allocated"].values())
        print(f"  {optimizer:<11} {flops / 1e12:6.2f} TFLOP ({products}); {moved / 1e9:6.1f} GB moved, "
              f"{allocated / 1e9:.1f} GB allocated" + (f"; {', '.join(times)}" if times else ""))
        print(f"  {'':<11} most bytes: " + ", ".join(f"{op} {n / 1e9:.1f} GB" for op, n in top))


if __name__ == "__main__":
    main()
