"""bench/scaling.py without launching anything: the child command lines and environment, option
checks, and the table's figures from finished runs (summary.json and metrics.jsonl written here).
The driver itself runs torchrun (see tests/distributed/test_cli_distributed.py for real launches)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import bench_script

from asteria.train import cli


@pytest.fixture(scope="module")
def scaling():
    return bench_script("scaling")


def test_child_commands_environment_and_default_process_counts(scaling):
    args = scaling.build_parser().parse_args(["--out", "X", "--local-world-size", "1", "--model", "olmo-160m",
                                              "--workers", "3", "--max-preconditioner-dim", "1024",
                                              "--lag-steps", "2", "--profile-steps", "40", "49",
                                              "--prefetch", "step", "--stagger-split"])
    args.device = "cuda"
    argv = scaling.train_command(args, "kl-shampoo-async", 2, "fsdp", Path("X/kl/fsdp-p2"))
    text = " ".join(argv)
    assert argv[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    assert "asteria.train.cli train --out X/kl/fsdp-p2 --overwrite --optimizer kl-shampoo --mode async" in text
    for option in ("--parallel fsdp", "--local-world-size 1", "--precondition-frequency 10", "--model olmo-160m",
                   "--workers 3", "--device cuda", "--eval-every 60", "--max-preconditioner-dim 1024",
                   "--lag-steps 2", "--profile-steps 40 49", "--prefetch step", "--stagger-split"):
        assert option in text, option
    single = " ".join(scaling.train_command(args, "adamw", 1, scaling.SINGLE, Path("X/adamw/p1")))
    assert "--nproc-per-node 1" in single and "--parallel" not in single and "--local-world-size" not in single
    assert "--optimizer adamw --mode sync" in single
    for option in ("--lag-steps", "stagger-split", "--staleness", "--workers", "--precondition-frequency",
                   "--max-preconditioner-dim", "--prefetch"):  # `train` refuses them for AdamW
        assert option not in single, option
    native = " ".join(scaling.train_command(args, "soap-sync", 2, "ddp", Path("X/soap/ddp-p2")))
    assert "--precondition-frequency 10" in native and "--prefetch step" in native
    for option in ("--lag-steps", "stagger-split", "--staleness", "--workers"):  # async-only: refused in native mode
        assert option not in native, option
    # every config's command is one that `asteria train` accepts (on this machine's device)
    args.device = "cpu"
    for config in scaling.CONFIGS:
        for procs, parallel in ((1, scaling.SINGLE), (2, "fsdp")):
            argv = scaling.train_command(args, config, procs, parallel, Path("X/run"))
            train_args = cli.build_parser().parse_args(argv[argv.index("train"):])
            given = {name for name, value in vars(train_args).items() if value is not None}
            cli.check_unused_options(cli.run_config_from_args(train_args), given, procs == 1)
    args.stagger_split = False
    assert "--no-stagger-split" in scaling.train_command(args, "soap-async", 2, "ddp", Path("X/soap/ddp-p2"))
    env = scaling.child_env("cuda")
    assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == \
        ("0", "1", "1")
    assert [scaling.default_nprocs(g) for g in (0, 1, 2, 4, 8)] == [[1, 2], [1], [1, 2], [1, 2, 4], [1, 2, 4, 8]]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--configs", "adamw", "lion-async"], "Invalid config='lion-async'"),
        (["--configs", "adamw", "adamw"], "Invalid configs=['adamw', 'adamw']: each config at most once"),
        (["--parallel", "hsdp"], "Invalid parallel='hsdp': must be one of ('ddp', 'fsdp')"),
        (["--nprocs", "0"], "Invalid nprocs=0: must be >= 1"),
        (["--nprocs", "64", "--device", "cuda"], "Invalid nprocs=64: one process per GPU"),
        (["--nprocs", "1", "2", "--local-world-size", "3"], "Invalid local_world_size=3: must divide every process"),
        (["--model", "gpt5"], "Invalid model='gpt5'"),
        (["--steps", "0"], "Invalid steps=0: must be >= 1"),
        (["--lag-steps", "51"], "Invalid lag_steps=51: must be in [0, staleness x precondition_frequency = 50]"),
        (["--max-preconditioner-dim", "0"], "Invalid max_preconditioner_dim=0: must be >= 1"),
    ],
)
def test_bad_options_name_the_value(scaling, argv, message, tmp_path, capsys):
    assert scaling.main(["--out", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def fake_run(run_dir: Path, step_ms: list[float], losses: list[float], procs: int, parallel: str) -> None:
    """A finished run as ``asteria train`` leaves it (the fields the driver reads)."""
    run_dir.mkdir(parents=True)
    wall, lines = 0.0, []
    for step, (ms, loss) in enumerate(zip(step_ms, losses, strict=True), start=1):
        wall += ms / 1e3
        lines.append(json.dumps({"step": step, "loss": loss, "step_time": ms / 1e3, "wall": wall,
                                 "gpu_step_time": ms / 1e3 - 0.01}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    distributed = None
    if procs > 1:
        distributed = {
            "nodes": 2,
            "optimizer_bytes": {"per_step": {"bytes_inter_node_sent": 3e6, "bytes_intra_node_shared": 1e6}},
            "gradient_bytes_per_step_computed": {"total_sent": 8e6, "inter_node_sent": 4e6},
            "replica_agreement": {"max_abs_diff": 0.0 if parallel == "ddp" else None},
        }
    summary = {"device": "cpu", "label": run_dir.parent.name, "vocab_size": 256,
               "final_loss": sum(losses[-10:]) / len(losses[-10:]),
               "final_val_loss": losses[-1] + 0.25, "energy_joules_per_step": None, "distributed": distributed,
               # f = 1 with two sync refreshes: a warm-up of 3 steps, as asteria bench counts it (AdamW's runs
               # are given no f: the comparison's counts for them too)
               "config": {"sync_refreshes": 2} | ({} if "adamw" in str(run_dir) else {"precondition_frequency": 1}),
               "runtime_stats": {"waits": 2, "wait_seconds": 0.5} if "soap" in str(run_dir) else {}}
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_table_figures_from_finished_runs(scaling, tmp_path):
    # The first 3 steps are warm-up. Losses fall 1 per step from 10; AdamW ends lower.
    steps = 14
    fake_run(tmp_path / "adamw" / "p1", [500.0] * 3 + [100.0] * 11, [10.0 - 0.5 * i for i in range(steps)], 1, "single")
    fake_run(tmp_path / "soap" / "p1", [500.0] * 3 + [200.0] * 11, [10.0 - 0.2 * i for i in range(steps)], 1, "single")
    fake_run(tmp_path / "adamw" / "ddp-p2", [500.0] * 3 + [125.0] * 10 + [400.0],
             [10.0 - 0.5 * i for i in range(steps)], 2, "ddp")
    rows = [scaling.measure(tmp_path / "adamw" / "p1", 1, "single", "adamw", 4, 32, 1),
            scaling.measure(tmp_path / "soap" / "p1", 1, "single", "soap-async", 4, 32, 1),
            scaling.measure(tmp_path / "adamw" / "ddp-p2", 2, "ddp", "adamw", 4, 32, 1)]
    rows = scaling.finish_rows(rows, target_loss=None)
    single, soap, ddp = rows
    assert single["median_step_seconds"] == 0.1 and single["tokens_per_second"] == pytest.approx(4 * 32 / 0.1)
    assert ddp["median_step_seconds"] == 0.125 and ddp["max_step_seconds"] == 0.4
    assert ddp["max_over_median"] == pytest.approx(3.2) and ddp["warmup_steps"] == 3
    assert ddp["gpu_median_step_seconds"] == pytest.approx(0.115)
    assert soap["waits"] == 2 and single["waits"] is None
    assert single["final_val_loss"] == pytest.approx(10.0 - 0.5 * 13 + 0.25)
    assert ddp["tokens_per_second"] == pytest.approx(2 * 4 * 32 / 0.125)
    assert ddp["scaling_efficiency"] == pytest.approx(0.8) and single["scaling_efficiency"] == 1.0
    assert ddp["optimizer_inter_node_bytes_per_step"] == 3e6 and ddp["gradient_bytes_per_step_computed"] == 8e6
    assert single["gradient_bytes_per_step_computed"] == 0.0 and single["replica_max_abs_diff"] is None
    # Target: AdamW's final loss at the same procs; SOAP (slower descent) never reaches it in 14 steps.
    assert soap["target_loss"] == single["final_loss"] and soap["time_to_target_seconds"] is None
    assert single["steps_to_target"] == steps  # its own trailing mean reaches it at the end
    assert single["time_to_target_seconds"] == pytest.approx(3 * 0.5 + 11 * 0.1)
    results = {"device": "cpu", "command": "python3 bench/scaling.py", "rows": rows, "failures": [],
               "settings": {"model": "tiny", "steps": steps, "batch_size": 4, "seq_len": 32,
                            "precondition_frequency": 2, "staleness": 1, "seed": 0, "local_world_size": 1}}
    table = scaling.markdown(results).splitlines()
    body = [line for line in table if line.startswith("|")]
    assert len(body) == 2 + len(rows) and len({line.count("|") for line in body}) == 1
    assert "| adamw | 2 | ddp | 125.0 | 400.0 | 3.20 | 115.0 | n/a | 2048 | 0.80 |" in table[-1]
    assert "| soap-async | 1 | single | 200.0 | 200.0 | 1.00 | 190.0 | 2 (0.5) |" in table[-2]
    text = scaling.format_table(results)
    assert text.startswith("device: cpu") and "soap-async" in text


def test_finished_runs_are_reused_and_max_seconds_stops_launching(scaling, tmp_path, capsys):
    """With --skip-done a run that finished with the same command line is read, not relaunched; past
    --max-seconds nothing more starts (exit 3) and the table covers what is done."""
    out = tmp_path / "out"
    argv = ["--out", str(out), "--nprocs", "1", "2", "--configs", "adamw", "--device", "cpu", "--steps", "14",
            "--precondition-frequency", "2", "--skip-done", "--max-seconds", "1e-9"]
    args = scaling.build_parser().parse_args(argv)
    run_dir = out / "adamw" / "p1"
    fake_run(run_dir, [100.0] * 14, [10.0 - 0.5 * i for i in range(14)], 1, "single")
    (run_dir / "command.json").write_text(json.dumps(scaling.train_command(args, "adamw", 1, "single", run_dir)[1:]))
    assert scaling.finished_with(run_dir, scaling.train_command(args, "adamw", 1, "single", run_dir))
    assert not scaling.finished_with(run_dir, scaling.train_command(args, "soap-async", 1, "single", run_dir))
    older = [a for a in scaling.train_command(args, "adamw", 1, "single", run_dir)[1:] if a != "--overwrite"]
    (run_dir / "command.json").write_text(json.dumps(older))  # recorded before the children carried it
    assert scaling.finished_with(run_dir, scaling.train_command(args, "adamw", 1, "single", run_dir))
    assert scaling.main(argv) == 3
    results = json.loads((out / "results.json").read_text())
    assert [(r["config"], r["procs"]) for r in results["rows"]] == [("adamw", 1)]
    assert results["not_started"] == [{"config": "adamw", "procs": 2, "parallel": p} for p in ("ddp", "fsdp")]
    assert "done before: reused" in capsys.readouterr().out
    assert "Not started (--max-seconds): adamw 2 ddp, adamw 2 fsdp" in (out / "scaling.md").read_text()
