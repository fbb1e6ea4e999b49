"""``RuntimeConfig.queue_order``: under the newest-finished rule, ``"shortest"`` lets the workers take the
smallest blocks' queued refreshes first (the pool's order itself is tested in C++: queue_order_test.cpp). Here:
the setting reaches the engine, which refuses a bad one by name, and training goes on with it, SOAP's
eigenbasis chains included (a block's versions keep their order, several of them queued at once)."""

from __future__ import annotations

import pytest
from conftest import regression_data, small_mlp, train

import asteria
from asteria import _core

SIZES = (12, 4, 24, 8)  # blocks of several sides, so that the two orders differ
DATA = regression_data(sizes=SIZES)


def test_the_engine_refuses_an_order_it_does_not_know_by_name():
    with pytest.raises(ValueError, match="Invalid queue_order='fifo': must be 'deadline' or 'shortest'"):
        _core.RefreshEngine(workers=1, queue_order="fifo")


@pytest.mark.parametrize("runtime, rule", [
    ({"deterministic": True}, r"deterministic=True on one rank, lag_steps=None, staleness=5"),
    ({"lag_steps": 2}, r"deterministic=None on one rank, lag_steps=2, staleness=5"),
    ({"staleness": 0}, r"deterministic=None on one rank, lag_steps=None, staleness=0"),
])
def test_an_optimizer_on_the_deterministic_rule_refuses_the_shortest_first_by_name(runtime, rule):
    model = small_mlp(sizes=SIZES)
    with pytest.raises(ValueError, match=r"Invalid queue_order='shortest': applies to the newest-finished rule only, "
                                         r"and this optimizer runs the deterministic rule \(" + rule):
        asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(queue_order="shortest", **runtime))
    # native mode has no queue to order: the setting is not read
    asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(queue_order="shortest", mode="sync",
                                                                     **runtime)).close()


@pytest.mark.parametrize("name", ["shampoo", "soap", "kl-shampoo"])
def test_training_goes_on_with_the_smallest_blocks_first(name):
    model = small_mlp(sizes=SIZES)
    runtime = asteria.RuntimeConfig(mode="async", staleness=2, workers=1, deterministic=False, stagger=False,
                                    device_refresh=False, timeout_s=20.0, in_flight=2, queue_order="shortest")
    optimizer = {"soap": asteria.SOAP, "shampoo": asteria.Shampoo, "kl-shampoo": asteria.KLShampoo}[name]
    opt = optimizer(list(model.named_parameters()), lr=0.01, precondition_frequency=2, runtime=runtime)
    try:
        losses = train(model, opt, 24, data=DATA)
        opt._refresher.engine.drain(20.0)
        newest = max(opt._refresher._newest_versions)
        train(model, opt, 1, data=DATA)
        stats = opt.runtime_stats()
        assert stats["refresh_failures"] == 0
        assert newest > asteria.RuntimeConfig().sync_refreshes + 2  # background versions ran
        assert all(min(fset.versions) >= newest - 1 for fset in opt._refresher.sets)
        assert losses[-1] < losses[0]
    finally:
        opt.close()
