from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_optimizer_outlives_its_test():
    """Fails the test that leaves an optimizer's workers running after it (closed neither by ``close()`` nor
    by the garbage collector), where it happens: the torch thread cap they hold would otherwise change the
    thread count of every later test. Costs nothing unless one is left."""
    from asteria.cpus import TorchThreadCap

    yield
    if not TorchThreadCap._live:
        return
    gc.collect()  # one only unreachable (in a cycle) is closed here by its finalizer
    leaked = list(TorchThreadCap._live)
    if leaked:
        for cap in leaked:  # the later tests start clean
            cap.restore()
        pytest.fail(f"{len(leaked)} optimizer(s) with workers outlived the test: close them (or drop every "
                    "reference); something keeps them alive", pytrace=False)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: the tiny model runs many times faster on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: a CLI run (train or bench) small enough for the CPU in seconds: OLMo-2's tiny shapes on 200 kB of the corpus, f = 3,
#: one worker, staleness 1
TINY_RUN = ["--batch-size", "4", "--seq-len", "32", "--eval-batches", "1", "--max-bytes", "200000", "--device", "cpu",
            "--precondition-frequency", "3", "--workers", "1", "--staleness", "1"]

#: the names the C++ worker pool gives its workers and its express workers (``kWorkerThreadName``,
#: ``kExpressThreadName``)
WORKER_THREAD_NAME = "asteria-worker"
EXPRESS_THREAD_NAME = "asteria-express"


def worker_threads(name: str = WORKER_THREAD_NAME) -> int:
    """This process's refresh-worker threads named ``name`` (Linux; counted by their name, so that thread pools
    that torch, OpenBLAS or OpenMP start or grow lazily do not count)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().strip() == name
        except OSError:  # the thread ended while the folder was read
            pass
    return count


def relative_errors(actual, expected) -> list[float]:
    """Per tensor pair, ||actual - expected|| / ||expected|| in float64."""
    return [float((a.detach().double() - e.double()).norm() / e.double().norm())
            for a, e in zip(actual, expected, strict=True)]


#: how far ``within_rounding_noise`` nudges the inputs of a run: far above float32's unit roundoff (6e-8), so
#: that the run's answer to it bounds the spread that rounding differences between two paths can reach
NUDGE = 1e-6
#: how many times the nudged run's spread two paths may differ by; a wrong count, lag or direction moves
#: the parameters by the order of the learning rate, thousands of times more
NOISE_FACTOR = 8.0


def rounding_noise(run, nudge: float = NUDGE) -> float:
    """The largest |difference| between ``run(1.0)`` and ``run(1 + nudge)`` (each a list of tensors, the
    inputs scaled by the factor given): how far rounding alone can move this computation's outputs. Two
    numerical paths (batched against separate blocks, two BLAS kernels) round differently, and eigensolvers
    amplify it, by an amount that depends on the machine's kernels; a tolerance derived from this noise
    holds on every machine and stays far below what a wrong result moves."""
    base, nudged = run(1.0), run(1.0 + nudge)
    return max(float((a.detach().double() - b.detach().double()).abs().max())
               for a, b in zip(base, nudged, strict=True))


def relative_rounding_noise(run, nudge: float = NUDGE) -> float:
    """``rounding_noise`` as the largest relative change ||a - b|| / ||b|| of one tensor (for comparisons
    against a float64 reference, whose float32 errors scale with the values)."""
    return max(relative_errors(run(1.0 + nudge), run(1.0)))


def assert_within_rounding_noise(actual, expected, noise: float, floor: float = 1e-6) -> None:
    """Each pair of tensors agrees to ``NOISE_FACTOR`` times the measured ``noise`` (at least ``floor``)."""
    tolerance = max(floor, NOISE_FACTOR * noise)
    for a, e in zip(actual, expected, strict=True):
        worst = float((a.detach().double() - e.detach().double()).abs().max())
        assert worst <= tolerance, (f"paths differ by {worst:.3g}, more than {NOISE_FACTOR:g} x the rounding noise "
                                    f"{noise:.3g} (a {NUDGE:g} nudge of the inputs) for a tensor of shape "
                                    f"{tuple(e.shape)}")


class ReferenceOptimizer:
    """What the tests' float64 reference optimizers share besides their math: the hyperparameters,
    the step count and ``zero_grad`` (so that ``train`` drives them as it drives an optimizer)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.t = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def small_mlp(seed: int = 0, sizes: tuple[int, ...] = (8, 16, 4)) -> torch.nn.Module:
    """A small MLP with a bias on every layer (1-D parameters too)."""
    gen = torch.Generator().manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        linear = torch.nn.Linear(a, b)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(b, a, generator=gen) / a**0.5)
            linear.bias.copy_(torch.randn(b, generator=gen) * 0.1)
        layers.append(linear)
        if i < len(sizes) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def regression_data(n: int = 128, sizes: tuple[int, ...] = (8, 16, 4), seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, sizes[0], generator=gen)
    w = torch.randn(sizes[0], sizes[-1], generator=gen)
    y = torch.sin(x @ w) + 0.05 * torch.randn(n, sizes[-1], generator=gen)
    return x, y


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, data=None, batch: int = 32,
          hook=None) -> list[float]:
    """Runs `steps` steps of MSE regression over fixed mini-batches; returns the losses."""
    x, y = data if data is not None else regression_data()
    losses = []
    for step in range(steps):
        start = (step * batch) % x.shape[0]
        xb, yb = x[start:start + batch], y[start:start + batch]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if hook is not None:
            hook(step + 1, opt)
    return losses


def blob_classification(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """400 points in 12-D around 5 class centers, and their labels."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(5, 12, generator=gen) * 2.0
    labels = torch.randint(0, 5, (400,), generator=gen)
    return centers[labels] + 0.7 * torch.randn(400, 12, generator=gen), labels


def train_classifier(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, labels: torch.Tensor,
                     steps: int = 60) -> tuple[float, float]:
    """Cross-entropy training over batches of 50; returns the first and the last batch loss."""
    losses = []
    for step in range(steps):
        idx = torch.arange(step * 50, step * 50 + 50) % x.shape[0]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), labels[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


def resumed_run(model: torch.nn.Module, opt, weights: list[torch.Tensor], load, steps: int, data) -> None:
    """A resume into a fresh (model, opt): the saved weights copied in, ``load(opt)`` (the optimizer's
    checkpoint loaded however the test saves it), then ``steps`` steps; closes ``opt``."""
    with opt:
        with torch.no_grad():
            for p, q in zip(model.parameters(), weights, strict=True):
                p.copy_(q)
        load(opt)
        train(model, opt, steps, data=data)


def hold_plan(refresher, on_lane: bool) -> None:
    """Puts every factor set of an async refresher on the device lane (``on_lane``) or on the workers, and keeps
    them there: the balancer's replanning returns this plan."""
    refresher.balancer.replan = lambda: refresher.balancer.plan
    refresher.balancer.plan = [on_lane] * len(refresher.sets)


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def resume_is_exact(make, data, before: int = 8, after: int = 7) -> bool:
    """Trains `before` steps, saves, trains `after` more; a second run loads the checkpoint into a fresh
    (model, optimizer) from `make()` and trains the same `after` steps. True if both end bit for bit equal."""
    model, opt = make()
    with opt:
        train(model, opt, before, data=data)
        saved, params = opt.state_dict(), [p.detach().clone() for p in model.parameters()]
        train(model, opt, after, data=data)
    resumed_model, resumed = make()
    resumed_run(resumed_model, resumed, params, lambda o: o.load_state_dict(saved), after, data)
    return same_parameters(model, resumed_model)


#: the repository's bench/ folder (its scripts are not part of the package)
BENCH = Path(__file__).resolve().parents[1] / "bench"


def script_module(path: Path) -> ModuleType:
    """A script of bench/ or tools/ imported as a module (its ``main`` not run), with its folder on the path
    meanwhile, as ``python3 <path>`` has it (for the scripts that import their siblings)."""
    spec = importlib.util.spec_from_file_location(f"script_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def bench_script(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as a module (its ``main`` not run)."""
    return script_module(BENCH / f"{name}.py")


def check_bench_namespace(args, monkeypatch) -> None:
    """The parsed options of an ``asteria bench`` command (or of ``tools/seeds.py run``, which shares them) make
    a valid run and runtime configuration for each of its configs, as they would on the GPU machine."""
    from asteria.train.bench import run_config_of
    from asteria.train.cli import bench_base
    from asteria.train.loop import runtime_config
    from asteria.train.peers import PEERS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the device's runs, checked on this machine
    base = bench_base(args)
    for label in args.configs:
        cfg = run_config_of(base, label)
        if cfg.optimizer != "adamw" and cfg.optimizer not in PEERS:
            runtime_config(cfg)  # the settings asteria.RuntimeConfig refuses


def check_bench_args(argv: list[str], monkeypatch) -> None:
    """``asteria bench`` with ``argv`` on a GPU: its options parse (argparse exits on a bad one) and make valid
    configurations."""
    from asteria.train.cli import build_parser

    check_bench_namespace(build_parser().parse_args(["bench", *argv, "--device", "cuda"]), monkeypatch)
