"""Stagger splits: factor sets bigger than an even share of an interval's refresh work are cut so that the stagger
can spread them (``RuntimeConfig.stagger_split``); the math is unchanged, and cut sets train, resume and take faults
as whole ones do."""

from __future__ import annotations

import pytest
import torch
from conftest import regression_data, resume_is_exact, small_mlp, train

import asteria
from asteria import testing
from asteria.errors import RefreshError


def test_split_for_stagger_keeps_every_set_within_an_even_share():
    from asteria.optim.groups import ShapeGroup, split_for_stagger

    def group(batch: int, shape: tuple[int, ...], tag: str) -> ShapeGroup:
        return ShapeGroup(0, shape, torch.device("cpu"), [f"{tag}{i}" for i in range(batch)],
                          [torch.zeros(1)] * batch)

    big, wide, small, flat = group(48, (8, 6), "b"), group(5, (6, 6), "w"), group(2, (4, 4), "s"), group(7, (6,), "f")
    dims = lambda g: [] if g is flat else list(g.shape)  # noqa: E731 - the 1-D group has no factor sets
    # Work: 48 (512 + 216) + 5 (216 + 216) + 2 (64 + 64) = 37360; at two sets a step an even share of 10 steps
    # is 1868, so a part of `big` holds at most 1868 // 512 = 3 blocks: 16 parts of 3.
    out = split_for_stagger([big, wide, small, flat], 10, dims, 2)
    parts = [g for g in out if g.blocks[0].startswith("b")]
    assert [g.batch for g in parts] == [3] * 16
    assert [b for g in parts for b in g.blocks] == big.blocks  # consecutive runs, in order
    assert all(g.shape == (8, 6) and g.group_index == 0 and len(g.params) == g.batch for g in parts)
    assert out[-3:] == [wide, small, flat]  # within the share, or without sets: the same objects
    assert max(g.batch * d**3 for g in out for d in dims(g)) <= 37360 / 20
    # At one set a step the share is 3736: 3736 // 512 = 7 blocks a part, 48 blocks in 7 parts of 6 or 7.
    out = split_for_stagger([big, wide, small, flat], 10, dims, 1)
    assert [g.batch for g in out if g.blocks[0].startswith("b")] == [7, 7, 7, 6, 7, 7, 7]
    assert out[-3:] == [wide, small, flat] and max(g.batch * d**3 for g in out for d in dims(g)) <= 37360 / 10
    assert split_for_stagger([big], 1, dims, 1) == [big]  # one set a step, one step an interval: nothing to spread
    lone = group(3, (10, 10), "l")  # a single block above the share stays a group of one
    assert [g.batch for g in split_for_stagger([lone, small], 10, dims, 2)] == [1, 1, 1, 2]


def refresh_loads(opt) -> list[int]:
    """The refresh work (batch x dim^3) the schedule brings at each step of one steady interval."""
    return [work for _, work in opt.schedule.interval_loads([(s.batch, s.dim) for s, _ in opt._set_groups])]


@pytest.mark.parametrize("kind", [asteria.Shampoo, asteria.SOAP, asteria.KLShampoo], ids=lambda k: k.__name__)
def test_stagger_split_evens_out_the_refresh_bursts_without_changing_the_math(kind):
    """24 layers of 16 x 16 (one group of 24 blocks per shape) at f = 10: staggered whole, each of the
    group's sets brings a third of an interval's refresh work on one step; split, no step carries more
    than twice an even share. In native mode (unstaggered) the split changes only the batching: the same
    parameters after training."""
    sizes = (16,) * 25 + (4,)

    def make(split: bool, mode: str = "async"):
        model = small_mlp(sizes=sizes)
        runtime = asteria.RuntimeConfig(mode=mode, staleness=1, workers=1, stagger_split=split)
        return model, kind(model.parameters(), lr=0.01, precondition_frequency=10, max_preconditioner_dim=16,
                           runtime=runtime)

    loads = {}
    for split in (False, True):
        _, opt = make(split)
        with opt:
            loads[split] = refresh_loads(opt)
    even = sum(loads[False]) / len(loads[False])
    assert sum(loads[True]) == sum(loads[False])
    assert max(loads[False]) > 3 * even and max(loads[True]) <= 2 * even
    runs = []
    for split in (False, True):
        model, opt = make(split, mode="sync")
        with opt:
            train(model, opt, 25, data=regression_data(sizes=sizes))
            runs.append((len(opt._set_groups), [p.detach().clone() for p in model.parameters()]))
    assert runs[1][0] > runs[0][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))
    # A checkpoint of one batching does not load into the other, and the error says why.
    (_, whole), (_, split) = make(False), make(True)
    with whole, split, pytest.raises(ValueError, match="RuntimeConfig.stagger_split differ"):
        split.load_state_dict(whole.state_dict())


@pytest.mark.parametrize("runtime, split", [
    ({"mode": "async"}, True), ({"mode": "async", "stagger": False}, False), ({"mode": "sync"}, False),
    ({"mode": "sync", "stagger": True}, True), ({"mode": "async", "stagger_split": False}, False),
], ids=["async", "async-unstaggered", "sync", "sync-staggered", "async-whole"])
def test_stagger_split_by_default_wherever_one_process_staggers(runtime, split):
    """``stagger_split=None`` (the default) splits the large factor sets exactly where the schedule is
    staggered on one process (several ranks: ``tests/distributed``); runtime_stats reports the outcome. The
    preconditioners stay on the device here, so the shape groups stay whole and only the refreshed sets are
    cut: the 24 weights' two sets and the 24 biases' set into eight runs each (two sets a step)."""
    sizes = (16,) * 25 + (4,)
    with asteria.Shampoo(small_mlp(sizes=sizes).parameters(), lr=0.01, precondition_frequency=10,
                         max_preconditioner_dim=16, precondition_1d=True,
                         runtime=asteria.RuntimeConfig(workers=1, **runtime)) as opt:
        assert opt.stagger_split is split and opt.runtime_stats()["stagger_split"] is split
        # The small sets apart wherever the schedule is staggered (stagger_small=None), as the checkpoint records.
        small = runtime.get("stagger") is not False and (runtime["mode"] == "async" or runtime.get("stagger") is True)
        assert opt.stagger_small is small and opt.state_dict()["stagger_cut"]["small"] is small
        assert len(opt._groups) == 4 and len(opt._set_groups) == (27 if split else 6)


def olmo_like_params() -> list[torch.nn.Parameter]:
    """12 layers of olmo-160m's weight shapes at a thirty-second of its width: four 24 x 24 attention weights, two
    64 x 24 and one 24 x 64 MLP weights (the 64 sides are the large factors, the 24 ones the small)."""
    shapes = [(24, 24)] * 4 + [(64, 24)] * 2 + [(24, 64)]
    return [torch.nn.Parameter(torch.zeros(shape)) for _ in range(12) for shape in shapes]


@pytest.mark.parametrize("kind", [asteria.Shampoo, asteria.SOAP], ids=lambda k: k.__name__)
def test_the_small_blocks_come_in_even_shares_over_the_interval(kind):
    """132 factors of 24 (at most half the largest, 64: the express workers' jobs) and 36 of 64 at f = 10. Spread
    with the large sets, the 96 of the attention weights come on two steps, as the 48 roots of 768 did at
    olmo-160m, and wait for a thread behind each other; spread by their own work (the default), no step brings
    more than 14 of them, and the large ones are placed as before."""
    def small_jobs(small: bool) -> tuple[list[int], list[int]]:
        runtime = asteria.RuntimeConfig(mode="async", workers=1, stagger_small=small)
        with kind(olmo_like_params(), lr=0.01, precondition_frequency=10, max_preconditioner_dim=64,
                  runtime=runtime) as opt:
            sets = [(s.batch, s.dim, phase) for (s, _), phase in zip(opt._set_groups, opt.schedule.phases)]
            assert opt.stagger_small is small and opt.runtime_stats()["stagger_small"] is small
        jobs = [[sum(b for b, d, p in sets if p == step and (d <= 32) == side) for step in range(10)]
                for side in (True, False)]
        return jobs[0], jobs[1]

    (small_before, large_before), (small_now, large_now) = small_jobs(False), small_jobs(True)
    assert sum(small_now) == sum(small_before) == 132 and sum(large_now) == 36
    assert max(small_before) >= 48 and max(small_now) <= 14
    assert sorted(large_now) == sorted(large_before)


@pytest.mark.parametrize("kind", [asteria.Shampoo, asteria.SOAP, asteria.KLShampoo], ids=lambda k: k.__name__)
def test_split_sets_on_whole_groups_train_as_split_groups_do(kind, tmp_path):
    """On the device the sets are cut into views of whole groups (one batch per shape for the step's
    math); with an NVMe tier (which moves whole sets) the groups themselves are cut. Both give the same
    refresh units in the same order, so the staggered schedule and, under the deterministic rule, every
    parameter are the same, bit for bit."""
    sizes = (16,) * 25 + (4,)
    runs = []
    for memory in (asteria.MemoryConfig(), asteria.MemoryConfig(nvme_dir=str(tmp_path))):
        model = small_mlp(sizes=sizes)
        runtime = asteria.RuntimeConfig(mode="async", staleness=1, workers=1, stagger_split=True, memory=memory,
                                        deterministic=True)
        with kind(model.parameters(), lr=0.01, precondition_frequency=10, max_preconditioner_dim=16,
                  runtime=runtime) as opt:
            train(model, opt, 35, data=regression_data(sizes=sizes))
            opt._refresher.engine.drain(60.0)  # the refreshes counted below: those still running too
            runs.append((len(opt._groups), [(s.batch, s.dim) for s, _ in opt._set_groups], list(opt.schedule.phases),
                         [p.detach().clone() for p in model.parameters()], opt.runtime_stats()["refreshes"]))
    (sliced_groups, *sliced), (split_groups, *split) = runs
    assert sliced_groups < split_groups
    assert sliced[0] == split[0] and sliced[1] == split[1] and sliced[3] == split[3] > 0
    assert all(torch.equal(a, b) for a, b in zip(sliced[2], split[2], strict=True))


@pytest.mark.parametrize("kind", [asteria.Shampoo, asteria.SOAP, asteria.KLShampoo], ids=lambda k: k.__name__)
def test_sliced_sets_resume_bit_for_bit(kind):
    """A checkpoint of sliced sets (each slice's versions, the refreshes in flight) resumes exactly."""
    sizes = (16,) * 25 + (4,)

    def make():
        model = small_mlp(sizes=sizes)
        runtime = asteria.RuntimeConfig(mode="async", staleness=1, workers=2, stagger_split=True, deterministic=True)
        return model, kind(model.parameters(), lr=0.01, precondition_frequency=10, max_preconditioner_dim=16,
                           runtime=runtime)

    _, opt = make()
    with opt:
        assert len(opt._set_groups) > 2 * len(opt._groups)  # sliced
    assert resume_is_exact(make, regression_data(sizes=sizes), before=17, after=12)


def test_fault_injection_finds_the_blocks_of_sliced_sets():
    """``asteria.testing`` reads the mode from a sliced set's name too ("..., mode 1, blocks 9-11"); a
    parameter whose jobs keep failing is named with its block's place in the shape group."""
    sizes = (16,) * 25 + (4,)
    model = small_mlp(sizes=sizes)
    runtime = asteria.RuntimeConfig(mode="async", staleness=1, workers=1, stagger_split=True)
    with asteria.Shampoo(list(model.named_parameters()), lr=0.01, precondition_frequency=10,
                         max_preconditioner_dim=16, precondition_1d=True, runtime=runtime) as opt:
        blocks = testing.engine_blocks(opt, "20.weight")
        assert sorted(b.mode for b in blocks) == [0, 1]
        assert all(b.factor.startswith("block 10 of ") and ", blocks 9-11" in b.factor for b in blocks)
        testing.inject_fault(opt, "20.weight", "throw")
        with pytest.raises(RefreshError, match=r"refresh of block 10 of param group 0, blocks \(16, 16\), mode \d, "
                                               r"blocks 9-11 of parameter '20.weight' failed"):
            train(model, opt, 40, data=regression_data(sizes=sizes))
