"""GPU memory of native (sync, everything on the device) vs Asteria (async, preconditioners in pinned
host memory or on NVMe) second-order training of OLMo-2 decoders, side by side in one run.

Part 1 (``--compare``): peak GPU memory per optimizer and mode on one model, with the bytes of the
preconditioners in use; the target is Asteria's peak <= native's - 0.9 x those bytes.
Part 2 (``--ladder``): the largest model of a ladder of OLMo-2 widths that trains (a few steps) with
SOAP under a GPU memory cap (``torch.cuda.set_per_process_memory_fraction``), for native, Asteria with
host placement, and Asteria with host + NVMe.

    python3 bench/memory.py --compare --model olmo-660m --out runs/memory
    python3 bench/memory.py --ladder --cap-gib 24 --nvme-dir /tmp/asteria-nvme --out runs/memory
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

import asteria
from asteria.train.model import PRESETS, build_model

KINDS = {"shampoo": asteria.Shampoo, "soap": asteria.SOAP, "kl-shampoo": asteria.KLShampoo}
LR = {"shampoo": 3e-3, "soap": 3e-3, "kl-shampoo": 3e-3}


def preconditioner_bytes(opt) -> int:
    report = opt.memory_report()
    kinds = ("root", "basis")
    return sum(tier.get(kind, 0) for tier in (report["device"], report["host"], report["nvme"]) for kind in kinds)


def run_one(model_fn, kind: str, mode: str, steps: int, batch: int, seq: int, placement: str = "device",
            nvme_dir: str | None = None, host_budget: int | None = None) -> dict:
    """Trains ``steps`` steps and returns peak GPU bytes, preconditioner bytes and step times."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = model_fn().to(device)
    memory = asteria.MemoryConfig(placement=placement, nvme_dir=nvme_dir, host_budget=host_budget)
    runtime = asteria.RuntimeConfig(mode=mode, staleness=1, memory=memory) if mode == "async" else \
        asteria.RuntimeConfig(mode="sync")
    opt = KINDS[kind](model.parameters(), lr=LR[kind], precondition_frequency=5, runtime=runtime)
    tokens = torch.randint(0, model.vocab_size, (batch, seq + 1), device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model.loss(tokens)
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        report = opt.memory_report()
        return {"peak_gpu_bytes": torch.cuda.max_memory_allocated(device),
                "preconditioner_bytes": preconditioner_bytes(opt), "placement": report["placement"],
                "staging_bytes": report["peak_staging_bytes"], "nvme_bytes": report["nvme"]["total"],
                "params": sum(p.numel() for p in model.parameters()), "loss": float(loss.detach()),
                "median_step_seconds": sorted(times)[len(times) // 2]}
    finally:
        opt.close()
        del opt, model
        gc.collect()
        torch.cuda.empty_cache()


def compare(args: argparse.Namespace) -> dict:
    rows = {}
    for kind in ("shampoo", "soap", "kl-shampoo"):
        def model_fn():
            return build_model(args.model, 256, args.seq_len)
        native = run_one(model_fn, kind, "sync", args.steps, args.batch_size, args.seq_len)
        host = run_one(model_fn, kind, "async", args.steps, args.batch_size, args.seq_len, placement="host")
        saved = native["peak_gpu_bytes"] - host["peak_gpu_bytes"]
        rows[kind] = {"native": native, "asteria_host": host, "saved_bytes": saved,
                      "saved_over_preconditioner_bytes": saved / native["preconditioner_bytes"]}
        gib = {key: row["peak_gpu_bytes"] / 2**30 for key, row in (("native", native), ("host", host))}
        print(f"{kind:<11} native peak {gib['native']:7.2f} GiB | asteria(host) peak {gib['host']:7.2f} GiB | "
              f"preconditioners {native['preconditioner_bytes'] / 2**30:6.2f} GiB | saved / preconditioner bytes "
              f"{rows[kind]['saved_over_preconditioner_bytes']:.3f} (target >= 0.9)",
              flush=True)
    return rows


def ladder_model(hidden: int):
    from transformers import Olmo2Config, Olmo2ForCausalLM

    from asteria.train.model import CausalLM

    config = Olmo2Config(vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=16,
                         num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128,
                         max_position_embeddings=2048, tie_word_embeddings=False, use_cache=False,
                         pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return lambda: CausalLM(Olmo2ForCausalLM(config))


def ladder(args: argparse.Namespace) -> dict:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    setups = {"native": dict(mode="sync"), "asteria_host": dict(mode="async", placement="host"),
              "asteria_host_nvme": dict(mode="async", placement="host", nvme_dir=args.nvme_dir,
                                        host_budget=int(args.host_budget_gib * 2**30))}
    setups = {name: setup for name, setup in setups.items() if name in args.setups}
    results: dict[str, list] = {name: [] for name in setups}
    for name, setup in setups.items():
        for hidden in args.widths:
            try:
                row = run_one(ladder_model(hidden), "soap", setup["mode"], 2, args.batch_size, args.seq_len,
                              **{k: v for k, v in setup.items() if k != "mode"})
                row |= {"hidden": hidden, "ok": True}
            except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as error:
                row = {"hidden": hidden, "ok": False, "error": str(error).splitlines()[0][:200]}
                gc.collect()
                torch.cuda.empty_cache()
            results[name].append(row)
            print(f"{name:<18} hidden {hidden:5d}: " + (f"trains, {row['params'] / 1e6:.0f}M params, peak "
                  f"{row['peak_gpu_bytes'] / 2**30:.1f} GiB" if row["ok"] else f"fails: {row['error']}"), flush=True)
            if not row["ok"]:
                break
    largest = {name: max((r["params"] for r in rows if r["ok"]), default=0) for name, rows in results.items()}
    print("largest model that trains with SOAP under a", args.cap_gib, "GiB cap:",
          {k: f"{v / 1e6:.0f}M" for k, v in largest.items()})
    if "native" in largest and "asteria_host" in largest:
        print(f"asteria_host / native = {largest['asteria_host'] / max(1, largest['native']):.2f}x (target >= 1.5x)")
    return {"cap_gib": args.cap_gib, "runs": results, "largest_params": largest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--ladder", action="store_true")
    parser.add_argument("--model", default="olmo-660m", choices=list(PRESETS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 1536, 2048, 2560, 3072, 3584])
    parser.add_argument("--nvme-dir", default="/tmp/asteria-nvme")
    parser.add_argument("--host-budget-gib", type=float, default=8.0)
    parser.add_argument("--setups", nargs="+", default=["native", "asteria_host", "asteria_host_nvme"])
    parser.add_argument("--out", type=Path, default=Path("runs/memory"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0)
    print("device:", device, flush=True)
    out = {"device": device}
    if args.compare:
        out["compare"] = compare(args)
    if args.ladder:
        out["ladder"] = ladder(args)
    (args.out / "memory.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
