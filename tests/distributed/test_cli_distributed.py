"""``asteria train`` under torchrun on 2 CPU processes (Gloo), real processes: DDP with Asteria SOAP
(async) across 2 simulated nodes of 1 rank, its resume (bit for bit; another world size refused), and
FSDP2 with Asteria KL-Shampoo (async) and with AdamW (resume bit for bit through DTensor state); and on 4
processes as 2 nodes x 2 ranks, HSDP with Asteria Shampoo (async) and with AdamW, each with its resume."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asteria.train.cli import main
from asteria.train.distributed import gradient_bytes, resolve_layout, ring_crossings

PLAIN = ["--model", "tiny", "--seq-len", "32", "--eval-batches", "1", "--max-bytes", "200000", "--device", "cpu"]
COMMON = [*PLAIN, "--precondition-frequency", "2", "--staleness", "1", "--workers", "1"]  # an async run's
SOAP = ["--optimizer", "soap", "--mode", "async"]
DDP = [*COMMON, *SOAP, "--batch-size", "2", "--steps", "6", "--eval-every", "3", "--checkpoint-every", "3",
       "--keep-checkpoints", "0", "--parallel", "ddp", "--local-world-size", "1"]
FSDP_KL = [*COMMON, "--batch-size", "2", "--steps", "4", "--eval-every", "4", "--optimizer", "kl-shampoo", "--mode",
           "async", "--parallel", "fsdp"]
FSDP_ADAMW = [*PLAIN, "--batch-size", "2", "--steps", "4", "--eval-every", "2", "--checkpoint-every", "2",
              "--keep-checkpoints", "0", "--optimizer", "adamw", "--mode", "sync", "--parallel", "fsdp"]
HSDP = [*COMMON, "--batch-size", "1", "--steps", "5", "--eval-every", "5", "--checkpoint-every", "2",
        "--keep-checkpoints", "0", "--optimizer", "shampoo", "--mode", "async", "--parallel", "hsdp",
        "--local-world-size", "2"]
HSDP_ADAMW = [*PLAIN, "--batch-size", "1", "--steps", "4", "--eval-every", "2", "--checkpoint-every", "2",
              "--keep-checkpoints", "0", "--optimizer", "adamw", "--mode", "sync", "--parallel", "hsdp",
              "--local-world-size", "2"]


def torchrun(out: Path, args: list[str], *extra: str, procs: int = 2, **environ: str) -> subprocess.CompletedProcess:
    """``asteria train`` on ``procs`` processes under torchrun (``environ``: more of their environment)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
            "-m", "asteria.train.cli", "train", "--out", str(out), *args, *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
               **environ)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def resume_from(source: Path, step: int, target: Path) -> Path:
    """A copy of ``source``'s run as it stood at checkpoint ``step`` (later metrics are cut on resume)."""
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / f"step-{step:09d}", target / "checkpoints" / f"step-{step:09d}")
    shutil.copy(source / "metrics.jsonl", target / "metrics.jsonl")
    return target


def check(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The torchrun launches, one after the other (concurrent launches gain nothing on 2 cores): fresh
    DDP, its resume from step 3, FSDP2 KL-Shampoo, fresh FSDP2 AdamW and its resume from step 2, and on 4
    processes HSDP Shampoo and AdamW, each with its resume from step 2."""
    root = tmp_path_factory.mktemp("torchrun")
    done = {"ddp": torchrun(root / "ddp", DDP)}
    check(done["ddp"])
    done["ddp-resumed"] = torchrun(resume_from(root / "ddp", 3, root / "ddp-resumed"), DDP, "--resume")
    done["fsdp-kl"] = torchrun(root / "fsdp-kl", FSDP_KL)
    done["fsdp-adamw"] = torchrun(root / "fsdp-adamw", FSDP_ADAMW)
    check(done["fsdp-adamw"])
    done["fsdp-adamw-resumed"] = torchrun(resume_from(root / "fsdp-adamw", 2, root / "fsdp-adamw-resumed"),
                                          FSDP_ADAMW, "--resume")
    done["hsdp"] = torchrun(root / "hsdp", HSDP, procs=4)
    check(done["hsdp"])
    done["hsdp-resumed"] = torchrun(resume_from(root / "hsdp", 2, root / "hsdp-resumed"), HSDP, "--resume", procs=4)
    done["hsdp-adamw"] = torchrun(root / "hsdp-adamw", HSDP_ADAMW, procs=4)
    check(done["hsdp-adamw"])
    done["hsdp-adamw-resumed"] = torchrun(resume_from(root / "hsdp-adamw", 2, root / "hsdp-adamw-resumed"),
                                          HSDP_ADAMW, "--resume", procs=4)
    return root, done


def test_ddp_summary_agreement_bytes_and_rank_0_metrics(runs):
    root, done = runs
    run = root / "ddp"
    s = summary(run)
    d = s["distributed"]
    assert (d["world_size"], d["local_world_size"], d["nodes"], d["nodes_simulated"]) == (2, 1, 2, True)
    assert (d["parallel"], d["backend"]) == ("ddp", "gloo")
    agreement = d["replica_agreement"]
    assert agreement["max_abs_diff"] == 0.0 and agreement["max_abs_diff_per_rank"] == [0.0, 0.0]
    assert agreement["bitwise_identical"] is True and agreement["parameters_compared"] > 20
    # SOAP async: each rank owns half the blocks, and the two "nodes" exchange what they refreshed.
    opt = d["optimizer_bytes"]
    assert opt["steps"] == 6 and all(n > 0 for n in opt["owned_blocks_per_rank"])
    assert opt["totals"]["bytes_inter_node_sent"] == opt["totals"]["bytes_inter_node_received"] > 0
    assert opt["totals"]["bytes_intra_node_shared"] == 0  # one rank per node: nothing shared on a node
    assert opt["per_step"]["bytes_inter_node_sent"] == opt["totals"]["bytes_inter_node_sent"] / 6
    # Ring all-reduce, W = 2: each rank sends 2 (W-1)/W P 4 = 4 P bytes; both ring edges cross nodes.
    grads, p = d["gradient_bytes_per_step_computed"], s["parameters"]
    assert grads["per_rank_sent"] == 4 * p and grads["total_sent"] == grads["inter_node_sent"] == 8 * p
    assert grads["intra_node_sent"] == 0
    rows = records(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # rank 0 alone writes
    assert all(math.isfinite(r["loss"]) for r in rows) and s["final_loss"] < s["initial_loss_bound"]
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert len(list((run / "tensorboard").iterdir())) == 1
    assert done["ddp"].stdout.count("final loss") == 1 and "on 2 processes" in done["ddp"].stdout
    manifest = json.loads(next((run / "checkpoints").glob("step-*/manifest.json")).read_text())
    assert manifest["world_size"] == 2 and manifest["config"]["parallel"] == "ddp"


def test_ranks_read_distinct_slices_of_one_global_batch(runs, tmp_path):
    """Step 1 starts from the same weights: the mean of the two ranks' losses over their slices equals one
    process's loss over the whole global batch (4 sequences) up to rounding, and not any one slice's."""
    root, _ = runs
    single = tmp_path / "single"
    assert main(["train", "--out", str(single), *COMMON, *SOAP, "--batch-size", "4", "--steps", "1"]) == 0
    assert records(single)[0]["loss"] == pytest.approx(records(root / "ddp")[0]["loss"], rel=1e-6)


def test_ddp_resume_is_bitwise_and_another_world_size_is_refused(runs, capsys):
    root, done = runs
    check(done["ddp-resumed"])
    resumed = root / "ddp-resumed"
    assert summary(resumed)["resumed_from"].endswith("step-000000003")
    assert summary(resumed)["distributed"]["optimizer_bytes"]["steps"] == 3
    fresh = [(r["step"], r["loss"], r.get("val_loss")) for r in records(root / "ddp")]
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in records(resumed)] == fresh
    # One process cannot continue a 2-process run; nothing is touched.
    before = (resumed / "metrics.jsonl").read_text()
    assert main(["train", "--out", str(resumed), *DDP, "--resume"]) == 2
    assert "saved by 2 ranks, this run has 1" in capsys.readouterr().err
    assert (resumed / "metrics.jsonl").read_text() == before


def test_fsdp2_with_asteria_kl_shampoo(runs):
    root, done = runs
    check(done["fsdp-kl"])
    s = summary(root / "fsdp-kl")
    d = s["distributed"]
    assert (d["world_size"], d["local_world_size"], d["nodes"], d["parallel"]) == (2, 2, 1, "fsdp")
    assert d["replica_agreement"]["max_abs_diff"] is None and "no two ranks" in d["replica_agreement"]["method"]
    # Each shard is its own replica domain: no exchange. FSDP2: (W-1)/W 4 (3 P_layers + 2 P_root) per rank.
    assert d["optimizer_bytes"]["totals"]["bytes_inter_node_sent"] == 0
    assert d["optimizer_bytes"]["owned_blocks_per_rank"][0] > 0
    grads, p = d["gradient_bytes_per_step_computed"], s["parameters"]
    layers = grads["layer_parameters"]
    assert 0 < layers < p and grads["per_rank_sent"] == 2 * (3 * layers + 2 * (p - layers))
    assert grads["inter_node_sent"] == 0 and grads["intra_node_sent"] == 2 * grads["per_rank_sent"]
    rows = records(root / "fsdp-kl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in rows)
    assert max(r["staleness"] for r in rows) <= 1 and math.isfinite(s["final_val_loss"])


def test_fsdp2_resume_is_bitwise(runs):
    """AdamW's moments are DTensors under FSDP2: saved as each rank's shard, laid out again on load."""
    root, done = runs
    check(done["fsdp-adamw-resumed"])
    fresh = [(r["step"], r["loss"], r.get("val_loss")) for r in records(root / "fsdp-adamw")]
    resumed = root / "fsdp-adamw-resumed"
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in records(resumed)] == fresh
    assert summary(resumed)["resumed_from"].endswith("step-000000002")


def test_hsdp_with_asteria_shampoo_and_its_resume(runs):
    """4 processes as 2 nodes x 2 ranks: each node holds one copy of the model, sharded over its 2 ranks;
    the copies of a shard on the two nodes end bit for bit equal, the optimizer exchanges across nodes, and
    the run resumes bit for bit. Its last step (5) saves no checkpoint, whose state_dict() would reshard the
    root's parameters that the last evaluation left gathered: the summary reshards them itself."""
    root, done = runs
    check(done["hsdp"])
    s = summary(root / "hsdp")
    d = s["distributed"]
    assert (d["world_size"], d["local_world_size"], d["nodes"], d["parallel"]) == (4, 2, 2, "hsdp")
    agreement = d["replica_agreement"]
    assert agreement["method"].startswith("HSDP") and agreement["bitwise_identical"] is True
    assert agreement["max_abs_diff_per_rank"] == [0.0] * 4 and agreement["parameters_compared"] > 20
    # The replicas of each shard live on the two nodes: their owners exchange what they refreshed.
    opt = d["optimizer_bytes"]
    assert opt["totals"]["bytes_inter_node_sent"] == opt["totals"]["bytes_inter_node_received"] > 0
    assert opt["totals"]["bytes_intra_node_shared"] == 0 and all(n > 0 for n in opt["owned_blocks_per_rank"])
    grads, p = d["gradient_bytes_per_step_computed"], s["parameters"]
    layers = grads["layer_parameters"]
    within, across = 1 / 2 * 4 * (3 * layers + 2 * (p - layers)), 2 * 1 / 2 * p / 2 * 4
    assert grads["per_rank_sent"] == within + across and grads["inter_node_sent"] == 4 * across
    rows = records(root / "hsdp")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and all(math.isfinite(r["loss"]) for r in rows)
    check(done["hsdp-resumed"])
    resumed = root / "hsdp-resumed"
    assert summary(resumed)["resumed_from"].endswith("step-000000002")
    assert ([(r["step"], r["loss"], r.get("val_loss")) for r in records(resumed)]
            == [(r["step"], r["loss"], r.get("val_loss")) for r in rows])


def test_hsdp_adamw_resume_is_bitwise(runs):
    """AdamW's moments are DTensors on the (replicate, shard) mesh: saved as each rank's shard, laid out again."""
    root, done = runs
    check(done["hsdp-adamw-resumed"])
    fresh = [(r["step"], r["loss"], r.get("val_loss")) for r in records(root / "hsdp-adamw")]
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in records(root / "hsdp-adamw-resumed")] == fresh
    assert summary(root / "hsdp-adamw")["distributed"]["replica_agreement"]["bitwise_identical"] is True


def test_an_overwrite_keeps_the_earlier_run_until_every_rank_is_set_up(runs, tmp_path, capsys):
    """Rank 1 killed once set up, before the run starts: rank 0 waits for it rather than drop the earlier run."""
    root, _ = runs
    out = tmp_path / "run"
    shutil.copytree(root / "fsdp-adamw", out)
    earlier = (out / "metrics.jsonl").read_text()
    result = torchrun(out, FSDP_ADAMW, "--overwrite", ASTERIA_TEST_KILL="set-up-rank1@0")
    assert result.returncode != 0
    # Rank 0 gave it back (Gloo's barrier failed once rank 1 was gone), or was killed holding it aside.
    assert earlier in ((out / where / "metrics.jsonl").read_text() for where in (".", ".replaced-run")
                       if (out / where / "metrics.jsonl").exists())
    assert main(["train", "--out", str(out), *FSDP_ADAMW[:-2]]) == 2  # (one process: refused, the run given back)
    assert "holds checkpoints of an earlier run" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == earlier and not (out / ".replaced-run").exists()


def test_hsdp_needs_two_nodes_of_two_ranks():
    from asteria.train.distributed import DistributedRun

    for local in (1, 4):  # 4 nodes of one rank; one node of 4
        layout = resolve_layout(local, {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"})
        with pytest.raises(ValueError, match=rf"Invalid parallel='hsdp' over {4 // local} node\(s\) of {local} rank"):
            DistributedRun(layout, "cpu", "hsdp")  # before any process group
    eight = resolve_layout(8, {"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"})
    with pytest.raises(ValueError, match=r"\(here --local-world-size 2 or 4\)"):
        DistributedRun(eight, "cpu", "hsdp")


def test_layout_and_computed_gradient_bytes_follow_the_ring_model():
    host = {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"}
    one_node = resolve_layout(None, host)
    assert (one_node.nodes, one_node.local_world_size, ring_crossings(one_node)) == (1, 8, 0)
    four_nodes = resolve_layout(2, host)  # 8 processes as 4 simulated nodes of 2
    assert (four_nodes.nodes, four_nodes.node_of(5), ring_crossings(four_nodes)) == (4, 2, 4)
    ddp = gradient_bytes("ddp", four_nodes, parameters=1000, layer_parameters=600)
    assert ddp["per_rank_sent"] == 2 * 7 / 8 * 1000 * 4 and ddp["total_sent"] == 8 * ddp["per_rank_sent"]
    assert ddp["inter_node_sent"] == ddp["intra_node_sent"] == 4 * ddp["per_rank_sent"]
    fsdp = gradient_bytes("fsdp", one_node, parameters=1000, layer_parameters=600)
    assert fsdp["per_rank_sent"] == 7 / 8 * 4 * (3 * 600 + 2 * 400) and fsdp["inter_node_sent"] == 0
    assert "(W-1)/W * 4 * (3*P_layers + 2*P_root)" in fsdp["formula"]
    assert resolve_layout(None, {}).distributed is False
    # HSDP: FSDP2 within each node of L ranks, an all-reduce of each (P / L) shard across the N nodes; the
    # two layouts of 8 ranks tell L from N.
    for local, nodes in ((4, 2), (2, 4)):
        layout = resolve_layout(local, host)
        hsdp = gradient_bytes("hsdp", layout, parameters=1000, layer_parameters=600)
        within = (local - 1) / local * 4 * (3 * 600 + 2 * 400)
        across = 2 * (nodes - 1) / nodes * 1000 / local * 4
        assert hsdp["per_rank_sent"] == pytest.approx(within + across)
        assert hsdp["intra_node_sent"] == pytest.approx(8 * within)
        assert hsdp["inter_node_sent"] == pytest.approx(8 * across)
