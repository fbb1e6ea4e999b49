"""The device lane's child process (``asteria.pipeline.lane_process``), on the CPU: the slot is a shared file
instead of CUDA IPC memory; the protocol, the math and the failures are those of a GPU's."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch
from conftest import hold_plan, regression_data, small_mlp, train

import asteria
from asteria.pipeline.factors import FactorSet, RootRequest
from asteria.pipeline.lane_process import LaneProcess, slot_fields
from asteria.pipeline.refresh_math import refresh_set

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="POSIX signals stop and resume the child")


def stopped_state(pid: int) -> str:
    """The process's state letter in ``/proc/<pid>/stat`` ("T": stopped by a signal)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def eigenbasis_set() -> FactorSet:
    """Two 8 x 8 blocks whose bases in use are their factors' eigenvectors a step ago (the warm start)."""
    g = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(4))
    old = g @ g.mT / 12
    bases = torch.linalg.eigh(old).eigenvectors.flip(-1)
    return FactorSet(name="group 0, blocks (8, 8), mode 0", factors=old + 0.05 * torch.eye(8), preconditioners=bases,
                     installed=torch.ones(2, dtype=torch.bool), exponent=-0.25, block_params=["w", "w"],
                     kind="eigenbasis")


def test_a_warm_eigenbasis_refresh_in_the_child_is_the_threads_bit_for_bit():
    """The QR refresh from the bases in use, with per-block scales, the column order and the skip count, comes back
    from the child as the same bits as computed here; the slot's fields do not overlap, but for the result, which
    takes the snapshot's place."""
    fset = eigenbasis_set()
    request = RootRequest(scale=(0.5, 2.0), eps=1e-6, skip_tol=1e-3)
    expected = refresh_set(fset, fset.factors, request, fset.preconditioners, fset.installed, in_thread=True)
    assert expected.order is not None
    child = LaneProcess(torch.device("cpu"), [fset], threads=1, timeout_s=120.0)
    try:
        got, cpu_seconds = child.refresh(0, fset, fset.factors, request, None)
        again, _ = child.refresh(0, fset, fset.factors * 2, RootRequest(scale=(0.25, 1.0), eps=1e-6, skip_tol=1e-3),
                                 None)
    finally:
        child.close()
    assert torch.equal(got.new, expected.new) and torch.equal(got.usable, expected.usable)
    assert torch.equal(got.order, expected.order) and int(got.skipped) == int(expected.skipped)
    assert torch.equal(again.new, expected.new) and cpu_seconds > 0  # 2F at half the scale: the same matrix
    assert child.child_sms is None  # no green context on the CPU
    layout = slot_fields("eigenbasis", 2, 8, torch.float32)
    assert layout["new"] == layout["factors"]  # the result takes the snapshot's place
    fields = sorted((offset, offset + dtype.itemsize * torch.Size(shape).numel())
                    for name, (offset, dtype, shape) in layout.items() if name not in ("end", "new"))
    assert all(end <= start for (_, end), (start, _) in zip(fields, fields[1:]))


def test_a_child_that_stops_answering_fails_its_job_after_timeout_s_and_every_later_one_at_once():
    """A child that ignores Ctrl-C keeps serving; one that stops fails the job waiting for it after timeout_s, and
    every later job at once (its reply is still owed), and is killed, so its GPU work ends."""
    g = torch.randn(1, 6, 9, generator=torch.Generator().manual_seed(5))
    fset = FactorSet(name="set", factors=g @ g.mT, preconditioners=torch.eye(6)[None].clone(),
                     installed=torch.zeros(1, dtype=torch.bool), exponent=-0.25, block_params=["p"])
    request = RootRequest(scale=1.0, eps=1e-6)
    child = LaneProcess(torch.device("cpu"), [fset], threads=1, timeout_s=1.0)
    child.timeout_s = 120.0  # (the child's start, importing torch, may take longer on a loaded machine)
    try:
        child.refresh(0, fset, fset.factors, request, None)
        os.kill(child.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the child too: the parent handles it
        child.refresh(0, fset, fset.factors, request, None)
        child.timeout_s = 1.0
        os.kill(child.proc.pid, signal.SIGSTOP)
        while stopped_state(child.proc.pid) != "T":  # (the stop lands asynchronously: wait until it has)
            os.sched_yield()
        message = r"did not finish refreshing set within timeout_s=1.0; later device refreshes fail"
        with pytest.raises(RuntimeError, match=message):
            child.refresh(0, fset, fset.factors, request, None)
        with pytest.raises(RuntimeError, match=message):  # at once: the slot's reply is still owed
            child.refresh(0, fset, fset.factors, request, None)
    finally:
        child.close()
    assert child.proc.returncode == -signal.SIGKILL and child.slots == []  # killed at the timeout, slots let go
    child.close()  # idempotent


def test_closing_ends_the_child_while_a_forked_process_holds_its_pipes():
    """A process forked after the lane started (a data loader's worker) holds copies of the pipes, so the child
    never sees them close: ``close`` tells it to stop instead, and returns at once."""
    fset = FactorSet(name="set", factors=torch.eye(4)[None].clone(), preconditioners=torch.eye(4)[None].clone(),
                     installed=torch.zeros(1, dtype=torch.bool), exponent=-0.25, block_params=["p"])
    child = LaneProcess(torch.device("cpu"), [fset], threads=1, timeout_s=120.0)
    child.refresh(0, fset, fset.factors, RootRequest(scale=1.0, eps=1e-6), None)
    read, write = os.pipe()
    holder = os.fork()
    if holder == 0:  # the forked process: holds everything until its parent lets it go
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        started = time.monotonic()
        child.close()
        assert child.proc.returncode == 0 and time.monotonic() - started < 30.0  # not timeout_s
    finally:
        os.close(write)  # the forked process ends
        os.waitpid(holder, 0)


def test_a_dead_lane_process_fails_the_blocks_refresh_and_the_step_names_it():
    """A child killed mid-run: its jobs fail as the workers' would (the previous versions stay in use), and past
    ``max_consecutive_failures`` the step raises saying the lane's process ended."""
    from asteria.errors import RefreshError

    model = small_mlp()
    runtime = asteria.RuntimeConfig(workers=1, stagger=False, device_refresh=True, device_process=True,
                                    max_consecutive_failures=1)
    data = regression_data()
    with asteria.Shampoo(model.parameters(), lr=1e-2, eps=1e-4, precondition_frequency=2, start_preconditioning_step=2,
                         runtime=runtime) as opt:
        refresher = opt._refresher
        train(model, opt, 4, data=data)  # versions 1 and 2, inline
        hold_plan(refresher, True)  # every set on the lane from here
        train(model, opt, 2, data=data)
        refresher.lane.drain(120.0)  # the child has started and served the lane's jobs: it waits for the next
        assert opt.runtime_stats()["device_versions"] > 2 * len(refresher.sets)
        served = [min(fset.versions) for fset in refresher.sets]
        child = refresher.lane.processes[torch.device("cpu")]
        child.proc.kill()
        child.proc.wait()
        with pytest.raises(RefreshError, match=r"device lane's process ended \(exited with code -9\) while "
                                               r"refreshing .*; later device refreshes fail"):
            train(model, opt, 24, data=data)  # (a failed version is seen when due: within S intervals)
        after = [min(fset.versions) for fset in refresher.sets]
        assert all(a >= b for a, b in zip(after, served, strict=True))  # nothing computed before is lost


def test_the_memory_report_counts_the_lane_processes_slots():
    """One slot per lane thread, each the size of the largest set's job (in and out), on the parameters' device."""
    from asteria.pipeline.lane_process import slot_bytes

    model = small_mlp()
    runtime = asteria.RuntimeConfig(workers=1, device_refresh=True, device_process=True, device_threads=2)
    with asteria.SOAP(model.parameters(), lr=1e-2, precondition_frequency=2, runtime=runtime) as opt:
        sets = opt._refresher.sets
        expected = 2 * slot_bytes(sets)
        assert expected >= 2 * max(2 * s.batch * s.dim * s.dim * 4 for s in sets)  # factors (then result), bases
        assert opt.memory_report()["device"]["lane_slots"] == expected
        assert opt.memory_report()["device"]["lane_cache"] == 0  # (a CPU child has no CUDA allocator to measure)
    runtime = asteria.RuntimeConfig(workers=1, device_refresh=True)  # the lane on the CPU: threads, no slots
    with asteria.SOAP(model.parameters(), lr=1e-2, precondition_frequency=2, runtime=runtime) as opt:
        assert "lane_slots" not in opt.memory_report()["device"]


def test_a_child_that_cannot_start_leaves_nothing_behind(monkeypatch):
    """A failed start (here, no Python to run) raises, and leaves no open file, pipe or shared file."""
    fset = FactorSet(name="set", factors=torch.eye(4)[None].clone(), preconditioners=torch.eye(4)[None].clone(),
                     installed=torch.zeros(1, dtype=torch.bool), exponent=-0.25, block_params=["p"])
    before = set(os.listdir("/proc/self/fd"))
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    with pytest.raises(FileNotFoundError, match="/nonexistent/python3"):
        LaneProcess(torch.device("cpu"), [fset], threads=2, timeout_s=30.0)
    assert set(os.listdir("/proc/self/fd")) <= before
    assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) <= shm


def test_slots_beyond_what_the_device_can_give_are_refused_before_the_child_starts(monkeypatch):
    """The lane's slots are compared with what the device can still give before anything of the lane exists: the
    error names the bytes and the settings that would fit, and the optimizer leaves no thread or child behind."""
    from asteria.pipeline import lane_process

    monkeypatch.setattr(lane_process, "device_available", lambda device: 2**20)
    started = []
    monkeypatch.setattr(lane_process.subprocess, "Popen", lambda *a, **k: started.append(a))
    threads = threading.active_count()
    runtime = asteria.RuntimeConfig(workers=1, device_refresh=True, device_process=True, device_threads=2)
    model = torch.nn.Linear(512, 512)
    with pytest.raises(ValueError, match=r"Invalid RuntimeConfig.device_threads=2: the device lane's process needs "
                                         r"\d+\.\d\d GiB on cpu for its slots .* can still give 0\.00 GiB; fewer "
                                         r"device_threads, device_process=False"):
        asteria.Shampoo(model.parameters(), runtime=runtime)
    assert started == [] and threading.active_count() == threads
