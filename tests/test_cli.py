"""The asteria command end to end on the CPU at tiny size."""

from __future__ import annotations

import json

import pytest

from asteria.train.cli import main


def test_demo_writes_runs_and_report(tmp_path):
    assert main(["demo", "--out", str(tmp_path), "--steps", "12", "--eval-every", "6", "--batch-size", "4",
                 "--seq-len", "32", "--precondition-frequency", "3", "--staleness", "1", "--workers", "1"]) == 0
    for label in ("adamw", "shampoo-async"):
        summary = json.loads((tmp_path / label / "summary.json").read_text())
        assert summary["label"] == label and summary["final_loss"] < summary["initial_loss_bound"]
        records = (tmp_path / label / "metrics.jsonl").read_text().splitlines()
        assert len(records) == 12 and "val_loss" in json.loads(records[5])
        assert any((tmp_path / label / "tensorboard").iterdir())
    report = (tmp_path / "report.md").read_text()
    assert "| adamw |" in report and "| shampoo-async |" in report
    assert (tmp_path / "loss.png").stat().st_size > 1000 and (tmp_path / "step_time.png").stat().st_size > 1000
    assert main(["report", str(tmp_path / "adamw"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "report.md").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--optimizer", "lion", "--out", "x"], "Invalid optimizer='lion'"),
        (["train", "--steps", "-3", "--out", "x"], "Invalid steps=-3"),
        (["train", "--data", "/nonexistent/corpus", "--steps", "1", "--out", "x"],
         "Invalid data='/nonexistent/corpus'"),
    ],
)
def test_bad_input_names_the_value(argv, message, capsys, tmp_path):
    argv[argv.index("x")] = str(tmp_path / "run")
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bench_compares_configs_side_by_side(tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path), "--steps", "6", "--eval-every", "6", "--batch-size", "4",
                 "--seq-len", "32", "--precondition-frequency", "2", "--staleness", "1", "--workers", "1",
                 "--configs", "adamw", "soap-sync", "kl-shampoo-async"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["runs"]) == ["adamw", "soap-sync", "kl-shampoo-async"]
    assert results["runs"]["adamw"]["median_step_vs_adamw"] == 1.0
    assert results["runs"]["kl-shampoo-async"]["max_staleness_seen"] <= 1
    assert "soap-sync" in capsys.readouterr().out
    assert (tmp_path / "step_time.png").exists()
    assert main(["bench", "--out", str(tmp_path), "--configs", "lion-async"]) == 2
