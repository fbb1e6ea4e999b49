"""The training CLI's learning-rate schedule (warm-up, cosine or constant) and gradient clipping."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import torch

from asteria.train import checkpoint
from asteria.train.checkpoint import CheckpointError, Manifest
from asteria.train.loop import MIN_LR_RATIO, RunConfig, check_resumable, clip_gradients, make_optimizer


def test_warmup_then_cosine_to_a_tenth():
    cfg = RunConfig(steps=110, lr=1.0, warmup_steps=10)
    assert [cfg.lr_at(s) for s in (1, 5, 10)] == pytest.approx([1 / 11, 5 / 11, 10 / 11])
    assert cfg.lr_at(11) == pytest.approx(MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi / 100)))
    assert cfg.lr_at(60) == pytest.approx(MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5)  # half way: the midpoint
    assert cfg.lr_at(110) == pytest.approx(MIN_LR_RATIO)
    lrs = [cfg.lr_at(s) for s in range(1, 111)]
    assert max(lrs) <= 1.0 and all(a > b for a, b in itertools.pairwise(lrs[10:]))


def test_constant_schedule_and_default_warmup():
    cfg = RunConfig(steps=300, lr=2.0, lr_schedule="constant")
    assert cfg.warmup == 30
    assert cfg.lr_at(31) == cfg.lr_at(300) == 2.0
    assert RunConfig(steps=5000).warmup == 200
    no_warmup = RunConfig(steps=5, warmup_steps=0, lr_schedule="constant")
    assert no_warmup.lr_at(1) == no_warmup.learning_rate


@pytest.mark.parametrize("kwargs, match", [
    ({"lr_schedule": "linear"}, "Invalid lr_schedule='linear'"),
    ({"warmup_steps": 200, "steps": 200}, "Invalid warmup_steps=200"),
    ({"warmup_steps": -1}, "Invalid warmup_steps=-1"),
    ({"grad_clip": float("nan")}, "Invalid grad_clip=nan"),
    ({"grad_clip": -0.5}, "Invalid grad_clip=-0.5"),
    ({"start_preconditioning_step": 0}, "Invalid start_preconditioning_step=0"),
    ({"optimizer": "kl-shampoo", "start_preconditioning_step": 5}, "Invalid start_preconditioning_step=5.*kl-shampoo"),
    ({"optimizer": "kl-shampoo", "precondition_1d": True}, "Invalid precondition_1d=True.*None for kl-shampoo"),
    ({"optimizer": "ds-shampoo", "precondition_1d": False}, "Invalid precondition_1d=False"),
    ({"precondition_1d": 1}, "Invalid precondition_1d=1"),
    ({"optimizer": "soap", "first_basis": "QR"}, r"Invalid first_basis='QR': must be None \(SOAP's own: eigh\)"),
    ({"optimizer": "shampoo", "first_basis": "qr"}, "Invalid first_basis='qr'.*other than soap"),
    ({"beta2": 1.0}, r"Invalid beta2=1.0: must be None \(the optimizer's own\) or a number in \(0, 1\)"),
    ({"beta2": True}, "Invalid beta2=True"),
    ({"beta2": 0}, "Invalid beta2=0"),
])
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(**kwargs)


def test_a_checkpoint_from_before_the_schedule_resumes_only_as_constant():
    """A manifest without the new settings was trained with a constant rate and no clipping."""
    cfg = RunConfig()
    saved = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(RunConfig)}
    for name in ("lr_schedule", "warmup_steps", "grad_clip"):
        saved.pop(name)
    manifest = Manifest(checkpoint.FORMAT, 10, 1, {}, saved)
    with pytest.raises(CheckpointError, match="lr_schedule='constant'.*grad_clip=0.0"):
        check_resumable(manifest, cfg, Path("old"))
    check_resumable(manifest, dataclasses.replace(cfg, lr_schedule="constant", warmup_steps=0, grad_clip=0.0),
                    Path("old"))


def model_with_grads(*grads: torch.Tensor) -> torch.nn.Module:
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(g)) for g in grads])
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()
    return model


def test_clipping_scales_to_the_global_norm_and_leaves_small_ones():
    model = model_with_grads(torch.full((3,), 4.0), torch.full((4,), 3.0))  # norm sqrt(48 + 36)
    clip_gradients(model, 1.0)
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    assert float(norm) == pytest.approx(1.0, rel=1e-5)
    assert float(model[0].grad[0] / model[1].grad[0]) == pytest.approx(4.0 / 3.0)
    small = model_with_grads(torch.full((2,), 0.1))
    clip_gradients(small, 1.0)
    assert torch.equal(small[0].grad, torch.full((2,), 0.1))


def test_a_non_finite_gradient_is_left_where_it_is():
    """The optimizer's policy skips the block holding the NaN; clipping must not spread it."""
    model = model_with_grads(torch.tensor([float("nan"), 1.0]), torch.full((2,), 30.0))
    clip_gradients(model, 1.0)
    assert torch.equal(model[1].grad, torch.full((2,), 30.0))
    assert torch.isnan(model[0].grad[0]) and model[0].grad[1] == 1.0


@pytest.mark.parametrize("setting, legacy, mode, optimizer, stagger, refused", [
    ("stagger_split", False, "async", "shampoo", None, True),
    ("stagger_split", False, "sync", "soap", None, False),
    ("stagger_split", False, "async", "adamw", None, False),
    ("stagger_sets_per_step", 1, "async", "shampoo", None, True),
    ("stagger_sets_per_step", 1, "sync", "soap", None, False),
    ("stagger_sets_per_step", 1, "sync", "shampoo", True, True),
    ("stagger_sets_per_step", 1, "async", "soap", False, False),
    ("stagger_small", False, "async", "kl-shampoo", None, True),
    ("stagger_small", False, "sync", "soap", None, False),
    ("stagger_small", False, "sync", "shampoo", True, True),
    ("stagger_small", False, "async", "soap", False, False),
    ("stagger_small", False, "async", "adamw", None, False),
])
def test_a_checkpoint_from_before_a_stagger_setting_resumes_with_its_sets(setting, legacy, mode, optimizer, stagger,
                                                                         refused):
    """A manifest without stagger_split kept its groups whole, one without stagger_sets_per_step cut its split
    sets at one a step, and one without stagger_small spread the small sets with the large ones; the defaults now
    split them where one process staggers (Asteria mode, or native with --stagger), at two a step, the small ones
    apart wherever the schedule is staggered, so that resume needs --no-stagger-split, --stagger-sets-per-step 1
    or --no-stagger-small there and nothing where the schedule is not staggered."""
    cfg = RunConfig(mode=mode, optimizer=optimizer, stagger=stagger)
    saved = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(RunConfig) if f.name != setting}
    manifest = Manifest(checkpoint.FORMAT, 10, 1, {}, saved)
    if refused:
        with pytest.raises(CheckpointError, match=rf"{setting}={legacy} \(this run: "):
            check_resumable(manifest, cfg, Path("old"))
    else:
        check_resumable(manifest, cfg, Path("old"))
    check_resumable(manifest, dataclasses.replace(cfg, **{setting: legacy}), Path("old"))


@pytest.mark.parametrize("optimizer", ["soap", "shampoo", "kl-shampoo"])
def test_a_checkpoint_from_before_the_start_setting_resumes_at_its_start(optimizer):
    """A manifest without start_preconditioning_step: SOAP then took its first basis at step 1 (its default is
    now f), so that its resume needs --start-preconditioning-step 1; the others start where they did."""
    cfg = RunConfig(optimizer=optimizer)
    saved = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(RunConfig)
             if f.name != "start_preconditioning_step"}
    manifest = Manifest(checkpoint.FORMAT, 10, 1, {}, saved)
    if optimizer == "soap":
        with pytest.raises(CheckpointError, match=r"start_preconditioning_step=1 \(this run: 10\)"):
            check_resumable(manifest, cfg, Path("old"))
        cfg = dataclasses.replace(cfg, start_preconditioning_step=1)
    check_resumable(manifest, cfg, Path("old"))
    written = Manifest(checkpoint.FORMAT, 10, 1, {}, saved | {"start_preconditioning_step": None})
    check_resumable(written, RunConfig(optimizer=optimizer), Path("new"))


@pytest.mark.parametrize("optimizer", ["soap", "shampoo", "kl-shampoo"])
def test_a_checkpoint_from_before_the_1d_setting_resumes_with_the_factors_it_holds(optimizer):
    """A manifest without precondition_1d: Shampoo then gave 1-D parameters factors (its default is now
    off), so that its resume needs --precondition-1d; SOAP's and KL-Shampoo's did not change."""
    cfg = RunConfig(optimizer=optimizer)
    saved = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(RunConfig) if f.name != "precondition_1d"}
    manifest = Manifest(checkpoint.FORMAT, 10, 1, {}, saved)
    if optimizer == "shampoo":
        with pytest.raises(CheckpointError, match=r"precondition_1d=True \(this run: False\)"):
            check_resumable(manifest, cfg, Path("old"))
        cfg = dataclasses.replace(cfg, precondition_1d=True)
    check_resumable(manifest, cfg, Path("old"))
    written = Manifest(checkpoint.FORMAT, 10, 1, {}, saved | {"precondition_1d": None})
    check_resumable(written, RunConfig(optimizer=optimizer), Path("new"))
    if optimizer != "kl-shampoo":  # an explicit False is the default
        check_resumable(written, RunConfig(optimizer=optimizer, precondition_1d=False), Path("new"))


def test_soaps_first_basis_rule_reaches_it_and_a_resume_keeps_it():
    """None is SOAP's own rule, eigh: a checkpoint from before the setting, or written with None, resumes with
    either, and a run with the other rule is refused."""
    for value, expected in ((None, "eigh"), ("eigh", "eigh"), ("qr", "qr")):
        with make_optimizer(RunConfig(optimizer="soap", mode="sync", first_basis=value), torch.nn.Linear(4, 4)) as opt:
            assert opt.first_basis == expected and all(f.first_basis == expected for f, _ in opt._set_groups)
    cfg = RunConfig(optimizer="soap")
    saved = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(RunConfig) if f.name != "first_basis"}
    for manifest in (Manifest(checkpoint.FORMAT, 10, 1, {}, saved),
                     Manifest(checkpoint.FORMAT, 10, 1, {}, saved | {"first_basis": None})):
        check_resumable(manifest, cfg, Path("old"))
        check_resumable(manifest, dataclasses.replace(cfg, first_basis="eigh"), Path("old"))
        with pytest.raises(CheckpointError, match=r"first_basis='eigh' \(this run: 'qr'\)"):
            check_resumable(manifest, dataclasses.replace(cfg, first_basis="qr"), Path("old"))


@pytest.mark.parametrize("optimizer", ["soap", "shampoo"])
@pytest.mark.parametrize("value", [None, True, False])
def test_the_1d_setting_reaches_the_optimizer(optimizer, value):
    with make_optimizer(RunConfig(optimizer=optimizer, mode="sync", precondition_1d=value),
                        torch.nn.Linear(4, 4)) as opt:
        assert opt.precondition_1d is bool(value)
        assert len(opt._set_groups) == (3 if value else 2)  # the weight's two modes, and the bias's one


@pytest.mark.parametrize("optimizer, beta1, beta2, follows", [
    ("adamw", 0.9, 0.999, ()), ("shampoo", 0.9, 0.999, ("grafting_beta2",)), ("soap", 0.95, 0.95, ("shampoo_beta",)),
    ("kl-shampoo", 0.9, 0.98, ()), ("hb-soap", 0.95, 0.95, ("shampoo_beta",)),
    ("hb-kl-shampoo", 0.9, 0.98, ("shampoo_beta",))])
def test_beta2_reaches_every_optimizer_and_peer(optimizer, beta1, beta2, follows):
    """--beta2 replaces betas[1] (and what follows it: Shampoo's grafting, SOAP's factors, heavyball's
    shampoo_beta), each optimizer keeping its own beta1; without it each has its own default."""
    if optimizer.startswith("hb-"):
        pytest.importorskip("heavyball")
    for value, expected in ((None, beta2), (0.95, 0.95), (0.99, 0.99)):
        opt = make_optimizer(RunConfig(optimizer=optimizer, mode="sync", beta2=value), torch.nn.Linear(4, 4))
        try:
            group = opt.param_groups[0]
            assert tuple(group["betas"]) == (beta1, expected)
            assert all(group[key] == expected for key in follows)
        finally:
            if hasattr(opt, "close"):
                opt.close()


def test_a_checkpoint_from_before_beta2_resumes_only_at_the_optimizers_own():
    cfg = RunConfig(optimizer="soap")
    saved = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(RunConfig) if f.name != "beta2"}
    manifest = Manifest(checkpoint.FORMAT, 10, 1, {}, saved)
    check_resumable(manifest, cfg, Path("old"))
    with pytest.raises(CheckpointError, match=r"beta2=None \(this run: 0.99\)"):
        check_resumable(manifest, dataclasses.replace(cfg, beta2=0.99), Path("old"))


@pytest.mark.parametrize("start, expected", [(None, 10), (1, 1)])
def test_the_start_setting_reaches_the_optimizer(start, expected):
    with make_optimizer(RunConfig(optimizer="soap", mode="sync", start_preconditioning_step=start),
                        torch.nn.Linear(4, 4)) as opt:
        assert opt.start_preconditioning_step == expected
