"""bench/balancer_fill.py: ``asteria bench`` under a chosen plan fill (with the bench's own stagger unit), and
clear errors for values the plan cannot use."""

from __future__ import annotations

import json
import re

import pytest
from conftest import TINY_RUN, bench_script

import asteria.pipeline.balance as balance

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("argv", "message"), [
    (["--worker-utilization", "1.2", "--", "--steps", "2"], r"--worker-utilization=1.2: give a share .* \[0.1, 1.0\]"),
    (["--worker-utilization", "0", "--", "--steps", "2"], r"--worker-utilization=0.0"),
    (["--worker-utilization", "0.9"], "no asteria bench arguments"),
    (["--worker-utilization", "0.9", "--", "--steps", "two"], r"argument --steps: invalid int value: 'two'"),
])
def test_values_the_plan_cannot_use_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_script("balancer_fill").main(argv)
    assert balance.WORKER_UTILIZATION == 1.0  # the default, untouched
    assert re.search(message, capsys.readouterr().err)


def test_the_bench_runs_under_the_chosen_fill_and_unit(tmp_path, monkeypatch):
    monkeypatch.setattr(balance, "WORKER_UTILIZATION", balance.WORKER_UTILIZATION)  # restored afterwards
    argv = ["--worker-utilization", "0.85", "--", "--stagger-sets-per-step", "3", "--out", str(tmp_path), "--steps",
            "7", "--eval-every", "7", "--configs", "adamw", "shampoo-async", *TINY_RUN]
    assert bench_script("balancer_fill").main(argv) == 0
    assert balance.WORKER_UTILIZATION == 0.85
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert list(runs) == ["adamw", "shampoo-async"] and runs["shampoo-async"]["refresh_work"] is not None
    summary = json.loads((tmp_path / "shampoo-async" / "summary.json").read_text())
    assert summary["config"]["stagger_sets_per_step"] == 3
    assert json.loads((tmp_path / "balancer_fill.json").read_text()) == {"worker_utilization": 0.85}
