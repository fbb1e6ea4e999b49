"""The experiment tools in tools/ end to end on the CPU at tiny size: sweep.py (one config over staleness
bounds) and seeds.py run (asteria bench over seeds), and clear errors for bad input. (seeds.py gather over
results on disk: test_seeds.py.)"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from seeds import main as seeds_main  # noqa: E402
from sweep import main as sweep_main  # noqa: E402
from test_cli import BASE, TINY, records  # noqa: E402  (the same tiny runs as the command's own tests)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sweep_over_staleness(tmp_path, capsys):
    assert sweep_main(["--out", str(tmp_path), "--staleness", "2", "0", "--steps", "7", "--eval-every", "7",
                 "--optimizer", "soap", "--mode", "async", *BASE]) == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert result["staleness"] == [0, 2]
    losses = [result["runs"][s]["final_loss"] for s in ("0", "2")]
    assert result["spread_final_loss_s_le_5"] == pytest.approx(max(losses) - min(losses))
    for s in (0, 2):
        summary = json.loads((tmp_path / f"S{s}" / "summary.json").read_text())
        assert summary["config"]["staleness"] == s and summary["runtime_stats"]["max_staleness_seen"] <= s
    table = (tmp_path / "sweep.md").read_text()
    assert "| 0 |" in table and "| 2 |" in table and "Spread of the final loss over S <= 5" in table
    assert (tmp_path / "sweep.png").stat().st_size > 1000 and (tmp_path / "report.md").exists()
    assert "spread over S <= 5" in capsys.readouterr().out
    assert "Activation: each block's newest finished version" in table  # the default on one process


def test_sweep_over_seeds_judges_the_spread_of_the_means(tmp_path, capsys):
    assert sweep_main(["--out", str(tmp_path), "--staleness", "0", "2", "--seeds", "1", "2", "--steps", "9",
                 "--eval-every", "9", "--optimizer", "soap", "--mode", "async",
                 "--deterministic", "--sync-refreshes", "1", *BASE]) == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert result["seeds"] == [1, 2]
    means = {}
    for s in (0, 2):
        row = result["runs"][str(s)]
        finals = [json.loads((tmp_path / f"S{s}" / f"seed{seed}" / "summary.json").read_text())["final_loss"]
                  for seed in (1, 2)]
        assert row["final_loss_per_seed"] == {"1": pytest.approx(finals[0]), "2": pytest.approx(finals[1])}
        assert row["final_loss"] == pytest.approx(sum(finals) / 2)
        assert row["final_loss_stats"]["se"] == pytest.approx(abs(finals[0] - finals[1]) / 2)
        means[s] = (row["final_loss"], finals)
    (m0, f0), (m2, f2) = means[0], means[2]
    assert result["spread_final_loss_s_le_5"] == pytest.approx(abs(m0 - m2))
    # Paired by seed: each run's deviation from its seed's mean over S <= 5; with two S these are
    # +-(L0 - L2) / 2 per seed, so the interval's half-width is t(1 df) x SE of those.
    deviations = [(a - b) / 2 for a, b in zip(f0, f2, strict=True)]
    # The deterministic rule with one synchronous refresh makes S move each seed's loss, by different amounts,
    # whatever the timing (with the newest-finished rule a fast worker may install the same versions at both S).
    assert deviations[0] != deviations[1] and all(deviations)
    half = 12.706 * abs(deviations[0] - deviations[1]) / 2
    offset = sum(deviations) / 2
    for s, sign in ((0, 1), (2, -1)):
        assert result["runs"][str(s)]["final_loss_offset"]["mean"] == pytest.approx(sign * offset)
        assert result["runs"][str(s)]["final_loss_offset"]["ci95"] == pytest.approx(
            [sign * offset - half, sign * offset + half])
    assert result["spread_band_s_le_5"] == pytest.approx([max(0.0, abs(m0 - m2) - 2 * half), abs(m0 - m2) + 2 * half])
    # The combined report keeps every run, each named by its folder.
    report = json.loads((tmp_path / "report.json").read_text())
    assert sorted(report["runs"]) == [f"soap-async (S{s}/seed{seed})" for s in (0, 2) for seed in (1, 2)]
    assert result["spread_verdict"] in ("met", "not met", "undecided")
    assert "95% interval" in (tmp_path / "sweep.md").read_text()
    assert f"({result['spread_verdict']} against < 0.02)" in capsys.readouterr().out
    assert sweep_main(["--out", str(tmp_path), "--seed", "0", "--seeds", "1", "--optimizer", "soap",
                 "--mode", "async", *BASE]) == 2
    assert "Invalid seed=0 beside seeds=[1]" in capsys.readouterr().err


def test_spread_verdict_follows_the_intervals():
    from sweep import _spread_verdict

    def stats(mean, half):
        return {"ci95": [mean - half, mean + half]}

    assert _spread_verdict([stats(1.00, 0.004), stats(1.01, 0.004)]) == (pytest.approx([0.002, 0.018]), "met")
    assert _spread_verdict([stats(1.00, 0.01), stats(1.05, 0.01)]) == (pytest.approx([0.03, 0.07]), "not met")
    assert _spread_verdict([stats(1.00, 0.02), stats(1.01, 0.02)])[1] == "undecided"
    assert _spread_verdict([stats(1.0, 0.01)]) == (None, None)
    assert _spread_verdict([{"ci95": None}, stats(1.0, 0.01)]) == (None, None)
    diverged = {"ci95": None, "diverged": 1}  # spread_stats of a seed whose loss is not finite
    assert _spread_verdict([diverged, stats(1.0, 0.01)]) == (None, "not met")
    assert _spread_verdict([stats(1.0, 0.01) | {"diverged": 1}, stats(1.0, 0.01)]) == (None, "not met")


def test_sweep_with_newest_finished_activation(tmp_path):
    """--no-deterministic: each block uses its newest finished refresh, still within S."""
    assert sweep_main(["--out", str(tmp_path), "--staleness", "3", "--steps", "7", "--eval-every", "7",
                 "--optimizer", "shampoo", "--mode", "async", "--no-deterministic", *BASE]) == 0
    summary = json.loads((tmp_path / "S3" / "summary.json").read_text())
    assert summary["config"]["deterministic"] is False and summary["runtime_stats"]["max_staleness_seen"] <= 3
    assert summary["late_activation"] is True  # on by default under the newest-finished rule
    assert "newest finished version" in (tmp_path / "sweep.md").read_text()


def test_sweep_reuse_trains_only_what_is_missing(tmp_path, capsys):
    """--reuse keeps the runs that finished with the same configuration; a run of another configuration
    (here fewer steps) or a missing seed is trained."""
    args = ["--out", str(tmp_path), "--staleness", "0", "2", "--steps", "6", "--eval-every", "6",
            "--optimizer", "soap", "--mode", "async", *BASE]
    assert sweep_main([*args, "--seeds", "1"]) == 0
    first = {s: json.loads((tmp_path / f"S{s}" / "seed1" / "summary.json").read_text()) for s in (0, 2)}
    (tmp_path / "S2" / "seed1" / "summary.json").write_text(
        json.dumps(first[2] | {"config": first[2]["config"] | {"steps": 5}}))  # as if run with other settings
    capsys.readouterr()
    assert sweep_main([*args, "--seeds", "1", "2", "--reuse"]) == 0
    out = capsys.readouterr().out
    assert f"S=0 seed=1: reusing the finished run in {tmp_path / 'S0' / 'seed1'}" in out
    assert "S=2 seed=1: reusing" not in out and "seed=2: reusing" not in out
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert result["seeds"] == [1, 2]
    assert result["runs"]["0"]["final_loss_per_seed"]["1"] == first[0]["final_loss"]
    retrained = json.loads((tmp_path / "S2" / "seed1" / "summary.json").read_text())
    assert retrained["config"]["steps"] == 6 and retrained["final_loss"] == pytest.approx(first[2]["final_loss"])
    for s in (0, 2):
        assert json.loads((tmp_path / f"S{s}" / "seed2" / "summary.json").read_text())["config"]["seed"] == 2
    # A run whose metrics lost their last step is not reused either (its summary alone is not enough).
    metrics = tmp_path / "S0" / "seed2" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:-1]))
    assert sweep_main([*args, "--seeds", "1", "2", "--reuse"]) == 0
    out = capsys.readouterr().out
    assert "S=0 seed=1: reusing" in out and "S=0 seed=2: reusing" not in out and "S=2 seed=2: reusing" in out
    assert len(metrics.read_text().splitlines()) == 6


def test_sweep_of_diverged_runs_reports_them_rather_than_a_spread(tmp_path, capsys):
    """A diverged run (lr far too large: its loss is NaN) made the statistics over seeds crash, and the
    spread over S came out as 0 without seeds (NaN in max/min). Now the S are named and the verdict is not met."""
    args = ["--staleness", "0", "1", "--steps", "4", "--eval-every", "4", "--optimizer", "shampoo",
            "--mode", "async", "--lr", "1e30", *BASE]
    assert sweep_main([*args, "--out", str(tmp_path / "one")]) == 0
    result = json.loads((tmp_path / "one" / "sweep.json").read_text())
    assert result["spread_final_loss_s_le_5"] is None and result["diverged_s"] == [0, 1]
    assert "n/a (diverged at S = 0, 1)" in (tmp_path / "one" / "sweep.md").read_text()
    assert sweep_main([*args, "--seeds", "1", "2", "--out", str(tmp_path / "seeds")]) == 0
    result = json.loads((tmp_path / "seeds" / "sweep.json").read_text())
    assert result["spread_verdict"] == "not met" and result["runs"]["0"]["final_loss_stats"]["diverged"] == 2
    assert "not met (a run diverged)" in (tmp_path / "seeds" / "sweep.md").read_text()
    assert "spread over S <= 5: n/a (not met against < 0.02)" in capsys.readouterr().out


def test_bench_over_seeds_pairs_asteria_with_native(tmp_path, capsys):
    assert seeds_main(["run", "--out", str(tmp_path), "--steps", "7", "--eval-every", "7", "--seeds", "3", "5",
                 "--configs", "shampoo-sync", "shampoo-async", *TINY]) == 0
    per_seed = {seed: json.loads((tmp_path / f"seed{seed}" / "results.json").read_text()) for seed in (3, 5)}
    assert [per_seed[s]["config"]["seed"] for s in (3, 5)] == [3, 5]
    gathered = json.loads((tmp_path / "seeds.json").read_text())
    assert gathered["seeds"] == [3, 5]
    assert list(gathered["code"].values()) == [2] and per_seed[3]["software"]["code"] in gathered["code"]
    summary = json.loads((tmp_path / "seed3" / "shampoo-async" / "summary.json").read_text())
    assert summary["software"] == per_seed[3]["software"]
    native = [per_seed[s]["runs"]["shampoo-sync"]["final_val_loss"] for s in (3, 5)]
    asteria = [per_seed[s]["runs"]["shampoo-async"]["final_val_loss"] for s in (3, 5)]
    deltas = [a / n - 1 for a, n in zip(asteria, native, strict=True)]
    pair = gathered["pairs"]["shampoo-async"]["final_val_loss"]
    assert pair["per_seed"] == {"3": pytest.approx(deltas[0]), "5": pytest.approx(deltas[1])}
    assert pair["stats"]["mean"] == pytest.approx(sum(deltas) / 2)
    assert pair["stats"]["sd"] == pytest.approx(abs(deltas[0] - deltas[1]) / math.sqrt(2))
    assert pair["asteria_behind"] == sum(d > 0 for d in deltas)
    stats = gathered["configs"]["shampoo-sync"]["final_val_loss_stats"]
    assert stats["min"] == min(native) and stats["max"] == max(native) and stats["n"] == 2
    # The gap over the run, from each run's own metrics: 7 steps give 7 windows of one step.
    gap = gathered["gap_over_run"]["shampoo-async"]
    assert gap["windows"] == [[s, s] for s in range(1, 8)] and gap["left_out"] == {}
    for seed in (3, 5):
        ours, theirs = (records(tmp_path / f"seed{seed}" / label) for label in ("shampoo-async", "shampoo-sync"))
        expected = [a["loss"] / n["loss"] - 1 for a, n in zip(ours, theirs, strict=True)]
        assert gap["per_seed"][str(seed)] == pytest.approx(expected)
    table = capsys.readouterr().out
    assert "shampoo-async vs shampoo-sync" in table and "seeds with Asteria behind" in table
    assert "Training-loss gap over the run" in table and (tmp_path / "gap.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "tool, argv, message",
    [
        (sweep_main, ["--optimizer", "adamw", "--out", "OUT"], "Invalid optimizer='adamw'"),
        (sweep_main, ["--staleness", "1", "-2", "--out", "OUT"], "Invalid staleness=-2"),
        (seeds_main, ["run", "--seeds", "1", "1", "--out", "OUT"],
         "Invalid seeds=[1, 1]: must be distinct integers in [0, 2**32)"),
        (seeds_main, ["run", "--seeds", "0", "4294967296", "--out", "OUT"],
         "Invalid seeds=[0, 4294967296]: must be distinct"),
        (seeds_main, ["run", "--seeds", "-1", "--out", "OUT"], "Invalid seeds=[-1]"),
        (seeds_main, ["run", "--seed", "0", "--seeds", "1", "--out", "OUT"], "Invalid seed=0 beside seeds=[1]"),
    ],
)
def test_bad_input_names_the_value(tool, argv, message, capsys, tmp_path):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert tool(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "summary.json").exists()
