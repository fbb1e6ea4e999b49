"""How the stagger cuts the factor sets (``RuntimeConfig.stagger_sets_per_step``) and what a checkpoint needs of
it: the versions and the refreshes in flight are saved per set, so a checkpoint loads only into sets cut as its
were, and a different cut is refused by name, never loaded into the wrong sets."""

from __future__ import annotations

import pytest
import torch
from conftest import regression_data, resume_is_exact, small_mlp, train

import asteria

SIZES = (16,) * 25 + (4,)  # 24 weights of 16 x 16 and 24 biases: sets large enough to cut


def make(sets_per_step: int, sizes: tuple[int, ...] = SIZES, max_dim: int = 16, **runtime):
    model = small_mlp(sizes=sizes)
    config = asteria.RuntimeConfig(mode="async", staleness=1, workers=1, deterministic=True,
                                   stagger_sets_per_step=sets_per_step, **runtime)
    return model, asteria.Shampoo(model.parameters(), lr=0.01, precondition_frequency=10,
                                  max_preconditioner_dim=max_dim, precondition_1d=True, runtime=config)


@pytest.mark.parametrize(("sets_per_step", "sets"), [(1, 15), (2, 27), (4, 75)])
def test_more_sets_a_step_cut_the_large_sets_finer(sets_per_step, sets):
    """24 blocks of 16 per set, three such sets of 24 x 16^3 among 6 (all sets: 3 x 98304 + 3 small ones, about
    294,960): at 1 a step the share of 10 steps holds 7 blocks (4 runs a set), at 2 it holds 3 (8 runs), at 4
    one (24 runs); the three small sets stay whole."""
    _, opt = make(sets_per_step)
    with opt:
        assert opt.stagger_split and len(opt._set_groups) == sets
        assert sum(s.batch for s, _ in opt._set_groups) == 3 * 24 + 3 * 1


def test_a_checkpoint_cut_otherwise_is_refused_by_name_and_resumes_with_its_cut():
    data = regression_data(sizes=SIZES)
    model, opt = make(1)
    with opt:
        train(model, opt, 7, data=data)
        saved = opt.state_dict()
    assert saved["stagger_cut"] == {"split": True, "sets_per_step": 1, "small": True}
    # Written before the cut was recorded, when the small sets were spread with the large ones.
    model, opt = make(1, stagger_small=False)
    with opt:
        train(model, opt, 7, data=data)
        legacy = {k: v for k, v in opt.state_dict().items() if k != "stagger_cut"}
    for state, before, small in ((saved, ", the small ones apart", {}),
                                 (legacy, r" \(saved before asteria recorded the cut", {"stagger_small": False})):
        _, opt = make(2)
        with opt, pytest.raises(ValueError, match=r"its factor sets were cut for the stagger at 1 a step" + before
                                + r".*this optimizer's at 2, the small ones apart; resume with "
                                r"RuntimeConfig\(stagger_sets_per_step=1"):
            opt.load_state_dict(state)
        _, opt = make(1, **small)
        with opt:
            opt.load_state_dict(state)
    # The cut named in the error resumes bit for bit.
    assert resume_is_exact(lambda: make(1), data, before=7, after=8)
    # Sets split on one side and whole on the other: named too (before, the versions' count said only "differ").
    _, whole = make(2, stagger_split=False)
    with whole, pytest.raises(ValueError, match=r"its factor sets were split for the stagger, this optimizer's are "
                                                r"whole \(RuntimeConfig.stagger_split differ"):
        whole.load_state_dict(saved)


def test_a_checkpoint_whose_sets_no_cut_divides_loads_at_any_unit_and_split():
    """One block per shape: no set can be cut, so a checkpoint written before the cut was recorded (at 1 a step),
    or with its sets whole, loads at the default 2 with the sets split."""
    sizes = (16, 16, 8)
    saved = {}
    for label, runtime in (("legacy", {}), ("whole", {"stagger_split": False})):
        model, opt = make(1, sizes=sizes, **runtime)
        with opt:
            train(model, opt, 5, data=regression_data(sizes=sizes))
            saved[label] = opt.state_dict()
    del saved["legacy"]["stagger_cut"]
    assert saved["whole"]["stagger_cut"] == {"split": False, "sets_per_step": 1, "small": True}
    for state in saved.values():
        _, opt = make(2, sizes=sizes)
        with opt:
            assert opt.stagger_split
            opt.load_state_dict(state)
            assert opt._step == 5 and torch.is_tensor(next(iter(opt._groups[0].state.values())))


def test_a_checkpoint_with_the_small_sets_cut_otherwise_is_refused_by_name_and_resumes_with_its_cut():
    """Blocks of 32 and of 16 (the small ones: at most half the largest): with ``stagger_small`` the 24 blocks of
    16 x 16 are cut by an even share of the small sets' work, finer than by a share of all of it. A checkpoint of
    the other cut names the setting it was saved with, and resumes bit for bit with it."""
    sizes = (32, 32) + (16,) * 25
    data = regression_data(sizes=sizes)
    cuts = {}
    for small in (False, True):
        model, opt = make(1, sizes=sizes, max_dim=32, stagger_small=small)
        with opt:
            cuts[small] = [s.batch for s, _ in opt._set_groups if s.dim == 16]
            train(model, opt, 7, data=data)
            saved = opt.state_dict()
        _, other = make(1, sizes=sizes, max_dim=32, stagger_small=not small)
        with other, pytest.raises(ValueError, match=rf"resume with RuntimeConfig\(stagger_small={small}\)"):
            other.load_state_dict(saved)
    assert max(cuts[True]) < max(cuts[False]) and sum(cuts[True]) == sum(cuts[False])
    assert resume_is_exact(lambda: make(1, sizes=sizes, max_dim=32, stagger_small=False), data, before=7, after=8)


def test_a_schedule_refusal_names_stagger_small_only_where_it_moved_the_phases():
    """Sets whole (no cut to differ), 27 of them in layers of 32 and of 16 down to 9: a checkpoint spread with the
    small sets among the large ones differs from the default only in its phases, and the refusal names
    ``stagger_small``; into an unstaggered schedule the setting would not help, and the refusal does not name it."""
    sizes = (32,) * 8 + (16, 15, 14, 13, 12, 11, 10, 9)
    model, opt = make(1, sizes=sizes, max_dim=32, stagger_small=False, stagger_split=False)
    with opt:
        train(model, opt, 7, data=regression_data(sizes=sizes))
        saved = opt.state_dict()
    _, staggered = make(1, sizes=sizes, max_dim=32, stagger_split=False)
    with staggered, pytest.raises(ValueError, match=r"\(phases differ.*saved with RuntimeConfig.stagger_small=False"):
        staggered.load_state_dict(saved)
    _, unstaggered = make(1, sizes=sizes, max_dim=32, stagger=False, stagger_split=False)
    with unstaggered, pytest.raises(ValueError, match="phases differ") as refused:
        unstaggered.load_state_dict(saved)
    assert "stagger_small" not in str(refused.value)
