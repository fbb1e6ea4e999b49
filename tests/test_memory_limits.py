"""The host memory the up-front checks compare with, and the NVMe tier's account of its own: the least of what the
machine, the process's cgroup and its address-space limit can give; the tier's install scratch counted from the
start; nothing of it reported, or left on disk, once it is closed or refused."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import small_mlp, train

import asteria
from asteria import memory

SIZES = (8, 32, 32, 32, 4)


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as file:
        file.write(text)


def test_the_cgroup_limit_bounds_the_room_v2_and_v1(tmp_path):
    cgroup = tmp_path / "proc_cgroup"
    write(cgroup, "0::/job/step\n")
    root = tmp_path / "v2"
    write(root / "job/step/memory.max", "3000000\n")
    write(root / "job/step/memory.current", "1000000\n")
    assert memory.cgroup_room(str(cgroup), str(root)) == 2_000_000
    write(root / "job/step/memory.stat", "active_file 7\ninactive_file 500000\n")  # page cache the kernel reclaims
    assert memory.cgroup_room(str(cgroup), str(root)) == 2_500_000
    write(root / "job/step/memory.max", "max\n")  # no limit here, nor above
    assert memory.cgroup_room(str(cgroup), str(root)) is None
    write(root / "job/memory.max", "8000000\n")  # a limit on a parent (Slurm's job, a systemd slice)
    write(root / "job/memory.current", "6000000\n")
    assert memory.cgroup_room(str(cgroup), str(root)) == 2_000_000
    inside = tmp_path / "container"  # a container's own cgroup mounted at the root
    write(inside / "memory.max", "5000\n")
    write(inside / "memory.current", "9000\n")  # over (the kernel reclaims): no room, not a negative one
    assert memory.cgroup_room(str(cgroup), str(inside)) == 0
    write(cgroup, "4:memory:/job\n1:cpu:/\n")
    v1 = tmp_path / "v1"
    write(v1 / "memory/job/memory.limit_in_bytes", "8000000\n")
    write(v1 / "memory/job/memory.usage_in_bytes", "6000000\n")
    assert memory.cgroup_room(str(cgroup), str(v1)) == 2_000_000
    write(v1 / "memory/job/memory.limit_in_bytes", "9223372036854771712\n")  # v1's "unlimited"
    assert memory.cgroup_room(str(cgroup), str(v1)) is None
    assert memory.cgroup_room(str(tmp_path / "absent"), str(v1)) is None


def test_the_address_space_limit_bounds_what_the_host_can_give():
    """Under RLIMIT_AS an allocation past the limit fails however much the machine has free: the checks must see
    the limit (in a process of its own, which sets it after its imports)."""
    script = textwrap.dedent("""
        import resource
        from asteria import memory
        assert memory.address_space_room() is None or resource.getrlimit(resource.RLIMIT_AS)[0] != -1
        used = memory._read_int("/proc/self/status", "VmSize:", unit=1024)
        resource.setrlimit(resource.RLIMIT_AS, (used + 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
        room = memory.address_space_room()
        assert 2**29 < room <= 2**30, room
        assert memory.host_available() <= room
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


def make(nvme_dir=None, host_budget=None):
    model = small_mlp(sizes=SIZES)
    config = asteria.MemoryConfig(nvme_dir=nvme_dir, host_budget=host_budget, group_bytes=8 * 8 * 4 * 2 * 4)
    runtime = asteria.RuntimeConfig(staleness=2, workers=1, memory=config, deterministic=True)
    return model, asteria.Shampoo(model.parameters(), lr=0.02, eps=1e-6, max_preconditioner_dim=8,
                                  precondition_frequency=3, runtime=runtime)


def test_the_nvme_tiers_install_scratch_is_counted_from_the_start(tmp_path):
    """The tier makes its install scratch at a shape's first install; the report at construction, which the
    host_budget check reads, counted it only from then on, so a budget accepted at construction was passed later."""
    _, probe = make()
    with probe:
        host = probe.memory_report()["host"]
    budget = host["refresh_buffers"] + (host["total"] - host["refresh_buffers"]) // 2
    model, opt = make(str(tmp_path / "pages"), budget)
    with opt:
        start = opt.memory_report()["host"]
        assert start["nvme_buffers"] > 0 and start["total"] <= budget
        train(model, opt, 8)
        assert opt.memory_report()["host"] == start
    report = opt.memory_report()  # closed: its page files are gone
    assert report["nvme"]["total"] == 0 and all(v == 0 for v in report["nvme"].values())


def test_a_refused_nvme_tier_removes_the_folders_it_made(tmp_path):
    """A budget the paged state still passes is refused after the tier made its folders: they go with it."""
    _, probe = make()
    with probe:
        host = probe.memory_report()["host"]
    tight = host["refresh_buffers"] + 1
    with pytest.raises(ValueError, match=rf"Invalid host_budget={tight}: too small .*nvme_buffers"):
        make(str(tmp_path / "made" / "for" / "pages"), host_budget=tight)
    assert sorted(os.listdir(tmp_path)) == []  # (before: made/for/pages stayed, empty)
    (tmp_path / "kept").mkdir()
    _, opt = make(str(tmp_path / "kept" / "pages"), host_budget=tight - 1 + (host["total"] - tight) // 2)
    opt.close()
    assert sorted(os.listdir(tmp_path)) == ["kept"]  # only what the tier made goes
    with pytest.raises(ValueError, match=r"Invalid memory.nvme_dir=.*must be a directory this process can create"):
        make(str(tmp_path / "made" / ("x" * 300)), host_budget=tight)  # a name too long: made/ is made, x... not
    assert sorted(os.listdir(tmp_path)) == ["kept"]


def test_memory_settings_changed_after_construction_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"Invalid nvme_dir='a\\x00b': must be None or a directory path .*no NUL"):
        asteria.MemoryConfig(nvme_dir="a\0b")
    runtime = asteria.RuntimeConfig()
    runtime.memory = None  # (a dataclass: the caller may change it after building it)
    with pytest.raises(ValueError, match=r"Invalid memory=None: must be an asteria.MemoryConfig"):
        asteria.Shampoo(torch.nn.Linear(4, 4).parameters(), runtime=runtime)


def test_the_ranks_torchrun_starts_on_a_host_share_what_it_can_pin(monkeypatch):
    """Each rank checks its pinned bytes at about the same time as the others: each may take its share of what the
    host can give, not all of it."""
    from asteria.optim import placement

    monkeypatch.setattr(placement, "host_available", lambda: 4000)
    assert placement.host_room() == (4000, "the least of MemAvailable, its cgroup's limit and RLIMIT_AS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert placement.host_room() == (1000, "the least of MemAvailable, its cgroup's limit and RLIMIT_AS, shared by "
                                           "this host's 4 ranks")
    monkeypatch.setattr(placement, "host_available", lambda: None)
    assert placement.host_room()[0] is None
