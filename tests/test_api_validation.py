"""Bad arguments across the public API (issue 8, item 3): every error is a ValueError (TypeError where
torch itself refuses) naming the argument and its value, raised before anything is changed. Cases
already pinned elsewhere (tests/test_failures.py, each optimizer's reference test) are not repeated."""

from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest
import torch
from conftest import small_mlp, train

import asteria
from asteria import testing

OPTIMIZERS = [asteria.Shampoo, asteria.SOAP, asteria.KLShampoo]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("kwargs, match", [
    ({"lr": True}, "Invalid lr=True"),  # a bool is an int to Python, never a learning rate
    ({"lr": "0.1"}, "Invalid lr='0.1'"),
    ({"betas": 0.9}, "Invalid betas=0.9"),
    ({"betas": (0.9, float("nan"))}, r"Invalid betas\[1\]=nan"),
    ({"eps": float("inf")}, "Invalid eps=inf"),
    ({"weight_decay": -0.1}, "Invalid weight_decay=-0.1"),
    ({"max_preconditioner_dim": True}, "Invalid max_preconditioner_dim=True"),
    ({"max_preconditioner_dim": 64.0}, "Invalid max_preconditioner_dim=64.0"),
    ({"precondition_frequency": True}, "Invalid precondition_frequency=True"),
    ({"precondition_frequency": -3}, "Invalid precondition_frequency=-3"),
    ({"precondition_frequency": 10**9}, r"Invalid precondition_frequency=1000000000: must be at most 1000000 steps"),
    ({"runtime": asteria.MemoryConfig()}, "Invalid runtime=MemoryConfig"),
])
def test_constructor_arguments(optimizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        optimizer(small_mlp().parameters(), **kwargs)


@pytest.mark.parametrize("optimizer, kwargs, match", [
    (asteria.Shampoo, {"start_preconditioning_step": True}, "Invalid start_preconditioning_step=True"),
    (asteria.Shampoo, {"grafting_beta2": 1.0}, "Invalid grafting_beta2=1.0"),
    (asteria.Shampoo, {"relative_eps": -1e-5}, "Invalid relative_eps=-1e-05: must be a finite number >= 0"),
    (asteria.Shampoo, {"relative_eps": float("nan")}, "Invalid relative_eps=nan"),
    (asteria.SOAP, {"shampoo_beta": -0.5}, "Invalid shampoo_beta=-0.5"),
    (asteria.SOAP, {"refresh_skip_tol": float("nan")}, "Invalid refresh_skip_tol=nan"),
    (asteria.KLShampoo, {"init_factor": True}, "Invalid init_factor=True"),
    (asteria.KLShampoo, {"refresh_skip_tol": -1}, "Invalid refresh_skip_tol=-1"),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_optimizer_specific_arguments(optimizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        optimizer(small_mlp().parameters(), **kwargs)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("group, match", [
    ({"lr": -1.0}, r"Invalid param_groups\[1\]\['lr'\]=-1.0"),
    ({"betas": (0.9, 1.5)}, r"Invalid param_groups\[1\]\['betas'\]\[1\]=1.5"),
    ({"eps": 0.0}, r"Invalid param_groups\[1\]\['eps'\]=0.0"),
    ({"weight_decay": float("inf")}, r"Invalid param_groups\[1\]\['weight_decay'\]=inf"),
])
def test_each_param_group_is_checked(optimizer, group, match):
    model = small_mlp()
    groups = [{"params": [model[0].weight, model[0].bias]}, {"params": [model[2].weight, model[2].bias], **group}]
    with pytest.raises(ValueError, match=match):
        optimizer(groups)


def test_param_group_added_after_construction_is_refused():
    model = small_mlp()
    with asteria.Shampoo([model[0].weight], runtime=asteria.RuntimeConfig(mode="sync")) as opt:
        with pytest.raises(ValueError, match="Invalid add_param_group after construction"):
            opt.add_param_group({"params": [model[2].weight]})
        assert len(opt.param_groups) == 1


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
def test_non_floating_parameters_are_refused(optimizer):
    counts = torch.zeros(4, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"Invalid parameter .* of dtype torch.int64: must be a real floating"):
        optimizer([counts])


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
def test_parameters_on_the_meta_device_are_refused(optimizer):
    layer = torch.nn.Linear(3, 4, device="meta")
    with pytest.raises(ValueError, match=r"Invalid parameter weight on device 'meta': it holds no data"):
        optimizer(layer.named_parameters())


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("key, value, match", [
    ("lr", float("nan"), r"Invalid param_groups\[0\]\['lr'\]=nan"),
    ("lr", -0.1, r"Invalid param_groups\[0\]\['lr'\]=-0.1"),
    ("lr", "1e-3", r"Invalid param_groups\[0\]\['lr'\]='1e-3'"),
    ("betas", (0.9, 1.5), r"Invalid param_groups\[0\]\['betas'\]\[1\]=1.5"),
    ("weight_decay", float("nan"), r"Invalid param_groups\[0\]\['weight_decay'\]=nan"),
])
def test_hyperparameters_changed_after_construction_are_checked_at_the_step(optimizer, mode, key, value, match):
    """An lr scheduler, or code that edits param_groups, can change a hyperparameter after construction:
    the next step() refuses it by name before anything changes (the NaN would otherwise reach every weight)."""
    model = small_mlp()
    runtime = asteria.RuntimeConfig(mode=mode, workers=1) if mode == "async" else asteria.RuntimeConfig(mode=mode)
    with optimizer(model.parameters(), precondition_frequency=2, runtime=runtime) as opt:
        train(model, opt, 3)
        before = [p.detach().clone() for p in model.parameters()]
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=match):
            train(model, opt, 1)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)) and opt._step == 3


def test_a_scheduler_that_makes_the_lr_nan_is_refused_at_the_step():
    model = small_mlp()
    with asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(mode="sync")) as opt:
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 2 else float("nan"))
        train(model, opt, 2, hook=lambda step, _: scheduler.step())
        with pytest.raises(ValueError, match=r"Invalid param_groups\[0\]\['lr'\]=nan"):
            train(model, opt, 1)


def test_a_grafting_typo_made_after_construction_is_refused_at_the_step():
    model = small_mlp()
    with asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(mode="sync")) as opt:
        opt.param_groups[0]["grafting"] = "adma"
        with pytest.raises(ValueError, match=r"Invalid param_groups\[0\]\['grafting'\]='adma': must be one of"):
            train(model, opt, 1)


def test_the_runtime_config_is_the_optimizers_own_copy():
    """Changing (or reusing) the RuntimeConfig after construction reached a live optimizer unchecked: a
    mode or staleness it was not built for, a misspelt policy."""
    runtime = asteria.RuntimeConfig(mode="sync")
    model = small_mlp()
    with asteria.Shampoo(model.parameters(), runtime=runtime) as opt:
        runtime.mode, runtime.nonfinite_grad_policy, runtime.memory.placement = "async", "Raise", "host"
        assert opt.runtime.mode == "sync" and opt.runtime.nonfinite_grad_policy == "skip"
        assert opt.runtime.memory.placement == "auto" and opt.runtime is not runtime
        train(model, opt, 2)
        assert opt.state_dict()["runtime_mode"] == "sync"


def test_param_groups_edited_after_construction_are_refused_at_the_step():
    """The blocks are batched at construction: parameters swapped in or a group appended were ignored
    silently, a hyperparameter deleted gave a raw KeyError."""
    for edit, match in ((lambda g: g[0].__setitem__("params", list(g[0]["params"])), r"their parameters changed"),
                        (lambda g: g[0]["params"].pop(), r"their parameters changed"),
                        (lambda g: g.append({"params": [torch.nn.Parameter(torch.ones(2))], **g[0]}),
                         r"now 2 groups"),
                        (lambda g: g[0].pop("eps"), r"Invalid param_groups\[0\]: \['eps'\] removed")):
        model = small_mlp()
        with asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(mode="sync")) as opt:
            train(model, opt, 1)
            edit(opt.param_groups)
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(ValueError, match=match):
                train(model, opt, 1)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            assert opt.runtime_stats()["step"] == 1


@pytest.mark.parametrize("group, match", [
    ({"precondition_frequency": 1}, r"Invalid param_groups\[0\]\['precondition_frequency'\]=1: precondition_"
                                    r"frequency is the optimizer's, one for every group"),
    ({"max_preconditioner_dim": 2}, r"Invalid param_groups\[0\]\['max_preconditioner_dim'\]=2"),
    ({"runtime": None}, r"Invalid param_groups\[0\]\['runtime'\]=None"),
])
def test_constructor_arguments_in_a_param_group_are_refused(group, match):
    with pytest.raises(ValueError, match=match):
        asteria.SOAP([{"params": list(small_mlp().parameters()), **group}])


def test_a_param_groups_beta2_follower_set_to_none_follows_its_betas():
    params = list(small_mlp().parameters())
    with asteria.Shampoo([{"params": params[:2], "grafting_beta2": None, "betas": (0.9, 0.95)},
                          {"params": params[2:], "grafting_beta2": None}], grafting_beta2=0.9,
                         runtime=asteria.RuntimeConfig(mode="sync")) as opt:
        assert [g["grafting_beta2"] for g in opt.param_groups] == [0.95, opt.defaults["betas"][1]]
    with asteria.SOAP([{"params": params, "shampoo_beta": None, "betas": (0.9, 0.8)}], shampoo_beta=0.5,
                      runtime=asteria.RuntimeConfig(mode="sync")) as opt:
        assert opt.param_groups[0]["shampoo_beta"] == 0.8


def test_numbers_torch_cannot_take_are_refused_by_name():
    from fractions import Fraction

    params = small_mlp().parameters()
    with pytest.raises(ValueError, match=r"Invalid lr=Fraction\(1, 1000\)"):
        asteria.Shampoo(params, lr=Fraction(1, 1000))
    with pytest.raises(ValueError, match=r"Invalid lr=tensor\(True\)"):
        asteria.Shampoo(small_mlp().parameters(), lr=torch.tensor(True))


def test_inference_mode_is_refused_at_construction():
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match=r"Invalid SOAP\(...\) under torch.inference_mode\(\)"):
            asteria.SOAP(small_mlp().parameters())
        model = small_mlp()  # inference tensors
    with pytest.raises(ValueError, match=r"Invalid parameter .*: an inference tensor"):
        asteria.SOAP(model.parameters())


def test_a_gradient_of_another_shape_or_kind_is_refused_before_anything_changes():
    model = small_mlp()
    with asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(mode="sync")) as opt:
        train(model, opt, 1)
        weight = model[0].weight
        for grad, shown in ((torch.randn(5), r"torch.float32 \(5,\)"),
                            (torch.randn(weight.shape[::-1]), r"torch.float32 \(8, 16\)"),
                            (torch.ones(weight.shape, dtype=torch.int64), r"torch.int64 \(16, 8\)")):
            model.zero_grad()
            model(torch.randn(3, 8)).sum().backward()
            weight.grad = None
            weight.grad = torch.zeros_like(weight)
            weight.grad.data = grad
            with pytest.raises(ValueError, match=rf"Invalid gradient of .*: {shown}, for a parameter of "
                                                 r"torch.float32 \(16, 8\): must be a floating-point tensor"):
                opt.step()
            assert opt.runtime_stats()["step"] == 1


def test_state_view_is_read_only_and_a_mapping():
    model = small_mlp()
    with asteria.SOAP(model.parameters(), runtime=asteria.RuntimeConfig(mode="sync")) as opt:
        weight = model[0].weight
        assert "w" not in opt.state and None not in opt.state and opt.state.get("w", 7) == 7
        with pytest.raises(TypeError, match="Invalid assignment to optimizer.state: it is a read-only view"):
            opt.state[weight] = {"step": 5}
        with pytest.raises(TypeError, match="read-only"):
            del opt.state[weight]
        view = opt.state
    del opt
    import gc
    gc.collect()
    with pytest.raises(ReferenceError, match="outlived its optimizer"):
        view[weight]


def test_attach_refuses_a_closed_optimizer_and_a_model_it_does_not_train():
    model = small_mlp()
    opt = asteria.SOAP(model.parameters(), runtime=asteria.RuntimeConfig(mode="sync"))
    with pytest.raises(ValueError, match=r"Invalid model=Sequential: none of its parameters is the optimizer's"):
        asteria.attach(small_mlp(), opt)
    asteria.attach(model, opt, drain_points=np.int64(2)).remove()  # NumPy ints as everywhere else
    opt.close()
    with pytest.raises(RuntimeError, match=r"Invalid attach\(\) of a closed optimizer"):
        asteria.attach(model, opt)
    with pytest.raises(RuntimeError, match=r"Invalid load_state_dict\(\) after close\(\)"):
        opt.load_state_dict(opt.state_dict())


def test_nvme_dir_takes_a_path_and_refuses_blanks(tmp_path):
    import pathlib

    assert asteria.MemoryConfig(nvme_dir=pathlib.Path(tmp_path)).nvme_dir == str(tmp_path)
    with pytest.raises(ValueError, match=r"Invalid nvme_dir='   ': must be None or a directory path"):
        asteria.MemoryConfig(nvme_dir="   ")


@pytest.mark.parametrize("kwargs, match", [
    ({"blas_threads": 0}, "Invalid blas_threads=0"),
    ({"blas_threads": 2**40}, r"Invalid blas_threads=1099511627776: must be an int in \[1, 1024\]"),
    ({"workers": 100000}, r"Invalid workers=100000: must be None or an int in \[1, 1024\]"),
    ({"timeout_s": 1e10}, r"Invalid timeout_s=10000000000.0: must be a finite number of seconds in \[1e-06, 1e\+07\]"),
    ({"timeout_s": 5e-10}, r"Invalid timeout_s=5e-10: must be a finite number of seconds in \[1e-06"),
    ({"torch_threads": 100000}, r"Invalid torch_threads=100000: must be 'auto', 'keep' or an int in \[1, 1024\]"),
    ({"sync_refreshes": 2**31}, r"Invalid sync_refreshes=2147483648: must be an int in \[0, 2147483647\]"),
    ({"max_consecutive_failures": 2**31}, r"Invalid max_consecutive_failures=2147483648: must be an int in \[1, "),
    ({"max_nonfinite_grad_steps": 2**40}, r"Invalid max_nonfinite_grad_steps=1099511627776"),
    ({"workers": 2.0}, "Invalid workers=2.0"),
    ({"deterministic": 1}, "Invalid deterministic=1"),
    ({"sync_refreshes": -1}, "Invalid sync_refreshes=-1"),
    ({"sync_refreshes": True}, "Invalid sync_refreshes=True"),
    ({"timeout_s": True}, "Invalid timeout_s=True"),
    ({"timeout_s": float("nan")}, "Invalid timeout_s=nan"),
    ({"staleness": True}, "Invalid staleness=True"),
    ({"max_consecutive_failures": 1.5}, "Invalid max_consecutive_failures=1.5"),
    ({"max_nonfinite_grad_steps": 0}, "Invalid max_nonfinite_grad_steps=0"),
    ({"local_world_size": 0}, "Invalid local_world_size=0"),
    ({"stagger_split": 1}, "Invalid stagger_split=1: must be None or a bool"),
    ({"stagger_sets_per_step": 0}, r"Invalid stagger_sets_per_step=0: must be an int in \[1, 64\]"),
    ({"stagger_sets_per_step": 2.0}, r"Invalid stagger_sets_per_step=2.0: must be an int"),
    ({"stagger_sets_per_step": True}, r"Invalid stagger_sets_per_step=True: must be an int"),
    ({"stagger_split": True, "stagger": False}, "Invalid stagger_split=True: splits groups for the staggered "
                                                "schedule: needs stagger=None or True, not False"),
    ({"stagger_small": 1}, "Invalid stagger_small=1: must be None or a bool"),
    ({"stagger_small": True, "stagger": False}, "Invalid stagger_small=True: spreads the small sets over the "
                                                "staggered schedule: needs stagger=None or True, not False"),
    ({"device_sms": 0}, r"Invalid device_sms=0: must be None or an int in \[1, 1024\]"),
    ({"device_sms": True}, "Invalid device_sms=True: must be None or an int"),
    ({"device_sms": 16.0}, "Invalid device_sms=16.0: must be None or an int"),
    ({"device_sms": 16, "mode": "sync"}, r"Invalid device_sms=16: partitions the GPU for the device lane, which "
                                         r"runs in mode='async' unless device_refresh=False \(here mode='sync'"),
    ({"device_threads": 0}, r"Invalid device_threads=0: must be an int in \[1, 16\]"),
    ({"device_threads": 2.0}, r"Invalid device_threads=2.0: must be an int in \[1, 16\]"),
    ({"device_threads": 2, "device_refresh": False}, r"Invalid device_threads=2: sets the device lane's threads, "
                                                     r"and the lane runs in mode='async' unless device_refresh=False"),
    ({"device_sms": 16, "device_refresh": False}, r"Invalid device_sms=16: .*\(here mode='async', "
                                                  r"device_refresh=False\)"),
    ({"device_process": 1}, "Invalid device_process=1: must be None or a bool"),
    ({"queue_order": "fifo"}, r"Invalid queue_order='fifo': must be one of \('deadline', 'shortest'\)"),
    ({"express_workers": -1}, r"Invalid express_workers=-1: must be None or an int in \[0, 1024\]"),
    ({"express_workers": True}, r"Invalid express_workers=True: must be None or an int in \[0, 1024\]"),
    ({"device_process": True, "mode": "sync"}, r"Invalid device_process=True: moves the device lane into a child "
                                               r"process, and the lane runs in mode='async'"),
])
def test_runtime_config_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        asteria.RuntimeConfig(**kwargs)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("runtime", [{}, {"device_refresh": True}])
def test_a_partition_of_the_gpu_without_a_device_lane_on_one_is_refused_before_anything_starts(optimizer, runtime):
    """device_sms partitions a GPU for the device lane: with the parameters on the CPU (the lane off, or on the
    CPU) it would do nothing, so construction refuses it by name, as it refuses device_threads where no lane
    thread would run (tests/test_cuda.py: the other cases)."""
    model = torch.nn.Linear(8, 4)
    threads = threading.active_count()
    why = "computes on the CPU here" if runtime else "does not run here"
    with pytest.raises(ValueError, match=rf"Invalid device_sms=16: partitions a GPU for the device lane, and the "
                                         rf"lane {why}\b.*: leave it None"):
        optimizer(model.parameters(), runtime=asteria.RuntimeConfig(device_sms=16, **runtime))
    if not runtime:  # no lane on CPU parameters unless device_refresh=True
        with pytest.raises(ValueError, match=r"Invalid device_threads=2: sets the device lane's threads, and the "
                                             r"lane does not run here"):
            optimizer(model.parameters(), runtime=asteria.RuntimeConfig(device_threads=2))
    else:  # the deterministic rule's lane computes the start-up refreshes only, inline
        with pytest.raises(ValueError, match=r"Invalid device_threads=2: sets the device lane's threads, and under "
                                             r"the deterministic rule the lane computes only the start-up refreshes"):
            optimizer(model.parameters(), runtime=asteria.RuntimeConfig(device_threads=2, deterministic=True,
                                                                        **runtime))
    assert threading.active_count() == threads  # no worker was started


@pytest.mark.parametrize("kwargs, match", [
    ({"host_budget": True}, "Invalid host_budget=True"),
    ({"gpu_budget": 0}, "Invalid gpu_budget=0"),
    ({"nvme_budget": 1.5}, "Invalid nvme_budget=1.5"),
    ({"placement": "gpu"}, "Invalid placement='gpu'"),
])
def test_memory_config_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        asteria.MemoryConfig(**kwargs)


def trained(optimizer, mode: str = "sync"):
    model = small_mlp()
    opt = optimizer(list(model.named_parameters()), precondition_frequency=2,
                    runtime=asteria.RuntimeConfig(mode=mode, staleness=1, workers=1))
    train(model, opt, 3)
    return model, opt


def mutate(path, value):
    def apply(state):
        target = state
        for key in path[:-1]:
            target = target[key]
        if value is KeyError:
            del target[path[-1]]
        elif callable(value):
            target[path[-1]] = value(target[path[-1]])
        else:
            target[path[-1]] = value
    return apply


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("change, match", [
    (mutate(["step"], KeyError), "Invalid state_dict: missing key 'step'"),
    (mutate(["refresher"], KeyError), "Invalid state_dict: missing key 'refresher'"),
    (mutate(["step"], "3"), r"Invalid state_dict\['step'\]='3'"),
    (mutate(["step"], -1), r"Invalid state_dict\['step'\]=-1"),
    (mutate(["groups"], lambda g: g[:-1]), r"Invalid state_dict\['groups'\]='list of \d+ entries'"),
    (mutate(["param_groups"], lambda g: g + g), r"Invalid state_dict\['param_groups'\]='list of 2 entries'"),
    (mutate(["versions"], lambda v: v[1:]), r"Invalid state_dict\['versions'\]"),
    (mutate(["versions", 0], lambda v: ["x"] * len(v)), r"Invalid state_dict\['versions'\]\[0\]=\['x'"),
    (mutate(["groups", 0, "exp_avg"], lambda t: t[..., :1]), r"Invalid state_dict\['groups'\]\[0\]\['exp_avg'\]="
                                                             r"'torch.float32 .*expects torch.float32"),
    (mutate(["groups", 0, "exp_avg"], lambda t: t.double()), r"Invalid state_dict\['groups'\]\[0\]\['exp_avg'\]="
                                                             r"'torch.float64"),
    (mutate(["groups", 0, "exp_avg"], lambda t: t.tolist()), r"\['exp_avg'\]='list': must be a torch.Tensor"),
    (mutate(["groups", 0, "exp_avg"], lambda t: torch.full_like(t, float("nan"))),
     r"\['exp_avg'\]='tensor with non-finite values'"),
    (mutate(["param_groups", 0, "lr"], -5.0), r"Invalid state_dict\['param_groups'\]\[0\]\['lr'\]=-5.0"),
    (mutate(["param_groups", 0, "betas"], (0.9, 2.0)), r"Invalid state_dict\['param_groups'\]\[0\]\['betas'\]\[1\]"),
])
def test_load_state_dict_rejects_bad_checkpoints_and_changes_nothing(optimizer, change, match):
    _, source = trained(optimizer)
    _, target = trained(optimizer)
    with source, target:
        state = source.state_dict()
        # Shampoo names its first moment "momentum"; the eigenbasis optimizers "exp_avg".
        if optimizer is asteria.Shampoo:
            for group in state["groups"]:
                group["exp_avg"] = group.pop("momentum")
            for group in target._groups:
                group.state["exp_avg"] = group.state.pop("momentum")
        before = [t.clone() for g in target._groups for t in g.state.values()]
        hyper = [dict(g) for g in target.param_groups]
        change(state)
        with pytest.raises(ValueError, match=match):
            target.load_state_dict(state)
        now = [t for g in target._groups for t in g.state.values()]
        assert all(torch.equal(a, b) for a, b in zip(before, now, strict=True))
        assert [dict(g) for g in target.param_groups] == hyper
        assert target.runtime_stats()["step"] == 3


@pytest.mark.parametrize("source, target", [(asteria.Shampoo, asteria.SOAP), (asteria.SOAP, asteria.KLShampoo)])
def test_load_state_dict_of_another_optimizer_class(source, target):
    model = small_mlp()
    a = source(model.parameters(), runtime=asteria.RuntimeConfig(mode="sync"), max_preconditioner_dim=16)
    b = target(model.parameters(), runtime=asteria.RuntimeConfig(mode="sync"), max_preconditioner_dim=16)
    with a, b:
        with pytest.raises(ValueError, match=rf"Invalid state_dict: saved by an asteria.{source.__name__}, loaded "
                                             rf"into an asteria.{target.__name__}"):
            b.load_state_dict(a.state_dict())
        older = {k: v for k, v in a.state_dict().items() if k != "optimizer"}  # written before the class was
        with pytest.raises(ValueError, match="Invalid state_dict"):
            b.load_state_dict(older)


def test_a_numpy_learning_rate_set_by_a_scheduler_checkpoints_as_a_float():
    model = small_mlp()
    with asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(mode="sync")) as opt:
        train(model, opt, 1)
        opt.param_groups[0]["lr"] = np.float64(0.002)
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        assert loaded["param_groups"][0]["lr"] == 0.002 and type(loaded["param_groups"][0]["lr"]) is float


def test_an_async_optimizer_refuses_to_step_in_a_forked_process():
    """Its workers are threads of the process that built it, which a fork does not copy: the child's step
    waited timeout_s for them, then raised a misleading TimeoutError."""
    model = small_mlp()
    with asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(workers=1, worker_cpus="any")) as opt:
        train(model, opt, 1)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what step() says, then leave at once
            try:
                opt.step()
                message = "accepted"
            except RuntimeError as error:
                message = str(error)
            os.write(write, message.encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            message = pipe.read()
        os.waitpid(pid, 0)
        assert message.startswith(f"Invalid step() in a process forked (pid {pid}) from the one that built this "
                                  f"async optimizer (pid {os.getpid()})"), message
        train(model, opt, 1)  # the parent goes on


def test_load_state_dict_of_another_mode():
    _, sync = trained(asteria.SOAP, "sync")
    _, other = trained(asteria.SOAP, "async")
    with sync, other:
        with pytest.raises(ValueError, match="saved in mode 'sync', this optimizer runs mode 'async'"):
            other.load_state_dict(sync.state_dict())


def test_fault_injection_arguments():
    model, opt = trained(asteria.Shampoo, "async")
    with opt:
        with pytest.raises(ValueError, match="Invalid kind='explode'"):
            testing.inject_fault(opt, "0.weight", "explode")
        with pytest.raises(ValueError, match=r"Invalid param='nope': no preconditioner block belongs to it"):
            testing.inject_fault(opt, "nope")
        with pytest.raises(ValueError, match="Invalid mode=5"):
            testing.inject_fault(opt, "0.weight", mode=5)
        with pytest.raises(ValueError, match="Invalid version=0"):
            testing.inject_fault(opt, "0.weight", version=0)
        with pytest.raises(ValueError, match=r"Invalid seconds=0.50* for kind='throw'"):
            testing.inject_fault(opt, "0.weight", "throw", seconds=0.5)
        with pytest.raises(ValueError, match="Invalid seconds=0.0"):
            testing.inject_fault(opt, "0.weight", "delay")
        with pytest.raises(ValueError, match="Invalid max_delay_s=-1"):
            testing.set_random_worker_delay(opt, -1.0)
    _, sync = trained(asteria.Shampoo, "sync")
    with sync, pytest.raises(ValueError, match="fault injection needs mode='async'"):
        testing.inject_fault(sync, "0.weight")


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
def test_blocks_whose_factors_cannot_fit_the_device_are_refused_before_any_allocation(optimizer):
    """A max_preconditioner_dim that leaves a factor larger than all of the host's memory: refused by name with
    the sizes, before anything is allocated (the allocator's own error, or on a host that overcommits memory,
    the process killed at the first steps, came otherwise)."""
    import math

    from asteria.optim.placement import device_capacity

    capacity = device_capacity(torch.device("cpu"))
    if capacity is None:
        pytest.skip("the host's physical memory is not known here")
    dim = math.isqrt(capacity // 4) + 1  # one dim x dim float32 factor is more than the host has
    wide = torch.nn.Parameter(torch.zeros(dim, 2))
    with pytest.raises(ValueError, match=rf"Invalid max_preconditioner_dim={dim}: the factors alone \(float32, n x "
                                         r"n for each dimension of each block\) would take [0-9.]+ GiB on cpu, which "
                                         rf"has [0-9.]+ GiB in all \(the largest, {dim} x {dim}, .*a smaller "
                                         r"max_preconditioner_dim splits"):
        optimizer([wide], max_preconditioner_dim=dim, runtime=asteria.RuntimeConfig(mode="sync"))
    narrow = torch.nn.Parameter(torch.zeros(4096, 2))  # a size that does not grow with the host
    with optimizer([narrow], max_preconditioner_dim=1024, runtime=asteria.RuntimeConfig(mode="sync")) as opt:
        assert opt.max_preconditioner_dim == 1024  # split into blocks of at most 1024, within memory: built


@pytest.mark.parametrize("mutation, named", [
    ("step", r"Invalid state_dict\['step'\]=10{30}: must be an int in \[0, 4611686018427387904\]"),
    ("meta", r"Invalid state_dict\['groups'\]\[0\]\['momentum'\]='torch.strided tensor on meta': must be a dense"),
    ("sparse", r"Invalid state_dict\['groups'\]\[0\]\['momentum'\]='torch.sparse_coo tensor on cpu': must be a dense"),
])
def test_a_state_dict_with_an_unusable_step_or_tensor_is_refused_at_load(mutation, named):
    """Refused by name when loaded, before anything changes: not at the next step, from inside the core."""
    model = torch.nn.Linear(4, 4)
    runtime = asteria.RuntimeConfig(deterministic=True, workers=1)
    with asteria.Shampoo(model.parameters(), runtime=runtime) as opt:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        saved = opt.state_dict()
    saved["groups"] = [dict(group) for group in saved["groups"]]
    if mutation == "step":
        saved["step"] = 10**30
    else:
        momentum = saved["groups"][0]["momentum"]
        saved["groups"][0]["momentum"] = (torch.empty_like(momentum, device="meta") if mutation == "meta"
                                          else momentum.to_sparse())
    with asteria.Shampoo(model.parameters(), runtime=runtime) as fresh:
        with pytest.raises(ValueError, match=named):
            fresh.load_state_dict(saved)
        assert fresh._step == 0


@pytest.mark.parametrize("priority", [1, -65, 0.5, True, "high"])
def test_training_stream_refuses_a_priority_cuda_cannot_take(priority):
    """Refused when called, before any ``with``."""
    with pytest.raises(ValueError, match=rf"Invalid priority={priority!r}: must be an int in \[-64, 0\]"):
        asteria.training_stream(priority=priority)


@pytest.mark.parametrize("device", [True, -1, 1.5, "no-such-device"])
def test_training_stream_refuses_what_names_no_device(device):
    with pytest.raises(ValueError, match=rf"Invalid device={device!r}: must be None, a CUDA device index >= 0"):
        asteria.training_stream(device)


def test_training_stream_runs_the_body_plainly_without_a_gpu():
    """A loop written for the GPU runs unchanged on a CPU-only machine, and a CUDA device named where there is
    none is refused by name."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with asteria.training_stream():
        done = torch.ones(2).sum().item()
    with asteria.training_stream("cpu", priority=np.int64(-3)):
        done += 1
    assert done == 3
    with pytest.raises(ValueError, match=r"Invalid device='cuda:0': CUDA is not available"), \
            asteria.training_stream("cuda:0"):
        pass
