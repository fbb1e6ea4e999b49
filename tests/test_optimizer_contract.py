"""What a user of torch.optim expects of an optimizer, and what Asteria's must therefore do: checkpoints that
load with ``torch.load(weights_only=True)`` and torch's state-dict hooks, a clear refusal where a load
cannot work (into an async optimizer that has run, or with a smaller staleness) before anything changes,
no silent copies, float64 parameters kept at their precision, per-group betas, NumPy and tensor
hyperparameters, sparse and strided gradients."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import warnings
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import regression_data, resumed_run, same_parameters, small_mlp, train, worker_threads

import asteria

OPTIMIZERS = [asteria.Shampoo, asteria.SOAP, asteria.KLShampoo]


def runtime(mode: str = "async", **kwargs) -> asteria.RuntimeConfig:
    if mode == "sync":
        return asteria.RuntimeConfig(mode="sync", **kwargs)
    # The deterministic rule: these tests resume and compare bit for bit.
    return asteria.RuntimeConfig(mode="async", workers=1, worker_cpus="any", **({"deterministic": True} | kwargs))


def make(optimizer, mode: str = "async", **kwargs):
    model = small_mlp()
    start = {"start_preconditioning_step": 1} if optimizer is asteria.SOAP else {}  # versions as KL-Shampoo's
    return model, optimizer(model.parameters(), precondition_frequency=2, runtime=runtime(mode, **kwargs), **start)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
def test_an_optimizer_dropped_without_close_is_collected_and_stops_its_workers(optimizer):
    """``close()`` is optional, as for torch's optimizers: once the last reference goes, the garbage collector
    takes the optimizer and its finalizer stops the workers. Nothing the workers keep may refer back to it
    (the finalizer holds them: such a cycle would keep it, its state and its threads for the process's life)."""
    model, warm = make(optimizer, staleness=1)  # torch and OpenBLAS start their own thread pools lazily
    train(model, warm, 4)
    warm.close()
    gc.collect()
    before = worker_threads()
    model, opt = make(optimizer, staleness=1)
    train(model, opt, 4)  # installs and reorders: every closure the refresher holds has been made and used
    assert worker_threads() == before + 1  # its worker
    alive, finalizer = weakref.ref(opt), opt._finalizer
    del opt
    gc.collect()
    assert alive() is None and not finalizer.alive
    assert worker_threads() == before


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_closed_optimizer_refuses_to_step_and_its_state_dict_goes_on_exactly(optimizer, mode):
    """After ``close()``: ``step()`` raises by name in both modes (it would train on silently in sync mode, and
    fail inside the stopped engine in async mode), ``prefetch()`` (the hooks' call) does nothing, and the
    state_dict, refreshes in flight included, goes on in a new optimizer as the optimizer left open does."""
    data = regression_data()
    settings = {"staleness": 1} if mode == "async" else {}
    model, opt = make(optimizer, mode, **settings)
    with opt:  # the optimizer left open: 7 steps, then 4 more
        train(model, opt, 7, data=data)
        train(model, opt, 4, data=data)
    closed_model, closed = make(optimizer, mode, **settings)
    train(closed_model, closed, 7, data=data)
    closed.close()
    before = [p.detach().clone() for p in closed_model.parameters()]
    with pytest.raises(RuntimeError, match=r"Invalid step\(\) after close\(\): .* load its state_dict\(\) into a new"):
        closed.step()
    closed.prefetch()
    assert all(torch.equal(a, b) for a, b in zip(before, closed_model.parameters(), strict=True))
    assert closed._step == 7
    saved = closed.state_dict()
    resumed_model, resumed = make(optimizer, mode, **settings)
    resumed_run(resumed_model, resumed, before, lambda o: o.load_state_dict(saved), 4, data)
    assert same_parameters(model, resumed_model)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("as_stateful", [True, False], ids=["optimizer", "state_dict"])
def test_torch_distributed_checkpoint_saves_and_resumes_exactly(optimizer, mode, as_stateful, tmp_path):
    """dcp.save / dcp.load on one process, with refreshes in flight in async mode: a fresh optimizer's
    state_dict is the load template (the in-flight refreshes travel as one entry, however many there are),
    and the resumed run continues bit for bit. Both ways DCP is used: the optimizer as a Stateful, or its
    state_dict loaded in place and then handed to load_state_dict."""
    import torch.distributed.checkpoint as dcp

    data = regression_data()
    settings = {"staleness": 2} if mode == "async" else {}
    model, opt = make(optimizer, mode, **settings)
    with opt, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP notes that it runs without a process group: intended here
        train(model, opt, 7, data=data)
        if mode == "async":
            assert opt.state_dict()["refresher"]["scheduled"], "refreshes in flight travel"
        dcp.save({"optim": opt if as_stateful else opt.state_dict()}, checkpoint_id=str(tmp_path))
        weights = [p.detach().clone() for p in model.parameters()]
        train(model, opt, 5, data=data)

        def load(resumed) -> None:
            if as_stateful:
                dcp.load({"optim": resumed}, checkpoint_id=str(tmp_path))
            else:
                template = {"optim": resumed.state_dict()}
                dcp.load(template, checkpoint_id=str(tmp_path))
                resumed.load_state_dict(template["optim"])

        resumed_model, resumed = make(optimizer, mode, **settings)
        resumed_run(resumed_model, resumed, weights, load, 5, data)
    assert same_parameters(model, resumed_model)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_checkpoint_loads_with_weights_only(optimizer, mode):
    model, opt = make(optimizer, mode, staleness=1) if mode == "async" else make(optimizer, mode)
    with opt:
        train(model, opt, 5)
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    model2, opt2 = make(optimizer, mode, staleness=1) if mode == "async" else make(optimizer, mode)
    with opt2:
        opt2.load_state_dict(loaded)
        train(model2, opt2, 2)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
def test_loading_into_an_async_optimizer_that_has_run_is_refused_and_changes_nothing(optimizer):
    model, opt = make(optimizer, staleness=1)
    with opt:
        train(model, opt, 4)
        saved = opt.state_dict()
        train(model, opt, 4)
        before = {key: [t.clone() for t in group.state.values()] for key, group in enumerate(opt._groups)}
        with pytest.raises(ValueError, match=r"Invalid load_state_dict into an async .* stepped \(step 8\).*new "
                                             "optimizer"):
            opt.load_state_dict(saved)
        assert opt._step == 8
        assert all(torch.equal(a, b) for key, group in enumerate(opt._groups)
                   for a, b in zip(before[key], group.state.values(), strict=True))
        train(model, opt, 3)  # still usable
        assert opt._step == 11
    model2, fresh = make(optimizer, staleness=1)
    with fresh:
        fresh.load_state_dict(saved)  # a fresh one loads it, once
        with pytest.raises(ValueError, match="that has already loaded a state_dict"):
            fresh.load_state_dict(saved)
        train(model2, fresh, 2)


def test_a_sync_optimizer_may_load_again():
    model, opt = make(asteria.SOAP, "sync")
    train(model, opt, 4)
    saved = opt.state_dict()
    train(model, opt, 4)
    opt.load_state_dict(saved)
    assert opt._step == 4


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_load_that_fails_midway_leaves_the_optimizer_refusing_to_step(mode, monkeypatch):
    """Past every check a load can still fail (an I/O error on the NVMe tier, the engine closed meanwhile; here the
    refresher raises as its part begins): the state is then part old, part loaded, so the optimizer refuses to step
    or be saved, by name, until a load goes through (sync) or for good (async: its engine cannot go back)."""
    model, opt = make(asteria.SOAP, mode, staleness=1)
    with opt:
        train(model, opt, 4)
        saved = opt.state_dict()
    model, fresh = make(asteria.SOAP, mode, staleness=1)
    with fresh:
        def fail(state: dict) -> None:
            raise OSError("the refresher's part could not be read")

        monkeypatch.setattr(fresh._refresher, "load_state", fail)
        with pytest.raises(OSError, match="could not be read"):
            fresh.load_state_dict(saved)
        monkeypatch.undo()
        for call in (lambda: train(model, fresh, 1), fresh.state_dict):
            with pytest.raises(RuntimeError, match=r"Invalid (step|state_dict)\(\): a load_state_dict\(\) into this "
                                                   r"SOAP failed after it had begun changing its state"):
                call()
        if mode == "async":
            with pytest.raises(ValueError, match="that has already failed midway through a load_state_dict"):
                fresh.load_state_dict(saved)
        else:
            fresh.load_state_dict(saved)  # a load that goes through makes it whole
            train(model, fresh, 2)
            assert fresh._step == 6


@pytest.mark.parametrize("optimizer", [asteria.Shampoo, asteria.SOAP], ids=lambda c: c.__name__)
def test_resuming_with_a_smaller_staleness_is_refused_and_a_larger_one_works(optimizer):
    model, opt = make(optimizer, staleness=2)
    with opt:
        train(model, opt, 5)
        saved = opt.state_dict()
    _, smaller = make(optimizer, staleness=1)
    with smaller, pytest.raises(ValueError, match=r"saved with staleness=2, this optimizer has staleness=1.*"
                                                  "staleness >= 2"):
        smaller.load_state_dict(saved)
    model3, larger = make(optimizer, staleness=3)
    with larger:
        larger.load_state_dict(saved)
        train(model3, larger, 4)


def test_resuming_with_a_shorter_deterministic_lag_is_refused_and_a_longer_one_loads():
    model, opt = make(asteria.Shampoo, staleness=2, lag_steps=2)
    with opt:
        train(model, opt, 5)
        saved = opt.state_dict()
    assert saved["refresher"]["scheduled"]  # (versions in flight, due 2 steps after their snapshots)
    _, shorter = make(asteria.Shampoo, staleness=2, lag_steps=1)
    with shorter, pytest.raises(ValueError, match="with a lag of 2 steps, this optimizer's is 1"):
        shorter.load_state_dict(saved)
    longer_model, longer = make(asteria.Shampoo, staleness=2, lag_steps=4)
    with longer:  # the versions in flight stay due where they were scheduled
        longer.load_state_dict(saved)
        train(longer_model, longer, 6)
        assert longer.runtime_stats()["refresh_failures"] == 0


def test_a_checkpoint_missing_refresher_entries_is_refused_before_anything_changes():
    model, opt = make(asteria.SOAP, staleness=1)
    with opt:
        train(model, opt, 3)
        saved = opt.state_dict()
    _, fresh = make(asteria.SOAP, staleness=1)
    with fresh:
        with pytest.raises(ValueError, match=r"Invalid state_dict\['refresher'\]=.*keys \['newest_versions', "
                                             "'scheduled'\\]"):
            fresh.load_state_dict(saved | {"refresher": {}})
        assert fresh._step == 0
        fresh.load_state_dict(saved)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
def test_state_holds_each_parameters_step_count_read_only(optimizer):
    """``opt.state[p]`` as torch's optimizers have it, where it means the same: the steps in which ``p`` had
    a gradient. A parameter that had none stays at 0."""
    model = small_mlp(sizes=(8, 12, 4))
    late = model[-1].bias
    # max_preconditioner_dim=4: every parameter is split into several blocks, each counting the steps
    with optimizer(model.parameters(), runtime=runtime("sync"), max_preconditioner_dim=4) as opt:
        params = list(model.parameters())
        assert list(opt.state) == params and all(opt.state[p] == {"step": 0} for p in params)
        for step in range(3):
            model.zero_grad(set_to_none=True)
            model(torch.randn(5, 8)).square().mean().backward()
            if step < 2:
                late.grad = None
            opt.step()
        assert [opt.state[p]["step"] for p in params] == [3, 3, 3, 1]
        with optimizer(model.parameters(), runtime=runtime("sync"), max_preconditioner_dim=4) as fresh:
            assert [fresh.state[p]["step"] for p in params] == [0, 0, 0, 0]  # indexed before the load
            fresh.load_state_dict(opt.state_dict())
            assert [fresh.state[p]["step"] for p in params] == [3, 3, 3, 1]
        with pytest.raises(KeyError, match=r"not a parameter of this optimizer: tensor of shape \(3,\)"):
            opt.state[torch.zeros(3)]
        with pytest.raises(TypeError):
            opt.state[late] = {"step": 7}  # type: ignore[index]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_torch_per_parameter_checkpoint_api_is_refused_before_anything_changes(mode):
    """torch.distributed.checkpoint.state_dict's functions rebuild the state per parameter FQN, which an
    Asteria optimizer does not keep: refused by name. They initialize an optimizer with an empty ``state``
    by a step with zero gradients; ``state`` is never empty here, so that step is never taken."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict

    model, opt = make(asteria.SOAP, mode)
    with opt:
        train(model, opt, 3)
        opt.zero_grad(set_to_none=True)  # what makes torch take its initializing step
        before = [t.clone() for g in opt._groups for t in g.state.values()]
        weights = [p.detach().clone() for p in model.parameters()]
        for call in (lambda: get_optimizer_state_dict(model, opt), lambda: get_state_dict(model, opt)):
            with pytest.raises(TypeError, match=r"Invalid optimizers=\(SOAP,\) for torch.distributed.checkpoint."
                                                r"state_dict's get_optimizer_state_dict.*dcp.save\(\{'optim': opt\}"):
                call()
        assert opt.runtime_stats()["step"] == 3
        now = [t for g in opt._groups for t in g.state.values()]
        assert all(torch.equal(a, b) for a, b in zip(before, now, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
        assert opt.state_dict()["step"] == 3  # a call of its own is not refused


@pytest.fixture
def default_dtype_and_device():
    """torch's default dtype and device, put back after the test."""
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    torch.set_default_device(None)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.usefixtures("default_dtype_and_device")
def test_torch_defaults_of_the_caller_do_not_change_the_state(optimizer, mode):
    """The state is allocated with its own dtype (float32) and the host buffers on the CPU, whatever
    torch.set_default_dtype / set_default_device say when the optimizer is built: under a float64 default
    every step failed on a float64 factor beside float32 operands, and an async optimizer built under
    another default device handed non-CPU buffers to the C++ engine. The run is then the same, bit for bit."""
    reference = small_mlp()
    train(reference, optimizer(reference.parameters(), precondition_frequency=2, runtime=runtime(mode)), 4)
    for dtype, device in ((torch.float64, None), (torch.float16, None), (torch.float32, "meta")):
        model = small_mlp()
        torch.set_default_dtype(dtype)
        torch.set_default_device(device)
        opt = optimizer(model.parameters(), precondition_frequency=2, runtime=runtime(mode))
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)
        with opt:
            assert {t.dtype for g in opt._groups for t in g.state.values() if t.is_floating_point()} == \
                {torch.float32}
            train(model, opt, 4)
        assert all(torch.equal(a, b)
                   for a, b in zip(model.parameters(), reference.parameters(), strict=True)), (dtype, device)


def malformed(path: tuple, value) -> Callable[[dict], None]:
    """Sets ``state['refresher'][path...]`` to ``value`` (or to ``value(old)`` when callable)."""
    def apply(state: dict) -> None:
        target = state["refresher"]
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value(target[path[-1]]) if callable(value) else value
    return apply


REFRESHER = r"Invalid state_dict\['refresher'\]"


def edited(key: str, value) -> Callable[[dict], None]:
    """Sets ``state[key]`` to ``value`` (or to ``value(old)`` when callable)."""
    def apply(state: dict) -> None:
        state[key] = value(state[key]) if callable(value) else value
    return apply


def in_use(versions: list) -> list:
    return [[99] + list(versions[0][1:])] + list(versions[1:])


@pytest.mark.parametrize("mode, change, match", [
    ("sync", malformed(("newest_versions",), [1, 2]), REFRESHER + r"\['newest_versions'\]=\[1, 2\]: must be 4 ints"),
    ("sync", malformed(("consecutive_failures", 1), ["x"]),
     REFRESHER + r"\['consecutive_failures'\]\[1\]=\['x'\]: must be 1 ints in \[0, 2\^62\]"),
    ("sync", malformed(("consecutive_failures",), 3), REFRESHER + r"\['consecutive_failures'\]=3: must be a list"),
    ("async", malformed(("scheduled",), 7), REFRESHER + r"\['scheduled'\]='int': must be a tuple"),
    ("async", malformed(("scheduled",), lambda s: (s[0], {"set": 0})),
     REFRESHER + r"\['scheduled'\]\[1\]=.*must be a dict with the keys"),
    ("async", malformed(("scheduled", 0, "set"), 9), r"\['scheduled'\]\[0\]\['set'\]=9: must be a factor set index"),
    ("async", malformed(("scheduled", 0, "version"), "2"), r"\['scheduled'\]\[0\]\['version'\]='2'"),
    ("async", malformed(("scheduled", 0, "version"), 5), r"\['version'\]=5: must be an int in \[1, 3\]"),
    ("async", malformed(("scheduled", 0, "due"), -1), r"\['scheduled'\]\[0\]\['due'\]=-1"),
    ("async", malformed(("scheduled", 0, "due"), lambda due: due + 10**6),
     r"\['scheduled'\]\[0\]\['due'\]=\d+: must be in \[\d+, \d+\]: version \d+ of .* is snapshotted at step \d+ "
     r"under this optimizer's schedule"),
    ("async", malformed(("scheduled", 0, "request"), (1.0,)), r"\['request'\]=\(1.0,\): must be \(scale, eps"),
    ("async", malformed(("scheduled", 0, "request"), ([1.0, 2.0], 1e-8, 0.0)), r"the scale one or 1 of them"),
    ("async", malformed(("scheduled", 0, "snapshot"), lambda t: t[..., :3]),
     r"\['snapshot'\]='torch.float32 \(1, 4, 3\)': must be torch.float32 \(1, 4, 4\)"),
    ("async", malformed(("scheduled", 0, "snapshot"), lambda t: t.double()), r"\['snapshot'\]='torch.float64"),
    ("async", malformed(("scheduled", 0, "snapshot"), lambda t: torch.full_like(t, float("nan"))),
     r"\['snapshot'\]='tensor with non-finite values'"),
    ("async", malformed(("scheduled", 0, "snapshot"), lambda t: t.tolist()), r"\['snapshot'\]='list'"),
    ("async", malformed(("scheduled",), lambda s: s[1:]), r"Invalid state_dict\['refresher'\]\['scheduled'\]='versions "
     r"\[\] of .*': must be \[\d+\]: under the deterministic rule every version after the one in use"),
    ("async", malformed(("scheduled",), lambda s: (*s, s[0])), r"\['scheduled'\]\[4\]\['version'\]=3: must differ "
     r"from the other scheduled versions of .* \(listed twice\)"),
    ("async", malformed(("scheduled", 0, "version"), 2**63), r"\['version'\]=9223372036854775808: must be an int in "
     r"\[1, 2\^62\]"),
    ("async", malformed(("newest_versions",), lambda n: [2**63] + n[1:]), r"must be 4 ints in \[0, 2\^62\]"),
    ("async", edited("activated_step", 10**9), r"Invalid state_dict\['activated_step'\]=1000000000: must be at most "
     r"\d+, the newest activation by step 5"),
    ("async", edited("bound", {"staleness": 1, "lag_steps": "2"}), r"Invalid state_dict\['bound'\]=.*lag_steps \(an "
     r"int or None\)"),
    ("sync", edited("versions", in_use), r"Invalid state_dict\['versions'\]\[0\]=\[99\]: must be at most \d+, "
     r"the newest version of .* snapshotted"),
])
def test_a_malformed_refresher_state_is_refused_by_name_before_anything_changes(mode, change, match):
    """The refresher's part of a checkpoint is checked like the rest: a bad entry (a corrupted or edited
    checkpoint) raised a raw TypeError or IndexError after the state tensors were already copied."""
    model, opt = make(asteria.SOAP, mode, staleness=1)
    with opt:
        train(model, opt, 5)  # (the two start-up versions, used at once, are in use when their steps end)
        saved = opt.state_dict()
    assert mode == "sync" or len(saved["refresher"]["scheduled"]) == 4  # one refresh in flight per set
    _, fresh = make(asteria.SOAP, mode, staleness=1)
    with fresh:
        before = [t.clone() for g in fresh._groups for t in g.state.values()]
        bad = copy.deepcopy(saved)
        change(bad)
        with pytest.raises(ValueError, match=match):
            fresh.load_state_dict(bad)
        assert fresh._step == 0
        now = [t for g in fresh._groups for t in g.state.values()]
        assert all(torch.equal(a, b) for a, b in zip(before, now, strict=True))
        fresh.load_state_dict(saved)  # the good one still loads into it
        assert fresh._step == 5


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_state_dict_hooks_run(mode):
    model, opt = make(asteria.KLShampoo, mode)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
    opt.register_state_dict_post_hook(lambda o, sd: sd | {"extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load pre", sd.pop("extra"))))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    with opt:
        saved = opt.state_dict()
        assert saved["extra"] == 1 and calls == ["save pre"]
        opt.load_state_dict(saved)
    assert calls == ["save pre", ("load pre", 1), "load post"]
    assert "extra" in saved  # the load worked on a copy


@pytest.mark.parametrize("copier", [copy.deepcopy, copy.copy, pickle.dumps], ids=["deepcopy", "copy", "pickle"])
def test_copying_an_optimizer_is_refused(copier):
    model, opt = make(asteria.SOAP, "sync")
    train(model, opt, 2)
    with pytest.raises(TypeError, match="SOAP cannot be pickled or copied.*state_dict"):
        copier(opt)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
def test_float64_parameters_keep_their_precision(optimizer):
    value = 1 + 1e-12  # not a float32
    p = torch.nn.Parameter(torch.full((4, 3), value, dtype=torch.float64))
    opt = optimizer([p], lr=0.0, weight_decay=0.1, runtime=runtime("sync"))
    for _ in range(3):
        p.grad = torch.ones_like(p)
        opt.step()
    assert bool((p == value).all())  # lr 0: unchanged bit for bit
    q = torch.nn.Parameter(torch.full((4, 3), value, dtype=torch.float64))
    opt = optimizer([q], lr=1e-10, weight_decay=0.0, runtime=runtime("sync"))
    for _ in range(3):  # SOAP's and KL-Shampoo's first step only sets up their bases
        q.grad = torch.ones_like(q)
        opt.step()
    assert 0 < float((q.detach() - value).abs().max()) < 1e-9  # steps far below float32's resolution land


def test_a_group_with_mixed_dtypes_writes_each_parameter_in_its_own():
    a = torch.nn.Parameter(torch.full((3, 2), 1 + 1e-12, dtype=torch.float64))
    b = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.bfloat16))
    c = torch.nn.Parameter(torch.ones(3, 2))
    opt = asteria.SOAP([a, b, c], lr=0.0, runtime=runtime("sync"))
    assert len(opt._groups) == 1  # one batch of three blocks
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.step()
    assert bool((a == 1 + 1e-12).all()) and a.dtype == torch.float64
    assert bool((b == 1).all()) and bool((c == 1).all())


def test_per_group_betas_set_the_derived_defaults():
    p, q = torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(6, 5))
    soap = asteria.SOAP([{"params": [p]}, {"params": [q], "betas": (0.9, 0.5)}], runtime=runtime("sync"))
    assert [g["shampoo_beta"] for g in soap.param_groups] == [0.95, 0.5]
    fixed = asteria.SOAP([{"params": [p]}, {"params": [q], "betas": (0.9, 0.5)}], shampoo_beta=0.9,
                         runtime=runtime("sync"))
    assert [g["shampoo_beta"] for g in fixed.param_groups] == [0.9, 0.9]  # set explicitly: kept
    shampoo = asteria.Shampoo([{"params": [p]}, {"params": [q], "betas": (0.9, 0.9)}], runtime=runtime("sync"))
    assert [g["grafting_beta2"] for g in shampoo.param_groups] == [0.999, 0.9]


def test_numpy_hyperparameters_are_accepted_as_python_numbers():
    model = small_mlp()
    rt = asteria.RuntimeConfig(mode="async", staleness=np.int64(2), workers=np.int64(1), worker_cpus="any",
                               timeout_s=np.float32(60))
    assert type(rt.staleness) is int and type(rt.workers) is int and type(rt.timeout_s) is float
    with asteria.SOAP(model.parameters(), lr=np.float32(1e-3), betas=(np.float64(0.9), np.float32(0.95)),
                      max_preconditioner_dim=np.int64(8), precondition_frequency=np.int32(2), runtime=rt) as opt:
        assert type(opt.param_groups[0]["lr"]) is float and type(opt.precondition_frequency) is int
        assert all(type(b) is float for b in opt.param_groups[0]["betas"])
        train(model, opt, 4)


def test_a_tensor_learning_rate_steps_and_checkpoints():
    model, opt = make(asteria.Shampoo, "sync")
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)
    train(model, opt, 3)
    saved = opt.state_dict()
    model2, opt2 = make(asteria.Shampoo, "sync")
    opt2.load_state_dict(saved)
    assert torch.equal(opt2.param_groups[0]["lr"], torch.tensor(1e-3))
    with pytest.raises(ValueError, match=r"Invalid lr=tensor\(-1.\): must be a finite"):
        asteria.Shampoo(model.parameters(), lr=torch.tensor(-1.0))


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_sparse_gradient_is_refused_by_name(optimizer):
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    opt = optimizer(embedding.named_parameters(), runtime=runtime("sync"))
    embedding(torch.tensor([1, 2])).sum().backward()
    before = embedding.weight.detach().clone()
    with pytest.raises(ValueError, match="Invalid gradient of weight: layout torch.sparse_coo is not supported"):
        opt.step()
    assert torch.equal(embedding.weight, before)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_strided_gradient_steps_like_a_contiguous_one(optimizer):
    grad = torch.randn(5, 6)
    results = []
    for g in (grad.t(), grad.t().contiguous()):
        p = torch.nn.Parameter(torch.ones(6, 5))
        opt = optimizer([p], runtime=runtime("sync"))
        p.grad = g
        opt.step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])


def test_a_parameter_whose_memory_format_changed_is_named():
    conv = torch.nn.Conv2d(3, 4, 3)
    opt = asteria.Shampoo(conv.named_parameters(), runtime=runtime("sync"))
    conv.to(memory_format=torch.channels_last)
    conv(torch.randn(2, 3, 5, 5)).sum().backward()
    with pytest.raises(ValueError, match="Invalid parameter weight: it is not contiguous .* before building"):
        opt.step()


def test_a_shampoo_checkpoint_from_before_relative_eps_resumes_with_the_rule_it_was_written_by():
    """Param groups saved without ``relative_eps`` were computed with eps alone: loaded into a Shampoo built
    with another value, the run goes on with relative_eps=0, bit for bit as the uninterrupted run; a
    checkpoint that has the key keeps its own value."""
    data = regression_data()
    model = small_mlp()
    opt = asteria.Shampoo(model.parameters(), precondition_frequency=2, relative_eps=0.0,
                          runtime=asteria.RuntimeConfig(mode="sync"))
    train(model, opt, 6, data=data)
    saved, params = opt.state_dict(), [p.detach().clone() for p in model.parameters()]
    train(model, opt, 5, data=data)
    old = copy.deepcopy(saved)
    for group in old["param_groups"]:
        del group["relative_eps"]
    resumed_model = small_mlp()
    resumed = asteria.Shampoo(resumed_model.parameters(), precondition_frequency=2, relative_eps=1e-3,
                              runtime=asteria.RuntimeConfig(mode="sync"))
    resumed_run(resumed_model, resumed, params, lambda o: o.load_state_dict(old), 5, data)
    assert resumed.param_groups[0]["relative_eps"] == 0.0
    assert same_parameters(model, resumed_model)
    own = copy.deepcopy(saved)
    own["param_groups"][0]["relative_eps"] = 2e-3
    kept = asteria.Shampoo(small_mlp().parameters(), precondition_frequency=2, relative_eps=0.5,
                           runtime=asteria.RuntimeConfig(mode="sync"))
    kept.load_state_dict(own)
    assert kept.param_groups[0]["relative_eps"] == 2e-3


def test_a_checkpoint_with_1d_factors_resumes_only_where_they_are_kept():
    """``precondition_1d`` decides which factor sets exist: a checkpoint is refused, naming the setting, by a
    Shampoo built the other way, also one written before the setting was saved (1-D factors then); built
    the saved way, the resume is bit for bit."""
    data = regression_data()

    def make_shampoo(precondition_1d: bool) -> tuple[torch.nn.Module, asteria.Shampoo]:
        model = small_mlp()
        return model, asteria.Shampoo(model.parameters(), precondition_frequency=2, precondition_1d=precondition_1d,
                                      runtime=asteria.RuntimeConfig(mode="sync"))

    model, opt = make_shampoo(True)
    train(model, opt, 6, data=data)
    saved, params = opt.state_dict(), [p.detach().clone() for p in model.parameters()]
    train(model, opt, 5, data=data)
    assert saved["precondition_1d"] is True
    older = {k: v for k, v in saved.items() if k != "precondition_1d"}
    for state in (saved, older):
        _, default = make_shampoo(False)
        with pytest.raises(ValueError, match=r"Invalid state_dict: saved with precondition_1d=True, this "
                                             r"asteria.Shampoo has precondition_1d=False .* build the optimizer with "
                                             r"precondition_1d=True to resume"):
            default.load_state_dict(state)
        assert default._step == 0
    resumed_model, resumed = make_shampoo(True)
    resumed_run(resumed_model, resumed, params, lambda o: o.load_state_dict(older), 5, data)
    assert same_parameters(model, resumed_model)
    _, without = make_shampoo(False)
    with pytest.raises(ValueError, match=r"saved with precondition_1d=False, .* has precondition_1d=True"):
        make_shampoo(True)[1].load_state_dict(without.state_dict())
