"""Each block counts its own steps (the steps in which its parameter had a gradient), as torch's AdamW and
the SOAP reference count per parameter: a parameter that first gets a gradient late starts as a fresh one."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import assert_within_rounding_noise, regression_data, rounding_noise, small_mlp
from test_shampoo_reference import HYPER as SHAMPOO_HYPER
from test_shampoo_reference import grafted_direction, mode_unfold, reference_root

import asteria
from asteria.optim.kl_shampoo import inv_sqrt_key
from asteria.optim.soap import EXP_AVG_SQ

OPTIMIZERS = {  # Shampoo's biases with their own factors too: blocks of two shapes whose counts differ
    "shampoo": lambda params, runtime: asteria.Shampoo(params, lr=0.02, eps=1e-2, precondition_frequency=3,
                                                       start_preconditioning_step=3, precondition_1d=True,
                                                       runtime=runtime),
    # SOAP's first basis the step after the first gradient, as KL-Shampoo's: the schedule these tests count
    "soap": lambda params, runtime: asteria.SOAP(params, lr=0.01, precondition_frequency=3,
                                                 start_preconditioning_step=1, runtime=runtime),
    "kl-shampoo": lambda params, runtime: asteria.KLShampoo(params, lr=0.01, precondition_frequency=3,
                                                            runtime=runtime),
}
RUNTIMES = {"sync": dict(mode="sync"), "async": dict(mode="async", staleness=0, workers=1, stagger=False)}
STEPS, LATE = 13, 6  # the second layer gets its first gradient at step LATE + 1, a refresh step (f = 3)


def two_layers() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])


def layers_at(params: list[torch.Tensor]) -> torch.nn.ModuleList:
    """``two_layers()`` with the parameters set to ``params`` (a run resumed from them)."""
    model = two_layers()
    with torch.no_grad():
        for p, q in zip(model.parameters(), params, strict=True):
            p.copy_(q)
    return model


def losses(model: torch.nn.ModuleList, step: int, late: int = LATE) -> list[torch.Tensor]:
    """Two independent regressions, one per layer; the second only from step ``late`` on (0-based)."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=gen).to(model[0].weight.device)
    out = [torch.nn.functional.mse_loss(model[0](x), x.flip(1))]
    if step >= late:
        out.append(torch.nn.functional.mse_loss(model[1](x), x.roll(1, dims=1)))
    return out


def train_layers(model: torch.nn.ModuleList, optimizers: list[torch.optim.Optimizer], steps=range(STEPS),
                 late: int = LATE) -> None:
    for step in steps:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        sum(losses(model, step, late)).backward()
        for opt in optimizers:
            opt.step()


@pytest.mark.parametrize("mode", RUNTIMES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_late_parameter_in_a_shared_batch_follows_its_own_counts(name, mode):
    """The two layers' blocks share the optimizer's batches; the second gets gradients from step 7 on.
    Each layer must end where an optimizer of its own takes it, whose steps without gradients leave it
    at count 0: the batched math keeps one count (and bias correction, first-step rule) per block."""
    runtime = asteria.RuntimeConfig(**RUNTIMES[mode])
    joint = two_layers()
    with OPTIMIZERS[name](joint.parameters(), runtime) as opt:
        train_layers(joint, [opt])
        counts = sorted(c for g in opt._groups for c in g.steps.counts)

    def separate(scale: float) -> list[torch.Tensor]:
        layers = two_layers()
        with torch.no_grad():
            for p in layers.parameters():
                p.mul_(scale)
        with OPTIMIZERS[name](layers[0].parameters(), runtime) as first, \
                OPTIMIZERS[name](layers[1].parameters(), runtime) as second:
            train_layers(layers, [first, second])
        return list(layers.parameters())

    assert counts == [STEPS - LATE] * 2 + [STEPS] * 2
    # Batched and separate blocks round differently, by an amount the BLAS kernels decide: the tolerance is
    # this run's own rounding noise.
    assert_within_rounding_noise(list(joint.parameters()), separate(1.0), rounding_noise(separate))
    untouched = two_layers()
    assert not torch.allclose(joint[1].weight, untouched[1].weight)  # the late layer did train


@pytest.mark.parametrize("mode", RUNTIMES)
@pytest.mark.parametrize("name", [*OPTIMIZERS, "shampoo-without-grafting"])
def test_steps_without_gradients_change_nothing(name, mode):
    """LATE steps without any gradient (a multiple of f: the schedule stays aligned) then the run leave the
    parameters where the run alone does. SOAP and KL-Shampoo: their zero factors' identity bases do not
    warm-start the first real refresh (it decomposes fully, as at step 1), and the first gradient only
    builds the factors. Shampoo: its zero factors' roots (eps^(-1/2k) I) are never used; until a root of
    a real factor comes, it takes its grafting direction, as a fresh run does before its first root
    (without grafting, such a root would have scaled the first steps by eps^(-1/2) = 10^6)."""
    runtime = asteria.RuntimeConfig(**RUNTIMES[mode])
    make = OPTIMIZERS.get(name) or (lambda params, runtime: asteria.Shampoo(
        params, lr=1e-3, grafting="none", precondition_frequency=3, start_preconditioning_step=3, runtime=runtime))
    results = []
    for idle in (0, LATE):
        model = two_layers()[0]
        with make(model.parameters(), runtime) as opt:
            for _ in range(idle):
                opt.zero_grad(set_to_none=True)
                opt.step()
            for step in range(STEPS - LATE):
                opt.zero_grad(set_to_none=True)
                gen = torch.Generator().manual_seed(step)
                x = torch.randn(16, 8, generator=gen)
                torch.nn.functional.mse_loss(model(x), x.flip(1)).backward()
                opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class LateShampooReference:
    """Shampoo with Adam grafting in float64 numpy, whole 2-D weights and 1-D biases, every parameter with
    its own step count: factors, moments and bias corrections advance only with a gradient; the roots are
    refreshed on the optimizer's schedule, each debiased by its own count, once the parameter has had a
    gradient (until then it has none, so its first steps take Adam's direction, as a fresh one's do)."""

    def __init__(self, params, lr, betas, eps, relative_eps, weight_decay, frequency, start):
        self.params, self.lr, self.betas, self.eps, self.wd = params, lr, betas, eps, weight_decay
        self.relative_eps = relative_eps
        self.frequency, self.start, self.t = frequency, start, 0
        self.state = [dict(t=0, factors=[np.zeros((d, d)) for d in p.shape], roots=None,
                           m=np.zeros(tuple(p.shape)), v=np.zeros(tuple(p.shape))) for p in params]

    def step(self):
        self.t += 1
        (b1, b2), refresh = self.betas, self.t >= self.start and (self.t - self.start) % self.frequency == 0
        for p, s in zip(self.params, self.state, strict=True):
            order = p.dim()
            if p.grad is not None:
                g = p.grad.double().numpy()
                s["t"] += 1
                for mode in range(order):
                    unfolded = mode_unfold(g, mode)
                    s["factors"][mode] = b2 * s["factors"][mode] + (1 - b2) * unfolded @ unfolded.T
                s["m"] = b1 * s["m"] + (1 - b1) * g
                s["v"] = b2 * s["v"] + (1 - b2) * g * g
            t = s["t"]
            if refresh:  # a zero factor's root (before the first gradient) is not used: the grafting direction
                s["roots"] = [reference_root(f / (1 - b2**t), -1.0 / (2 * order), self.eps, self.relative_eps)
                              for f in s["factors"]] if t else None
            if p.grad is None:
                continue
            direction = grafted_direction(s, b1, b2, t, grafting_eps=1e-8)
            w = p.detach().double().numpy() * (1 - self.lr * self.wd) - self.lr * direction
            with torch.no_grad():
                p.copy_(torch.from_numpy(w))


def run_late_shampoo(make_optimizer) -> list[torch.Tensor]:
    """The first layer's weight of small_mlp gets no gradient for the first 5 steps (it is frozen); blocks of
    at most 32 keep every parameter whole, as the reference does."""
    model = small_mlp()
    opt = make_optimizer(list(model.parameters()))
    x, y = regression_data()
    for step in range(14):
        for p in model.parameters():
            p.grad = None
        torch.nn.functional.mse_loss(model(x[(step * 32) % 128:][:32]), y[(step * 32) % 128:][:32]).backward()
        if step < 5:
            model[0].weight.grad = None
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", RUNTIMES)
def test_shampoo_with_a_late_parameter_matches_a_per_parameter_reference(mode):
    def make(params):
        return asteria.Shampoo(params, precondition_frequency=3, start_preconditioning_step=2,
                               max_preconditioner_dim=32, precondition_1d=True,
                               runtime=asteria.RuntimeConfig(**RUNTIMES[mode]),
                               **SHAMPOO_HYPER)

    def reference(params):
        return LateShampooReference(params, frequency=3, start=2, **SHAMPOO_HYPER)

    actual, expected = run_late_shampoo(make), run_late_shampoo(reference)
    # float32 roots against float64: up to 3.7e-4 apart after 14 steps on some hosts (torch's CPU eigh
    # rounds differently by instruction set); the old rule's count lands 6e-2 away.
    for a, e in zip(actual, expected, strict=True):
        assert float((a.double() - e.double()).norm() / e.double().norm()) < 1e-3
    # The reference with the optimizer's count for every parameter (the old rule) lands elsewhere.
    class GlobalCount(LateShampooReference):
        def step(self):
            for s in self.state:
                s["t"] = self.t
            super().step()
    assert float((actual[0].double() - run_late_shampoo(lambda ps: GlobalCount(ps, frequency=3, start=2,
                                                                               **SHAMPOO_HYPER))[0].double()).norm()
                 / actual[0].double().norm()) > 1e-3


@pytest.mark.parametrize("runtime", [asteria.RuntimeConfig(mode="sync"), asteria.RuntimeConfig(staleness=1, workers=1)],
                         ids=["sync", "async"])
def test_counts_are_checkpointed_and_older_checkpoints_count_the_optimizers_steps(runtime):
    model = two_layers()
    with asteria.SOAP(model.parameters(), precondition_frequency=3, start_preconditioning_step=1,
                      runtime=runtime) as opt:
        train_layers(model, [opt], range(LATE + 2))
        state = opt.state_dict()
    assert sorted(c for counts in state["block_steps"] for c in counts) == [2, 2, LATE + 2, LATE + 2]
    with asteria.SOAP(two_layers().parameters(), precondition_frequency=3, start_preconditioning_step=1,
                      runtime=runtime) as fresh:
        fresh.load_state_dict(state)
        assert [g.steps.counts for g in fresh._groups] == state["block_steps"]
    older = {k: v for k, v in state.items() if k != "block_steps"}
    with asteria.SOAP(two_layers().parameters(), precondition_frequency=3, start_preconditioning_step=1,
                      runtime=runtime) as fresh:
        fresh.load_state_dict(older)
        assert all(g.steps.counts == [LATE + 2] * g.batch for g in fresh._groups)
    bad = dict(state, block_steps=[[LATE + 3, 0]] + state["block_steps"][1:])
    with asteria.SOAP(two_layers().parameters(), precondition_frequency=3, start_preconditioning_step=1,
                      runtime=runtime) as fresh:
        with pytest.raises(ValueError, match=r"Invalid state_dict\['block_steps'\]\[0\]=\[9, 0\]: must be 2 ints "
                                             r"in \[0, step=8\]"):
            fresh.load_state_dict(bad)
        assert all(c == 0 for g in fresh._groups for c in g.steps.counts)  # nothing loaded


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resume_with_counts_that_differ_is_bit_for_bit(name, tmp_path):
    """Saved while the blocks' counts differ (13 against 7 by the end) and refreshes are in flight, with
    per-block root scales (Shampoo) in the scheduled entries; the checkpoint goes through torch.save and
    ``torch.load(weights_only=True)``; the resumed run continues bit for bit. (The sets stay whole: split for
    the stagger, each of these two-block sets would be two sets of one block, each with a count of its own.)"""
    runtime = asteria.RuntimeConfig(mode="async", staleness=2, workers=2, deterministic=True, stagger_split=False)

    model = two_layers()
    with OPTIMIZERS[name](model.parameters(), runtime) as opt:
        train_layers(model, [opt], range(LATE + 2))
        torch.save(opt.state_dict(), tmp_path / "opt.pt")
        params = [p.detach().clone() for p in model.parameters()]
        train_layers(model, [opt], range(LATE + 2, STEPS))
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert saved["refresher"]["scheduled"], "refreshes in flight travel in the checkpoint"
    if name == "shampoo":
        assert any(isinstance(entry["request"][0], list) for entry in saved["refresher"]["scheduled"])
    resumed = layers_at(params)
    with OPTIMIZERS[name](resumed.parameters(), runtime) as opt:
        opt.load_state_dict(saved)
        train_layers(resumed, [opt], range(LATE + 2, STEPS))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True))


@pytest.mark.parametrize("mode", RUNTIMES)
@pytest.mark.parametrize("first", ["zeros", "nan"])
def test_a_first_gradient_that_adds_nothing_never_brings_a_root_of_eps(first, mode):
    """A block whose first present gradient is all zeros (an expert on an empty batch) or non-finite
    (skipped) still has a zero factor at the next refresh: its root is the identity there, never
    (eps I)^(-1/4), which would scale the step by eps^(-1/2) = 10^6 without grafting."""
    moves = []
    for late in (False, True):
        model = two_layers()
        before = model[1].weight.detach().clone()
        with asteria.Shampoo(model.parameters(), lr=1e-3, grafting="none", precondition_frequency=100,
                             start_preconditioning_step=1, runtime=asteria.RuntimeConfig(**RUNTIMES[mode])) as opt:
            for step in range(3):
                opt.zero_grad(set_to_none=True)
                sum(losses(model, LATE)).backward()  # both layers get a gradient
                if late and step == 0:
                    model[1].weight.grad.fill_(0.0 if first == "zeros" else float("nan"))
                opt.step()
        moves.append(float((model[1].weight.detach() - before).abs().max()))
    assert moves[1] < 10 * moves[0], moves


def test_checkpoints_of_counts_load_safely_and_are_checked(tmp_path):
    model = two_layers()
    runtime = asteria.RuntimeConfig(mode="sync")
    with OPTIMIZERS["shampoo"](model.parameters(), runtime) as opt:
        train_layers(model, [opt], range(LATE + 2))
        state = opt.state_dict()
    assert sorted(f for firsts in state["block_first_steps"] for f in firsts) == [1, 1, LATE + 1, LATE + 1]
    # Without first steps (this format's first form), a block's first gradient is taken as late as its
    # count allows; versions saved as NumPy ints load as ints.
    older = {k: v for k, v in state.items() if k != "block_first_steps"}
    older["versions"] = [[np.int64(v) for v in versions] for versions in state["versions"]]
    with OPTIMIZERS["shampoo"](two_layers().parameters(), runtime) as fresh:
        fresh.load_state_dict(older)
        assert [g.steps.first_steps for g in fresh._groups] == state["block_first_steps"]
        assert all(type(v) is int for fset, _ in fresh._set_groups for v in fset.versions)
        fresh.zero_grad(set_to_none=True)
        sum(losses(two_layers(), 0)).backward()
        fresh.step()  # no gradients for its own parameters: a step that changes nothing, and does not raise
    bad = dict(state, block_first_steps=[[0, 1]] + state["block_first_steps"][1:])
    with OPTIMIZERS["shampoo"](two_layers().parameters(), runtime) as fresh:
        with pytest.raises(ValueError, match=r"Invalid state_dict\['block_first_steps'\]\[0\]=\[0, 1\]: must agree "
                                             r"with block_steps\[0\]="):
            fresh.load_state_dict(bad)


def test_a_checkpoint_loads_only_under_its_refresh_schedule():
    """Versions are numbered by the schedule (their snapshot and activation steps, and which roots came
    after a block's first gradient), so a resume under another one is refused, naming what differs."""
    model = two_layers()
    with OPTIMIZERS["shampoo"](model.parameters(), asteria.RuntimeConfig(mode="sync")) as opt:
        train_layers(model, [opt], range(4))
        state = opt.state_dict()
    # the sets: the weights' two modes and the biases
    assert state["schedule"] == {"start": 3, "interval": 3, "aligned": 2, "phases": [0, 0, 0]}
    other = asteria.Shampoo(two_layers().parameters(), lr=0.02, eps=1e-2, precondition_frequency=4,
                            start_preconditioning_step=3, precondition_1d=True,
                            runtime=asteria.RuntimeConfig(mode="sync"))
    with other, pytest.raises(ValueError, match=r"Invalid state_dict: saved under the refresh schedule .* \(interval "
                                                r"differ: start_preconditioning_step, precondition_frequency"):
        other.load_state_dict(state)
    assert other._step == 0
    with OPTIMIZERS["shampoo"](two_layers().parameters(), asteria.RuntimeConfig(mode="sync")) as same:
        same.load_state_dict({k: v for k, v in state.items() if k != "schedule"})  # older checkpoints: not checked
        same.load_state_dict(state)
    # Unstaggered, how many versions come aligned changes no step: another sync_refreshes loads; staggered, not.
    with OPTIMIZERS["shampoo"](two_layers().parameters(), asteria.RuntimeConfig(mode="sync", sync_refreshes=1)) as one:
        one.load_state_dict(state)
    staggered = asteria.RuntimeConfig(mode="sync", stagger=True)
    with OPTIMIZERS["shampoo"](model.parameters(), staggered) as opt:
        train_layers(model, [opt], range(4))
        state = opt.state_dict()
    assert any(state["schedule"]["phases"])
    refused = r"Invalid state_dict: saved under the refresh schedule .* \(aligned differ"
    with OPTIMIZERS["shampoo"](two_layers().parameters(), replace(staggered, sync_refreshes=1)) as one, \
            pytest.raises(ValueError, match=refused):
        one.load_state_dict(state)


BETWEEN = 4  # a first gradient at step 5, between the refreshes of steps 4 and 7 (f = 3)


def eigen_state(name: str, mode: int) -> str:
    """The state SOAP (its second moment, all dimensions) or KL-Shampoo (dimension ``mode``'s eigenvalue
    estimates, as d^(-1/2)) keeps in eigen-coordinates."""
    return EXP_AVG_SQ if name == "soap" else inv_sqrt_key(mode)


def carries(name: str, runtime: asteria.RuntimeConfig, late: int) -> list[dict]:
    """Trains the two layers (the second from step ``late`` on) and returns every carry into a first real
    basis: its step, dimension and blocks, and the state before and after it, with the basis in use."""
    from asteria.optim.state_keys import basis_key

    model = two_layers()
    calls = []
    with OPTIMIZERS[name](model.parameters(), runtime) as opt:
        carry = opt._into_basis

        def spy(group, dim, blocks, weights):
            key = eigen_state(name, dim)
            before = group.state[key][blocks].clone()
            carry(group, dim, blocks, weights)
            calls.append(dict(step=opt._step + 1, dim=dim, blocks=blocks.tolist(), before=before,
                              basis=group.state[basis_key(dim)][blocks].clone(),
                              after=group.state[key][blocks].clone()))

        opt._into_basis = spy
        train_layers(model, [opt], range(STEPS), late=late)
    return calls


def check_carry(name: str, call: dict) -> None:
    """SOAP's second moment V[i, j] <- sum_a Q[a, i]^2 V[a, j] along dimension 0 (the same along 1);
    KL-Shampoo's estimates d_i <- sum_a Q[a, i]^2 d_a; in float64, per block carried."""
    for block in range(len(call["blocks"])):
        dim, weights = call["dim"], call["basis"][block].double().square()  # the basis in use there
        assert not torch.allclose(weights, torch.eye(8, dtype=weights.dtype))
        before, after = call["before"][block].double(), call["after"][block].double()
        if name == "soap":
            assert float(before.abs().min()) > 0  # the steps in the identity basis left a second moment
            expected = torch.einsum("ai,aj->ij", weights, before) if dim == 0 else torch.einsum("bj,ib->ij", weights,
                                                                                                 before)
        else:
            expected = (weights.T @ before.pow(-2)).rsqrt()
            assert float((before - before.mean()).abs().max()) > 1e-3 * float(before.abs().max())  # not isotropic
        torch.testing.assert_close(after, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("mode", RUNTIMES)
@pytest.mark.parametrize("name", ["soap", "kl-shampoo"])
def test_a_late_blocks_state_is_carried_into_its_first_real_basis(name, mode):
    """The second layer's first gradient comes at step 5, between refreshes: steps 6 and 7 keep its state in
    the identity basis of its zero factors, and the refresh of step 7 (which holds its gradients) gives its
    first real bases, in use from step 8. Then, and only then, that state is carried into them (along
    dimension 0, then 1): in sync mode at the end of step 7, which installed them (so that a checkpoint of step 7
    holds it carried), in async mode as step 8 activates them. The first layer's first bases come the step after
    its first gradient, with no state to carry: it is never touched."""
    calls = carries(name, asteria.RuntimeConfig(**RUNTIMES[mode]), late=BETWEEN)
    step = 7 if mode == "sync" else 8
    assert [(c["step"], c["dim"], c["blocks"]) for c in calls] == [(step, 0, [1]), (step, 1, [1])]
    for call in calls:
        check_carry(name, call)


@pytest.mark.parametrize("name", ["soap", "kl-shampoo"])
def test_without_a_bootstrap_every_blocks_state_is_carried_into_its_first_basis(name):
    """With ``sync_refreshes=0`` under the deterministic rule (staleness 1, f = 3), the first refresh comes into
    use an interval after its snapshot, so every block steps in the identity basis until then: each is
    carried once, at that step."""
    runtime = asteria.RuntimeConfig(mode="async", staleness=1, workers=1, stagger=False, sync_refreshes=0,
                                    deterministic=True)
    calls = carries(name, runtime, late=0)
    steps = {c["step"] for c in calls}
    assert len(steps) == 1 and steps.pop() > 2
    assert sorted((c["dim"], c["blocks"]) for c in calls) == [(0, [0, 1]), (1, [0, 1])]
    for call in calls:
        check_carry(name, call)


def test_installs_keep_the_columns_of_blocks_awaiting_their_first_real_basis():
    """A block awaiting its first real basis keeps its state in plain coordinates, which the carry maps
    whole; an install's column order (under the newest-finished rule possibly composed through that first
    version) must not scramble it first. Blocks that have their basis are reordered as before."""
    model = two_layers()
    with OPTIMIZERS["soap"](model.parameters(), asteria.RuntimeConfig(mode="sync")) as opt:
        train_layers(model, [opt], range(4), late=BETWEEN)  # the second layer has had no gradient yet
        group = next(g for g in opt._groups if g.order == 2)
        fset = next(f for f, g in opt._set_groups if g is group and f.mode == 0)
        second = group.state[EXP_AVG_SQ]
        second.copy_(torch.arange(second.numel(), dtype=second.dtype).view_as(second))
        before = second.clone()
        reverse = torch.arange(7, -1, -1).expand(2, 8)
        fset.permute(torch.tensor([0, 1]), reverse)
        assert torch.equal(second[0], before[0].flip(0))  # the first layer's block: reordered
        assert torch.equal(second[1], before[1])  # the second layer's: awaiting, kept
        train_layers(model, [opt], range(4, STEPS), late=BETWEEN)
        assert not opt._unordered  # every block has its basis: installs reorder all of them


@pytest.mark.parametrize("name", ["soap", "kl-shampoo"])
def test_resume_while_a_block_awaits_its_first_real_basis_is_bit_for_bit(name):
    """Saved at step 6, after the second layer's first gradient and before its first real basis: the resumed
    optimizer carries its state into that basis when it comes into use, as the uninterrupted one does."""
    runtime = asteria.RuntimeConfig(mode="async", staleness=1, workers=2, deterministic=True)
    model = two_layers()
    with OPTIMIZERS[name](model.parameters(), runtime) as opt:
        train_layers(model, [opt], range(6), late=BETWEEN)
        saved = opt.state_dict()
        params = [p.detach().clone() for p in model.parameters()]
        train_layers(model, [opt], range(6, STEPS), late=BETWEEN)
    resumed = layers_at(params)
    with OPTIMIZERS[name](resumed.parameters(), runtime) as opt:
        opt.load_state_dict(saved)
        assert any(any(waiting) for waiting in opt._awaiting.values())
        train_layers(resumed, [opt], range(6, STEPS), late=BETWEEN)
        assert not any(any(waiting) for waiting in opt._awaiting.values())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True))
