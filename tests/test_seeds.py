"""``tools/seeds.py gather``: bench results gathered from disk, several runs of a seed, paired statistics."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from seeds import LOSS_TOLERANCE, T95, main  # noqa: E402

CONFIG = {"model": "tiny", "steps": 250, "stagger": None}


def write(folder, seed: int, runs: dict[str, float], config: dict | None = None, device: str = "GPU X") -> None:
    """A bench results.json with these validation losses (training loss 0.1 below)."""
    folder.mkdir(parents=True)
    rows = {label: {"final_loss": val - 0.1, "final_val_loss": val} for label, val in runs.items()}
    payload = {"device": device, "config": (config or CONFIG) | {"seed": seed}, "runs": rows}
    (folder / "results.json").write_text(json.dumps(payload))


def test_seeds_pools_runs_of_a_seed_and_pairs_by_seed(tmp_path, capsys):
    # Two calls: seed 1 ran twice on each side, seeds 2 and 3 once; a profile's results.json is skipped.
    write(tmp_path / "a" / "seed1", 1, {"kl-shampoo-sync": 1.00, "kl-shampoo-async": 1.03})
    write(tmp_path / "a" / "seed2", 2, {"kl-shampoo-sync": 1.10, "kl-shampoo-async": 1.12})
    write(tmp_path / "b" / "seed1", 1, {"kl-shampoo-sync": 1.02, "kl-shampoo-async": 1.05})
    write(tmp_path / "b" / "seed3", 3, {"kl-shampoo-sync": 1.20, "kl-shampoo-async": 1.19, "adamw": 1.5})
    (tmp_path / "b" / "profile").mkdir()
    (tmp_path / "b" / "profile" / "results.json").write_text(json.dumps({"steps": [1, 2]}))
    assert main(["gather", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "seeds.json").read_text())
    assert summary["seeds"] == [1, 2, 3]
    kl = summary["configs"]["kl-shampoo-sync"]
    assert kl["runs"] == {"1": 2, "2": 1, "3": 1}
    assert kl["final_val_loss"] == {"1": pytest.approx(1.01), "2": pytest.approx(1.10), "3": pytest.approx(1.20)}
    assert summary["configs"]["adamw"]["runs"] == {"3": 1}
    pair = summary["pairs"]["kl-shampoo-async"]["final_val_loss"]
    deltas = [1.04 / 1.01 - 1, 1.12 / 1.10 - 1, 1.19 / 1.20 - 1]  # each seed once, at the mean of its runs
    assert list(pair["per_seed"].values()) == pytest.approx(deltas)
    mean, sd = statistics.fmean(deltas), statistics.stdev(deltas)
    se = sd / math.sqrt(3)
    assert pair["stats"]["mean"] == pytest.approx(mean) and pair["stats"]["se"] == pytest.approx(se)
    assert pair["stats"]["ci95"] == pytest.approx([mean - 4.303 * se, mean + 4.303 * se])
    assert pair["asteria_behind"] == 2 and pair["within_tolerance"] == "undecided"
    table = capsys.readouterr().out
    assert "kl-shampoo-async vs kl-shampoo-sync" in table and "undecided" in table and "| 4 |" in table


@pytest.mark.parametrize("deltas, verdict", [([0.001, 0.002, 0.0015, 0.0012], "met"),
                                             ([0.05, 0.052, 0.049, 0.051], "not met"),
                                             ([0.001, 0.03, -0.01, 0.02], "undecided")])
def test_seeds_verdict_follows_the_interval(tmp_path, deltas, verdict):
    for seed, delta in enumerate(deltas):
        write(tmp_path / f"seed{seed}", seed, {"soap-sync": 1.0, "soap-async": 1.0 + delta})
    assert main(["gather", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    pair = json.loads((tmp_path / "out" / "seeds.json").read_text())["pairs"]["soap-async"]["final_val_loss"]
    low, high = pair["stats"]["ci95"]
    assert pair["within_tolerance"] == verdict
    assert (high <= LOSS_TOLERANCE) == (verdict == "met") and (low > LOSS_TOLERANCE) == (verdict == "not met")
    assert T95[len(deltas) - 2] == pytest.approx((high - low) / 2 / pair["stats"]["se"])


def test_a_diverged_run_is_counted_as_such_and_the_rest_still_summarized(tmp_path, capsys):
    """A run whose loss went to NaN (a too large lr) crashed the statistics, so no summary was written for
    the runs beside it. Now it is left out of the means and named: an Asteria run that diverged where
    native did not is behind, and the loss target is not met; a diverged native run is left out."""
    nan = float("nan")
    for seed, (native, asteria) in enumerate([(1.0, 1.001), (1.1, 1.1012), (1.2, nan), (nan, 1.3), (1.4, 1.4013)]):
        write(tmp_path / f"seed{seed}", seed, {"soap-sync": native, "soap-async": asteria})
    assert main(["gather", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "seeds.json").read_text())
    pair = summary["pairs"]["soap-async"]["final_val_loss"]
    assert pair["diverged"] == {"asteria": [2], "native": [3]}
    assert list(pair["per_seed"]) == ["0", "1", "4"] and pair["stats"]["n"] == 3
    assert pair["asteria_behind"] == 4 and pair["within_tolerance"] == "not met"  # within 1% otherwise
    stats = summary["configs"]["soap-async"]["final_val_loss_stats"]
    assert stats["n"] == 4 and stats["diverged"] == 1
    assert stats["mean"] == pytest.approx(statistics.fmean([1.001, 1.1012, 1.3, 1.4013]))
    table = (tmp_path / "out" / "seeds.md").read_text()
    assert "2: Asteria diverged, 3: native diverged (left out)" in table and "| 4 of 4 | not met |" in table
    assert "(1 diverged)" in table
    # every run of a config diverged: its figures are n/a, nothing crashes
    write(tmp_path / "all" / "seed0", 0, {"soap-sync": nan, "soap-async": nan})
    write(tmp_path / "all" / "seed1", 1, {"soap-sync": nan, "soap-async": nan})
    assert main(["gather", str(tmp_path / "all"), "--out", str(tmp_path / "out2")]) == 0
    assert "n/a (2 diverged)" in (tmp_path / "out2" / "seeds.md").read_text()


def test_seeds_refuses_runs_of_other_settings_and_bad_paths(tmp_path, capsys):
    write(tmp_path / "x" / "seed1", 1, {"shampoo-sync": 1.0, "shampoo-async": 1.01})
    write(tmp_path / "y" / "seed2", 2, {"shampoo-sync": 1.0, "shampoo-async": 1.01}, CONFIG | {"stagger": True})
    assert main(["gather", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "settings differ in more than seed, eval_every" in error
    assert f"stagger: null in {tmp_path / 'x' / 'seed1' / 'results.json'}" in error
    assert f"true in {tmp_path / 'y' / 'seed2' / 'results.json'}" in error
    assert not (tmp_path / "out").exists()
    assert main(["gather", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    assert f"Invalid run path {str(tmp_path / 'missing')!r}: it does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["gather", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert "no `asteria bench` results.json at or below them" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text("{not json")
    assert main(["gather", str(tmp_path / "bad"), "--out", str(tmp_path / "out")]) == 2
    assert "Invalid results file" in capsys.readouterr().err


def test_seeds_against_a_baseline_of_other_settings_pairs_every_config_with_its_native_run(tmp_path, capsys):
    # The runs: native and Asteria staggered; the baseline: native unstaggered (seed 3 has no baseline).
    staggered = CONFIG | {"stagger": True}
    for seed, (sync, asyn) in {1: (1.02, 1.05), 2: (1.10, 1.09), 3: (1.3, 1.3)}.items():
        write(tmp_path / "runs" / f"seed{seed}", seed, {"kl-shampoo-sync": sync, "kl-shampoo-async": asyn}, staggered)
    for seed, native in {1: 1.00, 2: 1.12}.items():
        write(tmp_path / "base" / f"seed{seed}", seed, {"kl-shampoo-sync": native, "adamw": 1.5})
    assert main(["gather", str(tmp_path / "runs"), "--baseline", str(tmp_path / "base"),
                 "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "seeds.json").read_text())
    assert summary["baseline_differs_in"] == {"stagger": [True, None]}
    assert summary["configs"]["kl-shampoo-sync (baseline)"]["runs"] == {"1": 1, "2": 1}
    assert set(summary["pairs"]) == {"kl-shampoo-sync", "kl-shampoo-async"}  # adamw has no native run
    for label, deltas in (("kl-shampoo-sync", [1.02 / 1.00 - 1, 1.10 / 1.12 - 1]),
                          ("kl-shampoo-async", [1.05 / 1.00 - 1, 1.09 / 1.12 - 1])):
        pair = summary["pairs"][label]
        assert pair["native"] == "kl-shampoo-sync (baseline)"
        assert list(pair["final_val_loss"]["per_seed"].values()) == pytest.approx(deltas)
    table = capsys.readouterr().out
    assert "stagger: true against null" in table and "kl-shampoo-async vs kl-shampoo-sync (baseline)" in table
    assert "Each config against the baseline's native config, paired by seed" in table
    # Each side must agree within itself.
    write(tmp_path / "base" / "seed5", 5, {"kl-shampoo-sync": 1.0}, CONFIG | {"steps": 100})
    assert main(["gather", str(tmp_path / "runs"), "--baseline", str(tmp_path / "base"),
                 "--out", str(tmp_path / "out2")]) == 2
    assert "steps: 250 in" in capsys.readouterr().err and not (tmp_path / "out2").exists()


def test_a_config_at_another_frequency_pairs_with_native_at_that_frequency_else_the_plain_one(tmp_path):
    for seed, (sync, f5, sync_f5) in {1: (1.00, 0.90, 0.95), 2: (1.10, 1.00, 1.04)}.items():
        write(tmp_path / "a" / f"seed{seed}", seed, {"soap-sync": sync, "soap-async-f5": f5, "adamw": 1.5})
        write(tmp_path / "b" / f"seed{seed}", seed, {"soap-sync": sync, "soap-sync-f5": sync_f5, "soap-async-f5": f5})
    for folder, native, reference in (("a", "soap-sync", (1.00, 1.10)), ("b", "soap-sync-f5", (0.95, 1.04))):
        assert main(["gather", str(tmp_path / folder), "--out", str(tmp_path / f"out-{folder}")]) == 0
        pairs = json.loads((tmp_path / f"out-{folder}" / "seeds.json").read_text())["pairs"]
        assert set(pairs) == {"soap-async-f5"} and pairs["soap-async-f5"]["native"] == native
        deltas = [0.90 / reference[0] - 1, 1.00 / reference[1] - 1]
        assert list(pairs["soap-async-f5"]["final_val_loss"]["per_seed"].values()) == pytest.approx(deltas)


def test_seeds_reads_each_file_once_and_refuses_malformed_results(tmp_path, capsys):
    write(tmp_path / "a" / "seed1", 1, {"shampoo-sync": 1.0, "shampoo-async": 1.01})
    # The same file reached through its folder and by its own path counts once.
    assert main(["gather", str(tmp_path / "a"), str(tmp_path / "a" / "seed1" / "results.json"),
                 "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "seeds.json").read_text())["configs"]["shampoo-sync"]["runs"] == {"1": 1}
    capsys.readouterr()
    for name, payload in (("noseed", {"device": "X", "config": {"model": "tiny"}, "runs": {}}),
                          ("nullconfig", {"device": "X", "config": None, "runs": {}}),
                          ("listruns", {"device": "X", "config": {"seed": 1}, "runs": []}),
                          ("norun", {"device": "X", "config": {"seed": 1}, "runs": {}}),
                          ("boolseed", {"device": "X", "config": {"seed": True}, "runs": {"adamw": {}}}),
                          ("numberdevice", {"device": 3, "config": {"seed": 1}, "runs": {"adamw": {}}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(payload))
        assert main(["gather", str(tmp_path / name), "--out", str(tmp_path / "out")]) == 2
        assert "config.seed (an int >= 0), the device's name and runs (config label -> row)" in \
            capsys.readouterr().err, name
    for name, row, message in (("text", {"final_val_loss": "5.2"}, "runs['adamw']['final_val_loss']='5.2': must be"),
                               ("label", {}, "Invalid config='foo'")):
        (tmp_path / name).mkdir()
        payload = {"device": "X", "config": {"seed": 1}, "runs": {"foo" if name == "label" else "adamw": row}}
        (tmp_path / name / "results.json").write_text(json.dumps(payload))
        assert main(["gather", str(tmp_path / name), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert f"Invalid results file {str(tmp_path / name / 'results.json')!r}" in err and message in err, err
    # A file named on the command line must be a bench results.json (below a folder, others are skipped).
    (tmp_path / "other.json").write_text(json.dumps({"steps": [1, 2]}))
    assert main(["gather", str(tmp_path / "a"), str(tmp_path / "other.json"), "--out", str(tmp_path / "out")]) == 2
    assert f"Invalid run path {str(tmp_path / 'other.json')!r}: not an `asteria bench` results.json" in \
        capsys.readouterr().err
    # A baseline with no native config to compare with
    write(tmp_path / "adamw-only" / "seed1", 1, {"adamw": 1.2})
    assert main(["gather", str(tmp_path / "a"), "--baseline", str(tmp_path / "adamw-only"),
                 "--out", str(tmp_path / "out")]) == 2
    assert "Invalid baseline: its configs ['adamw'] hold no native (X-sync) config to compare the runs' " \
           "['shampoo-sync', 'shampoo-async'] with" in capsys.readouterr().err


def test_seeds_names_the_files_whose_settings_differ_and_pools_timing_only_settings(tmp_path, capsys):
    newest = CONFIG | {"deterministic": False}
    write(tmp_path / "nd" / "a", 1, {"soap-sync": 1.0, "soap-async": 1.01}, newest | {"workers": 4})
    write(tmp_path / "nd" / "b", 2, {"soap-sync": 1.0, "soap-async": 1.01}, newest | {"workers": 14})
    # Under the newest-finished rule the workers decide which versions are used: not pooled.
    assert main(["gather", str(tmp_path / "nd"), "--out", str(tmp_path / "out")]) == 2
    assert "workers: 4 in" in capsys.readouterr().err
    schedule = CONFIG | {"deterministic": True}
    write(tmp_path / "x" / "seed1", 1, {"soap-sync": 1.0, "soap-async": 1.01}, schedule | {"workers": 4})
    write(tmp_path / "y" / "seed2", 2, {"soap-sync": 1.0, "soap-async": 1.01}, schedule | {"workers": 14})
    # Under the deterministic rule they change only the timing: pooled.
    assert main(["gather", str(tmp_path / "x"), str(tmp_path / "y"), "--out", str(tmp_path / "out")]) == 0
    write(tmp_path / "z" / "seed3", 3, {"soap-sync": 1.0, "soap-async": 1.01}, schedule | {"steps": 100})
    capsys.readouterr()
    assert main(["gather", str(tmp_path / "x"), str(tmp_path / "y"), str(tmp_path / "z"),
                 "--out", str(tmp_path / "out2")]) == 2
    error = capsys.readouterr().err
    assert f"steps: 250 in {tmp_path / 'x' / 'seed1' / 'results.json'}" in error
    assert f"100 in {tmp_path / 'z' / 'seed3' / 'results.json'}" in error


def test_a_setting_newer_than_the_results_counts_as_what_runs_had_before_it(tmp_path, capsys):
    old = {k: v for k, v in CONFIG.items() if k != "stagger"}  # written before stagger and lag_steps existed
    write(tmp_path / "old" / "seed1", 1, {"soap-sync": 1.0, "soap-async": 1.01}, old)
    write(tmp_path / "new" / "seed2", 2, {"soap-sync": 1.0, "soap-async": 1.02}, CONFIG | {"lag_steps": None})
    assert main(["gather", str(tmp_path / "old"), str(tmp_path / "new"), "--out", str(tmp_path / "out")]) == 0
    write(tmp_path / "lag" / "seed3", 3, {"soap-sync": 1.0, "soap-async": 1.0}, CONFIG | {"lag_steps": 2})
    capsys.readouterr()
    assert main(["gather", str(tmp_path / "old"), str(tmp_path / "lag"), "--out", str(tmp_path / "out2")]) == 2
    assert "lag_steps: null in" in capsys.readouterr().err
    # Late activation: the default (None) is on under the newest-finished rule, so it pools with runs that
    # asked for it; runs from before it existed had it off.
    newest = CONFIG | {"deterministic": False}
    write(tmp_path / "auto" / "seed1", 1, {"soap-sync": 1.0, "soap-async": 1.01}, newest | {"late_activation": None})
    write(tmp_path / "asked" / "seed2", 2, {"soap-sync": 1.0, "soap-async": 1.02}, newest | {"late_activation": True})
    write(tmp_path / "before" / "seed3", 3, {"soap-sync": 1.0, "soap-async": 1.03}, newest)
    assert main(["gather", str(tmp_path / "auto"), str(tmp_path / "asked"), "--out", str(tmp_path / "out3")]) == 0
    capsys.readouterr()
    assert main(["gather", str(tmp_path / "auto"), str(tmp_path / "before"), "--out", str(tmp_path / "out4")]) == 2
    assert "late_activation: true in" in capsys.readouterr().err


def test_t_quantiles_past_the_table_continue_it():
    from seeds import _t95

    assert _t95(30) == T95[29] and _t95(31) == pytest.approx(2.0395, abs=2e-3)
    assert _t95(60) == pytest.approx(2.0003, abs=2e-3) and _t95(120) == pytest.approx(1.9799, abs=2e-3)
    assert all(_t95(df) > _t95(df + 1) > 1.96 for df in range(1, 200))


def test_seeds_lists_the_code_that_wrote_the_results(tmp_path):
    for seed, code in ((1, "aaaaaaaaaaaa"), (2, "aaaaaaaaaaaa"), (3, None)):
        write(tmp_path / f"seed{seed}", seed, {"soap-sync": 1.0, "soap-async": 1.01})
        if code is not None:
            file = tmp_path / f"seed{seed}" / "results.json"
            file.write_text(json.dumps(json.loads(file.read_text()) | {"software": {"code": code}}))
    assert main(["gather", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "seeds.json").read_text())["code"] == {"aaaaaaaaaaaa": 2, "unknown": 1}
    text = (tmp_path / "out" / "seeds.md").read_text()
    assert "Code: aaaaaaaaaaaa (2 results files), unknown (1 results files) (runs of different code" in text


def test_runs_record_the_software_that_made_them():
    import re

    import torch

    import asteria
    from asteria.train.provenance import code_fingerprint, software

    info = software()
    assert re.fullmatch(r"[0-9a-f]{12}", info["code"]) and info["code"] == code_fingerprint()
    assert info["asteria"] == asteria.__version__ and info["torch"] == torch.__version__


def test_native_runs_pool_across_settings_only_asteria_mode_reads(tmp_path, capsys):
    """Native-only results pool although their Asteria-mode settings differ (late activation, the rule,
    split groups: nothing a native run reads), and pair with Asteria runs of one setting; two files whose
    Asteria runs differ in such a setting are still refused."""
    newest = CONFIG | {"deterministic": False}
    write(tmp_path / "native" / "a", 1, {"soap-sync": 1.00}, CONFIG | {"late_activation": False})
    write(tmp_path / "native" / "b", 2, {"soap-sync": 1.10}, newest | {"stagger_split": None, "staleness": 3})
    write(tmp_path / "asteria" / "seed1", 1, {"soap-async": 0.98}, newest | {"late_activation": None})
    write(tmp_path / "asteria" / "seed2", 2, {"soap-async": 1.09}, newest | {"late_activation": None})
    assert main(["gather", str(tmp_path / "native"), str(tmp_path / "asteria"), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "seeds.json").read_text())
    pair = summary["pairs"]["soap-async"]["final_val_loss"]["per_seed"]
    assert list(pair.values()) == pytest.approx([0.98 / 1.00 - 1, 1.09 / 1.10 - 1])
    # The same native runs as a baseline: no difference reported for settings they do not read.
    assert main(["gather", str(tmp_path / "asteria"), "--baseline", str(tmp_path / "native"),
                 "--out", str(tmp_path / "out2")]) == 0
    assert json.loads((tmp_path / "out2" / "seeds.json").read_text())["baseline_differs_in"] == {}
    write(tmp_path / "asteria" / "seed3", 3, {"soap-async": 1.0}, newest | {"late_activation": False})
    capsys.readouterr()
    assert main(["gather", str(tmp_path / "native"), str(tmp_path / "asteria"), "--out", str(tmp_path / "out3")]) == 2
    assert "late_activation: true in" in capsys.readouterr().err


def write_with_runs(folder, seed: int, losses: dict[str, list[float]]) -> None:
    """A bench results.json and, per config, the run folder `asteria train` leaves (metrics.jsonl, summary.json)."""
    write(folder, seed, {label: series[-1] + 0.1 for label, series in losses.items()})
    for label, series in losses.items():
        run = folder / label
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": loss, "wall": 0.1 * (i + 1),
                                                               "step_time": 0.1}) + "\n"
                                                   for i, loss in enumerate(series)))
        (run / "summary.json").write_text(json.dumps({"label": label, "device": "cpu", "vocab_size": 256,
                                                      "final_loss": series[-1]}))


def test_the_gap_over_the_run_pairs_each_seeds_windows_and_names_the_seeds_left_out(tmp_path, capsys):
    # 20 steps in 10 windows of 2; native's loss falls linearly, Asteria's is a known factor above it per window.
    native = [3.0 - 0.1 * i for i in range(20)]
    factors = {1: [1.0, 1.0, 1.01, 1.02, 1.03, 1.03, 1.02, 1.01, 1.0, 1.0],
               2: [1.0, 0.99, 1.0, 1.04, 1.05, 1.01, 1.0, 1.0, 0.99, 1.0]}
    for seed, per_window in factors.items():
        ours = [loss * per_window[i // 2] for i, loss in enumerate(native)]
        write_with_runs(tmp_path / f"seed{seed}", seed, {"shampoo-sync": native, "shampoo-async": ours})
    # Seed 0 comes first, with other steps: the windows most seeds share count.
    write_with_runs(tmp_path / "seed0", 0, {"shampoo-sync": native[:15], "shampoo-async": native[:15]})
    write_with_runs(tmp_path / "seed4", 4, {"shampoo-sync": native, "shampoo-async": native[:-1] + [math.nan]})
    write(tmp_path / "seed5", 5, {"shampoo-sync": 1.0, "shampoo-async": 1.0})  # results without run folders
    write_with_runs(tmp_path / "seed6", 6, {"shampoo-sync": native, "shampoo-async": native})
    (tmp_path / "seed6" / "shampoo-async" / "metrics.jsonl").write_text("{not json\n")  # damaged: its losses count
    assert main(["gather", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    gap = json.loads((tmp_path / "out" / "seeds.json").read_text())["gap_over_run"]["shampoo-async"]
    assert gap["native"] == "shampoo-sync"
    assert gap["windows"] == [[2 * w + 1, 2 * w + 2] for w in range(10)]
    for seed, per_window in factors.items():
        assert gap["per_seed"][str(seed)] == pytest.approx([f - 1 for f in per_window])
    for w, stats in enumerate(gap["stats"]):
        values = [factors[1][w] - 1, factors[2][w] - 1]
        assert stats["mean"] == pytest.approx(statistics.fmean(values))
        assert stats["se"] == pytest.approx(statistics.stdev(values) / math.sqrt(2), abs=1e-12)
    assert gap["left_out"] == {"0": "other steps (1-15 against the other seeds' 1-20)",
                               "4": "no common steps, or a loss that is not finite",
                               "5": "no run folder with its metrics.jsonl",
                               "6": gap["left_out"]["6"]}
    assert gap["left_out"]["6"].startswith(f"Invalid run={str(tmp_path / 'seed6' / 'shampoo-async')!r}: unreadable")
    assert json.loads((tmp_path / "out" / "seeds.json").read_text())["pairs"]["shampoo-async"]["final_val_loss"][
        "per_seed"]["6"] == 0.0
    table = capsys.readouterr().out
    assert "| shampoo-async vs shampoo-sync | 2 | +0.00 ± 0.00% | -0.50 ± 0.50% |" in table
    assert "steps 19-20" in table and "seed 5 left out of the gap over the run: no run folder" in table
    assert (tmp_path / "out" / "gap.png").stat().st_size > 1000


def test_no_gap_over_the_run_without_run_folders_and_why_when_every_seed_is_left_out(tmp_path, capsys):
    out = tmp_path / "out"
    write_with_runs(tmp_path / "with" / "seed1", 1, {"soap-sync": [2.0, 1.9], "soap-async": [2.0, 1.8]})
    assert main(["gather", str(tmp_path / "with"), "--out", str(out)]) == 0
    assert (out / "gap.png").is_file()
    capsys.readouterr()
    # Results alone: nothing to say about the gap, and the earlier report's plot is not left behind.
    write(tmp_path / "bare" / "seed1", 1, {"soap-sync": 1.0, "soap-async": 1.01})
    assert main(["gather", str(tmp_path / "bare"), "--out", str(out)]) == 0
    gap = json.loads((out / "seeds.json").read_text())["gap_over_run"]["soap-async"]
    assert gap["windows"] == [] and gap["per_seed"] == {}
    assert "gap over the run" not in capsys.readouterr().out and not (out / "gap.png").exists()
    # Every seed left out for another reason (here, Asteria diverged): said, with the reason.
    write_with_runs(tmp_path / "nan" / "seed2", 2, {"soap-sync": [2.0, 1.9], "soap-async": [2.0, math.nan]})
    assert main(["gather", str(tmp_path / "nan"), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert ("No training-loss gap over the run for soap-async vs soap-sync:\n- seed 2 left out of the gap over the "
            "run: no common steps, or a loss that is not finite") in table
