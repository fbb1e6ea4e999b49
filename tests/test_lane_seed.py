"""An eigenbasis set that comes back from the device lane to the workers: their chain must warm-start from the
bases in use, which the lane computed. The training thread hands them over without waiting for the device: they
are copied into the version's own result buffers on the side stream, and the engine's job takes them in
(``RefreshEngine.seed_basis``). The device lane runs on the CPU here (``device_refresh=True``)."""

from __future__ import annotations

import pytest
import torch
from conftest import hold_plan, regression_data, small_mlp, train

import asteria
from asteria import _core
from asteria.pipeline import packing

DATA = regression_data()


def one_blas_thread(function, *args):
    """``function(*args)[0]`` at one BLAS thread, the workers' setting (the same bits)."""
    threads = _core.blas_threads()
    _core.set_blas_threads(1)
    try:
        return function(*args)[0]
    finally:
        _core.set_blas_threads(threads)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("name", ["soap", "kl-shampoo"])
def test_the_workers_first_version_after_the_lane_warm_starts_from_the_bases_in_use(name, in_flight, device):
    """Versions 1 and 2 (the start-up's) run on the lane; version 3, on the workers, is the warm refresh of its
    snapshot from version 2's bases, bit for bit what the core's ``qr_refresh`` gives from them (with one host
    buffer per block, and with two, where version 3's is the second). On a GPU the bases reach the host buffers
    through the side stream's copy."""
    model = small_mlp().to(device)
    data = tuple(t.to(device) for t in DATA)
    runtime = asteria.RuntimeConfig(workers=1, stagger=False, device_refresh=True, in_flight=in_flight,
                                    device_process=None if device == "cuda" else False)
    optimizer = {"soap": asteria.SOAP, "kl-shampoo": asteria.KLShampoo}[name]
    with optimizer(model.parameters(), lr=1e-2, precondition_frequency=2, runtime=runtime) as opt:
        refresher = opt._refresher
        hold_plan(refresher, False)
        while min(refresher._newest_versions) < 2 or min(min(fset.versions) for fset in refresher.sets) < 2:
            train(model, opt, 1, data=data)
        assert all(lane == "device" for lane in refresher.lanes)  # (the start-up's versions)
        in_use = [fset.preconditioners.detach().cpu() for fset in refresher.sets]
        while min(refresher._newest_versions) < 3:
            train(model, opt, 1, data=data)
        assert all(fset.versions == [2] * fset.batch for fset in refresher.sets)  # (nothing installed since)
        refresher.engine.drain(30.0)
        assert refresher.depth == in_flight
        for index, fset in enumerate(refresher.sets):
            slot = 3 % refresher.depth
            snapshots = packing.unpack(refresher.snapshots[index][slot], fset.dim)
            for block in range(fset.batch):
                expected = one_blas_thread(_core.qr_refresh, snapshots[block].numpy(), in_use[index][block].numpy())
                computed = refresher.results[index][slot, block, :fset.dim]
                assert torch.equal(computed, torch.from_numpy(expected)), (fset.describe(block), name)
        train(model, opt, 2, data=data)
        assert min(min(fset.versions) for fset in refresher.sets) >= 3
        assert opt.runtime_stats()["refresh_failures"] == 0
