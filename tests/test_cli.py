"""The asteria command end to end on the CPU at tiny size: demo, train, report, bench, and clear errors
for bad input. (Checkpoints and resume: test_checkpoint.py; the sweep and seeds tools: test_tools.py.)"""

from __future__ import annotations

import gzip
import json
import math
import os
import statistics
import sys
import threading

import pytest
import torch

from asteria.train.cli import main
from asteria.train.report_plots import plot_loss, plot_step_times
from asteria.train.runs import load_run

PLAIN = ["--batch-size", "4", "--seq-len", "32", "--eval-batches", "1", "--max-bytes", "200000", "--device", "cpu"]
BASE = [*PLAIN, "--precondition-frequency", "3", "--workers", "1"]
TINY = [*BASE, "--staleness", "1"]


pytestmark = pytest.mark.usefixtures("one_thread")


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_demo_writes_runs_and_report(tmp_path):
    assert main(["demo", "--out", str(tmp_path), "--steps", "12", "--eval-every", "6", *TINY]) == 0
    for label in ("adamw", "shampoo-async"):
        summary = json.loads((tmp_path / label / "summary.json").read_text())
        assert summary["label"] == label and summary["final_loss"] < summary["initial_loss_bound"] == math.log(256)
        assert summary["vocab_size"] == 256 and summary["parameters"] > 100_000
        rows = records(tmp_path / label)
        assert [r["step"] for r in rows] == list(range(1, 13)) and "val_loss" in rows[5] and "val_loss" not in rows[4]
        assert all(r["rss_bytes"] > 0 and r["step_time"] > 0 for r in rows)
        assert ("staleness" in rows[0]) == (label != "adamw")
        assert any((tmp_path / label / "tensorboard").iterdir())
    report = (tmp_path / "report.md").read_text()
    assert "| adamw |" in report and "| shampoo-async |" in report
    assert (tmp_path / "loss.png").stat().st_size > 1000 and (tmp_path / "step_time.png").stat().st_size > 1000
    # The story: a verdict first, what each run was, steps to AdamW's loss, and the start-up read as such.
    figures = json.loads((tmp_path / "report.json").read_text())
    assert report.splitlines()[2] == f"**Verdict:** {figures['verdict'][0]}"
    assert figures["verdict"][0].startswith("shampoo-async ") and "AdamW's final loss" in figures["verdict"][0]
    assert "| adamw | adamw | - | tiny (0.59M parameters) | - | - | - |" in report
    assert "| shampoo-async | shampoo | async | tiny (0.59M parameters) | 1 | 3 | 2 |" in report  # S, f, sync refreshes
    header = next(line for line in report.splitlines() if line.startswith("| run | steps |")).split(" | ")
    for name, row in figures["runs"].items():
        cells = next(line for line in report.splitlines() if line.startswith(f"| {name} | 12 |")).split(" | ")
        assert cells[header.index("steps to AdamW's loss")] == str(row["steps_to_target"] or "n/a")
    assert figures["runs"]["adamw"]["steps_to_target"] is not None  # AdamW's own step count to its final loss
    assert "shampoo-async waits for its first 2 refreshes of every factor set at steps 3 and 6" in report
    runs = [load_run(tmp_path / label) for label in ("adamw", "shampoo-async")]
    assert plot_loss(runs, ["adamw", "shampoo-async"], tmp_path / "loss.png", 10) == [
        "training loss vs step (10-step mean)", "validation loss vs step", "training loss vs wall clock"]  # no energy
    startups = [figures["runs"][label]["startup"] for label in ("adamw", "shampoo-async")]
    assert startups == [None, {"steps": 9, "refresh_steps": [3, 6]}]
    assert "start-up of shampoo-async (steps 1-9)" in plot_step_times(runs, ["adamw", "shampoo-async"],
                                                                      tmp_path / "step_time.png", startups)


def test_train_follows_the_lr_schedule_and_clips_gradients(tmp_path):
    common = ["train", "--optimizer", "adamw", "--steps", "10", "--warmup-steps", "4", "--lr", "0.01", *PLAIN]
    assert main([*common, "--out", str(tmp_path / "free"), "--grad-clip", "0"]) == 0
    rows = records(tmp_path / "free")
    assert [r["lr"] for r in rows[:4]] == pytest.approx([0.002, 0.004, 0.006, 0.008])
    assert 0.009 < rows[4]["lr"] < 0.01 and rows[-1]["lr"] == pytest.approx(0.001)
    # A clip far below the gradients' norm leaves Adam's steps at the eps floor: the loss barely moves.
    assert main([*common, "--out", str(tmp_path / "clipped"), "--grad-clip", "1e-12"]) == 0
    clipped = records(tmp_path / "clipped")
    assert clipped[0]["loss"] == pytest.approx(rows[0]["loss"])
    assert abs(clipped[-1]["loss"] - clipped[0]["loss"]) < 0.2 * abs(rows[-1]["loss"] - rows[0]["loss"])


def test_profile_steps_trace_exactly_those_steps(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--optimizer", "soap", "--mode", "async", "--steps", "5", "--profile-steps", "2", "3",
                 "--out", str(run), *TINY]) == 0
    with gzip.open(run / "trace-rank0.json.gz", "rt") as handle:
        names = {e.get("name") for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"}
    assert {"step 2", "step 3"} <= names and not {"step 1", "step 4", "step 5"} & names
    assert any(name.startswith("Optimizer.step") for name in names)  # the optimizer's own range is inside
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4, 5]


def test_report_table_target_and_energy(tmp_path):
    assert main(["demo", "--out", str(tmp_path), "--steps", "8", "--eval-every", "4", *TINY]) == 0
    runs = [str(tmp_path / "adamw"), str(tmp_path / "shampoo-async")]
    assert main(["report", *runs, "--out", str(tmp_path / "r1")]) == 0
    figures = json.loads((tmp_path / "r1" / "report.json").read_text())
    adamw = json.loads((tmp_path / "adamw" / "summary.json").read_text())
    assert figures["target_loss"] == adamw["final_loss"] and figures["reference"] == "adamw"
    for name, row in figures["runs"].items():
        assert row["initial_loss"] == math.log(256)
        assert row["energy_joules"] is None and row["efficiency"] is None  # the CPU has no energy counter
        if row["time_to_target_seconds"] is not None:
            reached = next(r for r in records(tmp_path / name) if r["step"] == row["steps_to_target"])
            assert reached["wall"] == row["time_to_target_seconds"]
    assert figures["runs"]["adamw"]["steps_to_target"] is not None  # its own trailing mean reaches it
    table = (tmp_path / "r1" / "report.md").read_text()
    assert "AdamW's final loss" in table and "| n/a | n/a |" in table  # energy/step and efficiency
    # An explicit target nobody reaches: n/a, not a made-up time.
    assert main(["report", *runs, "--out", str(tmp_path / "r2"), "--target-loss", "0.01"]) == 0
    figures = json.loads((tmp_path / "r2" / "report.json").read_text())
    assert figures["target_loss"] == 0.01
    assert all(row["time_to_target_seconds"] is None for row in figures["runs"].values())
    assert (tmp_path / "r2" / "loss.png").stat().st_size > 1000


def fake_run(folder, label: str, losses: list[float], **summary) -> str:
    """A finished run's files as `asteria train` leaves them (what the reports read)."""
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": i + 1, "loss": loss, "wall": 0.1 * (i + 1), "step_time": 0.1})
             for i, loss in enumerate(losses)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "summary.json").write_text(json.dumps({"label": label, "device": "cpu", "vocab_size": 256,
                                                     "final_loss": losses[-1]} | summary))
    return str(folder)


@pytest.mark.parametrize("edit, message", [
    (lambda s, r: ([], r), "summary.json holds a list, not an object"),
    (lambda s, r: ({k: v for k, v in s.items() if k != "label"}, r), "summary.json's label='(missing)': must be"),
    (lambda s, r: (s | {"final_loss": "5.2"}, r), "summary.json's final_loss='5.2': must be a number"),
    (lambda s, r: (s | {"vocab_size": 0}, r), "summary.json's vocab_size=0: must be an int >= 2"),
    (lambda s, r: (s | {"runtime_stats": None, "config": []}, r), "summary.json's config=[]: must be an object"),
    (lambda s, r: (s, r[:1] + [5] + r[2:]), "metrics.jsonl line 2 holds 5, not an object"),
    (lambda s, r: (s, r[:2] + [{k: v for k, v in r[2].items() if k != "wall"}]),
     "metrics.jsonl line 3: wall='(missing)'"),
    (lambda s, r: (s, [r[0] | {"step": "1"}] + r[1:]), "metrics.jsonl line 1: step='1': must be an int >= 1"),
    (lambda s, r: (s, [r[0] | {"step_time": None}] + r[1:]), "metrics.jsonl line 1: step_time=None: must be a number"),
])
def test_report_names_what_it_cannot_read_in_a_run(tmp_path, capsys, edit, message):
    run = tmp_path / "run"
    fake_run(run, "adamw", [3.0, 2.5, 2.0])
    summary = json.loads((run / "summary.json").read_text())
    rows = records(run)
    summary, rows = edit(summary, rows)
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 2
    assert f"asteria: error: Invalid run={str(run)!r}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out" / "loss.png").exists()  # refused before anything is written


def test_report_of_a_diverged_adamw_run_takes_no_target_from_it(tmp_path):
    runs = [fake_run(tmp_path / "adamw", "adamw", [3.0, float("nan")]),
            fake_run(tmp_path / "soap", "soap-async", [3.0, 2.0], device="GPU X")]
    assert main(["report", *runs, "--out", str(tmp_path / "out")]) == 0
    figures = json.loads((tmp_path / "out" / "report.json").read_text())
    assert figures["target_loss"] is None and figures["reference_diverged"]
    assert figures["device"] == "cpu, GPU X"  # runs of several devices: every one named
    table = (tmp_path / "out" / "report.md").read_text()
    assert "Target loss: n/a (AdamW's run diverged: its final loss is not finite; give --target-loss)" in table
    assert figures["verdict"] == ["AdamW's run diverged (its final loss is not finite), so there is no loss to reach: "
                                  "give --target-loss."]
    assert main(["report", *runs, "--out", str(tmp_path / "out2"), "--target-loss", "2.5"]) == 0
    assert json.loads((tmp_path / "out2" / "report.json").read_text())["runs"]["soap-async"]["steps_to_target"] == 2


def test_report_verdict_says_what_the_figures_hold(tmp_path):
    """Steps to AdamW's final loss and what the median step makes of them in wall clock; a run that never gets
    there, a report without AdamW and one with a target are said as such."""
    adamw = fake_run(tmp_path / "adamw", "adamw", [5.0, 4.0, 3.0, 2.0], final_loss=3.5, median_step_seconds=0.1)
    fast = fake_run(tmp_path / "fast", "shampoo-async", [5.0, 2.5, 1.0, 1.0], final_loss=2.375,
                    median_step_seconds=0.3)
    slow = fake_run(tmp_path / "slow", "soap-async", [5.0, 4.5, 4.0, 3.9], final_loss=4.35, median_step_seconds=0.2)
    assert main(["report", adamw, fast, slow, "--out", str(tmp_path / "all")]) == 0
    figures = json.loads((tmp_path / "all" / "report.json").read_text())
    assert [figures["runs"][name]["steps_to_target"] for name in figures["runs"]] == [4, 3, None]
    assert figures["verdict"] == [
        "shampoo-async reached AdamW's final loss (3.5000) at step 3 of 4, AdamW at step 4: 25% fewer steps. Its "
        "median step took 3.00x AdamW's on this CPU, so at median step times it needed 2.25x AdamW's time to get "
        "there: slower in wall clock (measured: 0.3 s vs 0.4 s, which also counts start-up and uneven steps; see "
        "steady max/median).",
        "soap-async did not reach AdamW's final loss (3.5000) in its 4 steps (its final loss: 4.3500). Its median "
        "step took 2.00x AdamW's on this CPU."]
    report = (tmp_path / "all" / "report.md").read_text()
    assert "**Verdict:**\n\n- shampoo-async reached" in report and "\n- soap-async did not reach" in report
    assert "| soap-async | 4 | 4.3500 | n/a | n/a | n/a |" in report  # steps and time to AdamW's loss
    assert "| soap-async | n/a | n/a | n/a | n/a | n/a | n/a |" in report  # a summary without config: no settings
    assert main(["report", fast, slow, "--out", str(tmp_path / "none")]) == 0
    assert json.loads((tmp_path / "none" / "report.json").read_text())["verdict"] == [
        "No AdamW run among these runs and no --target-loss, so there is no loss to reach; the table gives each "
        "run's own figures."]
    assert main(["report", fast, slow, "--out", str(tmp_path / "target"), "--target-loss", "3"]) == 0
    assert json.loads((tmp_path / "target" / "report.json").read_text())["verdict"] == [
        "shampoo-async reached the target loss 3.0000 at step 3 of 4.",
        "soap-async did not reach the target loss 3.0000 in its 4 steps (its final loss: 4.3500)."]
    assert "| steps to target | time to target (s) |" in (tmp_path / "target" / "report.md").read_text()


def test_report_figures_draw_only_the_panels_with_data(tmp_path):
    """No energy readings (a CPU): no energy panel; no eval records: no validation panel."""
    plain = load_run(fake_run(tmp_path / "plain", "adamw", [5.0, 4.0, 3.0]))
    assert plot_loss([plain], ["adamw"], tmp_path / "plain.png", 10, 3.5, "target loss") == [
        "training loss vs step (10-step mean)", "training loss vs wall clock"]
    measured = load_run(fake_run(tmp_path / "measured", "soap-async", [5.0, 4.0, 3.0]))
    measured.records = [r | {"energy_joules": 2.0} | ({"val_loss": 3.2} if r["step"] == 2 else {})
                        for r in measured.records]
    assert plot_loss([plain, measured], ["adamw", "soap-async"], tmp_path / "measured.png", 10) == [
        "training loss vs step (10-step mean)", "validation loss vs step", "training loss vs wall clock",
        "training loss vs GPU energy"]
    assert (tmp_path / "measured.png").stat().st_size > 1000


def test_report_names_runs_of_different_vocabularies(tmp_path):
    """Losses per token of different vocabularies do not compare: the report says so and lists each run's."""
    same = [fake_run(tmp_path / "a", "adamw", [5.0, 4.0]), fake_run(tmp_path / "b", "soap-async", [5.0, 3.0])]
    bound = fake_run(tmp_path / "c", "shampoo-async", [5.0, 3.5])  # no vocab_size: an initial loss bound only
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    del summary["vocab_size"]
    (tmp_path / "c" / "summary.json").write_text(json.dumps(summary | {"initial_loss_bound": 5.5}))
    other = fake_run(tmp_path / "d", "kl-shampoo-async", [9.0, 6.0], vocab_size=50304)
    assert main(["report", *same, bound, "--out", str(tmp_path / "one")]) == 0
    figures = json.loads((tmp_path / "one" / "report.json").read_text())
    assert not figures["mixed_vocabularies"]
    assert figures["vocabularies"] == {"adamw": 256, "soap-async": 256, "shampoo-async": None}
    assert "different vocabularies" not in (tmp_path / "one" / "report.md").read_text()
    assert main(["report", *same, bound, other, "--out", str(tmp_path / "two")]) == 0
    assert json.loads((tmp_path / "two" / "report.json").read_text())["mixed_vocabularies"]
    assert ("**Runs of different vocabularies** (adamw: 256, soap-async: 256, shampoo-async: n/a, "
            "kl-shampoo-async: 50304)") in (tmp_path / "two" / "report.md").read_text()


def test_hf_tokenizer_from_a_local_folder(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    text = tmp_path / "corpus.txt"
    words = [f"w{i}" for i in range(300)]
    text.write_text(" ".join(words[(i * 7) % 300] for i in range(6000)))
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(["[UNK]", "[EOS]", *words])}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")
    fast.save_pretrained(tmp_path / "tok")
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "--optimizer", "adamw", "--steps", "3", "--data", str(text),
                 "--tokenizer", str(tmp_path / "tok"), *PLAIN]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["vocab_size"] == 384  # 302 tokens rounded up to a multiple of 128
    assert summary["initial_loss_bound"] == math.log(384)


def test_max_bytes_reads_only_the_head_of_the_data(tmp_path, monkeypatch):
    """A corpus larger than --max-bytes is read only up to it. ``head`` on a pipe whose writer holds it open
    (no end of file) until ``head`` has returned, which a read of the whole file would wait for; and
    load_documents reads every file through it, asking for no more than what is left of the budget. A pipe
    given as --data itself is refused (it would be read without end)."""
    from asteria.train import data

    fifo, returned, closed_early = tmp_path / "corpus", threading.Event(), []
    os.mkfifo(fifo)

    def writer() -> None:
        with fifo.open("wb") as pipe:
            pipe.write(b"word " * 2000)  # 10000 bytes of text, then no end of file until the reader is done
            pipe.flush()
            closed_early.append(returned.wait(timeout=120))

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        head = data.head(fifo, 6000)
    finally:
        returned.set()
        thread.join()
    assert closed_early == [True] and head == (b"word " * 2000)[:6000]
    with pytest.raises(ValueError, match=r"Invalid data='.*corpus': must be a regular file or a folder"):
        data.load_documents(str(fifo), max_bytes=6000)
    folder = tmp_path / "texts"
    folder.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (folder / name).write_bytes(b"word " * 1000)  # 5000 bytes each
    asked, real = [], data.head
    monkeypatch.setattr(data, "head", lambda path, limit: asked.append((path.name, limit)) or real(path, limit))
    docs = data.load_documents(str(folder), max_bytes=8000)
    assert asked == [("a.txt", 8000), ("b.txt", 3000)] and [len(d) for d in docs] == [5000, 3000]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--optimizer", "lion", "--out", "OUT"], "Invalid optimizer='lion'"),
        (["train", "--steps", "-3", "--out", "OUT"], "Invalid steps=-3"),
        (["train", "--model", "gpt5", "--out", "OUT"], "Invalid model='gpt5'"),
        (["train", "--lr", "-0.1", "--out", "OUT"], "Invalid lr=-0.1"),
        (["train", "--data", "", "--out", "OUT"], "Invalid data='': must be a file or folder path"),
        (["train", "--tokenizer", " ", "--out", "OUT"], "Invalid tokenizer=' ': must be a file or folder path"),
        (["train", "--max-preconditioner-dim", "0", "--out", "OUT"], "Invalid max_preconditioner_dim=0"),
        (["train", "--sync-refreshes", "-1", "--out", "OUT"], "Invalid sync_refreshes=-1"),
        (["train", "--lag-steps", "-1", "--out", "OUT"], "Invalid lag_steps=-1: must be an int >= 0"),
        (["train", "--lag-steps", "60", "--out", "OUT"],
         "Invalid lag_steps=60: must be at most staleness x precondition_frequency = 5 x 10 = 50"),
        (["train", "--lag-steps", "1", "--no-deterministic", "--out", "OUT"],
         "Invalid lag_steps=1: applies to the deterministic rule only"),
        (["train", "--seq-len", "100000", "--out", "OUT"], "Invalid seq_len=100000"),
        (["train", "--data", "/nonexistent/corpus", "--steps", "1", "--out", "OUT"],
         "Invalid data='/nonexistent/corpus'"),
        (["train", "--tokenizer", "/nonexistent/tok", "--steps", "1", "--out", "OUT"],
         "Invalid tokenizer='/nonexistent/tok'"),
        (["train", "--tokenizer", "TMP", "--steps", "1", "--out", "OUT"], "not a loadable HF tokenizer folder"),
        (["report", "TMP", "--out", "OUT"], "not a finished asteria train run"),
        (["report", "TMP", "--out", "OUT", "--target-loss", "-1"], "Invalid target_loss=-1.0"),
        (["bench", "--configs", "lion-async", "--out", "OUT"], "Invalid config='lion-async'"),
        (["bench", "--configs", "soap-async-f0", "--out", "OUT"],
         "Invalid config='soap-async-f0': must be one of ('adamw', "),
        (["bench", "--configs", "adamw-f5", "--out", "OUT"], "Invalid config='adamw-f5'"),
        (["bench", "--configs", "soap-async-fx", "--out", "OUT"],
         "followed by -f<N> (N >= 1, its precondition_frequency)"),
        (["train", "--steps", "4", "--profile-steps", "0", "2", "--out", "OUT"],
         "Invalid profile_steps=(0, 2): must be two steps FIRST LAST with 1 <= FIRST <= LAST <= steps (4)"),
        (["train", "--steps", "4", "--profile-steps", "3", "5", "--out", "OUT"], "Invalid profile_steps=(3, 5)"),
        (["train", "--mode", "async", "--worker-nice", "20", "--out", "OUT"],
         "Invalid worker_nice=20: must be an int in [0, 19]"),
        (["train", "--prefetch", "backward", "--out", "OUT"],
         "Invalid prefetch='backward': must be one of ('forward_start', 'forward_end', 'step')"),
        (["train", "--no-stagger", "--stagger-split", "--out", "OUT"],
         "Invalid stagger_split=True: must be None, True or False, and True only where the schedule is staggered"),
        (["train", "--late-activation", "--out", "OUT"],
         "Invalid late_activation=True: must be None (on where allowed), True or False, and True only with "
         "deterministic=False"),
        (["train", "--parallel", "zero", "--out", "OUT"],
         "Invalid parallel='zero': must be one of ('ddp', 'fsdp', 'hsdp')"),
        (["train", "--matmul-precision", "medium", "--out", "OUT"],
         "Invalid matmul_precision='medium': must be one of ('highest', 'high')"),
        (["train", "--local-world-size", "0", "--out", "OUT"], "Invalid local_world_size=0: must be an int >= 1"),
        (["train", "--local-world-size", "2", "--steps", "1", "--out", "OUT"],
         "Invalid local_world_size=2: must divide the world size 1"),
    ],
)
def test_bad_input_names_the_value(argv, message, capsys, tmp_path):
    argv = [str(tmp_path / "out") if a == "OUT" else str(tmp_path) if a == "TMP" else a for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--configs", "adamw", "shampoo-async", "--placement", "host"],
     "Invalid config 'shampoo-async': Invalid memory.placement='host': the host placements are for parameters "
     "on a GPU"),
    (["--configs", "shampoo-async", "shampoo-async-f2", "--lag-steps", "30"],
     "Invalid config 'shampoo-async-f2': Invalid lag_steps=30: must be at most staleness x precondition_frequency "
     "= 5 x 2 = 10"),
])
def test_bench_checks_every_config_before_its_first_run(argv, message, capsys, tmp_path):
    """A setting that one config's optimizer refuses stops the bench before any config has run (it used to
    fail after the configs before it had trained, and write no results)."""
    out = tmp_path / "bench"
    assert main(["bench", "--device", "cpu", "--steps", "2", *argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
RANK0_OF_4 = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}


@pytest.mark.parametrize(
    "env, argv, message",
    [
        (RANK0_OF_4, ["train", "--local-world-size", "3"], "Invalid local_world_size=3: must divide the world size 4"),
        (RANK0_OF_4 | {"LOCAL_WORLD_SIZE": "3"}, ["train"], "Invalid LOCAL_WORLD_SIZE=3: must divide the world size 4"),
        ({"WORLD_SIZE": "two"}, ["train"], "Invalid WORLD_SIZE='two': must be an int >= 1"),
        ({"WORLD_SIZE": "2"}, ["train"], "Invalid RANK=None: torchrun sets it"),
        (RANK0_OF_4 | {"RANK": "4"}, ["train"], "Invalid RANK=4: must be below WORLD_SIZE=4"),
        (RANK0_OF_4 | {"LOCAL_RANK": "5"}, ["train"], "Invalid LOCAL_RANK=5: must be below LOCAL_WORLD_SIZE=4"),
        (RANK0_OF_4, ["demo"], "Invalid command='demo' under torchrun (WORLD_SIZE=4)"),
        (RANK0_OF_4, ["train", "--parallel", "hsdp"], "Invalid parallel='hsdp' over 1 node(s) of 4 rank(s)"),
        (RANK0_OF_4, ["train", "--parallel", "hsdp", "--local-world-size", "1"],
         "Invalid parallel='hsdp' over 4 node(s) of 1 rank(s): HSDP shards within a node and replicates across "
         "nodes, so it needs at least 2 nodes of at least 2 ranks; --local-world-size declares the node size (here "
         "--local-world-size 2)"),
    ],
)
def test_bad_torchrun_layout_is_refused_before_any_process_group(env, argv, message, monkeypatch, capsys, tmp_path):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main([*argv, "--out", str(tmp_path / "out"), "--steps", "1"]) == 2
    assert message in capsys.readouterr().err
    assert not torch.distributed.is_initialized() and not (tmp_path / "out").exists()


def test_a_runs_peak_gpu_memory_counts_what_the_lane_process_held():
    """The bench's peak column: the training process's peak allocation plus the device lane's process's cache
    (another process on the same GPU, which torch's counters of this one miss); None off a GPU."""
    from asteria.train.bench import peak_gpu_bytes

    lane = {"memory_report": {"device": {"lane_slots": 64, "lane_cache": 5 * 2**20}}}
    assert peak_gpu_bytes({"peak_gpu_bytes": 2**30, **lane}) == 2**30 + 5 * 2**20
    assert peak_gpu_bytes({"peak_gpu_bytes": 2**30, "memory_report": {"device": {}}}) == 2**30  # no lane process
    assert peak_gpu_bytes({"peak_gpu_bytes": 2**30, "memory_report": {}}) == 2**30  # AdamW: no report
    assert peak_gpu_bytes({"peak_gpu_bytes": None, **lane}) is None


def test_bench_compares_configs_side_by_side(tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path), "--steps", "11", "--eval-every", "11",
                 "--configs", "adamw", "soap-sync", "kl-shampoo-async", "soap-async-f2", *TINY]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["runs"]) == ["adamw", "soap-sync", "kl-shampoo-async", "soap-async-f2"]
    # -f2: that config alone refreshes every 2 steps; its warm-up is (sync_refreshes + 1) x 2 steps
    f2 = json.loads((tmp_path / "soap-async-f2" / "summary.json").read_text())
    assert f2["config"]["precondition_frequency"] == 2 and f2["config"]["mode"] == "async"
    assert results["runs"]["soap-async-f2"]["warmup_steps"] == 6
    assert results["config"]["precondition_frequency"] == 3 and results["config"]["seed"] == 0
    adamw, kl = results["runs"]["adamw"], results["runs"]["kl-shampoo-async"]
    assert adamw["median_step_vs_adamw"] == 1.0
    assert kl["max_staleness_seen"] <= 1 and kl["waits"] is not None and kl["staleness_histogram"]
    assert adamw["energy_joules_per_step"] is None and adamw["gpu_median_step_seconds"] is None  # CPU: n/a
    steps = records(tmp_path / "soap-sync")
    kl_times = [r["step_time"] for r in records(tmp_path / "kl-shampoo-async")]
    # 3 f: allocation, compilation and the two sync refreshes (the bootstrap, at step f at the latest, and
    # the first refresh after it)
    assert kl["warmup_steps"] == 9
    assert kl["max_step_seconds"] == max(kl_times[9:]) and kl["warmup_max_step_seconds"] == max(kl_times[:9])
    assert [step for step, _ in kl["slowest_steady_steps"]] == sorted(range(10, 12), key=lambda s: -kl_times[s - 1])
    kl_held = [r["host_optimizer_time"] for r in records(tmp_path / "kl-shampoo-async")]
    assert kl["slowest_steady_in_step_seconds"] == [kl_held[step - 1] for step, _ in kl["slowest_steady_steps"]]
    assert len(steps) == 11
    # The refresh work per interval against capacity, from each async run's own counters over its steady steps (the
    # counters at the warm-up's end subtracted), at AdamW's pace.
    assert adamw["refresh_work"] is None and results["runs"]["soap-sync"]["refresh_work"] is None
    for label, f in (("kl-shampoo-async", 3), ("soap-async-f2", 2)):
        summary = json.loads((tmp_path / label / "summary.json").read_text())
        stats, warm = summary["runtime_stats"], summary["runtime_stats_at_warmup"]
        assert warm["step"] == results["runs"][label]["warmup_steps"] < 11
        grew = {key: stats[key] - warm[key] for key in ("refresh_seconds_on_workers", "worker_jobs_ended",
                                                        "refreshes_superseded", "refreshes_deferred")}
        assert min(grew.values()) >= 0 and grew["worker_jobs_ended"] <= stats["worker_jobs_ended"]
        work = results["runs"][label]["refresh_work"]
        interval = adamw["mean_step_seconds"] * f
        assert work["pace"] == "adamw" and work["window"] == "steady" and work["workers"] == stats["workers"] >= 1
        assert work["express_workers"] == stats["express_workers"]
        assert work["interval_seconds"] == pytest.approx(interval)
        ended = grew["worker_jobs_ended"]
        per_job = grew["refresh_seconds_on_workers"] / ended if ended else 0.0
        dropped = grew["refreshes_superseded"] + grew["refreshes_deferred"]
        assert work["worker_core_seconds"] == pytest.approx(
            (grew["refresh_seconds_on_workers"] + per_job * dropped) / ((11 - warm["step"]) / f))
        assert work["worker_capacity_core_seconds"] == pytest.approx(stats["workers"] * interval)
        capacity = work["worker_capacity_core_seconds"]
        assert work["worker_ratio"] == pytest.approx(work["worker_core_seconds"] / capacity)
        assert work["device_seconds"] == 0.0 and work["device_ratio"] == 0.0  # no device lane on the CPU
        assert work["device_cpu_seconds"] is None
        # How long the workers' jobs took from submission, and the small blocks' alone (the express workers' kind).
        assert stats["job_mean_latency_seconds"] >= stats["job_mean_run_seconds"] > 0
        assert stats["small_job_mean_latency_seconds"] >= stats["small_job_mean_run_seconds"] >= 0
        assert work["job_latency"] == {key: stats[key] for key in (
            "job_mean_latency_seconds", "job_mean_run_seconds", "small_jobs", "small_job_mean_latency_seconds",
            "small_job_mean_run_seconds")}
        assert results["runs"][label]["recent_deferrals"] == stats["recent_deferrals"]
    # The median step by position in the interval: 11 steps leave too few steady ones for f = 3 (steps 10-11),
    # and enough for f = 2 (steps 7-11).
    assert kl["interval_profile"] is None and adamw["interval_profile"] is None
    profile = results["runs"]["soap-async-f2"]["interval_profile"]
    f2_times = [r["step_time"] for r in records(tmp_path / "soap-async-f2")]
    medians = [statistics.median([f2_times[s - 1] for s in (8, 10)]), statistics.median(f2_times[6::2])]
    assert profile["median_seconds"] == pytest.approx(medians)
    assert profile["above_quietest_seconds"] == pytest.approx(abs(medians[0] - medians[1]))
    f2_host = [r["host_step_time"] for r in records(tmp_path / "soap-async-f2")]
    assert all(0 < host <= wall for host, wall in zip(f2_host, f2_times, strict=True))  # queued before it ended
    host_medians = [statistics.median([f2_host[s - 1] for s in (8, 10)]), statistics.median(f2_host[6::2])]
    assert profile["host_median_seconds"] == pytest.approx(host_medians)
    # The part of the host's time in step(), and the training thread's CPU time (which may exceed the wall time
    # only by the clocks' granularity).
    f2_records = records(tmp_path / "soap-async-f2")
    assert all(0 < r["host_optimizer_time"] < r["host_step_time"] for r in f2_records)
    assert all(0 < r["host_cpu_time"] <= r["host_step_time"] + 0.01 for r in f2_records)
    measures = [("host_optimizer_time", "host_optimizer_median_seconds"), ("host_cpu_time", "host_cpu_median_seconds")]
    if sys.platform == "linux":  # the thread's run-queue wait and sleeps come from /proc/thread-self
        assert all(0 <= r["host_runq_time"] <= r["host_step_time"] and r["host_sleeps"] >= 0 for r in f2_records)
        measures += [("host_runq_time", "host_runq_median_seconds"), ("host_sleeps", "host_sleeps_median")]
    for key, name in measures:
        assert profile[name] == pytest.approx([statistics.median([r[key] for r in f2_records[6:] if r["step"] % 2 == p])
                                               for p in (0, 1)]), key
    # The install delay by factor side: the histogram's installs and summed delay, split by the blocks' sides.
    histogram = json.loads((tmp_path / "soap-async-f2" / "summary.json").read_text())["runtime_stats"][
        "install_delay_histogram"]
    by_side = [s for s in results["runs"]["soap-async-f2"]["install_delay_by_side"] if s["installs"]]
    assert [s["side"] for s in by_side] == sorted({s["side"] for s in by_side})
    assert sum(s["installs"] for s in by_side) == sum(histogram) > 0
    assert sum(s["mean_steps"] * s["installs"] for s in by_side) == pytest.approx(
        sum(d * n for d, n in enumerate(histogram)))
    table = capsys.readouterr().out
    side = by_side[0]
    assert "install delay by factor side (mean steps after native mode's, and installs):" in table
    assert f"  soap-async-f2      {side['side']}: {side['mean_steps']:.2f} ({side['installs']})" in table
    assert "  soap-async-f2      " + " ".join(f"{1e3 * m:.0f}" for m in medians) + " | quietest " in table
    assert "    host queued      " + " ".join(f"{1e3 * m:.0f}" for m in host_medians) + " (the host's" in table
    assert "    in step()        " in table and "    host CPU         " in table
    assert sys.platform != "linux" or ("    core wait        " in table and "    sleeps           " in table)
    # The latest deferrals, where a run had some: the set's version and what was still on its way.
    from asteria.train.bench import format_table

    results["runs"]["kl-shampoo-async"]["recent_deferrals"] = [
        {"step": 7, "set": "net.0.weight[0]", "version": 4, "side": "cpu", "reason": "in_flight",
         "in_flight": [[3, "device"]]}]
    assert "  kl-shampoo-async   7: net.0.weight[0] v4 (cpu, in_flight; v3 device)" in format_table(results)
    # The CUDA allocator's retries: none counted on the CPU, and a part of the table only for a run that had some.
    assert all(r["alloc_retries_steady"] is None for r in results["runs"].values())
    assert "allocator's retries" not in table
    results["runs"]["kl-shampoo-async"]["alloc_retries_steady"] = 3
    assert "device sync each; the card is nearly full):\n  kl-shampoo-async   3\n" in format_table(results)
    assert "soap-sync" in table and "n/a" in table
    assert "refresh work per interval of f steps against capacity, at AdamW's mean step (the steady steps'):" in table
    assert "  kl-shampoo-async   workers " in table
    latency = results["runs"]["kl-shampoo-async"]["refresh_work"]["job_latency"]["job_mean_latency_seconds"]
    assert f"worker jobs from submission to end {1e3 * latency:.0f} ms (running " in table
    express = results["runs"]["kl-shampoo-async"]["refresh_work"]["express_workers"]
    assert (f", {express} express); device lane " in table) == (express > 0)
    assert "the balancer's last plan" not in table  # no device lane, no plan, on the CPU
    results["runs"]["kl-shampoo-async"]["refresh_work"]["planned_load"] = {"workers": 1.814, "device": 0.977}
    assert "the balancer's last plan: workers 1.81x, device lane 0.98x their interval" in format_table(results)
    (step, seconds), held = kl["slowest_steady_steps"][0], kl["slowest_steady_in_step_seconds"][0]
    assert f" | {step}: {1e3 * seconds:.0f} ({1e3 * held:.0f})" in table  # the slowest step, and its time in step()
    for png in ("step_time_series.png", "energy_per_step.png", "step_time.png", "loss.png"):
        assert (tmp_path / png).stat().st_size > 1000, png


def test_heavyballs_peers_train_beside_the_others_in_the_bench_eagerly_on_the_cpu(tmp_path):
    """hb-soap and hb-kl-shampoo run in the bench on the same model and batches; on the CPU heavyball's steps
    run eagerly (its max-autotune compile fails in torch's CPU inductor), and the loss falls."""
    heavyball = pytest.importorskip("heavyball")
    assert main(["bench", "--out", str(tmp_path), "--steps", "8", "--eval-every", "8", "--configs", "hb-soap",
                 "hb-kl-shampoo", *TINY]) == 0
    assert heavyball.utils.compile_mode is None
    for label in ("hb-soap", "hb-kl-shampoo"):
        losses = [r["loss"] for r in records(tmp_path / label)]
        assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses)
        assert losses[-1] < losses[0]


def test_stagger_reaches_the_optimizer():
    from asteria.train.cli import build_parser, run_config_from_args
    from asteria.train.loop import make_optimizer
    from asteria.train.model import build_model

    model = build_model("tiny", 256, 64)
    for flags, mode, staggered in ((["--stagger"], "sync", True), (["--no-stagger"], "async", False),
                                   ([], "async", True), ([], "sync", False)):
        args = build_parser().parse_args(["train", "--out", "OUT", "--optimizer", "soap", "--mode", mode, *flags])
        opt = make_optimizer(run_config_from_args(args), model)
        try:
            assert any(phase != 0 for phase in opt.schedule.phases) == staggered, (flags, mode)
        finally:
            opt.close()


def test_max_preconditioner_dim_reaches_the_optimizer():
    from asteria.train.loop import RunConfig, make_optimizer
    from asteria.train.model import build_model

    model = build_model("tiny", 256, 64)
    for dim in (2048, 32):
        opt = make_optimizer(RunConfig(optimizer="shampoo", mode="sync", max_preconditioner_dim=dim), model)
        largest = max(max(group.shape) for group in opt._groups)
        assert opt.max_preconditioner_dim == dim and (largest == 32 if dim == 32 else largest > 32)
        opt.close()


def test_sync_refreshes_reaches_the_optimizer():
    from asteria.train.loop import RunConfig, make_optimizer
    from asteria.train.model import build_model

    opt = make_optimizer(RunConfig(optimizer="soap", sync_refreshes=3), build_model("tiny", 256, 64))
    assert opt.runtime.sync_refreshes == 3
    opt.close()


def test_deterministic_kernels_hold_while_training_and_are_restored(tmp_path):
    from asteria.train.loop import deterministic_kernels

    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict: see the docstring
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(False):
        assert not torch.are_deterministic_algorithms_enabled()
    assert main(["train", "--out", str(tmp_path), "--steps", "2", "--eval-every", "2", "--deterministic-kernels",
                 *BASE]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["config"]["deterministic_kernels"] is True
    assert not torch.are_deterministic_algorithms_enabled()
