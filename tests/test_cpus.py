"""The worker CPU plan (asteria.cpus) and RuntimeConfig.worker_cpus, on a written sysfs tree
and on this machine's real one."""

from __future__ import annotations

import os

import pytest
import torch

import asteria
from asteria import cpus


def write_topology(root, siblings: dict[int, str]) -> None:
    for cpu, text in siblings.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(text + "\n")


def test_cores_group_smt_siblings(tmp_path):
    # 4 cores x 2 threads, numbered as Linux does on most x86 hosts: cpu i and i + 4 share a core.
    write_topology(tmp_path, {i: f"{i % 4},{i % 4 + 4}" for i in range(8)})
    assert cpus.physical_cores(list(range(8)), tmp_path) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Only the CPUs this process may use count; a CPU without topology is a core of its own.
    assert cpus.physical_cores([1, 2, 5, 9], tmp_path) == [[1, 5], [2], [9]]
    write_topology(tmp_path / "ranges", {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"})
    assert cpus.physical_cores([0, 1, 2, 3], tmp_path / "ranges") == [[0, 1], [2, 3]]


def test_plan_keeps_whole_cores_free_per_local_rank():
    cores = [[i, i + 8] for i in range(8)]  # 8 cores x 2 threads
    # One rank: the first two cores (and their siblings) stay free.
    assert cpus.plan_worker_cpus(cores) == sorted(c for core in cores[2:] for c in core)
    # Two ranks of one node: four cores each, two of them free; the shares do not overlap.
    first, second = cpus.plan_worker_cpus(cores, 0, 2), cpus.plan_worker_cpus(cores, 1, 2)
    assert first == [2, 3, 10, 11] and second == [6, 7, 14, 15]
    # Small shares keep one core; a single core is not pinned at all.
    assert cpus.plan_worker_cpus([[0], [1], [2]]) == [1, 2]
    assert cpus.plan_worker_cpus([[0, 1]]) == []
    assert cpus.plan_worker_cpus([[0], [1]], 1, 2) == []
    with pytest.raises(ValueError, match="Invalid local_rank=2"):
        cpus.plan_worker_cpus(cores, 2, 2)


def test_local_layout_reads_torchrun(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert cpus.local_layout() == (3, 4)
    monkeypatch.setenv("LOCAL_RANK", "9")  # inconsistent: treated as a single process
    assert cpus.local_layout() == (0, 1)


def test_runtime_config_worker_cpus():
    allowed = cpus.allowed_cpus()
    assert asteria.RuntimeConfig(worker_cpus="any").resolved_worker_cpus() == []
    explicit = asteria.RuntimeConfig(worker_cpus=[allowed[-1], allowed[-1]], workers=None)
    assert explicit.resolved_worker_cpus() == [allowed[-1]]
    assert explicit.resolved_workers() == 1
    last = allowed[-1]
    assert asteria.RuntimeConfig(worker_cpus=range(last, last + 1)).resolved_worker_cpus() == [last]
    auto = asteria.RuntimeConfig().resolved_worker_cpus()
    assert set(auto) <= set(allowed) and (auto == [] or len(auto) < len(allowed))
    for bad in ([], [-1], [max(allowed) + 1000], "all", [0.5]):
        with pytest.raises(ValueError, match=r"Invalid worker_cpus=.*'auto', 'any' or a non-empty sequence"):
            asteria.RuntimeConfig(worker_cpus=bad)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux affinity")
def test_workers_run_on_the_planned_cpus():
    """The engine's workers are pinned: a refresh runs while this thread is elsewhere, and
    runtime_stats() names the set."""
    cpu = cpus.allowed_cpus()[-1]
    model = torch.nn.Linear(6, 5)
    runtime = asteria.RuntimeConfig(worker_cpus=[cpu], staleness=0)
    with asteria.Shampoo(model.parameters(), precondition_frequency=1, runtime=runtime) as opt:
        for _ in range(3):
            model(torch.randn(4, 6)).square().sum().backward()
            opt.step()
        stats = opt.runtime_stats()
    assert stats["worker_cpus"] == [cpu] and stats["workers"] == 1 and stats["refreshes"] >= 1


@pytest.fixture
def restore_torch_threads():
    """torch's thread count and TorchThreadCap's bookkeeping as a fresh process has them, put back after:
    the caps' rules compose over every live cap, so a test sees only its own."""
    cls = cpus.TorchThreadCap
    before, saved = torch.get_num_threads(), (cls._live, cls._original, cls._last_set)
    cls._live, cls._original, cls._last_set = [], None, None
    yield before
    cls._live, cls._original, cls._last_set = saved
    torch.set_num_threads(before)


def test_training_cores_counts_the_cores_without_workers():
    allowed = cpus.allowed_cpus()
    cores = cpus.physical_cores(allowed)
    assert cpus.training_cores([]) == len(cores)
    assert cpus.training_cores(allowed) == 1  # never below one
    assert cpus.training_cores(cores[0]) == max(1, len(cores) - 1)


def test_torch_thread_cap_sets_and_restores(restore_torch_threads):
    torch.set_num_threads(2)
    assert cpus.TorchThreadCap("keep", cpus.allowed_cpus()).previous is None
    assert cpus.TorchThreadCap("auto", []).previous is None  # workers not pinned: torch keeps its pool
    cap = cpus.TorchThreadCap(1, [])
    assert torch.get_num_threads() == 1
    cap.restore()
    assert torch.get_num_threads() == 2
    auto = cpus.TorchThreadCap("auto", cpus.allowed_cpus())  # every core busy: one thread left
    assert torch.get_num_threads() == 1
    torch.set_num_threads(3)  # changed by someone else since: restore leaves it
    auto.restore()
    assert torch.get_num_threads() == 3


def test_async_optimizer_caps_torch_threads_until_close(restore_torch_threads):
    torch.set_num_threads(2)
    model = torch.nn.Linear(4, 4)
    runtime = asteria.RuntimeConfig(mode="async", workers=1, torch_threads=1)
    with asteria.Shampoo(model.parameters(), runtime=runtime) as opt:
        assert torch.get_num_threads() == 1
        assert opt.runtime_stats()["torch_threads"] == 1
    assert torch.get_num_threads() == 2


def test_the_last_of_several_caps_restores(restore_torch_threads):
    torch.set_num_threads(3)
    first, second = cpus.TorchThreadCap(1, []), cpus.TorchThreadCap("auto", cpus.allowed_cpus())
    assert torch.get_num_threads() == 1
    first.restore()
    assert torch.get_num_threads() == 1  # the second optimizer's workers still run
    second.restore()
    assert torch.get_num_threads() == 3
    second.restore()  # idempotent
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize("first_closed", ["older", "newer"])
def test_caps_of_different_counts_restore_in_any_order(restore_torch_threads, first_closed):
    torch.set_num_threads(2)
    older, newer = cpus.TorchThreadCap(1, []), cpus.TorchThreadCap(3, [])
    assert torch.get_num_threads() == 3
    (older if first_closed == "older" else newer).restore()
    assert torch.get_num_threads() == (3 if first_closed == "older" else 1)  # the live cap's count
    (newer if first_closed == "older" else older).restore()
    assert torch.get_num_threads() == 2  # the count before the first cap


@pytest.mark.parametrize("value", [0, -1, "all", 1.5, True])
def test_runtime_config_rejects_bad_torch_threads(value):
    with pytest.raises(ValueError, match=f"Invalid torch_threads={value!r}"):
        asteria.RuntimeConfig(torch_threads=value)
