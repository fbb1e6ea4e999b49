"""``RuntimeConfig.express_workers``: threads beside the workers that take only the small blocks' refreshes (the
pool's and the engine's behaviour is tested in C++: express_workers_test.cpp). Here: the default count and size
bound, the threads' life with the optimizer, and that who computes a refresh never changes the result."""

from __future__ import annotations

import pytest
import torch
from conftest import EXPRESS_THREAD_NAME, regression_data, small_mlp, train, worker_threads

import asteria
from asteria import _core

SIZES = (12, 4, 24, 8)  # blocks of 4 to 24: those of at most 12 are the express workers'
DATA = regression_data(sizes=SIZES)
OPTIMIZERS = {"shampoo": asteria.Shampoo, "soap": asteria.SOAP, "kl-shampoo": asteria.KLShampoo}


def test_by_default_as_many_as_the_pinned_workers_where_some_block_is_at_most_half_the_largest():
    config = asteria.RuntimeConfig(workers=3)
    assert config.resolved_express([2048, 768, 256]) == (3, 1024)
    assert config.resolved_express([2048, 1025]) == (0, 1024)  # no block that small: none
    assert config.resolved_express([]) == (0, 0)
    # unpinned workers: express ones would share the training thread's cores above the workers' priority
    assert asteria.RuntimeConfig(workers=3, worker_cpus="any").resolved_express([2048, 256]) == (0, 1024)
    assert asteria.RuntimeConfig(workers=3, worker_cpus="any", express_workers=2).resolved_express([256]) == (2, 128)
    assert asteria.RuntimeConfig(workers=3, express_workers=1).resolved_express([2048]) == (1, 1024)
    assert asteria.RuntimeConfig(workers=3, express_workers=0).resolved_express([2048, 256]) == (0, 1024)


def test_the_engine_refuses_a_negative_count_or_size_by_name():
    with pytest.raises(ValueError, match="Invalid express_workers=-1: must be >= 0"):
        _core.RefreshEngine(workers=1, express_workers=-1)
    with pytest.raises(ValueError, match="Invalid express_max_n=-2: must be >= 0"):
        _core.RefreshEngine(workers=1, express_workers=1, express_max_n=-2)


def test_the_express_workers_start_with_the_optimizer_and_end_at_close():
    model = small_mlp(sizes=SIZES)
    before = worker_threads(EXPRESS_THREAD_NAME)
    opt = asteria.Shampoo(model.parameters(), precondition_frequency=2,
                          runtime=asteria.RuntimeConfig(workers=2, device_refresh=False))
    assert worker_threads(EXPRESS_THREAD_NAME) == before + 2
    train(model, opt, 6, data=DATA)
    stats = opt.runtime_stats()
    assert stats["express_workers"] == 2 and stats["workers"] == 2
    opt.close()
    assert worker_threads(EXPRESS_THREAD_NAME) == before
    model = small_mlp(sizes=SIZES)
    with asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(workers=2, express_workers=0,
                                                                          device_refresh=False)) as opt:
        assert worker_threads(EXPRESS_THREAD_NAME) == before
        assert opt.runtime_stats()["express_workers"] == 0


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_who_computes_a_refresh_does_not_change_the_trajectory(name):
    """Under the deterministic rule every version comes into use at its scheduled step, so runs that differ
    only in which threads compute (none, one or three express workers) train bit for bit alike."""
    finals = []
    for express in (0, 1, 3):
        model = small_mlp(sizes=SIZES)
        runtime = asteria.RuntimeConfig(workers=2, express_workers=express, deterministic=True, staleness=2,
                                        device_refresh=False, timeout_s=30.0)
        with OPTIMIZERS[name](list(model.named_parameters()), lr=0.01, precondition_frequency=2,
                              runtime=runtime) as opt:
            losses = train(model, opt, 16, data=DATA)
            assert opt.runtime_stats()["refresh_failures"] == 0
        assert losses[-1] < losses[0]
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(finals[0], finals[1]) and torch.equal(finals[0], finals[2])
