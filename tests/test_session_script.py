"""bench/executor_session.sh, the script of the device calls, in its DRY_RUN mode: every command a stage would
run on the GPU machine parses with the parser of the program it calls, and every bench config makes a valid
run and runtime configuration, so that a mistyped option fails here rather than in a device call, whose
minutes are few."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import bench_script, check_bench_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "executor_session.sh"
STAGES = "build cuda small large 1b profile dims sweep first soapgap workers seeds phases hb green math syev contention"
GREEN_RUNS = "plain sms16 sms16-t2 prio prio-sms16 nolate nolane"
CLI = ["python3", "-m", "asteria.train.cli", "bench"]


def dry_run(out: Path, **env: str) -> list[list[str]]:
    """The commands the script would run, one argv each."""
    result = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=dict(os.environ, DRY_RUN="1", OUT=str(out), **env),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]


def test_every_command_of_every_stage_parses_and_makes_valid_configurations(tmp_path, monkeypatch):
    commands = dry_run(tmp_path, STAGES=STAGES, GREEN_RUNS=GREEN_RUNS)
    benches = [argv[len(CLI):] for argv in commands if argv[:len(CLI)] == CLI]
    maths = [argv[2:] for argv in commands if argv[:2] == ["python3", "bench/gpu_refresh_math.py"]]
    # small, large, 1b, 2 dims, 4 sweep points, 4 first-basis runs, 2 soapgap, 4 workers, 3 seeds, hb, 7 green
    assert len(benches) == 1 + 1 + 1 + 2 + 4 + 4 + 2 + 4 + 3 + 1 + len(GREEN_RUNS.split())
    assert len(maths) == 3  # green's two training priorities, and math
    for argv in benches:
        check_bench_args(argv, monkeypatch)
    parser = bench_script("gpu_refresh_math").build_parser()
    for argv in maths:
        parser.parse_args(argv)
    # profile: one process a config, each with its own folder, TF32 as the benches run, under the deadline's timeout
    profiles = [argv[argv.index("bench/profile_step.py") + 1:] for argv in commands if "bench/profile_step.py" in argv]
    profile_step = bench_script("profile_step")
    parsed = [profile_step.build_parser().parse_args(argv) for argv in profiles]
    assert [args.configs for args in parsed] == [[f"{name}:tf32=1"] for name in (
        "adamw", "shampoo-sync", "soap-sync", "kl-shampoo-sync")]
    for args in parsed:
        assert profile_step.parse(args.configs[0])[1]["tf32"] == 1
        assert args.model == "olmo2-1b" and args.batch_size == 16 and args.seq_len == 1024
        assert str(args.out) == f"runs/profile/{args.configs[0].split(':')[0]}"
    (syev,) = [argv[2:] for argv in commands if argv[:2] == ["python3", "bench/gpu_syev_batched.py"]]
    assert bench_script("gpu_syev_batched").build_parser().parse_args(syev).batches == [1, 4, 16]
    contention = [argv[2:] for argv in commands if argv[:2] == ["python3", "bench/launch_contention.py"]]
    assert len(contention) == 2
    for argv in contention:
        assert bench_script("launch_contention").arguments().parse_args(argv).sides[0] == "none"


@pytest.mark.parametrize("variant, flags", [
    ("plain", []), ("sms16", ["--device-sms", "16"]), ("sms32-t4", ["--device-sms", "32", "--device-threads", "4"]),
    ("prio-sms16", ["--stream-priority", "-1", "--device-sms", "16"]), ("nolate", ["--no-late-activation"]),
    ("nolane", ["--no-device-refresh"]), ("inproc", ["--no-device-process"]),
    ("prio-t4", ["--stream-priority", "-1", "--device-threads", "4"]),
    ("share0.3-t2", ["--device-share", "0.3", "--device-threads", "2"])])
def test_each_green_variant_passes_its_settings(tmp_path, variant, flags):
    (argv,) = dry_run(tmp_path, STAGES="green", GREEN_MATH="0", GREEN_RUNS=variant)
    args = argv[argv.index("--peer-path") + 2:argv.index("--configs")]
    assert args == flags
    assert argv[argv.index("--out") + 1] == f"runs/green-{variant}"


def test_an_unknown_stage_fails_before_anything_runs(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), STAGES="build 1B"))
    assert result.returncode == 2 and result.stdout == ""
    assert "Invalid STAGES entry '1B': the stages are build cuda" in result.stderr


def test_the_phases_stage_runs_each_vector_kernel_cap_at_each_thread_count(tmp_path):
    commands = dry_run(tmp_path, STAGES="phases", PHASES_SIMD="widest avx2", PHASES_THREADS="16 1")
    runs = [argv for argv in commands if "/tmp/eigh_variants" in argv and argv[0] == "env"]
    assert [argv[1:] for argv in runs] == [
        ["/tmp/eigh_variants", "48", "16", "2048"], ["/tmp/eigh_variants", "8", "1", "2048"],
        ["ASTERIA_MAX_SIMD=avx2", "/tmp/eigh_variants", "48", "16", "2048"],
        ["ASTERIA_MAX_SIMD=avx2", "/tmp/eigh_variants", "8", "1", "2048"]]


def test_a_deadline_starts_no_bench_without_the_time_for_one(tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), STAGES="small green", GREEN_MATH="0", GREEN_RUNS="plain")
    late = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=dict(env, DEADLINE_S="100", MIN_RUN_S="90"),
                          capture_output=True, text=True, timeout=60)
    assert late.returncode == 0 and late.stdout == ""
    assert "small: not started" in late.stderr and "green-plain: not started" in late.stderr
    assert len(dry_run(tmp_path, STAGES="small green", GREEN_MATH="0", GREEN_RUNS="plain", DEADLINE_S="200",
                       MIN_RUN_S="90")) == 2


def test_the_profile_stages_program_times_a_quiet_step_of_each_mode_on_the_cpu(tmp_path):
    """bench/profile_step.py runs native and async configs (native mode counts no activations) and writes each
    config's steady steps, with no allocator figures off a GPU; a mistyped modifier fails before any config runs."""
    script = str(ROOT / "bench" / "profile_step.py")
    argv = [sys.executable, script, "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--device", "cpu",
            "--steps", "2", "--profile-steps", "1", "--top", "3", "--out", str(tmp_path)]
    done = subprocess.run([*argv, "--configs", "shampoo-sync", "soap-async:w=1"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "=== shampoo-sync ===" in done.stdout and "=== soap-async:w=1 ===" in done.stdout
    results = json.loads((tmp_path / "profile.json").read_text())["results"]
    assert "activations" not in results["shampoo-sync"]["summary"]
    assert results["soap-async:w=1"]["summary"]["activations"]["max"] >= 0
    for result in results.values():
        assert result["steady_alloc_retries"] is None and result["steady_peak_bytes"] is None
        assert 0 < result["summary"]["wall"]["median"] <= result["summary"]["wall"]["max"]
    typo = subprocess.run([*argv, "--configs", "adamw", "shampoo-sync:tf=1"], capture_output=True, text=True,
                          timeout=300)
    assert typo.returncode != 0 and "Invalid config='shampoo-sync:tf=1'" in typo.stderr
    assert "=== adamw ===" not in typo.stdout


def test_the_cuda_stage_runs_every_test_file_that_needs_a_gpu(tmp_path):
    """A GPU test skips on the development machine and in CI, so the device call's cuda stage is where it runs at
    all: a new file of them that the stage does not list would never run anywhere."""
    commands = dry_run(tmp_path, STAGES="cuda")
    (pytest_argv,) = [argv for argv in commands if argv[:3] == ["python3", "-m", "pytest"]]
    listed = {arg for arg in pytest_argv if arg.startswith("tests/")}
    needing = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
               if path != Path(__file__).resolve() and 'reason="needs a CUDA GPU"' in path.read_text()}
    assert needing and needing <= listed, sorted(needing - listed)
