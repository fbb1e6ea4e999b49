"""The older device-call scripts of bench/ (gpu_session.sh and gpu_pair.sh, loss_arms.sh, loss_pairs.sh and
timed_pairs.sh) in their DRY_RUN mode: every command they would run parses with the parser of the program it
calls, so that a renamed or mistyped option fails here rather than in a device call. (executor_session.sh has
tests of its own, test_session_script.py.)"""

from __future__ import annotations

import argparse
import inspect
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import check_bench_args, check_bench_namespace, script_module

ROOT = Path(__file__).resolve().parents[1]
CLI = ["python3", "-m", "asteria.train.cli"]
GPU_SESSION_STAGES = "build cuda memory bench bench-large long sweep profile ladder nvme refresh scaling opt extra"


class Parsed(Exception):
    """Raised by the patched ``parse_args``: the program's arguments parsed, nothing run."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = namespace


def parse_only(path: Path, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """Runs the script at ``path`` as far as its ``parse_args`` of ``argv`` (an error exits, as on the device),
    whether its ``main`` takes the arguments or reads ``sys.argv``."""
    module = script_module(path)
    original = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    with monkeypatch.context() as patch, pytest.raises(Parsed) as parsed:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse)
        patch.setattr(sys, "argv", [str(path), *argv])
        module.main(argv) if inspect.signature(module.main).parameters else module.main()
    return parsed.value.namespace


def check(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """Parses one command line with its program's parser; returns the program."""
    if argv[:2] == ["taskset", "-c"]:
        argv = argv[3:]
    if argv[:3] == CLI:
        assert argv[3] == "bench", argv
        check_bench_args(argv[4:], monkeypatch)
        return "asteria bench"
    if argv[:3] in (["python3", "-m", "pip"], ["python3", "-m", "pytest"]):
        assert all((ROOT / arg).is_file() for arg in argv[3:] if arg.startswith("tests/")), argv  # (its test files)
        return argv[2]
    assert argv[0] == "python3" and argv[1].split("/")[0] in ("bench", "tools"), argv
    namespace = parse_only(ROOT / argv[1], argv[2:], monkeypatch)
    if argv[1:3] == ["tools/seeds.py", "run"]:  # the bench's options and configs, each seed's run
        check_bench_namespace(namespace, monkeypatch)
    return argv[1]


def dry_run(script: str, out: Path, *args: str, **env: str) -> str:
    result = subprocess.run(["bash", f"bench/{script}", *args], cwd=ROOT,
                            env=dict(os.environ, DRY_RUN="1", OUT=str(out), **env),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def commands(text: str) -> list[list[str]]:
    return [shlex.split(line) for line in text.splitlines() if line.strip()]


def test_every_gpu_session_stage_runs_commands_that_parse(tmp_path, monkeypatch):
    out = dry_run("gpu_session.sh", tmp_path, STAGES=GPU_SESSION_STAGES, SWEEP_OPTIMIZERS="soap shampoo",
                  LONG_ARGS="--no-deterministic", EXTRA_CMD="python3 bench/opt_step.py --steps 3")
    programs = [check(argv, monkeypatch) for argv in commands(out)]
    assert programs == ["pip", "pytest", "bench/memory.py", "asteria bench", "asteria bench", "asteria bench",
                        "tools/sweep.py", "tools/sweep.py", "bench/profile_step.py", "bench/memory.py",
                        "bench/memory.py", "bench/refresh_engine.py", "bench/refresh_engine.py", "bench/scaling.py",
                        "bench/opt_step.py", "bench/opt_step.py"]
    assert not (tmp_path / "device.txt").exists()  # (nothing queried a GPU)


def test_a_gpu_pair_runs_two_sessions_each_on_its_half(tmp_path, monkeypatch):
    out = dry_run("gpu_pair.sh", tmp_path, 'export STAGES="memory"', 'export STAGES="refresh"')
    assert [check(argv, monkeypatch) for argv in commands(out)] == ["pip"]
    for half, programs in (("a", ["bench/memory.py"]), ("b", ["bench/refresh_engine.py"] * 2)):
        log = (tmp_path / half / "session.log").read_text()
        assert [check(argv, monkeypatch) for argv in commands(log)] == programs
        assert f"--out {tmp_path / half}" in log


def test_the_loss_arms_parse_for_each_rule(tmp_path, monkeypatch):
    out = dry_run("loss_arms.sh", tmp_path, "3", "4", OPT="shampoo", LAGS="0 2", ARGS="--deterministic-kernels")
    lines = commands(out)
    assert [check(argv, monkeypatch) for argv in lines] == ["tools/seeds.py"] * 3
    assert [argv[argv.index("--out") + 1] for argv in lines] == [str(tmp_path / arm) for arm in ("na", "d0", "d2")]
    assert all(argv[argv.index("--seeds") + 1:argv.index("--seeds") + 3] == ["3", "4"] for argv in lines)


@pytest.mark.parametrize("script", ["loss_pairs.sh", "timed_pairs.sh"])
def test_the_seed_series_run_both_arms_per_seed_and_pool_them(tmp_path, monkeypatch, script):
    for seed in (5, 6):  # (the arms' folders, as finished runs leave them: the pooling then runs)
        for arm in ("na", "d2", "nf"):
            (tmp_path / f"s{seed}" / arm).mkdir(parents=True)
    out = dry_run(script, tmp_path, "5", "6", LAG="2", JOBS="1")
    gather = [argv for argv in commands(out) if argv[:3] == ["python3", "tools/seeds.py", "gather"]]
    assert len(gather) == 1 and check(gather[0], monkeypatch) == "tools/seeds.py"
    for seed in (5, 6):
        lines = commands((tmp_path / f"s{seed}" / "log.txt").read_text())
        assert [check(argv, monkeypatch) for argv in lines] == ["tools/seeds.py"] * 2
        assert all("--deterministic-kernels" in argv for argv in lines)
