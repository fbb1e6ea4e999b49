"""Memory placement on the GPU: preconditioners in pinned host memory, staged through the device ring
or read through device views, give the same bits as the device placement, whatever the streams'
timing; attach's prefetch too. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import regression_data, small_mlp

import asteria

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SIZES = (64, 96, 64, 32)
OPTIMIZERS = {
    "shampoo": lambda params, runtime: asteria.Shampoo(params, lr=0.02, eps=1e-6, precondition_frequency=3,
                                                       max_preconditioner_dim=64, runtime=runtime),
    "soap": lambda params, runtime: asteria.SOAP(params, eps=1e-4, precondition_frequency=3,
                                                 max_preconditioner_dim=64, runtime=runtime),
    "kl-shampoo": lambda params, runtime: asteria.KLShampoo(params, precondition_frequency=3,
                                                            max_preconditioner_dim=64, runtime=runtime),
}


def run(name: str, placement: str, steps: int = 15, delay: int = 0, attach: bool = False, **memory):
    model = small_mlp(sizes=SIZES).cuda()
    x, y = (t.cuda() for t in regression_data(sizes=SIZES))
    # The device lane runs only where the preconditioners stay on the device: every refresh on the CPU workers,
    # so that the placements compare one computation (the lane's own bits are test_cuda.py's).
    runtime = asteria.RuntimeConfig(staleness=1, workers=2, deterministic=True, device_refresh=False,
                                    memory=asteria.MemoryConfig(placement=placement, **memory))
    with OPTIMIZERS[name](model.parameters(), runtime) as opt:
        handle = asteria.attach(model, opt) if attach else None
        for step in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[:64]), y[:64])
            loss.backward()
            if delay:  # every staging and install copy starts late
                for side in list(opt._placement.tier._side.values()) + list(opt._refresher.side.values()):
                    with torch.cuda.stream(side.stream):
                        torch.cuda._sleep(delay)
            opt.step()
        torch.cuda.synchronize()
        report = opt.memory_report()
        if handle is not None:
            handle.remove()
    return [p.detach().cpu() for p in model.parameters()], report


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_host_placement_gives_the_device_placement_bits(name):
    # The same grouping in both: batched GPU kernels may round differently for another batch size.
    device, device_report = run(name, "device", group_bytes=64 * 64 * 4 * 2)
    host, host_report = run(name, "host", group_bytes=64 * 64 * 4 * 2)
    differences = [float((a - b).abs().max()) for a, b in zip(device, host, strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(device, host, strict=True)), differences
    assert host_report["placement"] == "host" and host_report["bytes_staged"] > 0
    assert host_report["host"]["total"] > device_report["host"]["total"]
    assert host_report["device"]["total"] < device_report["device"]["total"]
    delayed, _ = run(name, "host", delay=5_000_000, group_bytes=64 * 64 * 4 * 2)
    assert all(torch.equal(a, b) for a, b in zip(device, delayed, strict=True))
    hooked, _ = run(name, "host", delay=5_000_000, attach=True, group_bytes=64 * 64 * 4 * 2)
    assert all(torch.equal(a, b) for a, b in zip(device, hooked, strict=True))


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_device_views_of_host_memory_give_the_same_bits(name):
    device, _ = run(name, "device", group_bytes=64 * 64 * 4 * 2)
    viewed, report = run(name, "device_view", delay=5_000_000, group_bytes=64 * 64 * 4 * 2)
    assert report["placement"] == "device_view" and report["bytes_staged"] == 0
    assert all(torch.equal(a, b) for a, b in zip(device, viewed, strict=True))


def test_auto_placement_moves_preconditioners_to_the_host_under_a_gpu_budget():
    # Eight 64 x 64 layers: their roots outweigh a staging ring of two slots per shape and mode.
    model = small_mlp(sizes=(64,) * 9).cuda()
    # Under a GPU budget the preconditioners may leave the device, so no device lane is built: the device
    # placement's bytes are counted without its slots too.
    memory = asteria.MemoryConfig(placement="device", group_bytes=64 * 64 * 4)
    with asteria.Shampoo(model.parameters(), max_preconditioner_dim=64,
                         runtime=asteria.RuntimeConfig(workers=1, memory=memory, device_refresh=False)) as opt:
        budget = opt.memory_report()["device"]["total"] - 1  # the device placement no longer fits
    memory = asteria.MemoryConfig(gpu_budget=budget, group_bytes=64 * 64 * 4)
    with asteria.Shampoo(model.parameters(), max_preconditioner_dim=64,
                         runtime=asteria.RuntimeConfig(workers=1, memory=memory)) as opt:
        report = opt.memory_report()
        assert opt.placement in ("host", "device_view")
        assert report["device"]["total"] <= budget and "root" in report["host"]
    with pytest.raises(ValueError, match=r"Invalid gpu_budget=1000: too small .* device needs \d+ bytes"):
        asteria.Shampoo(model.parameters(), runtime=asteria.RuntimeConfig(
            memory=asteria.MemoryConfig(gpu_budget=1000, placement="host")))


def test_a_host_placement_the_host_cannot_pin_is_refused_by_name(monkeypatch):
    """The host's figure is replaced by one below the preconditioners' bytes (a machine cannot be made smaller):
    the optimizer is refused by name before they are pinned, not by the CUDA driver's raw error; with the real
    figure the same optimizer is built."""
    from asteria.optim import placement

    model = small_mlp(sizes=SIZES).cuda()
    runtime = asteria.RuntimeConfig(workers=1, memory=asteria.MemoryConfig(placement="host"))
    monkeypatch.setattr(placement, "host_available", lambda: 4096)
    with pytest.raises(ValueError, match=r"Invalid memory.placement='host': the preconditioners in use would take .* "
                                         r"of pinned host memory, and the host can give this process 0\.00 GiB"):
        OPTIMIZERS["shampoo"](model.parameters(), runtime)
    monkeypatch.undo()
    with OPTIMIZERS["shampoo"](model.parameters(), runtime) as opt:
        report = opt.memory_report()
        assert report["placement"] == "host"
    # Likewise where placement 'auto' would move them to the host to keep within a GPU budget, on a host with room
    # for the refresh buffers (pinned first) and half the preconditioners: its figure falls as memory is pinned.
    base = torch.cuda.host_memory_stats()["active_bytes.current"]
    room = report["host"]["refresh_buffers"] + report["host"]["root"] // 2
    monkeypatch.setattr(placement, "host_available",
                        lambda: room - (torch.cuda.host_memory_stats()["active_bytes.current"] - base))
    budget = asteria.RuntimeConfig(workers=1, memory=asteria.MemoryConfig(gpu_budget=1))
    with pytest.raises(ValueError, match=r"Invalid memory.gpu_budget=1: .* pinning them in host memory .* needs "):
        OPTIMIZERS["shampoo"](model.parameters(), budget)


def test_the_nvme_tier_pins_only_the_preconditioners_it_leaves_on_the_host(tmp_path):
    """Under a host budget the NVMe tier takes most sets: they are never pinned (before, every preconditioner was
    pinned at first and the tier's share let go after), and those left on the host are. Measured by the pinned
    allocator's peak of bytes handed out while each optimizer is built."""
    model = small_mlp(sizes=(64,) * 9).cuda()  # eight 64 x 64 layers: sixteen sets of one 64 x 64 root

    def build(**memory) -> tuple[asteria.Shampoo, int]:
        torch.cuda.reset_peak_host_memory_stats()
        before = torch.cuda.host_memory_stats()["active_bytes.current"]
        runtime = asteria.RuntimeConfig(workers=1, device_refresh=False, memory=asteria.MemoryConfig(
            placement="host", group_bytes=64 * 64 * 4, **memory))
        opt = asteria.Shampoo(model.parameters(), max_preconditioner_dim=64, runtime=runtime)
        return opt, torch.cuda.host_memory_stats()["active_bytes.peak"] - before

    whole, pinned_whole = build()
    with whole:
        budget = whole.memory_report()["host"]["total"] - 10 * 64 * 64 * 4  # ten sets' worth too many
    paged, pinned_paged = build(nvme_dir=str(tmp_path), host_budget=budget)
    with paged:
        report = paged.memory_report()
        on_nvme = sum(len(keys) for keys in paged._placement.paged_keys.values())
        assert on_nvme >= 10
        on_host = [fset for fset, _ in paged._placement.home_sets if fset.preconditioners.device.type == "cpu"]
        assert on_host and all(fset.preconditioners.is_pinned() for fset in on_host)
        assert pinned_paged - pinned_whole <= report["host"]["nvme_buffers"] - on_nvme * 64 * 64 * 4
