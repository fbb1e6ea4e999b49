"""Training on several processes under torchrun: the process layout (ranks, hosts, simulated nodes), the
process group, DDP / FSDP2 / HSDP wrapping, the per-step reductions (loss, energy, validation loss) and the
summary's ``distributed`` section (optimizer bytes summed over ranks, the gradient bytes computed from
the reduction algorithm, replica agreement).

A run is distributed when torchrun starts it with ``WORLD_SIZE`` > 1; otherwise nothing here runs and
the training loop is the single-process one.

Node layout: the ranks fill the nodes in order, ``local_world_size`` ranks per node (ranks 0..L-1 are
node 0, and so on), as torchrun numbers them and as ``asteria.distributed.topology`` assumes.
``--local-world-size`` overrides torchrun's ``LOCAL_WORLD_SIZE`` to simulate several nodes on one host
(4 processes as 2 nodes x 2 ranks); the optimizer's exchange and the byte accounting follow it.
"""

from __future__ import annotations

import inspect
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from asteria.distributed.refresher import DistributedRefresher
from asteria.distributed.runtime import gather_runtime_stats
from asteria.train.model import decoder_layers, next_token_loss

PARALLEL_MODES = ("ddp", "fsdp", "hsdp")
SHARDED_MODES = ("fsdp", "hsdp")  # the parameters are DTensors
PROCESS_GROUP_TIMEOUT_S = 600.0  # a collective that waits longer than this fails (a rank died or hangs)
# Counters of ``runtime_stats()`` that the summary sums over ranks (see distributed/refresher.py).
OPTIMIZER_COUNTERS = ("bytes_inter_node_sent", "bytes_inter_node_received", "bytes_intra_node_shared",
                      "bytes_to_host", "bytes_to_device", "exchanges", "exchanges_skipped", "blocks_published",
                      "store_waits", "store_wait_seconds", "exchange_seconds", "owned_blocks", "shared_store_bytes")
PER_STEP_COUNTERS = ("bytes_inter_node_sent", "bytes_inter_node_received", "bytes_intra_node_shared",
                     "bytes_to_host", "bytes_to_device")


@dataclass(frozen=True)
class Layout:
    """Where this process sits.

    Attributes:
        world_size: processes in the run (torchrun's ``WORLD_SIZE``; 1 without torchrun).
        rank: this process's global rank.
        local_rank: its index on its host (the GPU it uses).
        host_local_world_size: processes on this host (torchrun's ``LOCAL_WORLD_SIZE``).
        local_world_size: ranks per node, simulated or real (``--local-world-size``, default the host's).
    """

    world_size: int
    rank: int
    local_rank: int
    host_local_world_size: int
    local_world_size: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size


def _env_int(environ: Mapping[str, str], name: str, minimum: int, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"Invalid {name}=None: torchrun sets it for every process; launch several processes "
                             "with torchrun --nproc-per-node N")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"Invalid {name}={raw!r}: must be an int >= {minimum} (torchrun sets it)") from None
    if value < minimum:
        raise ValueError(f"Invalid {name}={raw!r}: must be an int >= {minimum} (torchrun sets it)")
    return value


def resolve_layout(local_world_size: int | None, environ: Mapping[str, str] = os.environ) -> Layout:
    """The layout from torchrun's environment and ``--local-world-size``; raises ``ValueError`` naming the
    value for an environment or a node size that does not fit (checked before any process group exists)."""
    world = _env_int(environ, "WORLD_SIZE", 1, default=1)
    if world == 1:
        if local_world_size not in (None, 1):
            raise ValueError(f"Invalid local_world_size={local_world_size!r}: must divide the world size 1 (this "
                             "is a single process; launch several with torchrun --nproc-per-node N)")
        return Layout(world_size=1, rank=0, local_rank=0, host_local_world_size=1, local_world_size=1)
    rank = _env_int(environ, "RANK", 0)
    if rank >= world:
        raise ValueError(f"Invalid RANK={rank}: must be below WORLD_SIZE={world}")
    local_rank = _env_int(environ, "LOCAL_RANK", 0)
    host_local = _env_int(environ, "LOCAL_WORLD_SIZE", 1, default=world)
    if local_rank >= host_local:
        raise ValueError(f"Invalid LOCAL_RANK={local_rank}: must be below LOCAL_WORLD_SIZE={host_local}")
    if local_world_size is None:
        name, local = "LOCAL_WORLD_SIZE", host_local
    else:
        name, local = "local_world_size", local_world_size
    if world % local != 0:
        raise ValueError(f"Invalid {name}={local!r}: must divide the world size {world} (every node has the same "
                         "number of ranks)")
    return Layout(world_size=world, rank=rank, local_rank=local_rank, host_local_world_size=host_local,
                  local_world_size=local)


def check_parallel(layout: Layout, parallel: str) -> None:
    """Raises ``ValueError`` for a parallel mode that is not one of ``PARALLEL_MODES`` or does not fit the
    layout (HSDP needs 2 or more nodes of 2 or more ranks); checked before the run touches anything."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"Invalid parallel={parallel!r}: must be one of {PARALLEL_MODES}")
    if parallel == "hsdp" and (layout.nodes < 2 or layout.local_world_size < 2):
        fits = [n for n in range(2, layout.world_size // 2 + 1) if layout.world_size % n == 0]
        hint = f" (here --local-world-size {' or '.join(map(str, fits))})" if fits else ""
        raise ValueError(f"Invalid parallel='hsdp' over {layout.nodes} node(s) of {layout.local_world_size} "
                         "rank(s): HSDP shards within a node and replicates across nodes, so it needs at least 2 "
                         f"nodes of at least 2 ranks; --local-world-size declares the node size{hint}; or use fsdp "
                         "or ddp")


def reshard(model: nn.Module) -> None:
    """Puts every FSDP2 module's sharded parameters back. FSDP2 leaves the root's parameters gathered after
    a forward pass that no backward follows (an evaluation under ``no_grad``): this frees them, and the
    module's parameters are its DTensor shards again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class DistributedRun:
    """The process group and everything a training run does across ranks (see the module docstring)."""

    def __init__(self, layout: Layout, device_type: str, parallel: str) -> None:
        check_parallel(layout, parallel)
        self.layout, self.parallel = layout, parallel
        self.mesh: Any = None  # HSDP's ("replicate", "shard") device mesh, once wrap() has made it
        if device_type == "cuda":
            count = torch.cuda.device_count()
            if layout.local_rank >= count:
                raise ValueError(f"Invalid LOCAL_RANK={layout.local_rank}: this host has {count} GPUs (one process "
                                 "per GPU: --nproc-per-node at most the GPU count)")
            torch.cuda.set_device(layout.local_rank)
            self.device = torch.device("cuda", layout.local_rank)
        else:
            self.device = torch.device("cpu")
        self.owns_group = not dist.is_initialized()
        if self.owns_group:
            timeout = timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
            if device_type == "cuda":
                dist.init_process_group("nccl", timeout=timeout, device_id=self.device)
            else:
                dist.init_process_group("gloo", timeout=timeout)
        elif dist.get_world_size() != layout.world_size or dist.get_rank() != layout.rank:
            raise ValueError(f"Invalid process group: rank {dist.get_rank()} of {dist.get_world_size()}, but torchrun "
                             f"says rank {layout.rank} of WORLD_SIZE={layout.world_size}")
        self.backend = str(dist.get_backend())

    @property
    def lead(self) -> bool:
        """Rank 0: the one that writes metrics, TensorBoard, the summary and shows the progress bar."""
        return self.layout.rank == 0

    def barrier(self) -> None:
        dist.barrier()

    def shutdown(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # ---- model -----------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP: the module to call for the forward pass (``model`` itself stays the module whose state is
        saved). FSDP2: ``fully_shard`` on each decoder layer, then on the root; ``model`` is sharded in place
        and returned (its parameters are DTensors from here on: build the optimizer after this). HSDP: the
        same over a (nodes, ranks per node) mesh, sharded within each node and replicated across nodes."""
        if self.parallel == "ddp":
            # The model's only buffers are RoPE's constant frequencies, equal on every rank: no broadcast per
            # forward pass (torch >= 2.13 names the option forward_sync_buffers).
            ddp = nn.parallel.DistributedDataParallel
            no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(ddp).parameters
                       else {"broadcast_buffers": False})
            return ddp(model, device_ids=[self.device.index] if self.device.type == "cuda" else None, **no_sync)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if self.parallel == "hsdp":
            mesh = init_device_mesh(self.device.type, (self.layout.nodes, self.layout.local_world_size),
                                    mesh_dim_names=("replicate", "shard"))
            self.mesh = mesh
        else:
            mesh = init_device_mesh(self.device.type, (self.layout.world_size,))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    # ---- per step ----------------------------------------------------------------------------------
    def reduce_step(self, loss: torch.Tensor, joules: float | None) -> tuple[float, float | None]:
        """The loss averaged over ranks (each rank's loss is its slice's mean: equal slices, so this is the
        global batch's mean) and the step's energy summed over ranks (``None`` unless every rank measured
        its GPU). One all-reduce."""
        values = torch.tensor([0.0, joules or 0.0, 0.0 if joules is None else 1.0], dtype=torch.float64,
                              device=self.device)
        values[0] = loss.detach().to(torch.float64)
        dist.all_reduce(values)
        total, energy, measured = values.tolist()
        return total / self.layout.world_size, energy if measured == self.layout.world_size else None

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: Any, batch_size: int, max_batches: int) -> float:
        """The single-process validation loss over global batches of ``batch_size`` x world sequences: each
        rank evaluates its slice of every batch, the per-batch sums and counts are all-reduced, and the
        result is the mean of the batch means (as ``loop.evaluate``). A rank whose slice is empty (a short
        last batch) still runs the forward pass on one sequence, with weight 0: FSDP2's collectives need
        every rank."""
        batches = data.val_batches(batch_size * self.layout.world_size, max_batches)
        sums = torch.zeros(len(batches), 2, dtype=torch.float64, device=self.device)
        model.eval()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            for i, batch in enumerate(batches):
                part = batch.tensor_split(self.layout.world_size)[self.layout.rank]
                rows = part.shape[0]
                part = (part if rows else batch[:1]).to(self.device)
                sums[i, 0] = next_token_loss(model(part[:, :-1]), part).double() * rows
                sums[i, 1] = rows
        model.train()
        if self.parallel in SHARDED_MODES:
            reshard(model)
        dist.all_reduce(sums)
        return statistics.fmean((sums[:, 0] / sums[:, 1]).tolist())

    # ---- the summary's section ---------------------------------------------------------------------
    def summary(self, model: nn.Module, opt: Any, steps: int, parameters: int, layer_parameters: int) -> dict[str, Any]:
        """The ``distributed`` section of summary.json (collective: every rank calls it). ``steps``: steps
        this process ran (the optimizer's counters start with the process, also after a resume)."""
        layout = self.layout
        return {
            "world_size": layout.world_size,
            "local_world_size": layout.local_world_size,
            "host_local_world_size": layout.host_local_world_size,
            "nodes": layout.nodes,
            "nodes_simulated": layout.local_world_size != layout.host_local_world_size,
            "node_layout": f"ranks fill the nodes in order, {layout.local_world_size} per node (node = rank // "
                           f"{layout.local_world_size})",
            "parallel": self.parallel,
            "backend": self.backend,
            "replica_agreement": self.replica_agreement(model),
            "optimizer_bytes": optimizer_bytes(opt, steps),
            "gradient_bytes_per_step_computed": gradient_bytes(self.parallel, layout, parameters, layer_parameters),
        }

    @torch.no_grad()
    def replica_agreement(self, model: nn.Module) -> dict[str, Any]:
        """DDP: rank 0 broadcasts every parameter; every rank compares its own copy with it (max |difference|
        and whether the bits are equal). HSDP: the same per shard, from node 0's rank holding it to the ranks
        holding it on the other nodes. FSDP2 holds each shard on one rank only: nothing to compare."""
        if self.parallel == "fsdp":
            return {"method": "none: plain FSDP2 keeps every parameter shard on exactly one rank, so no two ranks "
                              "hold the same values to compare (HSDP would compare the ranks sharing a shard)",
                    "max_abs_diff": None, "max_abs_diff_per_rank": None, "bitwise_identical": None,
                    "parameters_compared": 0}
        worst = torch.zeros((), dtype=torch.float64, device=self.device)
        differing = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        hsdp = self.parallel == "hsdp"
        group = self.mesh.get_group("replicate") if hsdp else None
        source = self.layout.rank % self.layout.local_world_size if hsdp else 0  # node 0's rank of this shard
        if hsdp:
            reshard(model)  # every parameter a DTensor again (see reshard)
        for _, param in model.named_parameters():
            mine = param.detach().to_local() if hsdp else param.detach()
            reference = mine.clone()
            dist.broadcast(reference, src=source, group=group)
            if mine.numel():  # an HSDP shard may be empty (a first dimension below the node's ranks)
                worst = torch.maximum(worst, (mine - reference).abs().max().double())
            differing += 0.0 if torch.equal(mine.contiguous().view(torch.uint8),
                                            reference.view(torch.uint8)) else 1.0
            count += 1
        mine_row = torch.stack([worst, differing])
        rows = [torch.zeros_like(mine_row) for _ in range(self.layout.world_size)]
        dist.all_gather(rows, mine_row)
        per_rank = [float(r[0]) for r in rows]
        method = ("HSDP: after the last step node 0's rank of each shard broadcasts it to the ranks holding it on "
                  "the other nodes, and each compares its replica with it element-wise" if hsdp else
                  "DDP: after the last step rank 0 broadcasts every parameter and each rank compares its replica with "
                  "it element-wise")
        return {"method": method,
                "max_abs_diff": max(per_rank), "max_abs_diff_per_rank": per_rank,
                "bitwise_identical": all(float(r[1]) == 0.0 for r in rows), "parameters_compared": count}


def optimizer_bytes(opt: Any, steps: int) -> dict[str, Any]:
    """The optimizer's own traffic: ``asteria.distributed.gather_runtime_stats`` summed over ranks (a
    collective for the distributed refresher, local otherwise), and the byte counters per step."""
    if not hasattr(opt, "runtime_stats"):
        source, stats = "none: AdamW keeps its state beside each parameter (shard); it exchanges nothing", [{}]
    elif not isinstance(getattr(opt, "_refresher", None), DistributedRefresher):
        source = ("none: mode 'sync' computes every block on the rank that holds it (every DDP replica computes "
                  "all blocks)")
        stats = [opt.runtime_stats()]
    else:
        source, stats = "asteria.distributed.gather_runtime_stats, summed over ranks", gather_runtime_stats(opt)
    totals = {key: sum(s.get(key, 0) for s in stats) for key in OPTIMIZER_COUNTERS}
    return {"source": source, "steps": steps, "totals": totals,
            "per_step": {key: totals[key] / steps if steps else None for key in PER_STEP_COUNTERS},
            "owned_blocks_per_rank": [s.get("owned_blocks") for s in stats] if len(stats) > 1 else None}


def ring_crossings(layout: Layout) -> int:
    """Edges of the ring 0 -> 1 -> ... -> W-1 -> 0 that join two different nodes (0 with one node, else one
    per node)."""
    w = layout.world_size
    return sum(1 for r in range(w) if layout.node_of(r) != layout.node_of((r + 1) % w))


def gradient_bytes(parallel: str, layout: Layout, parameters: int, layer_parameters: int) -> dict[str, Any]:
    """Bytes the gradient reduction moves per step, computed (not measured) from the algorithm, fp32.

    DDP, ring all-reduce of the gradients: each rank sends 2 (W-1)/W * P * 4 bytes per step.
    FSDP2 (``fully_shard`` defaults, no mixed-precision policy: fp32 all-gathers and reduce-scatters), a
    ring all-gather or reduce-scatter of a parameter group sends (W-1)/W * P_group * 4 bytes per rank. The
    decoder layers (P_layers) are all-gathered for the forward pass and again for the backward pass (they
    reshard after forward) and their gradients reduce-scattered: 3 collectives; the root's own parameters
    (P_root = P - P_layers: embeddings, final norm, output layer) are not resharded after forward (FSDP2's
    root heuristic): 2. Per rank: (W-1)/W * 4 * (3 P_layers + 2 P_root). FSDP2's padding of dim 0 to a
    multiple of W is not counted.
    Intra/inter-node split for DDP and FSDP2: one ring over the ranks in rank order, each rank sending to
    the next; nodes are consecutive blocks of ``local_world_size`` ranks, so one ring edge per node crosses
    nodes (none with one node). NCCL may pick trees or other rings; this is the ring model's figure.
    HSDP: FSDP2's collectives within each node (the same figure with W the node's L ranks: all of it
    intra-node), then a ring all-reduce of each rank's reduce-scattered gradient shard (P / L) with its
    replicas on the other N nodes (all of it inter-node): per rank (L-1)/L * 4 * (3 P_layers + 2 P_root)
    within the node and 2 (N-1)/N * P/L * 4 across."""
    w = layout.world_size
    if parallel == "hsdp":
        local, nodes = layout.local_world_size, layout.nodes
        within = _fsdp_sent(local, parameters, layer_parameters)
        across = 2 * (nodes - 1) / nodes * parameters / local * 4
        formula = ("HSDP: FSDP2's collectives within each node of L ranks, per rank (L-1)/L * 4 * (3*P_layers + "
                   "2*P_root), and a ring all-reduce of each gradient shard over the N nodes, per rank "
                   "2*(N-1)/N * P/L * 4")
        assumption = (f"rings within each node of {local} ranks, and across the {nodes} nodes between the ranks "
                      "holding the same shard (every edge of those crosses nodes)")
        per_rank, intra, inter = within + across, within * w, across * w
    else:
        if parallel == "ddp":
            formula = "ring all-reduce, fp32: per rank 2*(W-1)/W * P * 4"
            per_rank = 2 * (w - 1) / w * parameters * 4
        else:
            formula = ("FSDP2 ring all-gather x2 + reduce-scatter for the decoder layers, all-gather + reduce-scatter "
                       "for the root's parameters, fp32: per rank (W-1)/W * 4 * (3*P_layers + 2*P_root)")
            per_rank = _fsdp_sent(w, parameters, layer_parameters)
        crossing = ring_crossings(layout)
        assumption = ("one ring over the ranks in rank order; nodes are consecutive blocks of "
                      f"{layout.local_world_size} ranks, so {crossing} of the {w} ring edges cross nodes")
        intra, inter = per_rank * (w - crossing), per_rank * crossing
    return {"formula": formula, "assumption": assumption,
            "parameters": parameters, "layer_parameters": layer_parameters,
            "per_rank_sent": per_rank, "total_sent": per_rank * w, "intra_node_sent": intra, "inter_node_sent": inter}


def _fsdp_sent(ranks: int, parameters: int, layer_parameters: int) -> float:
    """Bytes each of ``ranks`` ranks sends per step in FSDP2's collectives over them (``gradient_bytes``)."""
    return (ranks - 1) / ranks * 4 * (3 * layer_parameters + 2 * (parameters - layer_parameters))


def local_optimizer_state_to_dtensors(state: dict[str, Any], opt: torch.optim.Optimizer) -> dict[str, Any]:
    """A torch optimizer's state_dict as checkpointed under FSDP2 (each rank's DTensor state saved as its
    local shard) with the shards turned back into DTensors laid out as their parameters."""
    from torch.distributed.tensor import DTensor

    params = [p for group in opt.param_groups for p in group["params"]]
    restored = {}
    for index, values in state["state"].items():
        param = params[index]
        if not isinstance(param, DTensor):
            restored[index] = values
            continue
        local_shape = param.to_local().shape
        restored[index] = {
            key: DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False,
                                    shape=param.shape, stride=param.stride())
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local_shape else value
            for key, value in values.items()}
    return {**state, "state": restored}
