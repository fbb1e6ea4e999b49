"""Real multi-process runs for the distributed tests: worker functions started with the spawn method,
one process per rank, over Gloo on the CPU. Each worker writes what the test checks to
``<out>/rank<r>.pt``; the parent process compares."""

from __future__ import annotations

import copy
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import asteria
from asteria.distributed import PeerError, gather_runtime_stats

# The suite's shared helpers (tests/conftest.py), also in the spawned workers.
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import small_mlp  # noqa: E402

WORLD = 4
LOCAL = 2          # 4 processes as 2 nodes x 2 ranks
DIM = 8            # max_preconditioner_dim
SIZES = (8, 32, 32)
BATCH = 32


def launch(fn: Callable, out: Path, *args: Any, world: int = WORLD, timeout: float = 90.0) -> list[int]:
    """Runs ``fn(rank, world, out, *args)`` in ``world`` spawned processes; returns their exit codes."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, rank, world, out, args)) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
        codes.append(p.exitcode)
    return codes


def _entry(fn: Callable, rank: int, world: int, out: Path, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if not getattr(fn, "makes_its_group", False):  # (one that does makes no Gloo mesh before its own)
        dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
    code = 0
    try:
        fn(rank, world, out, *args)
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        traceback.print_exc()
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Without the interpreter's finalization, as asteria's CLI leaves under torchrun: a Gloo thread releasing a
    # finished collective's tensors during it aborts the process (SIGABRT) after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def model(seed: int = 0) -> torch.nn.Module:
    return small_mlp(seed, SIZES)


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(SIZES[0], SIZES[-1], generator=gen)
    batches = []
    for _ in range(steps):
        x = torch.randn(BATCH, SIZES[0], generator=gen)
        batches.append((x, torch.sin(x @ w)))
    return batches


def optimizer(kind: str, params: Any, staleness: int, mode: str = "async", **runtime: Any) -> torch.optim.Optimizer:
    # Unstaggered unless asked, and the deterministic rule: the single-process references follow the multi-rank
    # schedule.
    config = asteria.RuntimeConfig(mode=mode, staleness=staleness, workers=1, timeout_s=runtime.pop("timeout_s", 20.0),
                                   stagger=runtime.pop("stagger", False),
                                   deterministic=runtime.pop("deterministic", True), **runtime)
    if kind == "shampoo":
        return asteria.Shampoo(params, lr=0.02, eps=1e-6, max_preconditioner_dim=DIM, precondition_frequency=2,
                               runtime=config)
    if kind in ("soap", "soap-qr"):  # soap-qr: Distributed Shampoo's first-basis rule
        return asteria.SOAP(params, lr=0.01, max_preconditioner_dim=DIM, precondition_frequency=2,
                            refresh_skip_tol=0.3, runtime=config, first_basis="qr" if kind == "soap-qr" else "eigh")
    return asteria.KLShampoo(params, lr=0.01, max_preconditioner_dim=DIM, precondition_frequency=2, runtime=config)


def train(net: torch.nn.Module, opt: torch.optim.Optimizer, batches: list, shard: tuple[int, int] | None,
          hook: Callable[[int], None] | None = None, extra: torch.Tensor | None = None) -> list[float]:
    """Steps over ``batches``; ``shard=(rank, world)`` takes this rank's slice of each batch. ``extra``: a
    parameter outside the model (replicated as it is on every rank), whose loss term is the same everywhere."""
    losses = []
    for step, (x, y) in enumerate(batches, start=1):
        if shard is not None:
            rank, world = shard
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(net(x), y)
        if extra is not None:
            loss = loss + (torch.sin(extra) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if hook is not None:
            hook(step)
    return losses


def extra_parameter() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(5)))


def single_process(kind: str, staleness: int, steps: int, lag_steps: int | None = None,
                   stagger: bool = False, extra: bool = False) -> dict[str, torch.Tensor]:
    """The reference: one process on the full batches (its groups whole, as on several ranks by default);
    with ``extra``, an ``extra_parameter()`` beside the model's (under the key "extra")."""
    net = model()
    more = [extra_parameter()] if extra else []
    with optimizer(kind, [*net.parameters(), *more], staleness, lag_steps=lag_steps, stagger=stagger,
                   stagger_split=False) as opt:
        train(net, opt, data(steps), None, extra=more[0] if more else None)
    return {k: v.detach().clone() for k, v in net.state_dict().items()} | {"extra": p.detach().clone() for p in more}


def split_run(shard: tuple[int, int] | None, steps: int = 9) -> tuple[dict[str, torch.Tensor], int, int]:
    """Shampoo at f = 4, where the 20 square blocks' sets carry more than a step's share of an interval,
    with ``stagger_split=True`` (lag 1): the parameters after ``steps``, the shape groups and the refreshed
    sets. Under DDP (``shard``) the shape groups themselves are cut; one process slices its sets instead."""
    net = model()
    if shard is not None:
        net = torch.nn.parallel.DistributedDataParallel(net)
    runtime = asteria.RuntimeConfig(mode="async", staleness=1, workers=1, timeout_s=20.0, stagger=True,
                                    stagger_split=True, lag_steps=1, local_world_size=LOCAL if shard else None)
    with asteria.Shampoo(net.parameters(), lr=0.02, eps=1e-6, max_preconditioner_dim=DIM, precondition_frequency=4,
                         runtime=runtime) as opt:
        train(net, opt, data(steps), shard)
        groups, sets = len(opt._groups), len(opt._set_groups)
    module = net.module if shard is not None else net
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, groups, sets


def segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("asteria-")}


# ---- DDP --------------------------------------------------------------------------------------------
def ddp_worker(rank: int, world: int, out: Path, runs: list[tuple[str, int, int, int | None, bool]]) -> None:
    """Each run ``(optimizer, S, steps, lag_steps, stagger)`` is kept under ``(optimizer, S, lag_steps)``."""
    result: dict[str, Any] = {"runs": {}}
    for kind, staleness, steps, lag_steps, stagger in runs:
        net = torch.nn.parallel.DistributedDataParallel(model())
        opt = optimizer(kind, net.parameters(), staleness, local_world_size=LOCAL, lag_steps=lag_steps,
                        stagger=stagger)
        refresher = opt._refresher
        store = refresher.domains[0].store
        # The segment's name is gone as soon as every local rank has mapped it.
        result["segment_visible"] = bool(store.name) and asteria._core.NodeStore.exists(store.name)
        staleness_seen = []
        train(net, opt, data(steps), (rank, world), hook=lambda step: staleness_seen.append(opt.staleness()))
        stats = gather_runtime_stats(opt)
        params = {k: v.detach().clone() for k, v in net.module.state_dict().items()}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, params)
        result["runs"][(kind, staleness, lag_steps)] = {
            "params": params, "stats": stats, "staleness": staleness_seen, "phases": list(opt.schedule.phases),
            "identical": all(all(torch.equal(g[k], params[k]) for k in params) for g in gathered),
        }
        state = opt.state_dict()  # each rank's part under its own key
        result["runs"][(kind, staleness, lag_steps)]["state_keys"] = sorted(state)
        result["runs"][(kind, staleness, lag_steps)]["state_layout"] = state[f"rank{rank}"]["distributed"]
        # Another rank's checkpoint is refused before anything changes: as it comes, and its part taken out.
        states: list[Any] = [None] * world
        dist.all_gather_object(states, state)
        other = (rank + 1) % world
        for name, foreign in (("foreign_load", states[other][f"rank{other}"]), ("foreign_wrapped", states[other])):
            try:
                opt.load_state_dict(foreign)
                result["runs"][(kind, staleness, lag_steps)][name] = "accepted"
            except ValueError as error:
                result["runs"][(kind, staleness, lag_steps)][name] = str(error)
        opt.close()
    result["split"] = split_run((rank, world))
    try:
        optimizer("shampoo", model().parameters(), 1, deterministic=False)
        result["nondeterministic"] = "accepted"
    except ValueError as error:
        result["nondeterministic"] = str(error)
    try:  # every rank's factor sets differ: no common staggered schedule
        optimizer("shampoo", torch.nn.Linear(4 + rank, 3).parameters(), 1, stagger=True, local_world_size=LOCAL)
        result["uneven_stagger"] = "accepted"
    except ValueError as error:
        result["uneven_stagger"] = str(error)
    out.mkdir(exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")


# ---- a rank dies ------------------------------------------------------------------------------------
def kill_worker(rank: int, world: int, out: Path, victim: int, kill_step: int, timeout_s: float,
                pairs: bool = False, stall: bool = False) -> None:
    """Every rank steps on the full batches (identical gradients without any collective of the test's own),
    so that the optimizer's protocol is the only thing that can notice the victim is gone. With ``pairs``,
    ranks {0, 1} and {2, 3} each run an optimizer over a group of their own (Gloo, with a timeout of
    10 x ``timeout_s``), declared as two nodes of one rank (so its two ranks exchange). With ``stall`` the
    victim hangs for 3 x ``timeout_s`` before it exits."""
    net = model()
    if pairs:
        groups = [dist.new_group(pair, backend="gloo", timeout=timedelta(seconds=10 * timeout_s))
                  for pair in ([0, 1], [2, 3])]
        opt = optimizer("shampoo", net.parameters(), 1, local_world_size=1, timeout_s=timeout_s,
                        process_group=groups[rank // 2])
    else:
        opt = optimizer("shampoo", net.parameters(), 1, local_world_size=LOCAL, timeout_s=timeout_s)
    started = [0.0]

    def hook(step: int) -> None:
        if step == kill_step:
            started[0] = time.monotonic()
            if rank == victim:
                if stall:
                    time.sleep(3 * timeout_s)
                os._exit(17)

    outcome: dict[str, Any] = {"raised": None, "steps": 0}
    try:
        train(net, opt, data(kill_step + 8), None, hook=hook)
        outcome["steps"] = kill_step + 8
    except (TimeoutError, PeerError) as error:
        outcome = {"raised": type(error).__name__, "message": str(error),
                   "seconds": time.monotonic() - started[0] if started[0] else -1.0}
    torch.save(outcome, out / f"rank{rank}.pt")
    os._exit(0)  # the group cannot be destroyed cleanly with a dead peer


def failure_worker(rank: int, world: int, out: Path) -> None:
    """Every refresh of the first factor set fails (an injected exception in each owner's jobs), too few times in
    a row to raise: each rank saves what ``runtime_stats()["refresh_errors"]`` says, with the set's blocks and the
    ones this rank owns."""
    net = model()
    opt = optimizer("shampoo", net.parameters(), 1, local_world_size=LOCAL, max_consecutive_failures=100)
    refresher = opt._refresher
    for block_id in refresher.ids[0]:
        refresher.engine.inject_fault(block_id, None, "throw", 0.0)
    train(net, opt, data(6), None)
    fset = refresher.sets[0]
    torch.save({"errors": opt.runtime_stats()["refresh_errors"],
                "blocks": [fset.describe(b) for b in range(fset.batch)],
                "owned": [fset.describe(b) for b in refresher.owned[0]]}, out / f"rank{rank}.pt")
    opt.close()


# ---- FSDP2 and HSDP ---------------------------------------------------------------------------------
def sharded_worker(rank: int, world: int, out: Path, runs: list[tuple[str, str, int, int, bool]]) -> None:
    """Each run ``(layout, optimizer, S, steps, stagger)`` is kept under ``(layout, optimizer, S, stagger)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    result: dict[str, Any] = {}
    for layout, kind, staleness, steps, stagger in runs:
        net = model()
        if layout == "fsdp":
            mesh = init_device_mesh("cpu", (world,))
        else:
            mesh = init_device_mesh("cpu", (world // LOCAL, LOCAL), mesh_dim_names=("replicate", "shard"))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        # "hsdp+plain": a replicated parameter beside the sharded ones, so that the node leaders of the world's
        # domain are those of a shard's domain too, and exchange in both over one channel.
        more = [extra_parameter()] if layout == "hsdp+plain" else []
        opt = optimizer(kind, [*net.parameters(), *more], staleness, local_world_size=LOCAL, stagger=stagger)
        train(net, opt, data(steps), (rank, world), extra=more[0] if more else None)
        stats = opt.runtime_stats()
        params = {k: v.full_tensor().detach().clone() for k, v in net.state_dict().items()}
        params |= {"extra": p.detach().clone() for p in more}
        local = {k: v.to_local().detach().clone() for k, v in net.state_dict().items()}
        domains = [list(d.ranks) for d in opt._refresher.domains]
        result[(layout, kind, staleness, stagger)] = {"params": params, "local": local, "stats": stats,
                                                      "domains": domains, "phases": list(opt.schedule.phases)}
        opt.close()
    out.mkdir(exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")


# ---- optimizers over subgroups ---------------------------------------------------------------------
def subgroup_worker(rank: int, world: int, out: Path, kinds: tuple[str, str], steps: int) -> None:
    """4 processes as 2 hosts x 2 ranks (``LOCAL_WORLD_SIZE=2``), each pair of ranks training its own DDP
    replicas with its own optimizer over its own Gloo group (as pipeline stages would): pair g trains
    ``kinds[g]``. Layout "hosts": the pairs {0, 1} and {2, 3}, each on one host (one node, a shared store);
    "across": {0, 2} and {1, 3}, each across the hosts (two nodes of one rank, which exchange), over groups
    of backend ``cpu:gloo`` (as ``cpu:gloo,cuda:nccl`` would run host tensors); "declared": the pairs of
    "hosts" with ``local_world_size=1`` (two nodes of one rank each, on one host)."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        layouts = {"hosts": [[0, 1], [2, 3]], "across": [[0, 2], [1, 3]], "declared": [[0, 1], [2, 3]]}
        # A Gloo group, one with Gloo for CPU tensors, and one declared as two nodes of one rank.
        backends = {"hosts": "gloo", "across": "cpu:gloo", "declared": "gloo"}
        declared = {"declared": 1}
        groups = {name: [dist.new_group(pair, backend=backends[name]) for pair in pairs]
                  for name, pairs in layouts.items()}
        uneven = dist.new_group([0, 1, 2], backend="gloo")  # 2 ranks on host 0, 1 on host 1
        result: dict[str, Any] = {}
        for name, pairs in layouts.items():
            g = next(i for i, pair in enumerate(pairs) if rank in pair)
            group, index = groups[name][g], pairs[g].index(rank)
            net = torch.nn.parallel.DistributedDataParallel(model(), process_group=group)
            with optimizer(kinds[g], net.parameters(), 1, process_group=group,
                           local_world_size=declared.get(name)) as opt:
                train(net, opt, data(steps), (index, 2))
                params = {k: v.detach().clone() for k, v in net.module.state_dict().items()}
                gathered: list[Any] = [None, None]
                dist.all_gather_object(gathered, params, group=group)
                result[name] = {"kind": kinds[g], "params": params, "stats": gather_runtime_stats(opt),
                                "identical": all(torch.equal(gathered[1 - index][k], v) for k, v in params.items())}
            try:  # the other pair's group, which this rank is not in
                optimizer("shampoo", model().parameters(), 1, process_group=groups[name][1 - g])
                result[f"{name}_foreign"] = "accepted"
            except ValueError as error:
                result[f"{name}_foreign"] = str(error)
        result["stages"] = _fsdp_stage(rank, kinds, steps)
        if rank < 3:
            try:
                optimizer("shampoo", model().parameters(), 1, process_group=uneven)
                result["uneven"] = "accepted"
            except ValueError as error:
                result["uneven"] = str(error)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    out.mkdir(exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")


def unnamed_backend_worker(rank: int, world: int, out: Path) -> None:
    """3 processes under a default group initialised without a backend name (as with ``device_id``), whose
    groups torch reports as backend 'undefined' and runs CPU tensors on Gloo: ranks 0 and 1 train DDP
    replicas with Shampoo over a group of theirs, made without a backend name either; rank 2 only takes
    part in making it. It makes the default group itself, so that the test connects one default group's Gloo
    mesh, not two: on localhost a mesh fails to connect now and then ("Connection closed by peer",
    pytorch/pytorch#53270), and this test's second one, made at once after the first was torn down, did so once
    in CI."""
    dist.init_process_group(init_method=f"file://{out}/rendezvous-unnamed", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    pair = dist.new_group([0, 1])
    result: dict[str, Any] = {}
    if rank < 2:
        result["backend"] = dist.get_backend(pair)
        net = torch.nn.parallel.DistributedDataParallel(model(), process_group=pair)
        with optimizer("shampoo", net.parameters(), 1, process_group=pair) as opt:
            train(net, opt, data(6), (rank, 2))
            result["stats"] = opt.runtime_stats()
        result["params"] = {k: v.detach().clone() for k, v in net.module.state_dict().items()}
    torch.save(result, out / f"rank{rank}.pt")


unnamed_backend_worker.makes_its_group = True  # type: ignore[attr-defined]


def _fsdp_stage(rank: int, kinds: tuple[str, str], steps: int) -> dict[str, Any]:
    """Two stages of two ranks (a ("stage", "shard") mesh), as pipeline parallelism with FSDP2 lays them out:
    each stage shards its own model over its row of the mesh and steps it with its own optimizer over that
    row's group; stage g trains ``kinds[g]``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("stage", "shard"))
    row, stage = mesh["shard"], rank // 2
    net = model()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=row)
    fully_shard(net, mesh=row)
    with optimizer(kinds[stage], net.parameters(), 1, process_group=row.get_group()) as opt:
        train(net, opt, data(steps), (rank % 2, 2))
        domains = [list(d.ranks) for d in opt._refresher.domains]
        stats = opt.runtime_stats()
    params = {k: v.full_tensor().detach().clone() for k, v in net.state_dict().items()}
    return {"kind": kinds[stage], "params": params, "domains": domains, "stats": stats}


# ---- checkpoint and resume on every rank -------------------------------------------------------------
def malformed_loads(opt: Any, saved: dict[str, Any], rank: int) -> list[str]:
    """``opt.load_state_dict`` of ``saved`` with this rank's first scheduled refresh spoiled (its request, the
    snapshot of a set this rank owns blocks of, or its due step, far beyond the activation lag), or its saved layout
    emptied. The errors, or "accepted"."""
    errors = []
    for spoil in ("request", "snapshot", "layout", "due"):
        bad = copy.deepcopy(saved)
        entry = bad[f"rank{rank}"]["refresher"]["scheduled"][0]
        index = next(i for i, snapshot in entry["snapshots"].items() if snapshot is not None)
        if spoil == "request":
            entry["requests"][index] = (1.0,)
        elif spoil == "snapshot":
            entry["snapshots"][index] = entry["snapshots"][index][..., :1]
        elif spoil == "due":
            entry["due"] += 10**6
        else:
            bad[f"rank{rank}"]["refresher"]["distributed"] = {}
        try:
            opt.load_state_dict(bad)
            errors.append("accepted")
        except ValueError as error:
            errors.append(str(error))
    return errors


def resume_worker(rank: int, world: int, out: Path, runs: list[tuple[str, int, int, int]]) -> None:
    """Per run (optimizer, S, steps before the checkpoint, steps after): every rank trains its replica on
    the full batches (identical gradients with no collective of the test's own: a fresh DDP would bucket
    its all-reduce differently after a restart, which changes the gradients' rounding, not the
    optimizer's), takes its own ``state_dict()`` with refreshes in flight and trains on; a fresh model
    and optimizer on the same ranks load the checkpoint and train the same steps. Records whether both
    end bit for bit equal."""
    result: dict[str, Any] = {}
    for kind, staleness, before, after in runs:
        batches = data(before + after)
        net = model()
        opt = optimizer(kind, net.parameters(), staleness, local_world_size=LOCAL)
        train(net, opt, batches[:before], None)
        saved = opt.state_dict()
        weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
        train(net, opt, batches[before:], None)
        opt.close()
        again = model()
        again.load_state_dict(weights)
        resumed = optimizer(kind, again.parameters(), staleness, local_world_size=LOCAL)
        malformed = malformed_loads(resumed, saved, rank)  # refused by name, leaving it fresh
        resumed.load_state_dict(saved)
        train(again, resumed, batches[before:], None)
        resumed.close()
        # The same through torch.distributed.checkpoint: every rank's part in one checkpoint, each rank
        # loading its own into a fresh optimizer (the optimizer is a Stateful for DCP).
        import torch.distributed.checkpoint as dcp

        third = model()
        third.load_state_dict(weights)
        writer = optimizer(kind, third.parameters(), staleness, local_world_size=LOCAL)
        writer.load_state_dict(saved)
        dcp.save({"optim": writer}, checkpoint_id=str(out / f"dcp-{kind}-{staleness}"))
        writer.close()
        third = model()
        third.load_state_dict(weights)
        reader = optimizer(kind, third.parameters(), staleness, local_world_size=LOCAL)
        dcp.load({"optim": reader}, checkpoint_id=str(out / f"dcp-{kind}-{staleness}"))
        train(third, reader, batches[before:], None)
        reader.close()
        own = saved[f"rank{rank}"]
        result[(kind, staleness)] = {
            "in_flight": len(own["refresher"]["scheduled"]),
            "malformed": malformed,
            "identical": all(torch.equal(a, b) for a, b in zip(net.parameters(), again.parameters(), strict=True)),
            "dcp_identical": all(torch.equal(a, b) for a, b in zip(net.parameters(), third.parameters(), strict=True)),
            "layout": own["distributed"],
        }
    out.mkdir(exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")


# ---- CUDA: installs straight from page-locked node stores ------------------------------------------
CUDA_STEPS = 12


def cuda_run(kind: str, device: torch.device, side_delay: int = 0,
             local_world_size: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Trains on the full batches on ``device`` (lag 1, staggered); ``side_delay`` cycles of GPU sleep are
    queued on the side streams after every step, so that snapshots and installs finish late."""
    net = model().to(device)
    # Whole groups on one process too (the default splits there only), and every refresh on the CPU workers (one
    # process would decompose its start-up refreshes on the GPU's lane, which the ranks' refresher has not), so
    # that it ends where the ranks end.
    runtime = {"stagger_split": False, "device_refresh": False} | (
        {} if local_world_size is None else {"local_world_size": local_world_size})
    batches = [(x.to(device), y.to(device)) for x, y in data(CUDA_STEPS)]
    with optimizer(kind, net.parameters(), 1, lag_steps=1, stagger=True, **runtime) as opt:
        def delay(step: int) -> None:
            for side in opt._refresher.stager.side.values():
                with torch.cuda.stream(side.stream):
                    torch.cuda._sleep(side_delay)

        train(net, opt, batches, None, hook=delay if side_delay else None)
        torch.cuda.synchronize(device)
        stats = opt.runtime_stats()
    return {k: v.detach().cpu() for k, v in net.state_dict().items()}, stats


def cuda_worker(rank: int, world: int, out: Path, local: int, runs: list[tuple[str, int]]) -> None:
    """Every rank trains on the full batches on its GPU (identical gradients, no collective of the test's
    own), so each must end bit for bit where one process ends; each run ``(optimizer, side delay)``."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    result = {(kind, delay): cuda_run(kind, device, delay, local) for kind, delay in runs}
    torch.save(result, out / f"rank{rank}.pt")


def training_worker(rank: int, world: int, out: Path, ddp_runs: list, sharded_runs: list,
                    resume_runs: list, subgroup_run: tuple[tuple[str, str], int]) -> None:
    """The DDP runs, the FSDP2 / HSDP runs, the resume runs and the subgroup runs in one set of processes
    (one start-up)."""
    ddp_worker(rank, world, out / "ddp", ddp_runs)
    sharded_worker(rank, world, out / "sharded", sharded_runs)
    resume_worker(rank, world, out / "resume", resume_runs)
    subgroup_worker(rank, world, out / "subgroups", *subgroup_run)


def errors(out: Path) -> str:
    """The tracebacks the ranks wrote (for an assertion's message), or a line saying there are none."""
    return "\n".join(p.read_text() for p in sorted(out.glob("rank*.error"))) or "no rank wrote an error"


def load(out: Path, world: int = WORLD) -> list[Any]:
    if any(out.glob("rank*.error")):
        raise AssertionError(errors(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
