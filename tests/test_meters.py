"""The GPU memory a run records: the meter of its processes (``train.meters.ProcessMemoryMeter``: the training
process's and the device lane's, contexts included, as the driver lists them), and the caching allocator's figures
of each step (what it holds, and its retries, which the bench counts over the steady steps)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import hold_plan

import asteria
from asteria.train.meters import ProcessMemoryMeter


def listed(meter: ProcessMemoryMeter, processes: dict[int, int | None]) -> ProcessMemoryMeter:
    """``meter`` reading ``processes`` (pid: bytes, None where NVML has no figure) as NVML's list of the GPU's."""
    meter.handle = object()
    meter._list = lambda handle: [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in processes.items()]
    return meter


def test_without_a_gpu_the_meter_reads_nothing():
    assert ProcessMemoryMeter(torch.device("cpu"), [12345]).read() is None


def test_the_meter_sums_this_process_and_its_helpers_and_no_other():
    """A helper not (yet) listed counts nothing; another process on the GPU is not the run's."""
    me, helper, stranger = os.getpid(), os.getpid() + 1, os.getpid() + 2
    meter = listed(ProcessMemoryMeter(torch.device("cpu"), [helper]), {me: 3 << 20, helper: 5 << 20, stranger: 1 << 30})
    assert meter.read() == 8 << 20
    assert listed(meter, {me: 3 << 20, stranger: 1 << 30}).read() == 3 << 20


@pytest.mark.parametrize("own", ["absent", "not available"])
def test_the_meter_reads_nothing_where_the_driver_does_not_list_this_process(own):
    """In a PID namespace apart from the driver's, NVML lists other numbers; some drivers give no figure."""
    helper = os.getpid() + 1
    processes = {helper: 5 << 20} | ({} if own == "absent" else {os.getpid(): None})
    assert listed(ProcessMemoryMeter(torch.device("cpu"), [helper]), processes).read() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_meter_counts_the_device_lanes_process_beside_the_training_processes_pool():
    """What the driver gives the training process covers its allocator's pool; the lane's process (a CUDA context
    and workspace of its own, from its first job on) adds to it, which torch's counters of this process leave
    out."""
    device = torch.device("cuda")
    model = torch.nn.Linear(256, 256, device=device)
    runtime = asteria.RuntimeConfig(device_refresh=True, device_process=True)
    with asteria.Shampoo(list(model.named_parameters()), lr=0.01, precondition_frequency=2, runtime=runtime) as opt:
        hold_plan(opt._refresher, True)  # (past the start-up versions, which the training process computes itself)
        for _ in range(10):
            model(torch.randn(64, 256, device=device)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        opt._refresher.lane.drain(60.0)
        assert opt.runtime_stats()["device_versions"] > 2 * 2  # (two sets' start-up versions, and the lane's)
        helpers = opt.runtime_stats()["device_process_ids"]
        assert len(helpers) == 1
        alone, run = ProcessMemoryMeter(device), ProcessMemoryMeter(device, helpers)
        if alone.read() is None:
            pytest.skip("NVML does not list this process (no NVML, or a PID namespace apart from the driver's)")
        assert alone.read() >= torch.cuda.memory_reserved(device)
        assert run.read() > alone.read()


def run_records(tmp_path, device: str) -> list[dict]:
    from asteria.train.cli import main

    assert main(["train", "--model", "tiny", "--device", device, "--steps", "4", "--batch-size", "2", "--seq-len",
                 "32", "--optimizer", "shampoo", "--out", str(tmp_path)]) == 0
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_cpu_runs_steps_carry_no_allocator_figures(tmp_path):
    for record in run_records(tmp_path, "cpu"):
        assert not {"gpu_allocated_bytes", "gpu_reserved_bytes", "gpu_alloc_retries"} & record.keys()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_each_gpu_step_records_what_the_allocator_holds_and_its_retries(tmp_path):
    """Reserved covers allocated at each step's end; the retries are a running count (a card nearly full shows
    them climbing, and the reserved bytes falling between steps)."""
    records = run_records(tmp_path, "cuda")
    assert len(records) == 4
    for record in records:
        assert record["gpu_reserved_bytes"] >= record["gpu_allocated_bytes"] > 0
    retries = [record["gpu_alloc_retries"] for record in records]
    assert retries == sorted(retries) and retries[0] >= 0


def test_the_allocators_retries_count_from_the_warm_ups_end():
    """The steady steps' retries: the cumulative counter at the last step less at the last warm-up step (from 0
    without a warm-up); None off a GPU (no counter) or without steady steps."""
    from asteria.train.bench import steady_alloc_retries

    records = [{"gpu_alloc_retries": count} for count in (0, 1, 1, 3, 5)]
    assert steady_alloc_retries(records, 2) == 4  # steps 3-5: 5 - 1
    assert steady_alloc_retries(records, 0) == 5
    assert steady_alloc_retries(records, 5) is None
    assert steady_alloc_retries([{}] * 5, 2) is None
    assert steady_alloc_retries(records[:3] + [{}], 2) is None
