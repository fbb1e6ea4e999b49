"""The matrix products of one optimizer step that refreshes nothing, counted per optimizer over a model preset:
what the step's own work is before any refresh, and how long it takes at a given rate.

The count runs on the CPU over slices of the preset (one decoder layer, then two; byte vocabulary) and extends
to its depth, since the layers are alike. The step is native mode's second (the first computes the start-up
preconditioners): the factors' update and the preconditioning, the products that grow with the blocks' sizes.

    python3 bench/step_flops.py --model olmo2-1b --tflops 60 400
"""

from __future__ import annotations

import argparse
import dataclasses
from inspect import signature
from typing import Any

import torch
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


def quiet_step_flops(params: Any, optimizer: str) -> dict[str, int]:
    """FLOPs by operator of the second step of ``optimizer`` in native mode over ``params`` (named parameters),
    every gradient a random one: the first step computes the preconditioners, the second only uses them."""
    params = list(params)
    cls = OPTIMIZERS[optimizer]
    start = {"start_preconditioning_step": 1} if "start_preconditioning_step" in signature(cls).parameters else {}
    with cls(params, lr=1e-4, precondition_frequency=1000, runtime=asteria.RuntimeConfig(mode="sync"), **start) as opt:
        counts: dict[str, int] = {}
        for step in (1, 2):
            for _, param in params:
                param.grad = torch.randn_like(param)
            if step == 1:
                opt.step()
                continue
            with FlopCounterMode(display=False, custom_mapping=IN_PLACE) as counter:
                opt.step()
            counts = {str(op): int(flops) for op, flops in counter.get_flop_counts()["Global"].items()}
    return counts


def preset_slice(model: str, layers: int) -> torch.nn.Module:
    name = f"{model}-{layers}-layers"
    models.PRESETS[name] = dataclasses.replace(models.PRESETS[model], num_layers=layers)
    return models.build_model(name, vocab_size=256, seq_len=64)


def preset_step_flops(model: str, optimizer: str) -> dict[str, int]:
    """``quiet_step_flops`` of the preset ``model`` at its depth, from its slices of one and two layers."""
    depth = models.PRESETS[model].num_layers
    torch.manual_seed(0)
    first = quiet_step_flops(preset_slice(model, 1).named_parameters(), optimizer)
    second = quiet_step_flops(preset_slice(model, 2).named_parameters(), optimizer)
    return {op: first.get(op, 0) + (depth - 1) * (second.get(op, 0) - first.get(op, 0))
            for op in sorted(first.keys() | second.keys())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="olmo2-1b", choices=sorted(models.PRESETS))
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--tflops", type=float, nargs="*", default=[],
                        help="rates (TFLOP/s) at which to give the products' time")
    args = parser.parse_args()
    depth = models.PRESETS[args.model].num_layers
    print(f"{args.model} ({depth} layers): matrix products of a step that refreshes nothing")
    for optimizer in args.optimizers:
        total = preset_step_flops(args.model, optimizer)
        flops = sum(total.values())
        times = ", ".join(f"{1e3 * flops / (rate * 1e12):.0f} ms at {rate:g} TFLOP/s" for rate in args.tflops)
        parts = ", ".join(f"{op} {value / 1e12:.2f}" for op, value in total.items())
        print(f"  {optimizer:<11} {flops / 1e12:7.2f} TFLOP ({parts})" + (f"; {times}" if times else ""))


if __name__ == "__main__":
    main()
