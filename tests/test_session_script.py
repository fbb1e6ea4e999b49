"""bench/executor_session.sh, the script of the device calls, in its DRY_RUN mode: every command a stage would
run on the GPU machine parses with the parser of the program it calls, and every bench config makes a valid
run and runtime configuration, so that a mistyped option fails here rather than in a device call, whose
minutes are few."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import bench_script, check_bench_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "executor_session.sh"
STAGES = "build cuda small large 1b dims sweep first soapgap workers seeds phases hb green math contention"
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


def test_a_deadline_starts_no_bench_without_the_time_for_one(tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), STAGES="small green", GREEN_MATH="0", GREEN_RUNS="plain")
    late = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=dict(env, DEADLINE_S="100", MIN_RUN_S="90"),
                          capture_output=True, text=True, timeout=60)
    assert late.returncode == 0 and late.stdout == ""
    assert "small: not started" in late.stderr and "green-plain: not started" in late.stderr
    assert len(dry_run(tmp_path, STAGES="small green", GREEN_MATH="0", GREEN_RUNS="plain", DEADLINE_S="200",
                       MIN_RUN_S="90")) == 2
