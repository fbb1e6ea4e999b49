"""What ``asteria train`` does with the folder it writes to and the data it reads: an earlier run is never
replaced silently, a summary never outlives the run it describes, options a run would ignore are refused,
and input that cannot train (binary data, too few sequences, huge bounds) is named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import asteria
from asteria.train.cli import main

# Options of every run; those of a native run; those of an async run (`train` refuses the options a run
# would not read).
BASE = ["--batch-size", "4", "--seq-len", "32", "--eval-batches", "1", "--max-bytes", "20000", "--device", "cpu"]
NATIVE = [*BASE, "--precondition-frequency", "3"]
RUN = [*NATIVE, "--workers", "1", "--staleness", "1"]


pytestmark = pytest.mark.usefixtures("one_thread")


def child(argv: list[str]) -> list[str]:
    """The command line of ``asteria`` in a child process."""
    return [sys.executable, "-m", "asteria.train.cli", *argv]


def child_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1", **extra)


def steps_of(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_an_earlier_run_is_refused_unless_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--optimizer", "adamw", "--steps", "4", "--out", str(out), *BASE]) == 0
    for extra in ([], ["--resume"]):  # no checkpoint to resume from either
        assert main(["train", "--steps", "2", "--out", str(out), *RUN, *extra]) == 2
        assert "holds an earlier run (metrics.jsonl, summary.json, tensorboard)" in capsys.readouterr().err
        assert steps_of(out) == [1, 2, 3, 4]
        assert json.loads((out / "summary.json").read_text())["label"] == "adamw"
    assert main(["train", "--steps", "2", "--out", str(out), "--overwrite", *RUN]) == 0
    assert steps_of(out) == [1, 2]
    assert json.loads((out / "summary.json").read_text())["label"] == "shampoo-async"
    assert len(list((out / "tensorboard").iterdir())) == 1  # the earlier run's events went with it


def test_an_overwrite_refused_before_its_first_step_keeps_the_earlier_run(tmp_path, capsys):
    """--overwrite holds the earlier run's files aside until the new run is set up: one refused before (its batch
    larger than the data, its data missing) gives them back, where before it left neither run."""
    out = tmp_path / "run"
    assert main(["train", "--optimizer", "adamw", "--steps", "4", "--checkpoint-every", "2", "--out", str(out),
                 *BASE]) == 0
    for bad in (["--batch-size", "100000"], ["--data", str(tmp_path / "absent.txt")]):
        assert main(["train", "--steps", "2", "--out", str(out), "--overwrite", *RUN, *bad]) == 2
        assert "Invalid" in capsys.readouterr().err
        assert steps_of(out) == [1, 2, 3, 4] and (out / "checkpoints").is_dir()
        assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl", "summary.json", "tensorboard"]
    assert main(["train", "--steps", "2", "--out", str(out), "--overwrite", *RUN]) == 0  # set up: replaced
    assert steps_of(out) == [1, 2] and not (out / "checkpoints").exists()
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "summary.json", "tensorboard"]


def test_an_earlier_run_left_aside_by_a_killed_overwrite_comes_back(tmp_path, capsys):
    """An --overwrite killed while its run was being set up leaves the earlier run's files aside; the next call
    without --overwrite puts them back (before, it went on as if the folder were empty, and removed them)."""
    out = tmp_path / "run"
    assert main(["train", "--steps", "4", "--checkpoint-every", "2", "--out", str(out), *RUN]) == 0
    (out / ".replaced-run").mkdir()
    for name in ("checkpoints", "metrics.jsonl", "summary.json", "tensorboard"):
        (out / name).rename(out / ".replaced-run" / name)
    assert main(["train", "--steps", "2", "--out", str(out), *RUN]) == 2
    assert "holds checkpoints of an earlier run" in capsys.readouterr().err
    assert steps_of(out) == [1, 2, 3, 4] and not (out / ".replaced-run").exists()
    assert main(["train", "--steps", "6", "--resume", "--out", str(out), *RUN]) == 0
    assert steps_of(out) == list(range(1, 7))


def test_settings_that_fail_only_later_are_refused_before_the_first_step(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("not a folder")
    assert main(["train", "--steps", "4", "--checkpoint-every", "2", "--out", str(out), *RUN]) == 2
    assert "its 'checkpoints' is a file, where checkpoint_every=2 writes a folder" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()  # (before: 2 steps trained, then a raw FileExistsError)
    assert main(["train", "--steps", "2", "--out", str(tmp_path / "b"), *RUN, "--max-bytes", str(10**20)]) == 2
    assert "Invalid max_bytes=100000000000000000000: must be an int in [4096, 2^62]" in capsys.readouterr().err


def test_a_resume_under_another_activation_rule_is_refused(tmp_path, capsys):
    """The deterministic rule and the newest-finished one activate other versions: a resume that switched would
    go on another run than the checkpoint's (its losses differed from the resume on)."""
    out = tmp_path / "run"
    assert main(["train", "--steps", "4", "--checkpoint-every", "2", "--deterministic", "--out", str(out),
                 *RUN]) == 0
    assert main(["train", "--steps", "6", "--resume", "--no-deterministic", "--out", str(out), *RUN]) == 2
    assert "deterministic=True (this run: False)" in capsys.readouterr().err
    assert main(["train", "--steps", "6", "--resume", "--deterministic", "--out", str(out), *RUN]) == 0


def test_a_resume_may_change_group_bytes_where_the_blocks_stay_batched_as_saved(tmp_path, capsys):
    """--group-bytes only batches the blocks: a resume compares the batches themselves (the optimizer's state_dict),
    so a bound that keeps them resumes, and one that would cut a group is refused naming the bound that fits."""
    from asteria.optim.groups import preconditioner_bytes

    out = tmp_path / "run"
    assert main(["train", "--steps", "4", "--checkpoint-every", "2", "--mode", "sync", "--out", str(out),
                 *NATIVE]) == 0
    assert main(["train", "--steps", "6", "--resume", "--mode", "sync", "--group-bytes", str(2**40), "--out",
                 str(out), *NATIVE]) == 0
    three_squares = 3 * preconditioner_bytes((128, 128))  # (the tiny model's square blocks are more than three)
    assert main(["train", "--steps", "8", "--resume", "--mode", "sync", "--group-bytes", str(three_squares),
                 "--out", str(out), *NATIVE]) == 2
    assert "RuntimeConfig.stagger_split differ); MemoryConfig(group_bytes=" in capsys.readouterr().err


def test_resume_with_overwrite_resumes_a_checkpoint_or_replaces_a_run_without_one(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--optimizer", "adamw", "--steps", "3", "--out", str(out), *BASE]) == 0
    assert main(["train", "--steps", "4", "--checkpoint-every", "2", "--resume", "--overwrite", "--out", str(out),
                 *RUN]) == 0  # no checkpoint: replaced
    assert json.loads((out / "summary.json").read_text())["label"] == "shampoo-async" and steps_of(out) == [1, 2, 3, 4]
    assert main(["train", "--steps", "6", "--checkpoint-every", "2", "--resume", "--overwrite", "--out", str(out),
                 *RUN]) == 0  # a checkpoint: resumed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-000000004") and steps_of(out) == list(range(1, 7))


def test_a_native_run_may_stagger_and_resumes_only_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--mode", "sync", "--stagger", "--steps", "4", "--checkpoint-every", "2", "--out", str(out),
                 *NATIVE]) == 0
    assert main(["train", "--mode", "sync", "--steps", "6", "--resume", "--out", str(out), *NATIVE]) == 2
    assert "stagger=True (this run: None)" in capsys.readouterr().err
    assert main(["train", "--mode", "sync", "--stagger", "--steps", "6", "--resume", "--out", str(out), *NATIVE]) == 0


def test_an_unstaggered_native_run_resumes_whatever_sync_refreshes_it_was_saved_with(tmp_path):
    """`train` refuses --sync-refreshes in native mode without --stagger (it would change nothing), so a
    native run saved with another value (by the library, or before the refusal; a checkpoint older than the
    setting counts as 1) must resume without it."""
    from asteria.train.loop import RunConfig, train

    out = tmp_path / "run"
    cfg = RunConfig(mode="sync", sync_refreshes=1, steps=4, checkpoint_every=2, batch_size=4, seq_len=32,
                    eval_batches=1, max_bytes=20000, precondition_frequency=3)
    train(cfg, out)
    assert main(["train", "--mode", "sync", "--steps", "6", "--resume", "--out", str(out), *NATIVE]) == 0
    assert steps_of(out) == list(range(1, 7))


def test_a_resume_whose_metrics_were_lost_is_refused_and_keeps_the_summary(tmp_path, capsys):
    """The records of the steps before the checkpoint are kept on resume: without them the summary would be
    built from the new steps alone. Missing or damaged, they are refused by name, and the finished run's
    summary stays."""
    out = tmp_path / "run"
    assert main(["train", "--steps", "4", "--checkpoint-every", "2", "--out", str(out), *RUN]) == 0
    good, summary = (out / "metrics.jsonl").read_text(), (out / "summary.json").read_text()
    lines = good.splitlines()
    for damaged, message in ((None, "its metrics.jsonl is missing"),
                             ([lines[0], "42", *lines[2:]], "not all there (missing: 2)"),
                             ([lines[1], lines[0], *lines[2:]], "out of order or repeated")):
        if damaged is None:
            (out / "metrics.jsonl").unlink()
        else:
            (out / "metrics.jsonl").write_text("\n".join(damaged) + "\n")
        assert main(["train", "--steps", "6", "--checkpoint-every", "2", "--resume", "--out", str(out), *RUN]) == 2
        err = capsys.readouterr().err
        assert f"Invalid metrics={str(out / 'metrics.jsonl')!r}: the run resumes from step 4" in err and message in err
        assert (out / "summary.json").read_text() == summary
    (out / "metrics.jsonl").write_text(good)
    assert main(["train", "--steps", "6", "--checkpoint-every", "2", "--resume", "--out", str(out), *RUN]) == 0
    assert steps_of(out) == list(range(1, 7))


def test_checkpoints_of_an_earlier_run_are_refused_unless_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--steps", "4", "--checkpoint-every", "2", "--out", str(out), *RUN]) == 0
    assert main(["train", "--steps", "4", "--out", str(out), *RUN]) == 2
    assert "pass --resume to continue it, --overwrite to replace it" in capsys.readouterr().err
    assert main(["train", "--steps", "3", "--out", str(out), "--overwrite", *RUN]) == 0
    assert steps_of(out) == [1, 2, 3] and not (out / "checkpoints").exists()


def test_a_resume_with_fewer_steps_than_done_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--steps", "6", "--checkpoint-every", "3", "--out", str(out), *RUN]) == 0
    assert main(["train", "--steps", "4", "--resume", "--out", str(out), *RUN]) == 2
    assert "it has done 6 steps, beyond this run's steps=4; resume with --steps >= 6" in capsys.readouterr().err
    assert steps_of(out) == list(range(1, 7)) and (out / "summary.json").exists()


def test_extending_a_run_warns_that_its_lr_schedule_follows_the_new_length(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--steps", "6", "--checkpoint-every", "3", "--out", str(out), *RUN]) == 0
    with pytest.warns(UserWarning, match=r"Resuming a run of steps=6 with steps=9: its lr schedule follows the new "
                                         r"length from step 7 \(lr 0.0003 there becomes"):
        assert main(["train", "--steps", "9", "--resume", "--out", str(out), *RUN]) == 0
    assert steps_of(out) == list(range(1, 10))


def test_the_command_shows_a_warning_as_one_clean_line(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--steps", "4", "--checkpoint-every", "2", "--out", str(out), *RUN]) == 0
    done = subprocess.run([sys.executable, "-m", "asteria.train.cli", "train", "--steps", "6", "--resume",
                           "--out", str(out), *RUN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "lr schedule follows" in line]
    assert len(lines) == 1 and lines[0].startswith("asteria: UserWarning: Resuming a run of steps=4 with steps=6")
    assert "warnings.warn" not in done.stderr and "check=lambda" not in done.stderr


def test_a_refused_run_leaves_no_folder_behind(tmp_path, capsys):
    for command in ("train", "demo"):
        out = tmp_path / command / "new" / "out"
        for data in (tmp_path / "missing.txt", Path("/bin/ls")):
            assert main([command, "--data", str(data), "--steps", "2", "--out", str(out), *BASE]) == 2
            assert "Invalid data=" in capsys.readouterr().err
            assert not (tmp_path / command).exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert main(["train", "--data", str(tmp_path / "missing.txt"), "--out", str(kept), *BASE]) == 2
    assert kept.is_dir()  # a folder the user made stays


def test_a_summary_does_not_outlive_its_run(tmp_path):
    """A resumed run that dies leaves no summary of the run before it (``asteria report`` would mix them)."""
    out = tmp_path / "run"
    assert main(["train", "--steps", "6", "--checkpoint-every", "3", "--out", str(out), *RUN]) == 0
    killed = subprocess.run(child(["train", "--steps", "9", "--resume", "--out", str(out), *RUN]),
                            env=child_env(ASTERIA_TEST_KILL="train-step@8"), capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (out / "summary.json").exists()
    assert main(["train", "--steps", "9", "--resume", "--out", str(out), *RUN]) == 0
    assert json.loads((out / "summary.json").read_text())["steps_done"] == 9


@pytest.mark.parametrize("argv, message", [
    (["--mode", "sync", "--lag-steps", "2"], "Invalid --lag-steps 2 with --mode sync: native mode computes"),
    (["--mode", "sync", "--staleness", "3"], "Invalid --staleness 3 with --mode sync"),
    (["--mode", "sync", "--workers", "2"], "Invalid --workers 2 with --mode sync"),
    (["--mode", "sync", "--sync-refreshes", "3"], "Invalid --sync-refreshes 3 with --mode sync: native mode "
                                                  "computes every refresh inside its step and uses it there (and "
                                                  "aligns a --stagger after the first --sync-refreshes)"),
    (["--optimizer", "adamw", "--precondition-frequency", "5"], "Invalid --precondition-frequency 5 with --optimizer "
                                                                "adamw: AdamW has no preconditioners; leave it out"),
    (["--optimizer", "adamw", "--workers", "2"], "Invalid --workers 2 with --optimizer adamw"),
    (["--mode", "sync", "--device-sms", "16"], "Invalid --device-sms 16 with --mode sync: native mode computes"),
    (["--optimizer", "adamw", "--device-sms", "16"], "Invalid --device-sms 16 with --optimizer adamw"),
    (["--mode", "sync", "--device-threads", "2"], "Invalid --device-threads 2 with --mode sync"),
    (["--mode", "sync", "--express-workers", "2"], "Invalid --express-workers 2 with --mode sync"),
    (["--express-workers", "-1"], "Invalid express_workers=-1: must be None (as many as the workers) or an int >= 0"),
    (["--stream-priority", "-1"], "Invalid stream_priority=-1: must be an int in [-64, 0] (CUDA stream priorities: "
                                  "0 the lowest; torch clamps to the GPU's range), and 0 with device='cpu'"),
    (["--device-sms", "0"], "Invalid device_sms=0: must be None (the whole GPU) or an int >= 1"),
    (["--device-sms", "16"], "Invalid device_sms=16: partitions a GPU for the device lane, and the lane does not run"),
    (["--optimizer", "adamw", "--prefetch", "step"], "Invalid --prefetch step with --optimizer adamw"),
    (["--optimizer", "adamw", "--max-preconditioner-dim", "64"], "Invalid --max-preconditioner-dim 64 with"),
    (["--optimizer", "adamw", "--start-preconditioning-step", "1"], "Invalid --start-preconditioning-step 1 with"),
    (["--optimizer", "kl-shampoo", "--start-preconditioning-step", "1"],
     "Invalid start_preconditioning_step=1: must be None (the optimizer's own) or an int >= 1, and None for "
     "kl-shampoo"),
    (["--optimizer", "adamw", "--precondition-1d"], "Invalid --precondition-1d with --optimizer adamw"),
    (["--optimizer", "adamw", "--first-basis", "qr"], "Invalid --first-basis qr with --optimizer adamw"),
    (["--optimizer", "kl-shampoo", "--no-precondition-1d"], "Invalid precondition_1d=False: must be None"),
    (["--keep-checkpoints", "3"], "Invalid --keep-checkpoints 3 without --checkpoint-every: it bounds"),
    (["--mode", "sync", "--stagger-split"], "Invalid --stagger-split with --mode sync without --stagger: it sets"),
    (["--optimizer", "adamw", "--no-stagger"], "Invalid --no-stagger with --optimizer adamw"),
    (["--parallel", "fsdp"], "Invalid --parallel fsdp on one process: it sets how torchrun's processes"),
    (["--parallel", "hsdp"], "Invalid --parallel hsdp on one process: it sets how torchrun's processes"),
    (["--mode", "sync", "--no-deterministic"], "Invalid --no-deterministic with --mode sync"),
    (["--optimizer", "adamw", "--deterministic"], "Invalid --deterministic with --optimizer adamw"),
    (["--optimizer", "ds-shampoo", "--lag-steps", "2"],
     "Invalid --lag-steps 2 with --optimizer ds-shampoo: it computes"),
    (["--optimizer", "hb-soap", "--peer-path", "/nowhere"], "Invalid --peer-path /nowhere with --optimizer hb-soap"),
    (["--optimizer", "adamw", "--stagger-split"], "Invalid --stagger-split with --optimizer adamw"),
    (["--optimizer", "adamw", "--stagger-sets-per-step", "1"], "Invalid --stagger-sets-per-step 1 with --optimizer"),
    (["--mode", "sync", "--stagger-sets-per-step", "1"], "Invalid --stagger-sets-per-step 1 with --mode sync without"),
    (["--stagger-sets-per-step", "0"], "Invalid stagger_sets_per_step=0: must be an int in [1, 64]"),
    (["--optimizer", "adamw", "--no-stagger-small"], "Invalid --no-stagger-small with --optimizer adamw"),
    (["--mode", "sync", "--stagger-small"], "Invalid --stagger-small with --mode sync without --stagger"),
    (["--no-stagger", "--stagger-small"], "Invalid stagger_small=True: must be None, True or False, and True only"),
    (["--optimizer", "adamw", "--no-deterministic", "--late-activation"], "Invalid --late-activation with"),
    (["--optimizer", "adamw", "--stagger"], "Invalid --stagger with --optimizer adamw"),
    (["--mode", "sync", "--placement", "host"], "Invalid --placement host with --mode sync: native mode keeps"),
    (["--optimizer", "adamw", "--placement", "device_view"], "Invalid --placement device_view with --optimizer"),
    (["--seed", str(2**32)], "Invalid seed=4294967296: must be below 2**32"),
    (["--staleness", "1000000"], "Invalid staleness=1000000: must be at most 1000"),
    (["--precondition-frequency", "10000000"], "Invalid precondition_frequency=10000000: must be at most"),
    (["--batch-size", "64", "--seq-len", "256", "--max-bytes", "5000"], "Invalid batch_size=64: data=None gives"),
])
def test_options_a_run_would_ignore_or_cannot_hold_are_refused(argv, message, tmp_path, capsys):
    assert main(["train", "--steps", "2", "--out", str(tmp_path / "run"), *BASE, *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("argv", [
    ["--mode", "sync", "--stagger", "--sync-refreshes", "3", "--stagger-split", "--precondition-frequency", "4",
     "--prefetch", "step", "--max-preconditioner-dim", "64"],
    ["--mode", "async", "--staleness", "2", "--workers", "3", "--lag-steps", "4", "--sync-refreshes", "1"],
    ["--mode", "async", "--no-deterministic", "--late-activation", "--no-stagger", "--no-stagger-split"],
    ["--mode", "sync", "--stagger", "--no-stagger-small", "--stagger-sets-per-step", "3"],
    ["--optimizer", "adamw", "--mode", "sync", "--placement", "auto"],
    ["--checkpoint-every", "5", "--keep-checkpoints", "3", "--parallel", "ddp"],
])
def test_options_a_run_reads_are_accepted(argv):
    from dataclasses import fields

    from asteria.train.cli import build_parser, check_unused_options, run_config_from_args
    from asteria.train.loop import RunConfig

    args = build_parser().parse_args(["train", "--out", "OUT", *argv])
    given = {f.name for f in fields(RunConfig) if getattr(args, f.name) is not None}
    check_unused_options(run_config_from_args(args), given)


def test_out_must_be_a_folder(tmp_path, capsys):
    existing = tmp_path / "file"
    existing.write_text("keep me")
    for out in ("", str(existing), str(existing / "run")):
        with pytest.raises(SystemExit) as exit_:
            main(["train", "--steps", "2", "--out", out, *RUN])
        assert exit_.value.code == 2
        assert f"invalid --out={out!r}" in capsys.readouterr().err
    assert existing.read_text() == "keep me"


def test_binary_data_is_refused_or_skipped(tmp_path, capsys):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 64)
    assert main(["train", "--steps", "2", "--data", str(blob), "--out", str(tmp_path / "a"), *RUN]) == 2
    assert "not a text file (a NUL byte in its first 8 KiB)" in capsys.readouterr().err
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "image.png").write_bytes(blob.read_bytes())
    (folder / "text.txt").write_text("a line of plain text\n" * 400)
    assert main(["train", "--steps", "2", "--data", str(folder), "--out", str(tmp_path / "b"), *RUN]) == 0
    (folder / "text.txt").unlink()
    assert main(["train", "--steps", "2", "--data", str(folder), "--out", str(tmp_path / "c"), *RUN]) == 2
    assert "0 bytes of text (1 binary files skipped)" in capsys.readouterr().err


def interrupt_when_training(argv: list[str], out: Path) -> tuple[int, str]:
    """Starts ``asteria`` in a child, sends it SIGINT once its first steps are logged, returns its exit code
    and stderr."""
    process = subprocess.Popen(child(argv), env=child_env(), stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # until it trains (metrics logged), at most 60 s
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            try:
                process.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    return process.returncode, err


@pytest.mark.parametrize("checkpoints", [False, True, "rare"])
def test_ctrl_c_ends_with_a_hint_and_no_traceback(tmp_path, checkpoints):
    """With checkpoints, also where the step it stops after is not one of them: that step is checkpointed, so that
    --resume goes on from it rather than redo the steps since the last checkpoint."""
    out = tmp_path / "run"
    extra = {False: [], True: ["--checkpoint-every", "1"], "rare": ["--checkpoint-every", "100000"]}[checkpoints]
    code, err = interrupt_when_training(["train", "--steps", "100000", "--out", str(out), *RUN, *extra], out)
    assert code == 130
    hint = "(pass --resume to continue" if checkpoints else "(no checkpoint to resume from: --overwrite starts it"
    assert "asteria: stopping after this step" in err and f"asteria: interrupted {hint}" in err
    assert "Traceback" not in err and "leaked" not in err
    if checkpoints:  # stopped between steps: no checkpoint cut short, and the last step's there
        assert not list((out / "checkpoints").glob(".tmp-*"))
        newest = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
        assert newest == steps_of(out)[-1]


def test_ctrl_c_in_a_bench_still_compares_the_configs_it_finished(tmp_path):
    """Ctrl-C in a bench's second config: the first one's results are written and printed, the second is named
    as interrupted with the steps it recorded (they stay in its folder), and an earlier bench's results.json,
    which would read as this one's, is gone."""
    out = tmp_path / "bench"
    out.mkdir()
    (out / "results.json").write_text('{"runs": {"stale": {}}}')
    (out / "report.md").write_text("an earlier bench's report")
    argv = ["bench", "--steps", "200", "--configs", "adamw", "shampoo-async", "--out", str(out), *RUN]
    code, err = interrupt_when_training(argv, out / "shampoo-async")
    assert code == 130 and "Traceback" not in err
    results = json.loads((out / "results.json").read_text())
    assert list(results["runs"]) == ["adamw"] and results["runs"]["adamw"]["mean_step_seconds"] > 0
    recorded = steps_of(out / "shampoo-async")
    assert 3 <= len(recorded) < 200
    assert results["failed"] == {"shampoo-async": f"interrupted after {len(recorded)} recorded steps"}
    assert f"asteria: interrupted (the configs it finished: {out / 'results.json'})" in err
    assert "adamw" in (out / "report.md").read_text() and not (out / ".results.json.tmp").exists()


def test_version_and_help_name_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"asteria {asteria.__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for choices in ("one of adamw, shampoo, soap, kl-shampoo", "one of tiny, olmo-160m", "one of sync, async",
                    "one of auto, device, host, device_view", "one of forward_start, forward_end, step"):
        assert choices in text
    assert "[default: None]" not in text.split("--lr ")[1].split("--lr-schedule")[0]  # its help says it once
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out


def test_a_torchrun_worker_leaves_without_finalization_and_keeps_its_status_and_output(tmp_path):
    """Under torchrun the command ends through os._exit once its output is flushed (a Gloo thread releasing a
    collective's tensors during the interpreter's finalization would abort a finished run): the exit status
    and everything printed survive, and nothing registered for the interpreter's exit runs."""
    script = ("import atexit, sys\n"
              "atexit.register(lambda: print('finalized', flush=True))\n"
              "from asteria.train.cli import main\n"
              "print('before', end='')\n"  # unflushed: _leave must flush it
              f"sys.argv = ['asteria', 'report', {str(tmp_path)!r}]\n"
              "main()\n"
              "print('not reached')\n")
    env = child_env(WORLD_SIZE="2", RANK="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "before"
    assert "Invalid command='report' under torchrun (WORLD_SIZE=2)" in done.stderr
    # On one process the same call returns its status to the caller and the interpreter finalizes as usual.
    done = subprocess.run([sys.executable, "-c", script], env=child_env(WORLD_SIZE="1"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("before") and done.stdout.endswith("not reached\nfinalized\n")
