"""The memory a step takes beyond the optimizer's state, what a step that runs out of it says, and the bench's
record of a config that does.

A step's temporaries are tensors of a whole shape group's size (at olmo2-1b one group stacks 256 blocks of
2048 x 2048: 4 GiB), so each one the step keeps alive at once moves the step's peak by that much. The GPU cases
measure the peak with the CUDA allocator's counters; they are skipped without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

import asteria
from asteria import functional as F
from asteria.memory import explain_out_of_memory, gib
from asteria.train import cli

BLOCKS, SIDE, FREQUENCY = 16, 256, 4
#: a step's peak above what was allocated before it, in temporaries of the group's size: for Shampoo the Adam
#: direction and the two products of the preconditioning (the momentum's bias correction goes into Adam's
#: denominator); for SOAP and KL-Shampoo the stacked gradients, the direction and the two operands of a rotation
TEMPORARIES = {"shampoo": 3, "soap": 4, "kl_shampoo": 4}
OPTIMIZERS = {"shampoo": asteria.Shampoo, "soap": asteria.SOAP, "kl_shampoo": asteria.KLShampoo}


def step_peaks(name: str) -> list[int]:
    """Bytes above the allocation before ``step()`` that each step after the first refresh reached at most
    (the steps that refresh nothing: the native mode decomposes the factors inside refresh steps)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(SIDE, SIDE, device="cuda")) for _ in range(BLOCKS)]
    opt = OPTIMIZERS[name](params, lr=1e-3, precondition_frequency=FREQUENCY, max_preconditioner_dim=SIDE,
                           runtime=asteria.RuntimeConfig(mode="sync"))
    peaks = []
    with opt:
        for step in range(1, 2 * FREQUENCY):
            for param in params:
                param.grad = torch.randn_like(param)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            torch.cuda.synchronize()
            if step > FREQUENCY and not opt.is_refresh_step(step):
                peaks.append(torch.cuda.max_memory_allocated() - before)
    assert len(opt._groups) == 1 and opt._groups[0].batch == BLOCKS  # one shape group
    return peaks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_keeps_few_temporaries_of_the_group_size(name):
    group_bytes = BLOCKS * SIDE * SIDE * 4
    peaks = step_peaks(name)
    assert peaks
    # A quarter of a group for the small tensors (per-block scalars and masks) and the allocator's rounding.
    assert max(peaks) <= (TEMPORARIES[name] + 0.25) * group_bytes, [p / group_bytes for p in peaks]


def test_in_place_directions_equal_the_formulas():
    """The step's in-place forms against the formulas written out: the Adam direction over its denominator
    (with a bias of 1.0 and with per-block biases) and the graft."""
    torch.manual_seed(1)
    m, v = torch.randn(5, 6, 7), torch.rand(5, 6, 7)
    bias1, bias2 = torch.rand(5) + 0.5, torch.rand(5) + 0.5
    for b1, b2 in [(bias1, bias2), (1.0, 0.5), (0.3, bias2), (bias1, 0.5)]:
        expected = (m / F.per_block(b1, m)) / ((v / F.per_block(b2, v)).sqrt() + 1e-8)
        torch.testing.assert_close(F.adam_direction(m, v, b1, b2, 1e-8), expected, rtol=1e-6, atol=0)
    m_before = m.clone()
    F.adam_direction(m, v, bias1, bias2, 1e-8)
    assert torch.equal(m, m_before)  # the momentum is read, never changed
    direction, target = torch.randn(5, 6, 7), torch.randn(5, 6, 7)
    norms = torch.linalg.vector_norm(target.reshape(5, -1), dim=1) / torch.linalg.vector_norm(
        direction.reshape(5, -1), dim=1)
    grafted = F.graft_(direction.clone(), target)
    torch.testing.assert_close(grafted, direction * norms.view(5, 1, 1), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.linalg.vector_norm(grafted.reshape(5, -1), dim=1),
                               torch.linalg.vector_norm(target.reshape(5, -1), dim=1), rtol=1e-5, atol=0)


@pytest.mark.usefixtures("one_thread")
def test_a_config_that_runs_out_of_gpu_memory_leaves_the_others_their_bench(tmp_path, capsys, monkeypatch):
    """torch's out-of-memory error, raised by Shampoo's third step (the CPU has no GPU to fill): the bench notes
    that config with the steps it recorded, runs and tabulates the others, and exits with status 1; when no
    config fits, it refuses with the configs named (status 2)."""
    from test_cli import TINY

    step = asteria.Shampoo.step
    calls = []

    def third_step_fails(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB. If reserved but "
                                         "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(asteria.Shampoo, "step", third_step_fails)
    argv = ["bench", "--out", str(tmp_path), "--steps", "4", "--eval-every", "4", *TINY]
    assert cli.main([*argv, "--configs", "adamw", "shampoo-async", "soap-sync"]) == 1
    out, err = capsys.readouterr()
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["runs"]) == ["adamw", "soap-sync"]
    expected = "out of GPU memory after 2 recorded steps: CUDA out of memory. Tried to allocate 4.00 GiB."
    assert results["failed"] == {"shampoo-async": expected}
    assert f"shampoo-async      {expected}" in out and "shampoo-async ran out of GPU memory" in err
    assert (tmp_path / "report.md").exists() and len((tmp_path / "shampoo-async" / "metrics.jsonl").read_text()
                                                    .splitlines()) == 2
    calls.clear()
    assert cli.main([*argv, "--configs", "shampoo-async"]) == 2
    assert "every one ran out of GPU memory" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["soap", "kl_shampoo"])
def test_a_version_used_at_once_is_installed_at_the_end_of_its_step(name):
    """SOAP and KL-Shampoo read a version from the step after its refresh; one used at once (the start-up
    refreshes, computed by the device lane inline) is installed when its step ends, so the lane holds no such result
    between steps (on a GPU: 8 GiB of bases at olmo2-1b through the next forward pass). On the CPU, with the
    lane asked for."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 32)) for _ in range(4)]
    opt = OPTIMIZERS[name](params, lr=1e-3, precondition_frequency=FREQUENCY, max_preconditioner_dim=32,
                           runtime=asteria.RuntimeConfig(device_refresh=True, workers=1))
    started = []
    with opt:
        for step in range(1, 3 * FREQUENCY):
            for param in params:
                param.grad = torch.randn_like(param)
            opt.step()
            # (an async version the lane finished during the step waits there for its activation)
            with opt._refresher.lane._lock:
                held = [key for key in opt._refresher.lane._results if opt.timeline.used_at_once(*key)]
            assert held == [], step
            due = opt.schedule.due(step)
            started += [(step, version) for index, version in due if opt.timeline.used_at_once(index, version)]
            for index, version in due:
                if opt.timeline.used_at_once(index, version):
                    assert min(opt._set_groups[index][0].versions) == version, (step, index)
    assert [version for _, version in started][-1] == opt.runtime.sync_refreshes  # the start-up versions ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_start_up_bases_leave_the_gpu_with_their_step():
    """Between SOAP's steps the GPU holds its state and no start-up result: the memory after the first
    refresh's step is what it was before it, give or take less than half the bases' bytes (lane buffers)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(SIDE, SIDE, device="cuda")) for _ in range(BLOCKS)]
    opt = asteria.SOAP(params, lr=1e-3, precondition_frequency=FREQUENCY, max_preconditioner_dim=SIDE)
    bases = BLOCKS * 2 * SIDE * SIDE * 4
    allocated = []
    with opt:
        for _ in range(FREQUENCY):
            for param in params:
                param.grad = torch.randn_like(param)
            opt.step()
            torch.cuda.synchronize()
            # (the next allocation frees the blocks whose side-stream uses have ended: as the forward pass would)
            torch.empty(1, device="cuda")
            allocated.append(torch.cuda.memory_allocated())
    assert opt.is_refresh_step(FREQUENCY)
    assert abs(allocated[-1] - allocated[-2]) < bases / 2, (allocated[-2:], bases)


def test_running_out_of_gpu_memory_in_a_step_names_what_the_state_holds():
    """torch's out-of-memory error from inside ``step()`` (here raised by the closure: the CPU has no GPU to fill)
    comes out as torch's type, with the optimizer's share of the device and the settings that take less; the step
    counted nothing, and the next one goes on."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 32)) for _ in range(4)]
    opt = asteria.Shampoo(params, lr=1e-3, precondition_frequency=2, max_preconditioner_dim=32,
                          runtime=asteria.RuntimeConfig(workers=1))

    def closure():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    with opt:
        for param in params:
            param.grad = torch.randn_like(param)
        opt.step()
        with pytest.raises(torch.OutOfMemoryError) as raised:
            opt.step(closure)
        report = opt.memory_report()
        assert str(raised.value).startswith("CUDA out of memory. Tried to allocate 2.00 GiB.\nIn Shampoo.step(): the "
                                            f"optimizer's state holds {gib(report['device']['total'])} on the device (")
        assert "max_preconditioner_dim" in str(raised.value) and "expandable_segments:True" in str(raised.value)
        assert "placement='host'" not in str(raised.value)  # CPU parameters' roots are in host memory already
        assert opt._step == 1
        opt.step()
        assert opt._step == 2
    # On a GPU under the device placement, moving the preconditioners is offered, with their bytes.
    report["device"] = {"root": 2**31, "factor": 2**31, "momentum": 2**30, "total": 5 * 2**30}
    soap = type("SOAP", (), {"memory_report": lambda _: report})()
    text = explain_out_of_memory(RuntimeError("CUDA out of memory."), soap)
    assert text == ("CUDA out of memory.\nIn SOAP.step(): the optimizer's state holds 5.00 GiB on the device (root "
                    "2.00 GiB, factor 2.00 GiB, momentum 1.00 GiB); MemoryConfig(placement='host') keeps the 2.00 "
                    "GiB of preconditioners in pinned host memory (and turns the device lane off); a smaller "
                    "max_preconditioner_dim shrinks the factors and preconditioners; "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before CUDA starts, lets memory freed "
                    "between tensors of different sizes serve the next ones")


def test_group_bytes_bounds_the_shape_groups_from_the_cli():
    """``--group-bytes`` reaches ``MemoryConfig.group_bytes``: every shape group's preconditioner bytes stay within
    it (a step's temporaries are each a group's parameter size), where the unbounded run has larger groups; a bad
    value, or the option with AdamW, is refused by name."""
    from asteria.optim.groups import preconditioner_bytes
    from asteria.train.loop import make_optimizer
    from asteria.train.model import build_model
    from asteria.train.run_config import RunConfig

    def groups(**given):
        cfg = RunConfig(model="tiny", optimizer="shampoo", mode="sync", seq_len=32, **given)
        with make_optimizer(cfg, build_model("tiny", 256, 32)) as opt:
            return [(g.batch, preconditioner_bytes(g.shape)) for g in opt._groups]

    square = preconditioner_bytes((128, 128))
    bound = 3 * square  # three of the tiny model's square blocks
    unbounded, bounded = groups(), groups(group_bytes=bound)
    assert max(batch * each for batch, each in unbounded) > bound
    assert all(batch * each <= bound or batch == 1 for batch, each in bounded)
    assert max(batch for batch, each in bounded if each == square) == 3
    assert sum(batch for batch, _ in bounded) == sum(batch for batch, _ in unbounded)  # the same blocks
    with pytest.raises(ValueError, match=r"Invalid group_bytes=0: must be None or an int >= 1"):
        RunConfig(group_bytes=0)
    with pytest.raises(ValueError, match=r"Invalid --group-bytes 1024 with --optimizer adamw"):
        cli.check_unused_options(RunConfig(optimizer="adamw", group_bytes=1024), {"group_bytes"})


def square_params(count: int = 6, side: int = 64) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(side, side)) for _ in range(count)]


def test_the_device_bounds_its_shape_groups_by_default(monkeypatch):
    """Without ``group_bytes`` the preconditioners kept on the parameters' device are batched in groups of at most
    ``DEVICE_GROUP_BYTES`` (1 GiB: at olmo2-1b a whole shape group's temporaries found no room on an 80 GB card),
    here lowered to two blocks' bytes; a bound given wins, and the math does not see the batching."""
    from asteria.optim import placement
    from asteria.optim.groups import preconditioner_bytes

    assert placement.DEVICE_GROUP_BYTES == 2**30
    monkeypatch.setattr(placement, "DEVICE_GROUP_BYTES", 2 * preconditioner_bytes((64, 64)))
    trained = {}
    for label, memory in (("default", asteria.MemoryConfig()), ("one group", asteria.MemoryConfig(group_bytes=2**40))):
        params = square_params()
        with asteria.Shampoo(params, lr=0.1, precondition_frequency=2,
                             runtime=asteria.RuntimeConfig(mode="sync", memory=memory)) as opt:
            batches = [group.batch for group in opt._groups]
            for _ in range(5):
                for param in params:
                    param.grad = param.detach() * 0.5 + 0.1
                opt.step()
        trained[label] = (batches, [param.detach().clone() for param in params])
    assert trained["default"][0] == [2, 2, 2] and trained["one group"][0] == [6]
    for a, b in zip(trained["default"][1], trained["one group"][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_larger_groups_names_the_bound_that_loads_it(monkeypatch):
    """A checkpoint whose shape groups are larger than the default bound's (saved before the device had one) is
    refused naming the ``group_bytes`` that batches the blocks as it did; with that bound it loads."""
    from asteria.optim import placement
    from asteria.optim.groups import preconditioner_bytes

    monkeypatch.setattr(placement, "DEVICE_GROUP_BYTES", 2 * preconditioner_bytes((64, 64)))
    whole = 6 * preconditioner_bytes((64, 64))

    def shampoo(**memory):
        return asteria.Shampoo(square_params(), precondition_frequency=2,
                               runtime=asteria.RuntimeConfig(mode="sync", memory=asteria.MemoryConfig(**memory)))

    with shampoo(group_bytes=2**40) as saved:
        for param in saved.param_groups[0]["params"]:
            param.grad = torch.ones_like(param)
        saved.step()
        state = saved.state_dict()
    hint = rf"MemoryConfig\(group_bytes={whole}\), its largest group's preconditioner bytes, groups them as it does"
    with shampoo() as bounded, pytest.raises(ValueError, match=hint):
        bounded.load_state_dict(state)
    with shampoo(group_bytes=whole) as matching:
        matching.load_state_dict(state)
        assert [group.batch for group in matching._groups] == [6]
    with shampoo(group_bytes=whole + 1) as other, pytest.raises(ValueError, match=r"stagger_split differ\)$"):
        state["layout"][0][2] = 5  # (no bound batches the blocks so: no hint)
        other.load_state_dict(state)
