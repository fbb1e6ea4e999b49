"""The device lane's child where torch's CUDA allocator maps expandable segments (``PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True``, which a model that nearly fills the card wants): the slots cross to the child from
segments of fixed size, so the child opens them without the ptrace rights that an expandable segment's memory
takes (``asteria.memory.fixed_segments``). Each GPU case runs in a process of its own, whose allocator starts with
the setting; they are skipped without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from asteria import memory
from asteria.memory import fixed_segments

# The training process as an unprivileged container makes it: not dumpable, so that another process of the same
# user has no ptrace rights over it (unless it holds CAP_SYS_PTRACE). The lane's refresh of a set of roots through
# the child is compared with the same math here; the segments come from the allocator's own snapshot.
CASE = r"""
import contextlib, ctypes, json, sys
import torch
from asteria import memory
from asteria.pipeline import lane_process
from asteria.pipeline.factors import FactorSet, RootRequest
from asteria.pipeline.refresh_math import refresh_set

fixed = sys.argv[1] == "fixed"
if not fixed:  # (the control: the slots as any tensor of this process)
    lane_process.fixed_segments = lambda device: contextlib.nullcontext()
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
device = torch.device("cuda", torch.cuda.current_device())
g = torch.randn(2, 96, 160, device=device, generator=torch.Generator(device).manual_seed(3))
fset = FactorSet(name="set", factors=g @ g.mT / 160, preconditioners=torch.eye(96, device=device).repeat(2, 1, 1),
                 installed=torch.zeros(2, dtype=torch.bool, device=device), exponent=-0.25, block_params=["p", "p"])
request = RootRequest(scale=1.0, eps=1e-6)
expected = refresh_set(fset, fset.factors, request, fset.preconditioners, fset.installed, in_thread=True)


def segment_of(tensor):
    address = tensor.data_ptr()
    [segment] = [s for s in torch.cuda.memory_snapshot() if s["address"] <= address < s["address"] + s["total_size"]]
    return segment["is_expandable"]


child = lane_process.LaneProcess(device, [fset], threads=1, timeout_s=120.0 if fixed else 30.0)
result = {"expandable_on": memory.expandable_segments(), "slot_expandable": segment_of(child.slots[0])}
try:
    got, _ = child.refresh(0, fset, fset.factors, request, torch.cuda.current_stream())
    result["error"] = float((got.new - expected.new).abs().max() / expected.new.abs().max())
    result["usable"] = bool(torch.equal(got.usable, expected.usable))
except RuntimeError as failed:
    result["failed"] = str(failed)
finally:
    child.close()
result["later_expandable"] = segment_of(torch.empty(2**26, dtype=torch.uint8, device=device))
print(json.dumps(result))
"""


def run_case(mode: str) -> dict:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    done = subprocess.run([sys.executable, "-c", CASE, mode], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_lanes_child_opens_its_slots_under_expandable_segments_without_ptrace_rights():
    """With the allocator's expandable segments and no ptrace rights over the training process, the child maps
    the slots and computes what this process computes; the slots lie in fixed segments while the allocations
    after them are expandable again. Without ``fixed_segments`` (the control) the slot lies in an expandable
    segment, and where the machine enforces the ptrace check the child cannot open it: the lane breaks, named."""
    got = run_case("fixed")
    assert got["expandable_on"] and got["slot_expandable"] is False and got["later_expandable"] is True
    assert "failed" not in got, got["failed"]
    assert got["error"] < 1e-5 and got["usable"]
    control = run_case("control")
    assert control["slot_expandable"] is True
    if "failed" in control:  # (a machine whose root holds CAP_SYS_PTRACE opens it anyway)
        assert control["failed"].startswith("the device lane's process"), control["failed"]


@pytest.mark.parametrize("settings, calls", [
    ("expandable_segments:True", ["expandable_segments:False", "expandable_segments:True"]),
    ("max_split_size_mb:64,expandable_segments:true", ["expandable_segments:False", "expandable_segments:True"]),
    ("expandable_segments:False", []), ("", []),
])
def test_fixed_segments_switches_expandable_segments_off_for_its_block_only(monkeypatch, settings, calls):
    """Where the allocator's segments are expandable they are fixed inside the block and expandable again after,
    also when the block raises; elsewhere, and off the GPU, nothing is set. (What the setting does to an
    allocation is the GPU case's above, whose process starts with the setting.)"""
    made = []
    monkeypatch.setattr(memory, "allocator_settings", lambda: settings)
    monkeypatch.setattr(memory, "_set_allocator_settings", made.append)
    with pytest.raises(KeyError), fixed_segments(torch.device("cuda")):
        assert made == calls[:1]
        raise KeyError("inside")
    assert made == calls
    made.clear()
    with fixed_segments(torch.device("cpu")):
        pass
    assert made == []
