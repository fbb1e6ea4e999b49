"""The shadow-state pipeline on the CPU: the staggered refresh schedule and ``asteria.attach``."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import regression_data, resumed_run, same_parameters, small_mlp, train

import asteria
from asteria import testing
from asteria.pipeline.timeline import RefreshSchedule, stagger_phases

SIZES = (8, 16, 12, 4)
OPTIMIZERS = {
    "shampoo": lambda params, runtime: asteria.Shampoo(params, lr=0.02, eps=1e-6, precondition_frequency=3,
                                                       runtime=runtime),
    "soap": lambda params, runtime: asteria.SOAP(params, lr=0.01, eps=1e-4, precondition_frequency=3,
                                                 runtime=runtime),
    "kl-shampoo": lambda params, runtime: asteria.KLShampoo(params, lr=0.01, precondition_frequency=3,
                                                            runtime=runtime),
}


def test_stagger_phases_balance_the_cost():
    assert sorted(stagger_phases([1.0] * 4, 4)) == [0, 1, 2, 3]
    costs = [8.0, 5.0, 4.0, 3.0, 3.0, 1.0]
    phases = stagger_phases(costs, 3)
    load = [sum(c for c, p in zip(costs, phases, strict=True) if p == slot) for slot in range(3)]
    assert max(load) == 8.0 and sum(load) == sum(costs)  # 8 | 5+3 | 4+3+1: the best split of these costs
    assert stagger_phases(costs, 1) == [0] * len(costs)


def test_stagger_phases_balance_each_class_on_its_own():
    """Two large sets and six small ones over 4 steps: by one balance the small sets fill the two steps the large
    ones leave empty (three each); by class each step takes one or two small ones, the two where no large set
    is (ties go to the step of least load overall)."""
    costs = [100.0, 100.0] + [1.0] * 6
    together = stagger_phases(costs, 4)
    assert sorted(together[2:]) == [2, 2, 2, 3, 3, 3]
    apart = stagger_phases(costs, 4, [0, 0] + [1] * 6)
    assert apart == [0, 1, 2, 3, 0, 1, 2, 3]


def test_schedule_follows_its_definition():
    schedule = RefreshSchedule(start=2, interval=3, phases=[0, 2])
    # Set 0 refreshes at 2 (bootstrap), 5, 8, 11; set 1 at 2, 4, 7, 10: a staggered set's versions come
    # no later than the unstaggered ones.
    expected = {2: [(0, 1), (1, 1)], 4: [(1, 2)], 5: [(0, 2)], 7: [(1, 3)], 8: [(0, 3)], 10: [(1, 4)],
                11: [(0, 4)]}
    for step in range(1, 12):
        assert schedule.due(step) == expected.get(step, []), step
    assert [schedule.version_at(s, 1) for s in (1, 2, 3, 4, 6, 7, 9, 10)] == [0, 1, 1, 2, 2, 3, 3, 4]
    assert [schedule.first_staggered(i) for i in (0, 1)] == [5, 4]
    # With two aligned versions (sync_refreshes=2) the second also comes on the unstaggered step, 5;
    # set 1 then takes its phase: 7, 10.
    aligned = RefreshSchedule(start=2, interval=3, phases=[0, 2], aligned=2)
    expected = {2: [(0, 1), (1, 1)], 5: [(0, 2), (1, 2)], 7: [(1, 3)], 8: [(0, 3)], 10: [(1, 4)], 11: [(0, 4)]}
    for step in range(1, 12):
        assert aligned.due(step) == expected.get(step, []), step
    assert [aligned.version_at(s, 1) for s in (1, 2, 4, 5, 6, 7, 9, 10)] == [0, 1, 1, 2, 2, 3, 3, 4]
    with pytest.raises(ValueError, match=r"Invalid aligned=0"):
        RefreshSchedule(start=1, interval=3, phases=[0], aligned=0)
    with pytest.raises(ValueError, match=r"Invalid phases=\[3\]"):
        RefreshSchedule(start=1, interval=3, phases=[3])
    with pytest.raises(ValueError, match="Invalid stagger='yes'"):
        asteria.RuntimeConfig(stagger="yes")


@pytest.mark.parametrize("aligned", [1, 2, 3])
@pytest.mark.parametrize("start, interval", [(1, 10), (3, 3), (2, 1)])
def test_staggered_sets_refresh_every_interval_and_never_later_than_unstaggered(start, interval, aligned):
    costs = [float(c) for c in (9, 7, 7, 5, 3, 3, 2, 1)]
    staggered = RefreshSchedule(start, interval, stagger_phases(costs, interval), aligned=aligned)
    plain = RefreshSchedule(start, interval, [0] * len(costs), aligned=aligned)
    horizon = start + (aligned + 6) * interval
    for index in range(len(costs)):
        steps = [s for s in range(1, horizon) if staggered.is_refresh_step(s, index)]
        plain_steps = [s for s in range(1, horizon) if plain.is_refresh_step(s, index)]
        assert plain_steps == list(range(start, horizon, interval))
        # The aligned versions (the bootstrap and those used at their own step) are the unstaggered ones.
        assert steps[:aligned] == plain_steps[:aligned]
        # Every later version comes no later than the unstaggered one, one interval apart.
        assert len(steps) >= len(plain_steps)  # an earlier phase may fit one more refresh before the horizon
        assert all(s <= p for s, p in zip(steps[:len(plain_steps)], plain_steps, strict=True))
        assert all(b - a == interval for a, b in itertools.pairwise(steps[aligned:]))
        assert steps[aligned] > steps[aligned - 1]
        # Versions count the refreshes so far, whatever the phase, and each knows its snapshot's step.
        assert [staggered.version_at(s, index) for s in steps] == list(range(1, len(steps) + 1))
        assert [staggered.snapshot_step(index, v) for v in range(1, len(steps) + 1)] == steps
    with pytest.raises(ValueError, match=r"Invalid version=0"):
        staggered.snapshot_step(0, 0)


@pytest.mark.parametrize("name, staleness", [("shampoo", 0), ("shampoo", 2), ("soap", 1), ("kl-shampoo", 2)])
def test_install_delays_are_one_interval_under_the_deterministic_rule_by_default(name, staleness):
    _, stats = run(name, asteria.RuntimeConfig(staleness=staleness, workers=2, deterministic=True), steps=24)
    histogram = stats["install_delay_histogram"]
    # Every block of every set (staggered, f = 3) installs each version after the sync refreshes exactly one
    # interval after its snapshot (capped by the bound: at S = 0, at its own step), as native mode would then.
    lag = min(3, 3 * staleness)
    assert sum(histogram) > 0 and histogram[-1] == sum(histogram) and len(histogram) == lag + 1
    assert stats["install_delay_mean_steps"] == stats["install_delay_max_steps"] == lag
    assert sum(s["installs"] for s in stats["install_delay_by_set"]) == sum(histogram)
    assert all(s["mean_steps"] == lag for s in stats["install_delay_by_set"] if s["installs"])


@pytest.mark.parametrize("name, staleness, lag", [("shampoo", 2, 1), ("soap", 1, 2), ("kl-shampoo", 2, 4),
                                                  ("kl-shampoo", 1, 0)])
def test_install_delays_are_lag_steps_under_the_deterministic_rule(name, staleness, lag):
    params, stats = run(name, asteria.RuntimeConfig(staleness=staleness, lag_steps=lag, workers=2), steps=24)
    histogram = stats["install_delay_histogram"]
    # Every install after the sync refreshes comes exactly lag_steps after its snapshot (f = 3, staggered).
    assert sum(histogram) > 0 and histogram[-1] == sum(histogram) and len(histogram) == lag + 1
    assert stats["install_delay_mean_steps"] == stats["install_delay_max_steps"] == stats["lag_steps"] == lag
    # Still the deterministic rule: another worker count gives the same bits.
    again, _ = run(name, asteria.RuntimeConfig(staleness=staleness, lag_steps=lag, workers=1), steps=24)
    assert all(torch.equal(a, b) for a, b in zip(params, again, strict=True))


@pytest.mark.parametrize("name", ["shampoo", "kl-shampoo"])
def test_lag_steps_zero_is_staleness_zero_and_the_default_is_one_interval(name):
    """lag_steps=0 uses every version at its own step, as S = 0 does; lag_steps=None means one interval."""
    zero, _ = run(name, asteria.RuntimeConfig(staleness=2, lag_steps=0, workers=2), steps=16)
    native_like, stats = run(name, asteria.RuntimeConfig(staleness=0, workers=2), steps=16)
    assert all(torch.equal(a, b) for a, b in zip(zero, native_like, strict=True)) and stats["lag_steps"] == 0
    full, _ = run(name, asteria.RuntimeConfig(staleness=2, lag_steps=3, workers=2), steps=16)
    default, stats = run(name, asteria.RuntimeConfig(staleness=2, workers=2, deterministic=True), steps=16)
    assert all(torch.equal(a, b) for a, b in zip(full, default, strict=True)) and stats["lag_steps"] == 3
    assert not all(torch.equal(a, b) for a, b in zip(zero, full, strict=True))  # the lag changes the trajectory
    _, stats = run(name, asteria.RuntimeConfig(staleness=2, deterministic=False, workers=2), steps=4)
    assert stats["lag_steps"] is None


def test_lag_steps_is_checked_against_the_staleness_bound():
    for value, allowed in ((-1, "must be None or an int >= 0"), (True, "must be None or an int >= 0"),
                           (1.0, "must be None or an int >= 0")):
        with pytest.raises(ValueError, match=rf"Invalid lag_steps={value!r}: {allowed}"):
            asteria.RuntimeConfig(lag_steps=value)
    with pytest.raises(ValueError, match=r"Invalid lag_steps=2: applies to the deterministic rule only"):
        asteria.RuntimeConfig(lag_steps=2, deterministic=False)
    model = small_mlp(sizes=SIZES)
    with pytest.raises(ValueError, match=r"Invalid lag_steps=7: must be at most staleness x "
                                         r"precondition_frequency = 2 x 3 = 6"):
        OPTIMIZERS["soap"](model.parameters(), asteria.RuntimeConfig(staleness=2, lag_steps=7))
    # Native mode has no lag: the setting is not used there.
    with OPTIMIZERS["soap"](model.parameters(), asteria.RuntimeConfig(mode="sync", staleness=2, lag_steps=7)) as opt:
        assert opt.runtime_stats()["lag_steps"] is None


def test_install_delays_leave_out_an_install_before_its_snapshot_with_one_warning():
    from asteria.pipeline.timeline import InstallDelays

    delays = InstallDelays(RefreshSchedule(start=1, interval=3, phases=[0]), ["set 0"], excluded=1)
    delays.record(7, 0, 3)  # version 3 is snapshotted at step 7: delay 0
    with pytest.warns(RuntimeWarning, match="counted as installed at step 5, before its snapshot at step 7"):
        delays.record(5, 0, 3)
    delays.record(4, 0, 3)  # warned once only
    assert delays.anomalies == 2 and delays.stats()["install_delay_histogram"] == [1]


def test_install_delays_by_factor_side_pool_the_sets_of_one_side():
    from asteria.pipeline.timeline import InstallDelays

    # Three sets snapshotted at steps 3, 6, 9, ... (f = 3, no stagger); sets 0 and 2 have blocks of side 8.
    delays = InstallDelays(RefreshSchedule(start=3, interval=3, phases=[0, 0, 0]), ["a", "b", "c"], excluded=0,
                           sides=[8, 4, 8])
    for step, index, version in [(4, 0, 1), (9, 0, 2), (3, 1, 1), (8, 2, 2)]:  # delays 1, 3, 0 and 2
        delays.record(step, index, version)
    assert delays.stats()["install_delay_by_side"] == [
        {"side": 4, "installs": 1, "mean_steps": 0.0, "max_steps": 0},
        {"side": 8, "installs": 3, "mean_steps": 2.0, "max_steps": 3}]
    assert InstallDelays(RefreshSchedule(start=3, interval=3, phases=[0]), ["a"], excluded=0).stats()[
        "install_delay_by_side"] == []  # no sides given


def test_install_delays_count_how_late_the_newest_finished_version_came():
    # Unstaggered, f = 3: versions 1 and 2 (steps 3 and 6) are used at their own step; version 3, snapshotted
    # at step 9, is held in the workers past step 10 (a latch, no timing) and installed at step 11.
    model, data = small_mlp(sizes=SIZES), regression_data(sizes=SIZES)
    runtime = asteria.RuntimeConfig(staleness=1, workers=2, deterministic=False, stagger=False)
    with OPTIMIZERS["shampoo"](model.parameters(), runtime) as opt:
        engine, blocks = opt._refresher.engine, testing.engine_blocks(opt)
        for block in blocks:
            engine.inject_fault(block.id, 3, "pause")
        train(model, opt, 10, data=data)  # version 3's jobs cannot finish before the release below
        assert opt.runtime_stats()["install_delay_histogram"] == []  # nothing after the aligned versions yet
        testing.clear_faults(opt)  # jobs not started yet run through; then the paused ones go on
        engine.release_pauses()
        engine.drain(30.0)
        train(model, opt, 1, data=data)
        stats = opt.runtime_stats()
    assert stats["install_delay_histogram"] == [0, 0, len(blocks)]
    assert stats["install_delay_mean_steps"] == stats["install_delay_max_steps"] == 2
    # Native mode installs every version at its own refresh, delay 0: SOAP (f = 3) refreshes every block at
    # steps 1, 4, ..., 16, six versions of which the last four come after the two sync refreshes.
    _, native = run("soap", asteria.RuntimeConfig(mode="sync", stagger=False), steps=18)
    assert native["install_delay_histogram"] == [4 * (native["refreshes"] // 6)] and native["refreshes"] > 0
    assert native["install_delay_mean_steps"] == native["install_delay_max_steps"] == 0


def run(name: str, runtime: asteria.RuntimeConfig, steps: int = 14, attach: bool = False, hook=None, sizes=SIZES):
    model = small_mlp(sizes=sizes)
    with OPTIMIZERS[name](model.parameters(), runtime) as opt:
        handle = asteria.attach(model, opt) if attach else None
        train(model, opt, steps, data=regression_data(sizes=sizes), hook=hook)
        if handle is not None:
            handle.remove()
        stats = opt.runtime_stats()
    return [p.detach().clone() for p in model.parameters()], stats


def snapshot_bytes_per_step(runtime: asteria.RuntimeConfig, steps: int = 12) -> list[int]:
    totals: list[int] = []
    run("shampoo", runtime, steps=steps, hook=lambda step, opt: totals.append(opt.runtime_stats()["bytes_to_host"]))
    return [b - a for a, b in zip([0] + totals[:-1], totals, strict=True)]


def test_staggered_snapshots_spread_over_the_interval():
    # The deterministic rule: every scheduled snapshot is taken (newest-finished may skip one still in flight).
    on_schedule = dict(staleness=1, workers=1, deterministic=True)
    staggered = snapshot_bytes_per_step(asteria.RuntimeConfig(**on_schedule), steps=15)[6:15]
    plain = snapshot_bytes_per_step(asteria.RuntimeConfig(**on_schedule, stagger=False), steps=15)[6:15]
    # Steps 7 to 15, three whole intervals after the refreshes used at their own step (the bootstrap at
    # step 3 and the first refresh at 6, both unstaggered; f = 3, phases 0 to 2): the same bytes in all,
    # but unstaggered they come on one step per interval, staggered on several, none carrying a whole
    # interval's.
    assert sum(staggered) == sum(plain) > 0
    assert sum(1 for b in plain if b) == 3
    assert sum(1 for b in staggered if b) > 3 and max(staggered) < max(plain)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_staggered_async_at_staleness_zero_matches_staggered_sync(name):
    # Square layers: the first factors are full rank, so their eigenbases are unique and the two modes'
    # eigensolvers (torch's, LAPACK's) may differ only by rounding.
    square = (8, 8, 8, 8)
    sync, _ = run(name, asteria.RuntimeConfig(mode="sync", stagger=True), sizes=square)
    async_, _ = run(name, asteria.RuntimeConfig(staleness=0, workers=2, stagger=True), sizes=square)
    plain, _ = run(name, asteria.RuntimeConfig(staleness=0, workers=2), sizes=square)
    for a, s in zip(async_, sync, strict=True):
        assert float((a - s).norm() / s.norm()) < 2e-3
    assert any(not torch.equal(a, p) for a, p in zip(async_, plain, strict=True))  # staggering does change the schedule


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("own_step", [{"staleness": 0}, {"staleness": 2, "lag_steps": 0}])
def test_async_with_every_version_at_its_own_step_follows_sync_by_default(name, own_step):
    """Invariant 1 without settings beyond S = 0 (or lag 0): the default schedule is then the sync one,
    unstaggered, and only the eigensolvers' rounding separates the two modes."""
    square = (8, 8, 8, 8)
    sync, _ = run(name, asteria.RuntimeConfig(mode="sync"), sizes=square)
    async_, stats = run(name, asteria.RuntimeConfig(workers=2, **own_step), sizes=square)
    staggered, _ = run(name, asteria.RuntimeConfig(workers=2, stagger=True, **own_step), sizes=square)
    assert stats["lag_steps"] == 0
    error = max(float((a - s).norm() / s.norm()) for a, s in zip(async_, sync, strict=True))
    assert error < 1e-3  # measured: 1.8e-4 (Shampoo), 1.0e-5 (SOAP), 1.1e-7 (KL-Shampoo)
    # The staggered schedule, a different trajectory, is told apart (1e-3 to 0.13): the test can fail.
    assert max(float((a - s).norm() / s.norm()) for a, s in zip(staggered, sync, strict=True)) > 10 * error


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_staggered_runs_are_bitwise_identical_across_worker_counts(name):
    one, _ = run(name, asteria.RuntimeConfig(staleness=2, workers=1, deterministic=True))
    three, _ = run(name, asteria.RuntimeConfig(staleness=2, workers=3, deterministic=True))
    assert all(torch.equal(a, b) for a, b in zip(one, three, strict=True))


@pytest.mark.parametrize("name, staleness", [("shampoo", 0), ("shampoo", 2), ("soap", 1), ("kl-shampoo", 2)])
def test_attach_changes_no_bits(name, staleness):
    plain, _ = run(name, asteria.RuntimeConfig(staleness=staleness, workers=2, deterministic=True))
    hooked, stats = run(name, asteria.RuntimeConfig(staleness=staleness, workers=2, deterministic=True), attach=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked, strict=True))
    assert stats["refreshes"] > 0 and stats["max_staleness_seen"] <= staleness


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_pre_hooks)
               for m in model.modules())


class TiedFrozenUnused(torch.nn.Module):
    """Tied input/output embeddings, a frozen layer, and a branch used only on odd calls."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(10, 6)
        self.frozen = torch.nn.Linear(6, 6)
        self.mix = torch.nn.Linear(6, 6)
        self.branch = torch.nn.Linear(6, 6)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.frozen.requires_grad_(False)
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.mix(self.frozen(self.embed(tokens))))
        if self.calls % 2:
            h = h + self.branch(h)
        return h @ self.embed.weight.T  # tied output head


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_attach_with_tied_frozen_and_unused_parameters(name):
    def trained(attach: str | None):
        model = TiedFrozenUnused()
        params = [p for p in model.parameters() if p.requires_grad]
        gen = torch.Generator().manual_seed(2)
        tokens = torch.randint(0, 10, (12, 8), generator=gen)
        with OPTIMIZERS[name](params, asteria.RuntimeConfig(staleness=1, workers=1, deterministic=True)) as opt:
            before = hook_count(model)
            handle = asteria.attach(model, opt, prefetch=attach) if attach else None
            if handle is not None:
                assert hook_count(model) == before + handle.num_hooks > before
                assert (bool(model._forward_hooks), bool(model._forward_pre_hooks)) == \
                    {"forward_end": (True, False), "forward_start": (False, True), "step": (False, False)}[attach]
            losses = []
            for step in range(9):
                opt.zero_grad(set_to_none=True)
                logits = model(tokens[step % 2])  # two fixed batches: the loss must fall
                loss = torch.nn.functional.cross_entropy(logits, tokens[step % 2 + 2])
                loss.backward()
                opt.step()
                losses.append(loss.item())
            if handle is not None:
                handle.remove()
                handle.remove()  # idempotent
                assert hook_count(model) == before
        return losses, [p.detach().clone() for p in model.parameters()]

    plain_losses, plain = trained(None)
    assert plain_losses[-1] < plain_losses[0] and plain_losses[-2] < plain_losses[1]
    for point in asteria.hooks.PREFETCH_POINTS:  # the same bits wherever the activation runs
        hooked_losses, hooked = trained(point)
        assert plain_losses == hooked_losses, point
        assert all(torch.equal(a, b) for a, b in zip(plain, hooked, strict=True)), point


@pytest.mark.parametrize("name", ["shampoo", "kl-shampoo"])
def test_resume_with_hooks_is_exact(name):
    """A checkpoint taken between steps while a deferred (hooked) activation is pending resumes bit for bit."""
    data = regression_data(sizes=SIZES)
    runtime = asteria.RuntimeConfig(staleness=2, workers=1, deterministic=True)

    def make():
        model = small_mlp(sizes=SIZES)
        opt = OPTIMIZERS[name](model.parameters(), runtime)
        return model, opt, asteria.attach(model, opt)

    model, opt, _ = make()
    with opt:
        train(model, opt, 7, data=data)
        saved, params = opt.state_dict(), [p.detach().clone() for p in model.parameters()]
        train(model, opt, 6, data=data)
    again, resumed, _ = make()
    resumed_run(again, resumed, params, lambda o: o.load_state_dict(saved), 6, data)
    assert same_parameters(model, again)


def test_hooks_left_on_a_model_neither_keep_the_optimizer_alive_nor_act_after_it_is_closed():
    """The hooks reach the optimizer weakly: a model that keeps them does not keep its workers and host
    buffers alive, and a closed or collected optimizer's hooks do nothing (the model trains on under
    another optimizer)."""
    import gc
    import weakref

    model = small_mlp()
    data = regression_data()
    opt = asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(staleness=1, workers=1))
    handle = asteria.attach(model, opt)
    assert handle.optimizer is opt and hook_count(model) == handle.num_hooks > 1
    train(model, opt, 12, data=data)  # past the start-up refresh at step 10: the workers have been busy
    opt.close()
    before = opt.runtime_stats()
    assert before["refreshes"] > 0 and before["worker_busy_fraction"] > 0
    with asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(staleness=1, workers=1)) as other:
        train(model, other, 3, data=data)  # the old hooks still run on every forward and backward
        assert other.runtime_stats()["step"] == 3
    assert opt.runtime_stats() == before  # closed: its hooks did nothing, and its busy fractions end at close()
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None and handle.optimizer is None  # neither the hooks nor the handle held it
    model(torch.randn(3, SIZES[0])).sum().backward()  # hooks of a collected optimizer: no-ops
    handle.remove()
    assert hook_count(model) == 0


def test_attach_rejects_bad_arguments():
    model = small_mlp()
    with pytest.raises(ValueError, match="Invalid model=str"):
        asteria.attach("model", asteria.Shampoo(model.parameters()))
    with pytest.raises(ValueError, match="Invalid optimizer=AdamW"):
        asteria.attach(model, torch.optim.AdamW(model.parameters()))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"Invalid drain_points=.*int >= 0"):
            asteria.attach(model, asteria.Shampoo(model.parameters()), drain_points=bad)
    with pytest.raises(ValueError, match=r"Invalid prefetch='backward': must be one of \('forward_start', "
                                         r"'forward_end', 'step'\)"):
        asteria.attach(model, asteria.Shampoo(model.parameters()), prefetch="backward")


def test_attach_spreads_a_few_drain_points_over_the_modules():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(10)])
    with asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(workers=1)) as opt:
        counts = {}
        for points in (0, 3, 8, 50):
            handle = asteria.attach(model, opt, drain_points=points)
            hooked = [i for i, layer in enumerate(model) if layer._forward_hooks]
            counts[points] = (handle.num_hooks, hooked)
            handle.remove()
    assert counts[0] == (1, [])                      # the root's prefetch hook only
    assert counts[3] == (4, [0, 3, 6])
    assert counts[8][0] == 9 and len(counts[8][1]) == 8
    assert counts[50] == (11, list(range(10)))       # never more than one per module


def test_late_activation_is_on_by_default_where_allowed_and_refused_elsewhere():
    model = small_mlp()
    nondet = asteria.RuntimeConfig(workers=1, deterministic=False)
    with pytest.raises(ValueError, match=r"Invalid late_activation=1: must be None, True or False"):
        asteria.attach(model, asteria.Shampoo(model.parameters(), runtime=nondet), late_activation=1)
    for runtime, text in ((asteria.RuntimeConfig(mode="sync", deterministic=True), "mode='sync', deterministic=True"),
                          (asteria.RuntimeConfig(workers=1, deterministic=True), "mode='async', deterministic=True")):
        with asteria.SOAP(model.parameters(), runtime=runtime) as opt:
            with pytest.raises(ValueError, match=rf"Invalid late_activation=True for an optimizer with {text}: "
                                                 r"needs mode='async' and deterministic=False"):
                asteria.attach(model, opt, late_activation=True)
            with asteria.attach(model, opt):  # the default leaves it off there
                assert not opt.late_activation
    with asteria.KLShampoo(model.parameters(), runtime=nondet) as opt:
        with pytest.raises(ValueError, match=r"Invalid drain_points=0 with late_activation=True: must be >= 1"):
            asteria.attach(model, opt, drain_points=0, late_activation=True)
        assert not opt.late_activation and hook_count(model) == 0  # a refused attach leaves nothing behind
        with asteria.attach(model, opt, drain_points=0):  # no backward drain points: the default is off
            assert not opt.late_activation
        with asteria.attach(model, opt, late_activation=False):
            assert not opt.late_activation
        handle = asteria.attach(model, opt)  # on by default under deterministic=False
        assert opt.late_activation
        plain = asteria.attach(model, opt)  # a second default attach neither refuses nor takes it over
        with pytest.raises(ValueError, match="already attached with it; remove that handle first"):
            asteria.attach(model, opt, late_activation=True)
        plain.remove()
        assert opt.late_activation
        handle.remove()
        assert not opt.late_activation and hook_count(model) == 0
        handle = asteria.attach(model, opt, late_activation=True)  # allowed again once removed
        handle.remove()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_late_activation_trains_on_the_cpu_where_no_wait_is_needed(name):
    """On the CPU every kernel has run when it returns: the backward marks are no-ops, and a run with late
    activation trains like any newest-finished run (the GPU test in test_cuda.py shows the wait)."""
    model, data = small_mlp(sizes=SIZES), regression_data(sizes=SIZES)
    runtime = asteria.RuntimeConfig(staleness=2, workers=2, deterministic=False)
    with OPTIMIZERS[name](model.parameters(), runtime) as opt:
        with asteria.attach(model, opt) as handle:
            assert opt.late_activation and handle.num_hooks > 1
            losses = train(model, opt, 15, data=data)
            assert opt.runtime_stats()["late_activation"]
        stats = opt.runtime_stats()
        # The handle's removal turned it off; the handle still says it had it on.
        assert not stats["late_activation"] and handle.late_activation
    assert losses[-1] < losses[0] and stats["refreshes"] > 0 and stats["max_staleness_seen"] <= 2
