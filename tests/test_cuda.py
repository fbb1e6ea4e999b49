"""The CUDA path: side-stream snapshots and installs, events, and results that do not depend on
stream timing. Skipped without a GPU."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import hold_plan, regression_data, small_mlp

import asteria
from asteria import testing
from asteria.pipeline import streams
from asteria.pipeline.async_refresh import AsyncRefresher
from asteria.pipeline.partition import granularity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SIZES = (64, 128, 32)


def run_cuda(runtime: asteria.RuntimeConfig, steps: int = 24, main_delay: int = 0, side_delay: int = 0):
    model = small_mlp(sizes=SIZES).cuda()
    x, y = (t.cuda() for t in regression_data(sizes=SIZES))
    opt = asteria.Shampoo(model.parameters(), lr=0.02, eps=1e-6, precondition_frequency=3,
                          max_preconditioner_dim=64, runtime=runtime)
    with opt:
        for step in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[:64]), y[:64]).backward()
            if main_delay:
                torch.cuda._sleep(main_delay)  # the factor update and snapshot start late
            if side_delay and isinstance(opt._refresher, AsyncRefresher):
                for side in opt._refresher.side.values():
                    with torch.cuda.stream(side.stream):
                        torch.cuda._sleep(side_delay)  # installs and snapshots finish late
            opt.step()
        torch.cuda.synchronize()
        stats = opt.runtime_stats()
    return [p.detach().cpu() for p in model.parameters()], stats


def test_async_staleness_zero_matches_sync_on_gpu():
    sync, _ = run_cuda(asteria.RuntimeConfig(mode="sync"))
    async_, stats = run_cuda(asteria.RuntimeConfig(mode="async", staleness=0, workers=2, stagger=False))
    assert stats["bytes_to_host"] > 0 and stats["bytes_to_device"] > 0
    for a, b in zip(async_, sync, strict=True):
        assert float((a - b).norm() / b.norm()) < 1e-3


@pytest.mark.parametrize("staleness", [0, 2])
def test_injected_stream_delays_do_not_change_results(staleness):
    runtime = asteria.RuntimeConfig(staleness=staleness, workers=2, deterministic=True)
    plain, _ = run_cuda(runtime)
    delayed_main, _ = run_cuda(runtime, main_delay=20_000_000)
    delayed_side, _ = run_cuda(runtime, side_delay=20_000_000)
    for a, b, c in zip(plain, delayed_main, delayed_side, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


def test_worker_count_does_not_change_bits_on_gpu():
    one, _ = run_cuda(asteria.RuntimeConfig(staleness=1, workers=1, deterministic=True))
    four, _ = run_cuda(asteria.RuntimeConfig(staleness=1, workers=4, deterministic=True))
    for a, b in zip(one, four, strict=True):
        assert torch.equal(a, b)


def test_refresh_buffers_are_pinned():
    model = small_mlp(sizes=SIZES).cuda()
    with asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(workers=1)) as opt:
        assert all(t.is_pinned() for t in opt._refresher.snapshots + opt._refresher.results)


@pytest.mark.parametrize("optimizer", [asteria.SOAP, asteria.KLShampoo])
def test_eigenbasis_optimizers_async_match_sync_and_ignore_stream_delays(optimizer):
    # Square layers and a batch as wide: the first factors are full rank, so their eigenbases are unique
    # and the GPU's and LAPACK's eigensolvers must agree (a null space's basis is arbitrary). eps well
    # above round-off: SOAP's first steps are sign-like in the rotated coordinates, so with eps=1e-8 the
    # two eigensolvers' rounding in near-zero coordinates alone moves the weights by ~15% in 16 steps
    # (seen on the CPU too, sync vs async); with eps=1e-4 they agree to ~4e-4.
    sizes = (48, 48, 48)

    def run(runtime, side_delay=0):
        model = small_mlp(sizes=sizes).cuda()
        x, y = (t.cuda() for t in regression_data(sizes=sizes))
        with optimizer(model.parameters(), precondition_frequency=3, eps=1e-4, runtime=runtime) as opt:
            for _ in range(16):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x[:64]), y[:64]).backward()
                if side_delay:
                    for side in opt._refresher.side.values():
                        with torch.cuda.stream(side.stream):
                            torch.cuda._sleep(side_delay)
                opt.step()
            torch.cuda.synchronize()
        return [p.detach().cpu() for p in model.parameters()]

    sync = run(asteria.RuntimeConfig(mode="sync"))
    async_ = run(asteria.RuntimeConfig(staleness=0, workers=2, stagger=False))
    for a, b in zip(async_, sync, strict=True):
        assert float((a - b).norm() / b.norm()) < 2e-3
    stale = asteria.RuntimeConfig(staleness=2, workers=2, deterministic=True)
    for a, b in zip(run(stale), run(stale, side_delay=20_000_000), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_nonfinite_streak_check_raises_on_gpu_without_host_waits(mode):
    """On the GPU the streak check reads a pinned copy made at an earlier refresh step: it still raises,
    at most one interval after the bound is crossed, and no good step raises."""
    model = small_mlp(sizes=SIZES).cuda()
    x, y = (t.cuda() for t in regression_data(sizes=SIZES))
    runtime = asteria.RuntimeConfig(mode=mode, max_nonfinite_grad_steps=3, workers=1)
    with asteria.Shampoo(model.parameters(), precondition_frequency=3, max_preconditioner_dim=64,
                         runtime=runtime) as opt:
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[:64]), y[:64]).backward()
            opt.step()
        bad_steps = 0
        with pytest.raises(asteria.NonFiniteGradientError, match=r"max_nonfinite_grad_steps=3"):
            for _ in range(20):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x[:64]), y[:64]).backward()
                model[0].bias.grad.fill_(float("nan"))
                bad_steps += 1
                opt.step()
        # Crossed at the 3rd bad step; read at a refresh step (every 3) one check later at the latest.
        assert 3 <= bad_steps <= 3 + 2 * 3


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 3 * 10 * 8 * 4])
def test_copy_leading_rows_from_a_strided_slab(monkeypatch, chunk_bytes):
    """The install's copy of a (B, n + 2, n) result slab: the leading n rows of every block and the asked
    extra row arrive exactly, also when the slab crosses in chunks of a few blocks."""
    from asteria.pipeline import streams

    monkeypatch.setattr(streams, "STAGING_CHUNK_BYTES", chunk_bytes)
    slab = torch.randn(7, 10, 8).pin_memory()
    target = torch.zeros(7, 8, 8, device="cuda")
    extra = streams.copy_leading_rows_(target, slab, extra_row=9)
    torch.cuda.synchronize()
    assert torch.equal(target.cpu(), slab[:, :8])
    assert torch.equal(extra.cpu(), slab[:, 9])


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("optimizer", [asteria.SOAP, asteria.KLShampoo])
def test_eigenbasis_installs_never_copy_from_pageable_memory(optimizer, deterministic, tmp_path):
    """Every install of a whole eigenbasis set crosses from the pinned result ring: a strided source would
    be gathered into pageable memory by the training thread and copied synchronously (a 40 ms stall of the
    main stream per install on an H200 at olmo-160m's sizes)."""
    import json

    sizes = (48, 48, 48)
    model = small_mlp(sizes=sizes).cuda()
    x, y = (t.cuda() for t in regression_data(sizes=sizes))
    # Unstaggered sets install whole; under the newest-finished rule blocks also install one by one.
    runtime = asteria.RuntimeConfig(staleness=0 if deterministic else 2, workers=2, stagger=not deterministic,
                                    deterministic=deterministic)
    with optimizer(model.parameters(), precondition_frequency=3, eps=1e-4, runtime=runtime) as opt:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x[:64]), y[:64]).backward()
                opt.step()
            torch.cuda.synchronize()
        installed = opt.runtime_stats()["bytes_to_device"]
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    copies = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
              if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    pageable = sum(e["args"].get("bytes", 0) for e in copies if "Pageable" in e["name"])
    pinned = sum(e["args"].get("bytes", 0) for e in copies if "Pinned" in e["name"])
    assert installed > 0 and pinned >= installed
    assert pageable < 1024, f"{pageable} bytes copied to the GPU from pageable memory"


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("optimizer", [asteria.Shampoo, asteria.SOAP, asteria.KLShampoo])
def test_async_steps_never_make_the_training_thread_wait_for_the_gpu(optimizer, deterministic):
    """In Asteria mode a steady step only queues work: no operation inside ``step()`` (or the hooks of
    ``attach``) may synchronize with the GPU, such as a host-to-device copy of a Python value, ``.item()``
    or a copy to pageable memory. One such wait left the GPU idle while the training thread launched the
    rest of KL-Shampoo's step (about 40 ms of host time per step at olmo-160m's sizes)."""
    model = small_mlp(sizes=SIZES).cuda()
    x, y = (t.cuda() for t in regression_data(sizes=SIZES))
    runtime = asteria.RuntimeConfig(staleness=2, workers=2, deterministic=deterministic)
    with optimizer(model.parameters(), precondition_frequency=3, max_preconditioner_dim=64, runtime=runtime) as opt:
        # Late activation waits for the GPU by design (its own test is below); everything else must not.
        hooks = asteria.attach(model, opt, late_activation=False)

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[:64]), y[:64]).backward()
            opt.step()

        for _ in range(12):  # the first versions are used at their own step, by design
            step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(9):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        hooks.remove()
        assert opt.runtime_stats()["activations"] > 0


def test_a_refused_page_lock_warns_falls_back_and_leaves_no_cuda_error():
    """The node stores are page-locked with cudaHostRegister; where CUDA refuses (here: memory registered
    already), the caller is warned and falls back, and the refusal does not surface at a later kernel."""
    host = torch.arange(1 << 20, dtype=torch.float32)
    device = torch.device("cuda", torch.cuda.current_device())
    first = streams.HostRegistration.register(host, "the test's buffer", device)
    assert first is not None
    try:
        with pytest.warns(RuntimeWarning, match="CUDA refused to page-lock the test's buffer"):
            assert streams.HostRegistration.register(host, "the test's buffer", device) is None
        doubled = torch.ones(4, device=device) * 2  # torch checks the last CUDA error after each launch
        copied = host.to(device, non_blocking=True)  # a DMA copy from the registered memory
        torch.cuda.synchronize(device)
        assert float(doubled.sum()) == 8.0 and torch.equal(copied.cpu(), host)
    finally:
        first.close()
        first.close()  # idempotent


def test_native_refresh_keeps_small_eigenvalue_directions_where_tf32_scrambles_them():
    """Under ``set_float32_matmul_precision("high")`` a GPU computes float32 products in TF32; the warm-started
    refresh's power step must not (``functional.float32_matmuls``, used by every native refresh): against a
    float64 reference every column of the refreshed basis stays aligned, where TF32 leaves some of the
    small-eigenvalue columns nearly orthogonal to theirs."""
    from asteria import functional as F

    gen = torch.Generator().manual_seed(0)
    n = 256
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=gen))
    factor = (q * torch.logspace(0, -4, n, dtype=torch.float64)) @ q.T
    skew = torch.randn(n, n, dtype=torch.float64, generator=gen) * 1e-3
    old = q @ torch.linalg.matrix_exp(skew - skew.T)  # last refresh's basis, slightly off
    reference = F.qr_refresh(factor[None], old[None])[0][0]

    def worst_alignment_loss(basis: torch.Tensor) -> float:
        return float((1 - (basis[0].double().cpu() * reference).sum(0).abs()).max())

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with F.float32_matmuls():
            exact = F.qr_refresh(factor.float()[None].cuda(), old.float()[None].cuda())[0]
        blurred = F.qr_refresh(factor.float()[None].cuda(), old.float()[None].cuda())[0]
    finally:
        torch.set_float32_matmul_precision(before)
    assert worst_alignment_loss(exact) < 1e-4
    if torch.cuda.get_device_capability() >= (8, 0):  # TF32 exists from Ampere on
        assert worst_alignment_loss(blurred) > 0.1


@pytest.mark.parametrize("late", [False, True])
def test_late_activation_uses_a_version_finished_during_the_backward_pass(late):
    """Version 3 (snapshotted at step 9) is held in the workers until the GPU, in step 10's backward pass,
    has passed a 0.5 s sleep; a second 0.5 s sleep follows before the backward drain points. The training
    thread reaches ``step()`` while the GPU still sleeps, so only the late activation, which waits for the
    GPU to reach the next-to-last drain point, finds the version finished and installs it at step 10;
    without it the version comes at step 11."""
    model = small_mlp(sizes=SIZES).cuda()
    x, y = (t.cuda() for t in regression_data(sizes=SIZES))
    runtime = asteria.RuntimeConfig(staleness=1, workers=2, deterministic=False, stagger=False)
    with asteria.Shampoo(model.parameters(), lr=0.02, eps=1e-6, precondition_frequency=3, runtime=runtime) as opt:
        hooks = asteria.attach(model, opt, late_activation=late)
        engine, blocks = opt._refresher.engine, testing.engine_blocks(opt)
        for block in blocks:
            engine.inject_fault(block.id, 3, "pause")
        slept = torch.cuda.Event()

        def release() -> None:  # both workers hold a paused job; the other jobs wait in the queue
            engine.wait_paused(2, 30.0)
            slept.synchronize()
            testing.clear_faults(opt)  # the queued jobs then run through
            engine.release_pauses()

        releaser = threading.Thread(target=release)

        def sleep_then_release(grad: torch.Tensor) -> None:  # runs first in the backward pass
            torch.cuda._sleep(1_000_000_000)
            slept.record()
            releaser.start()  # after the record: an event not yet recorded counts as complete
            torch.cuda._sleep(1_000_000_000)

        for step in range(1, 12):
            opt.zero_grad()
            out = model(x[:64]) * 1.0
            if step == 10:
                out.register_hook(sleep_then_release)
            torch.nn.functional.mse_loss(out, y[:64]).backward()
            opt.step()
            torch.cuda.synchronize()
            if step == 10:
                releaser.join()
                installed_at_10 = opt.runtime_stats()["install_delay_histogram"]
        stats = opt.runtime_stats()
        hooks.remove()
    # What the wait cost: from the mark waited for, the GPU runs at least as long as the host takes to queue the
    # rest of the step (the mark had passed when the host woke, and the step's end comes after its last launch).
    assert (stats["late_activation_steps"] > 0) == late
    if late:
        assert stats["late_activation_host_seconds"] > 0 and stats["late_activation_wait_seconds"] >= 0
        assert stats["late_activation_gpu_seconds"] >= stats["late_activation_host_seconds"] - 1e-3
        assert 0 <= stats["late_activation_tight_steps"] <= stats["late_activation_steps"]
    assert installed_at_10 == ([0, len(blocks)] if late else [])
    assert stats["install_delay_histogram"] == ([0, len(blocks)] if late else [0, 0, len(blocks)])
    assert not opt.late_activation



@pytest.mark.parametrize("late", ["at-a-refresh", "between-refreshes"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("optimizer", ["shampoo", "soap", "kl-shampoo"])
def test_a_late_parameter_on_the_gpu_matches_the_cpu_without_host_waits(optimizer, mode, late):
    """Blocks of one batch at different step counts (the second layer gets gradients from step 7 on, or from
    step 5, between refreshes: SOAP and KL-Shampoo then carry its state into its first real basis): the GPU
    run matches the CPU run, and in Asteria mode its steps with per-block counts (and a missing gradient, and
    the carry) never make the training thread wait for the GPU."""
    from test_block_steps import BETWEEN, LATE, OPTIMIZERS, STEPS, losses, two_layers

    late = LATE if late == "at-a-refresh" else BETWEEN

    # Staleness 1: the late layer's first real basis comes into use at step 11, inside the checked steps.
    runtime = dict(mode="sync") if mode == "sync" else dict(staleness=1, workers=2, stagger=False, deterministic=True)
    results = []
    for device in ("cpu", "cuda"):
        model = two_layers().to(device)
        # Their hyperparameters keep Shampoo's roots well conditioned (eps 1e-2): with a tiny eps the
        # rank-deficient early factors amplify the GPU's and the CPU's rounding apart.
        with OPTIMIZERS[optimizer](model.parameters(), asteria.RuntimeConfig(**runtime)) as opt:
            carried = []
            if optimizer != "shampoo":
                carry = opt._into_basis
                opt._into_basis = lambda *args: carried.append(args[1]) or carry(*args)
            for step in range(STEPS):
                opt.zero_grad(set_to_none=True)
                sum(losses(model, step, late)).backward()
                checked = device == "cuda" and mode == "async" and step >= late + 3
                if checked:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    opt.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            assert sorted(c for g in opt._groups for c in g.steps.counts) == [STEPS - late] * 2 + [STEPS] * 2
            # Sync mode carries only the layer that stepped in its identity basis (first gradient between refreshes).
            assert carried == ([0, 1] if optimizer != "shampoo" and (mode == "async" or late == BETWEEN) else [])
        results.append([p.detach().cpu() for p in model.parameters()])
    for cpu, gpu in zip(*results, strict=True):
        torch.testing.assert_close(gpu, cpu, rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("sms, threads, process", [(None, 1, None), (None, 2, False), (16, 1, False),
                                                   (16, 2, False), (16, 2, True)],
                         ids=["whole-gpu", "in-process", "16-sms", "16-sms-2-threads", "16-sms-child"])
@pytest.mark.parametrize("optimizer", [asteria.Shampoo, asteria.SOAP, asteria.KLShampoo])
def test_the_device_lane_refreshes_beside_the_workers_on_the_gpu(optimizer, sms, threads, process):
    """The start-up refreshes run on the GPU inline; then every set goes to the lane (its plan held there), then
    back to the workers and to the lane again: its versions come from the lane's stream and thread, an
    eigenbasis set returning to the workers seeds their chain, and nothing fails. The math runs in the lane's
    child process by default, else on the lane's threads; with ``device_sms`` the streams that compute are a
    green context's, one a thread (the child's, where it computes)."""
    model = small_mlp(sizes=SIZES).cuda()
    x, y = (t.cuda() for t in regression_data(sizes=SIZES))
    runtime = asteria.RuntimeConfig(staleness=2, workers=2, stagger=False, device_sms=sms, device_threads=threads,
                                    device_process=process, timeout_s=60.0)  # (a wait that hangs fails, named)
    with optimizer(model.parameters(), precondition_frequency=3, max_preconditioner_dim=64, runtime=runtime) as opt:
        refresher = opt._refresher
        assert refresher.lane is not None and refresher.balancer is not None
        device = torch.device("cuda", torch.cuda.current_device())
        assert (device in refresher.lane.processes) == (process is not False)
        partition = refresher.lane.partitions.get(device)
        assert (partition is None) == (sms is None or process is not False)
        if partition is not None:
            assert refresher.lane.streams[device] == partition.streams and partition.sms == sms
        assert len({stream.cuda_stream for stream in refresher.lane.streams[device]}) == threads
        streams = refresher.lane.streams[device]
        assert all(bool(green_context_of(stream)) == (partition is not None) for stream in streams)

        def steps(count: int) -> None:
            for _ in range(count):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x[:64]), y[:64]).backward()
                opt.step()

        steps(6)  # versions 1 and 2, inline on the GPU
        for side in (True, False, True):
            hold_plan(refresher, side)
            steps(6)
            torch.cuda.synchronize()
            refresher.engine.drain(30.0)
            refresher.lane.drain(30.0)
        steps(3)
        torch.cuda.synchronize()
        stats = opt.runtime_stats()
        report = opt.memory_report()["device"]
    assert stats["device_versions"] > 2 * len(refresher.sets)
    assert stats["refresh_failures"] == 0, stats["refresh_errors"]
    assert stats["lane_moves"] >= len(refresher.sets)
    if process is not False:  # the child computed on its green context's streams, where there is one
        assert refresher.lane.processes[device].child_sms == sms
        # its math's, measured (a job that ended during close() may have raised the peak since)
        assert 0 < report["lane_cache"] <= refresher.lane.processes[device].peak_reserved
    assert stats["device_refresh_seconds"] > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_start_up_refreshes_run_on_the_gpu_and_match_native_mode():
    """Versions 1 and 2 (used at their own step) are the device's, computed as native mode computes them."""
    results = []
    for runtime in (asteria.RuntimeConfig(mode="sync"), asteria.RuntimeConfig(staleness=2, workers=2, stagger=False)):
        params, stats = run_cuda(runtime, steps=5)  # f = 3: versions 1 (step 3) and 2 (step 6, not reached)
        results.append(params)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert stats["device_versions"] >= 1


def green_context_of(stream: torch.cuda.Stream) -> int:
    """The driver's green context of ``stream`` (0 for a stream of the primary context): cuStreamGetGreenCtx."""
    import ctypes

    context = ctypes.c_void_p()
    code = ctypes.CDLL("libcuda.so.1").cuStreamGetGreenCtx(ctypes.c_void_p(stream.cuda_stream), ctypes.byref(context))
    assert code == 0, f"cuStreamGetGreenCtx failed: CUresult {code}"
    return context.value or 0


def test_a_partition_of_more_sms_than_the_gpu_has_or_without_a_lane_is_refused_by_name():
    """device_sms beyond the GPU's SMs, or rounded up beyond them by the architecture's granularity, is refused
    naming the count the GPU has, before any worker starts; with the preconditioners in host memory the lane
    cannot run, and the partition is refused rather than ignored."""
    model = small_mlp(sizes=SIZES).cuda()
    threads = threading.active_count()
    count = torch.cuda.get_device_properties(0).multi_processor_count
    step = granularity(torch.device("cuda", 0))
    for sms in (count + 8, count - count % step + 1):  # beyond the GPU; at most its SMs, but rounded up beyond
        too_many = asteria.RuntimeConfig(workers=1, device_sms=sms)
        with pytest.raises(ValueError, match=rf"Invalid RuntimeConfig.device_sms={sms}: .* has {count} SMs, in "
                                             rf"partitions of multiples of \d+ .*give at most"):
            asteria.Shampoo(model.parameters(), runtime=too_many)
    host = asteria.RuntimeConfig(workers=1, device_sms=16, memory=asteria.MemoryConfig(placement="host"))
    with pytest.raises(ValueError, match="Invalid device_sms=16: partitions a GPU for the device lane"):
        asteria.Shampoo(model.parameters(), runtime=host)
    assert threading.active_count() == threads


@pytest.mark.parametrize("kind", ["root", "eigenbasis"])
def test_the_device_lane_on_a_partition_computes_what_the_training_stream_computes(kind):
    """A refresh on a green context of 16 SMs matches the one computed on the training stream with every SM:
    the partition changes where the kernels run, not what they compute."""
    from asteria import _core
    from asteria.pipeline.device_lane import DeviceLane
    from asteria.pipeline.factors import FactorSet, RootRequest
    from asteria.pipeline.refresh_math import refresh_set

    g = torch.randn(4, 96, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    fset = FactorSet(name="set", factors=g @ g.mT / 128, preconditioners=torch.eye(96, device="cuda").repeat(4, 1, 1),
                     installed=torch.zeros(4, dtype=torch.bool, device="cuda"), exponent=-0.25,
                     block_params=["p"] * 4, kind=kind)
    engine = _core.RefreshEngine(workers=1, deterministic=True)
    rows = 98 if kind == "eigenbasis" else 96
    ids = [[engine.add_block(torch.zeros(2, 96 * 97 // 2), torch.zeros(2, rows, 96), kind=kind) for _ in range(4)]]
    lane = DeviceLane(engine, [fset], ids, timeout_s=60.0, sms=16)
    try:
        request = RootRequest(scale=1.0, eps=1e-6)
        snapshot = fset.factors.clone()
        torch.cuda.synchronize()  # the lane's stream does not wait for the default stream: the inputs are made
        lane.start(0, 1, 1, request, lambda f: (snapshot, None))
        engine.activate(1, 60.0)  # waits for the lane's report
        got = lane.take(0, 1)
        expected = refresh_set(fset, snapshot, request, fset.preconditioners, fset.installed, in_thread=True)
        if kind == "root":
            torch.testing.assert_close(got.new, expected.new, rtol=1e-4, atol=1e-5)
        else:  # eigenvectors of distinct eigenvalues, up to their signs
            torch.testing.assert_close(got.new.abs(), expected.new.abs(), rtol=1e-3, atol=1e-4)
        assert torch.equal(got.usable, expected.usable) and bool(got.usable.all())
    finally:
        lane.close()
        engine.close()


def test_a_run_on_a_high_priority_stream_computes_what_the_default_stream_computes(tmp_path):
    """``asteria train --stream-priority -1`` gives the same losses, bit for bit, as the default stream (native
    mode and deterministic kernels: nothing in the math depends on timing), and leaves the default stream the
    current one again."""
    from asteria.train.cli import main

    losses = []
    for priority in ("0", "-1"):
        out = tmp_path / f"priority{priority}"
        assert main(["train", "--model", "tiny", "--device", "cuda", "--steps", "8", "--batch-size", "4", "--seq-len",
                     "64", "--eval-batches", "1", "--max-bytes", "40000", "--mode", "sync", "--precondition-frequency",
                     "3", "--deterministic-kernels", "--stream-priority", priority, "--out", str(out)]) == 0
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert losses[0] == losses[1]


def test_asteria_training_stream_orders_the_body_between_the_current_streams_work():
    """The public training stream starts after what the current stream queued and the current stream resumes
    after what the body queued: a long product queued before it and a read queued after it see each other's
    results without a synchronize; an optimizer built and stepped inside works there."""
    least, greatest = torch.cuda.current_stream().priority_range()
    a = torch.randn(2048, 2048, device="cuda")
    before = a @ a @ a  # (still running when the body starts)
    with asteria.training_stream(priority=-1):
        current = torch.cuda.current_stream()
        assert current.priority == max(-1, greatest) < least
        inside = before.sum() * 0 + before[0, 0]
        model = torch.nn.Linear(8, 8, device="cuda")
        opt = asteria.Shampoo(model.parameters(), lr=1e-3)
        model(torch.randn(4, 8, device="cuda")).square().sum().backward()
        opt.step()
        opt.close()
        assert streams.SideStream(torch.device("cuda")).stream.priority == current.priority
    after = inside.clone()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.testing.assert_close(after, (a @ a @ a)[0, 0])


def test_the_training_stream_has_the_runs_priority_and_the_side_streams_take_it():
    """``--stream-priority`` makes the run's stream current (autograd runs the backward on the forward's
    stream); the side streams made meanwhile share its priority, since training waits for their copies; the
    default stream is current again afterwards, after a failure too."""
    from asteria.train.loop import RunConfig, training_stream

    least, greatest = torch.cuda.current_stream().priority_range()
    with training_stream(RunConfig(device="cuda", stream_priority=-1), None):
        current = torch.cuda.current_stream()
        assert current != torch.cuda.default_stream() and current.priority == max(-1, greatest) < least
        assert streams.SideStream(torch.device("cuda")).stream.priority == current.priority
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    with pytest.raises(RuntimeError, match="inside the run"), \
            training_stream(RunConfig(device="cuda", stream_priority=-1), None):
        raise RuntimeError("inside the run")
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert streams.SideStream(torch.device("cuda")).stream.priority == least


def test_a_checkpoint_keeps_the_random_state_of_its_runs_device_alone():
    """A run on the CPU keeps no GPU's state, a run on a GPU only its own: the states of every visible GPU would
    fail a resume where fewer are visible. Restoring gives the same draws again."""
    from asteria.train.checkpoint import restore_rng, rng_state

    assert rng_state(torch.device("cpu"))["cuda"] == []
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    saved = rng_state(device)
    assert len(saved["cuda"]) == 1
    first = torch.rand(4, device=device)
    restore_rng(saved, device)
    assert torch.equal(torch.rand(4, device=device), first)
    # A checkpoint of the earlier format kept every visible GPU's state: the run's device's is taken by its index.
    other = torch.cuda.get_rng_state(device)  # (the state after those draws: not the saved one)
    states = [other] * max(2, device.index + 2)
    states[device.index] = saved["cuda"][0]
    restore_rng({"torch": saved["torch"], "cuda": states}, device)
    assert torch.equal(torch.rand(4, device=device), first)
