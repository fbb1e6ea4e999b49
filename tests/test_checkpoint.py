"""Training checkpoints: atomic publish, validation, crash safety under SIGKILL (mid-step and
mid-checkpoint, through the test-only ``ASTERIA_TEST_KILL`` hook) and bitwise resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asteria.train import checkpoint
from asteria.train.checkpoint import CheckpointError, Manifest, pack, parse_manifest, unpack
from asteria.train.cli import main

# 10 steps of the tiny model, a checkpoint every 4 steps: published at 4 and 8.
# AdamW's options; RUN adds those of an async second-order run (`train` refuses the options a run would
# not read).
PLAIN = ["--steps", "10", "--batch-size", "4", "--seq-len", "32", "--eval-every", "5", "--max-bytes", "200000",
         "--checkpoint-every", "4", "--keep-checkpoints", "0", "--eval-batches", "1", "--device", "cpu"]
# The deterministic rule: a resumed run continues bit for bit.
RUN = [*PLAIN, "--precondition-frequency", "3", "--staleness", "1", "--workers", "1", "--deterministic"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread, here and in the killed subprocesses: the same arithmetic in both (bitwise
    comparison across processes), and no OpenMP spinning on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def optimizer_args(label: str) -> list[str]:
    optimizer, mode = ("adamw", "sync") if label == "adamw" else label.rsplit("-", 1)
    return ["--optimizer", optimizer, "--mode", mode]


def run_args(label: str) -> list[str]:
    """A config's run: its optimizer and the options it reads."""
    return [*(PLAIN if label == "adamw" else RUN), *optimizer_args(label)]


def spawn_killed(run: Path, label: str, kill_at: str) -> subprocess.Popen:
    env = dict(os.environ, ASTERIA_TEST_KILL=kill_at, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "asteria.train.cli", "train", "--out", str(run), *run_args(label)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_optimizer_args():
    assert optimizer_args("adamw") == ["--optimizer", "adamw", "--mode", "sync"]
    assert optimizer_args("soap-async") == ["--optimizer", "soap", "--mode", "async"]
    assert optimizer_args("kl-shampoo-async") == ["--optimizer", "kl-shampoo", "--mode", "async"]


KILLS = {
    "adamw": ("train-step@7", 4),                  # killed inside step 7 (after backward, before the update)
    "soap-async": ("checkpoint-shards@8", 4),      # DCP data of step 8 written, no manifest yet
    "shampoo-async": ("checkpoint-manifest@8", 4),  # manifest of step 8 written, not yet published
}


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """The three runs to be killed, started together (they spend most of their time importing)."""
    root = tmp_path_factory.mktemp("killed")
    procs = {label: spawn_killed(root / label, label, kill_at) for label, (kill_at, _) in KILLS.items()}
    yield root, procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("label", list(KILLS))
def test_sigkill_then_resume_is_bitwise_identical(tmp_path, killed_runs, label):
    kill_at, last_complete = KILLS[label]
    root, procs = killed_runs
    # The uninterrupted reference run, in this process.
    assert main(["train", "--out", str(tmp_path / "reference"), *run_args(label)]) == 0
    output, _ = procs[label].communicate(timeout=300)
    assert procs[label].returncode == -signal.SIGKILL, output
    run = root / label

    ckpts = run / "checkpoints"
    assert [p.name for p in checkpoint.published(ckpts)] == [f"step-{last_complete:09d}"]
    if kill_at.startswith("checkpoint"):
        partial = ckpts / ".tmp-step-000000008"
        assert partial.is_dir() and (partial / "manifest.json").exists() == kill_at.startswith("checkpoint-manifest")

    assert main(["train", "--out", str(run), *run_args(label), "--resume"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step-{last_complete:09d}")
    assert not (ckpts / ".tmp-step-000000008").exists()  # the half-written one was discarded, never read
    reference = losses(tmp_path / "reference")
    assert [s for s, _ in reference] == list(range(1, 11))
    assert losses(run) == reference  # every loss bit for bit, before and after the crash
    assert [p.name for p in checkpoint.published(ckpts)] == ["step-000000004", "step-000000008"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished")
    assert main(["train", "--out", str(run), *RUN, "--optimizer", "kl-shampoo", "--mode", "async"]) == 0
    return run


def test_resume_into_another_configuration_is_refused(finished, capsys, tmp_path):
    native = [*PLAIN, "--precondition-frequency", "3", "--optimizer", "kl-shampoo", "--mode", "sync"]
    for flags, named in ((run_args("adamw"), "optimizer='kl-shampoo' (this run: 'adamw')"),
                         (native, "mode='async' (this run: 'sync')"),
                         ([*run_args("kl-shampoo-async"), "--seq-len", "16"], "seq_len=32 (this run: 16)")):
        assert main(["train", "--out", str(finished), *flags, "--resume"]) == 2
        err = capsys.readouterr().err
        assert "Invalid checkpoint=" in err and named in err, err
    # A fresh run into a directory with checkpoints needs --resume.
    assert main(["train", "--out", str(finished), *RUN, "--optimizer", "kl-shampoo"]) == 2
    assert f"Invalid out={str(finished)!r}" in capsys.readouterr().err


def test_a_refused_resume_closes_the_optimizer_it_made(finished, capsys, monkeypatch):
    # The optimizer is made before the checkpoint is read: a refusal must still stop its workers and put
    # back the torch thread count they capped (a leaked one capped every later test's threads).
    from asteria.train import loop
    made, real = [], loop.make_optimizer
    monkeypatch.setattr(loop, "make_optimizer", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    argv = ["train", "--out", str(finished), *RUN, "--optimizer", "kl-shampoo", "--mode", "async", "--seq-len", "16",
            "--resume"]
    assert main(argv) == 2 and "seq_len=32 (this run: 16)" in capsys.readouterr().err
    assert len(made) == 1 and not made[0]._finalizer.alive  # closed, not left to the garbage collector


def test_resume_of_a_finished_run_extends_it(finished, tmp_path, capsys):
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(finished), str(copy)], check=True)
    longer = [*RUN[:1], "12", *RUN[2:]]
    # A profiled range wholly before the resume point (step 8) would capture nothing: refused, the run untouched.
    before = {name: (copy / name).read_bytes() for name in ("metrics.jsonl", "summary.json")}
    assert main(["train", "--out", str(copy), *longer, "--optimizer", "kl-shampoo", "--mode", "async", "--resume",
                 "--profile-steps", "2", "8"]) == 2
    assert ("Invalid profile_steps=(2, 8): the run resumes after step 8, so none of the range's steps would run"
            in capsys.readouterr().err)
    assert {name: (copy / name).read_bytes() for name in before} == before
    assert main(["train", "--out", str(copy), *longer, "--optimizer", "kl-shampoo", "--mode", "async", "--resume"]) == 0
    steps = [s for s, _ in losses(copy)]
    assert steps == list(range(1, 13))
    assert losses(copy)[:8] == losses(finished)[:8]
    assert [p.name for p in checkpoint.published(copy / "checkpoints")] == [
        "step-000000004", "step-000000008", "step-000000012"]


def test_corrupt_checkpoint_is_refused_with_the_file_named(finished, tmp_path, capsys):
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(finished), str(copy)], check=True)
    newest = checkpoint.published(copy / "checkpoints")[-1]
    data = newest / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    argv = ["train", "--out", str(copy), *RUN, "--optimizer", "kl-shampoo", "--mode", "async", "--resume"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"Invalid checkpoint={str(newest)!r}" in err and "__0_0.distcp fails its SHA-256 check" in err
    intact = checkpoint.published(copy / "checkpoints")[-2]
    assert f"the newest intact checkpoint is {str(intact)!r}: move {newest.name} out of" in err
    assert checkpoint.newest_intact(checkpoint.published(copy / "checkpoints")) == intact
    data.write_bytes(bytes(raw[:100]))
    assert main(argv) == 2
    assert "__0_0.distcp has 100 bytes" in capsys.readouterr().err
    (newest / "manifest.json").write_text('{"format": "asteria.checkpoint.v1", "step": 8')
    assert main(argv) == 2
    assert "manifest: not UTF-8 JSON" in capsys.readouterr().err
    (newest / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        checkpoint.verify(newest)
    # Moved aside as the message says, the run resumes from the intact one and trains the rest again.
    newest.rename(tmp_path / "aside")
    assert main(argv) == 0
    assert losses(copy) == losses(finished)


def test_checkpoint_records_rank_world_size_and_config(finished):
    newest = checkpoint.published(finished / "checkpoints")[-1]
    manifest = checkpoint.verify(newest)
    assert manifest.step == 8 and manifest.world_size == 1
    assert manifest.config["optimizer"] == "kl-shampoo" and manifest.config["staleness"] == 1
    assert set(manifest.files) == {".metadata", "__0_0.distcp"}
    loaded = checkpoint.load(newest)
    assert loaded.rank_state["rank"] == 0 and loaded.rank_state["world_size"] == 1
    assert loaded.rank_state["loop"]["step"] == 8 and loaded.rank_state["loop"]["cursor"] == 8 * 4
    assert loaded.rank_state["optimizer"]["format"] == "asteria.v1"
    assert any(k.startswith("lm.model.layers.0.") for k in loaded.model_state)


def test_pack_round_trips_exactly():
    state = {"a": torch.randn(3, 4), 0: {"b": (1, 2.5, None, True)}, "$x": [np.arange(3), np.int64(7)],
             "f": [float("inf"), float("nan"), 1e-300, 0.1], "empty": torch.zeros(0, 3)}
    tensors: list[torch.Tensor] = []
    skeleton = json.loads(json.dumps(pack(state, tensors)))
    back = unpack(skeleton, dict(enumerate(tensors)))
    assert torch.equal(back["a"], state["a"]) and back[0] == {"b": (1, 2.5, None, True)}
    assert np.array_equal(back["$x"][0], np.arange(3)) and back["$x"][1] == 7 and isinstance(back["$x"][1], np.int64)
    assert back["f"][0] == float("inf") and back["f"][1] != back["f"][1] and back["f"][2:] == [1e-300, 0.1]
    assert back["empty"].shape == (0, 3)
    with pytest.raises(TypeError, match="cannot checkpoint a set"):
        pack({"s": {1, 2}}, [])


def test_manifest_parser_names_what_is_wrong():
    good = Manifest(checkpoint.FORMAT, 3, 1, {".metadata": checkpoint.FileEntry(5, "0" * 64)}, {"x": 1})
    assert parse_manifest(good.to_json().encode()) == good
    doc = json.loads(good.to_json())
    cases = [
        ({**doc, "format": "v0"}, "format='v0'"),
        ({**doc, "step": -1}, "step=-1"),
        ({**doc, "step": True}, "step=True"),
        ({**doc, "world_size": 0}, "world_size=0"),
        ({**doc, "files": {}}, "files={}"),
        ({**doc, "files": {"../etc/passwd": {"size": 1, "sha256": "0" * 64}}}, "not a plain data file name"),
        ({**doc, "files": {"a": {"size": 1, "sha256": "xyz"}}}, "sha256 of 'a'"),
        ({**doc, "files": {"a": {"size": -2, "sha256": "0" * 64}}}, "size of 'a' is -2"),
        ({k: v for k, v in doc.items() if k != "config"}, "missing 'config'"),
        ([1, 2], "top level is list"),
    ]
    for bad, message in cases:
        with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
            parse_manifest(json.dumps(bad).encode())
    for raw in (b"\xff\xfe", b"[" * 100_000, b"1" * 5000, b" " * (2 << 20)):
        with pytest.raises(CheckpointError):
            parse_manifest(raw)


@pytest.fixture
def small_filesystem(tmp_path):
    """A 2 MiB tmpfs (as root; skipped where mount is refused): a disk that really fills up."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs a small filesystem: mounting a tmpfs (as root) was refused")
    yield where
    subprocess.run(["umount", str(where)], check=False)


def test_a_checkpoint_onto_a_full_disk_names_the_path_and_enospc(small_filesystem, capsys):
    """The checkpoint of step 2 does not fit: the command ends with ENOSPC, the path and the bytes (not torch's
    "unexpected pos"), and leaves no partial folder behind."""
    out = small_filesystem / "run"
    argv = ["train", "--out", str(out), *PLAIN, "--optimizer", "adamw", "--mode", "sync"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "[Errno 28] No space left on device: the checkpoint of step 4 needs about" in error
    assert "the checkpoints published before are intact" in error and ".tmp-step-000000004" in error
    assert not (out / "checkpoints" / ".tmp-step-000000004").exists()
