"""The NVMe tier: preconditioners paged to real files under a tiny host budget give the same bits as
all-host state, resume exactly, and I/O faults surface as clear errors."""

from __future__ import annotations

import errno
import os
import resource
import signal
import time

import pytest
import torch
from conftest import regression_data, resume_is_exact, small_mlp, train

import asteria
from asteria.errors import StateLostError

SIZES = (8, 32, 32, 32, 4)
GROUP_BYTES = 8 * 8 * 4 * 2 * 4  # four (8, 8) blocks per shape group: many sets of one shape


def make(name: str, nvme_dir=None, budget: int | None = None, nvme_budget: int | None = None):
    model = small_mlp(sizes=SIZES)
    memory = asteria.MemoryConfig(nvme_dir=nvme_dir, host_budget=budget, group_bytes=GROUP_BYTES,
                                  nvme_budget=nvme_budget)
    runtime = asteria.RuntimeConfig(staleness=2, workers=1, memory=memory, deterministic=True)
    kwargs = {"lr": 0.02, "eps": 1e-6} if name == "shampoo" else {}
    cls = {"shampoo": asteria.Shampoo, "soap": asteria.SOAP, "kl-shampoo": asteria.KLShampoo}[name]
    return model, cls(model.parameters(), max_preconditioner_dim=8, precondition_frequency=3, runtime=runtime,
                      **kwargs)


def tiny_budget(name: str) -> int:
    """Room for the refresh buffers and half of the preconditioners: the rest must go to NVMe."""
    _, opt = make(name)
    with opt:
        host = opt.memory_report()["host"]
    return host["refresh_buffers"] + (host["total"] - host["refresh_buffers"]) // 2


@pytest.mark.parametrize("name", ["shampoo", "soap", "kl-shampoo"])
def test_nvme_tier_gives_the_all_host_bits(name, tmp_path):
    data = regression_data(sizes=SIZES)
    model, opt = make(name)
    with opt:
        train(model, opt, 14, data=data)
    budget = tiny_budget(name)
    paged_model, paged = make(name, str(tmp_path), budget)
    with paged:
        report = paged.memory_report()
        assert report["host"]["total"] <= budget and report["nvme"]["total"] > 0
        assert len(os.listdir(tmp_path)) == 1  # the optimizer's own directory
        train(paged_model, paged, 14, data=data)
        report = paged.memory_report()
        assert report["nvme_bytes_read"] > 0 and report["nvme_bytes_written"] > 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), paged_model.parameters(), strict=True))
    assert os.listdir(tmp_path) == []  # close() removes the page files
    with pytest.raises(RuntimeError, match=r"Invalid state_dict\(\) after close\(\): the preconditioners on the "
                                           "NVMe tier went with their page files"):
        paged.state_dict()  # and a checkpoint without them would not resume


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_nvme_tier_resumes_exactly(name, tmp_path):
    budget = tiny_budget(name)
    assert resume_is_exact(lambda: make(name, str(tmp_path), budget), regression_data(sizes=SIZES))


def page_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".astp"))


def test_corrupted_and_removed_pages_raise_clear_errors(tmp_path):
    budget = tiny_budget("shampoo")
    data = regression_data(sizes=SIZES)
    model, opt = make("shampoo", str(tmp_path), budget)
    with opt:
        # Bootstrap at step 3, version 2 of every set at step 6 (f = 3, both used at their own step);
        # version 3 comes into use only at step 13 (S = 2): the next steps read the live version 2.
        train(model, opt, 7, data=data)
        for path in page_files(tmp_path):
            size = os.path.getsize(path)
            # A byte of every slot's payload (slots A and B of 4096 bytes, each a 64-byte header and the
            # payload): no good version is left to fall back on, whichever slot holds the live one.
            with open(path, "r+b") as f:
                for offset in range(64 + 17, size, 4096):
                    f.seek(offset)
                    byte = f.read(1)
                    f.seek(offset)
                    f.write(bytes([byte[0] ^ 0xFF]))
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(OSError, match=r"corrupt page|[Cc]hecksum|no readable version") as info:
            train(model, opt, 3, data=data)
        assert str(tmp_path) in str(info.value) or "asteria-nvme-" in str(info.value)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        del before
    model, opt = make("shampoo", str(tmp_path), budget)
    with opt:
        train(model, opt, 4, data=data)
        os.remove(page_files(tmp_path)[0])
        with pytest.raises((OSError, KeyError)) as info:
            train(model, opt, 3, data=data)
        assert "asteria-nvme-" in str(info.value)


def test_full_disk_raises_and_the_previous_version_stays(tmp_path):
    budget = tiny_budget("shampoo")
    data = regression_data(sizes=SIZES)
    model, opt = make("shampoo", str(tmp_path), budget)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    with opt:
        train(model, opt, 4, data=data)
        try:
            # Page files are already this large: a write beyond 4 KiB into any file now fails.
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))
            with pytest.raises(OSError) as info:
                train(model, opt, 12, data=data)
            assert info.value.errno in (errno.EFBIG, errno.ENOSPC) and "asteria-nvme-" in str(info.value)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
            signal.signal(signal.SIGXFSZ, old_handler)
        # With space back, the set whose write failed has no newest version on disk: every later step fails
        # at once, naming it and how to recover (never an internal error, never a wait for timeout_s).
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(StateLostError, match=r"lost their newest version \(writing it failed: .*load the "
                                                     r"last state_dict\(\) into a new optimizer"):
                train(model, opt, 1, data=data)
            assert time.monotonic() - started < 5.0
        # The last good versions are still readable: a checkpoint holds them, finite.
        state = opt.state_dict()
        roots = [t for g in state["groups"] for k, t in g.items() if k.startswith("root")]
        assert len(roots) == sum(len(k) for k in opt._placement.paged_keys.values()) + sum(
            1 for g in opt._groups for k in g.state if k.startswith("root"))
        assert all(torch.isfinite(t).all() for t in roots)


def test_nvme_configuration_errors(tmp_path):
    params = small_mlp().parameters
    with pytest.raises(ValueError, match="Invalid memory.nvme_dir=.*mode='async'"):
        asteria.Shampoo(params(), runtime=asteria.RuntimeConfig(
            mode="sync", memory=asteria.MemoryConfig(nvme_dir=str(tmp_path))))
    with pytest.raises(ValueError, match="Invalid nvme_dir=''"):
        asteria.MemoryConfig(nvme_dir="")
    with pytest.raises(ValueError, match=r"Invalid host_budget=100: too small .* host needs \d+ bytes"):
        make("shampoo", str(tmp_path), 100)
    assert os.listdir(tmp_path) == []


def test_nvme_budget_bounds_the_page_files(tmp_path):
    budget = tiny_budget("shampoo")
    _, probe = make("shampoo", str(tmp_path), budget)
    with probe:
        need = probe.memory_report()["nvme"]["total"]
    assert need > 0
    with pytest.raises(ValueError, match=rf"Invalid nvme_budget={need - 1}: the page files need {need} bytes to fit "
                                         rf"host_budget={budget} \(placement"):
        make("shampoo", str(tmp_path), budget, nvme_budget=need - 1)
    assert os.listdir(tmp_path) == []  # the refused optimizer removed its page files
    model, opt = make("shampoo", str(tmp_path), budget, nvme_budget=need)
    with opt:
        train(model, opt, 4, data=regression_data(sizes=SIZES))
        assert opt.memory_report()["nvme"]["total"] == need
    with pytest.raises(ValueError, match="Invalid nvme_budget=4096: bounds the page files under nvme_dir"):
        asteria.MemoryConfig(nvme_budget=4096)


def test_an_nvme_dir_that_cannot_hold_files_is_refused_by_name(tmp_path):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    with pytest.raises(ValueError, match=rf"Invalid memory.nvme_dir='{not_a_directory}': must be a directory this "
                                         r"process can create files in \(File exists\)"):
        make("shampoo", str(not_a_directory), tiny_budget("shampoo"))


def test_a_step_that_times_out_on_the_nvme_tier_goes_on_as_all_host(tmp_path):
    """Shampoo waits in its step for the refresh of that step. When the wait times out under a host budget
    that pages half the roots to NVMe, the step counts without a parameter update (as all-host), and the
    run goes on through the same fault to the bits of the all-host run: no page buffer or read-ahead is
    left behind by the raise."""
    from test_fault_injection import next_refreshes, run_to

    from asteria import testing

    def run(nvme_dir=None, budget=None):
        model = small_mlp(sizes=SIZES)
        memory = asteria.MemoryConfig(nvme_dir=nvme_dir, host_budget=budget, group_bytes=GROUP_BYTES)
        runtime = asteria.RuntimeConfig(staleness=0, workers=1, stagger=False, timeout_s=2.0, memory=memory)
        opt = asteria.Shampoo(list(model.named_parameters()), lr=0.02, eps=1e-6, max_preconditioner_dim=8,
                              precondition_frequency=3, runtime=runtime)
        data = regression_data(sizes=SIZES)
        with opt:
            train(model, opt, 4, data=data)
            step = next_refreshes(opt, 1)[0]
            blocks = testing.inject_fault(opt, "0.weight[block 0]", "pause", version=opt.refresh_version(step), mode=0)
            run_to(model, opt, step - 1)
            with pytest.raises(TimeoutError, match="not done within timeout_s=2.0"):
                train(model, opt, 1, data=data)
            opt._refresher.engine.wait_paused(len(blocks), 30.0)
            opt._refresher.engine.release_pauses()
            train(model, opt, 6, data=data)
            report = opt.memory_report()
        return [p.detach().clone() for p in model.parameters()], report

    host, report = run()
    budget = report["host"]["refresh_buffers"] + (report["host"]["total"] - report["host"]["refresh_buffers"]) // 2
    paged, paged_report = run(str(tmp_path), budget)
    assert paged_report["nvme"]["total"] > 0 and paged_report["nvme_bytes_read"] > 0
    assert all(torch.equal(a, b) for a, b in zip(host, paged, strict=True))


def test_a_lost_newest_version_fails_every_later_step_by_name(tmp_path):
    """One bit flipped in the slot holding a set's newest version: the step that reads it raises, and so does
    every later one, naming the set and how to recover, instead of going on quietly with the older copy the
    pager falls back to. The buffers the failed step had acquired go back: no later step waits for them."""
    from asteria.errors import StateLostError

    budget = tiny_budget("shampoo")
    data = regression_data(sizes=SIZES)
    model, opt = make("shampoo", str(tmp_path), budget)
    with opt:
        train(model, opt, 7, data=data)  # versions 1 and 2 of every set written; 2 is live
        paged = opt._placement.tier.paged
        fset = next(f for f, _ in opt._placement.home_sets if f in paged)
        key = paged.key[id(fset)]
        path = next(p for p in page_files(tmp_path) if f"{key:016x}" in os.path.basename(p))
        with open(path, "r+b") as f:  # one payload bit of the slot (A or B) that holds the newest version
            header = f.read(64)
            slot_bytes = int.from_bytes(header[32:40], "little")  # see cpp/asteria/store/page_format.h
            for offset in (0, slot_bytes):
                f.seek(offset + 16)  # the version field
                if int.from_bytes(f.read(8), "little") == paged._versions[key]:
                    f.seek(offset + 64 + 17)
                    byte = f.read(1)
                    f.seek(offset + 64 + 17)
                    f.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(OSError, match=r"[Cc]hecksum|corrupt"):
            train(model, opt, 1, data=data)
        for _ in range(3):  # more steps than the read-ahead buffers: none is left held by a failed read
            with pytest.raises(StateLostError, match=r"lost their newest version .* load the last state_dict\(\) "
                                                     r"into a new optimizer") as info:
                train(model, opt, 1, data=data)
            assert fset.name in str(info.value)


def test_the_page_folders_of_killed_owners_are_reclaimed_and_live_ones_kept(tmp_path):
    """Two processes claim page folders under one nvme_dir; one is killed (SIGKILL: no close(), no cleanup).
    The next optimizer there removes the dead owner's folder and leaves the live owner's."""
    import subprocess
    import sys

    code = ("import sys; from asteria.pipeline.nvme import claim_root; root, _ = claim_root(sys.argv[1]); "
            "open(root + '/page-0000000000000000.astp', 'wb').write(b'x' * 4096); print(root, flush=True); "
            "sys.stdin.readline()")
    owners = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True) for _ in range(2)]
    live, dead = (proc.stdout.readline().strip() for proc in owners)
    owners[1].send_signal(signal.SIGKILL)
    owners[1].wait()
    try:
        assert os.path.isdir(dead) and os.path.isdir(live)
        model, opt = make("shampoo", str(tmp_path), tiny_budget("shampoo"))
        with opt:
            assert not os.path.exists(dead) and os.path.isdir(live)
            train(model, opt, 1, data=regression_data(sizes=SIZES))
        assert sorted(os.listdir(tmp_path)) == [os.path.basename(live)]  # this optimizer's own folder went too
    finally:
        owners[0].communicate("\n", timeout=30)


class _Set:
    """What the tier reads of a factor set: its identity, name and block names."""

    def __init__(self, index: int) -> None:
        self.name, self.block_params = f"set {index}", [f"p{index}"]


def test_a_refused_write_leaves_the_tiers_version_as_it_was(tmp_path):
    """The pager refuses a write of the wrong size; the tier's count of its set's versions must not move, or
    every later read would take the set's newest version for lost."""
    from asteria.pipeline.nvme import PagedSets

    fset = _Set(0)
    tier = PagedSets(str(tmp_path), [fset], [torch.ones(2, 8, 8)], pin=False, timeout_s=30.0)
    try:
        with pytest.raises(ValueError, match="Invalid bytes"):
            tier.write(fset, torch.ones(2, 8, 8, dtype=torch.float64))
        tier.write(fset, torch.full((2, 8, 8), 3.0))
        tier.schedule([fset])
        buffer, pager, index = tier.acquire(fset)  # (before, StateLostError: "lost their newest version")
        assert pager.version(0) == 2 and torch.equal(buffer, torch.full((2, 8, 8), 3.0))
        tier.release_after(pager, index, None)
    finally:
        tier.close()


def test_a_scratch_buffer_still_written_from_is_not_handed_out_after_a_timeout(tmp_path):
    """``scratch_for`` waits for the previous write from its buffer; where that wait times out the buffer stays
    held, so the next call waits again instead of handing out memory the write still reads (its half-new
    content would go to disk as the version, with a valid checksum). The write is kept in flight by a queue of
    larger writes ahead of it on the pager's two I/O threads."""
    from asteria.pipeline.nvme import PagedSets

    shape = (4, 512, 512)  # 4 MiB a version
    sets = [_Set(i) for i in range(8)]
    tier = PagedSets(str(tmp_path), sets, [torch.zeros(shape) for _ in sets], pin=False, timeout_s=30.0)
    try:
        pager, fset, timed_out = tier.pagers[shape], sets[0], 0
        for version in range(2, 8):
            ahead = [pager.write(k, version, torch.full(shape, 9.0)) for k in range(1, 8)]
            scratch = tier.scratch_for(fset, current=False)
            scratch.fill_(float(version))
            tier.commit(fset, scratch)  # queued behind the writes ahead
            tier.timeout_s = 1e-6
            try:
                tier.scratch_for(fset, current=False)
            except TimeoutError:
                timed_out += 1
            tier.timeout_s = 30.0
            again = tier.scratch_for(fset, current=False)
            assert again is scratch and pager.version(0) == version  # handed out only once written
            for ticket in ahead:
                pager.wait(ticket, 30.0)
        assert timed_out > 0  # (a write ahead of 28 MiB takes far longer than the 1 us wait)
        out = torch.empty(shape)
        assert torch.equal(tier.read_into(fset, out), torch.full(shape, 7.0))
    finally:
        tier.close()
