"""Distributed Asteria on GPUs: 2 processes over Gloo, each on a CUDA device (the same one when the
machine has one). The node stores are page-locked, and installs copy straight from them on the side
stream; the results must not depend on that or on stream timing. Skipped without a GPU."""

from __future__ import annotations

import dist_workers as W
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RUNS = [("shampoo", 0), ("soap", 0), ("soap", 20_000_000), ("kl-shampoo", 20_000_000)]


@pytest.mark.parametrize("local", [2, 1], ids=["one-node-shared-store", "two-nodes-private-stores"])
def test_installs_from_page_locked_stores_match_one_process(tmp_path, local):
    before = W.segments()
    codes = W.launch(W.cuda_worker, tmp_path, local, RUNS, world=2, timeout=240)
    assert W.segments() - before == set(), "a shared-memory segment was left in /dev/shm"
    assert codes == [0, 0]
    results = W.load(tmp_path, world=2)
    references = {kind: W.cuda_run(kind, torch.device("cuda", 0))[0] for kind in {kind for kind, _ in RUNS}}
    for rank, result in enumerate(results):
        for (kind, delay), (params, stats) in result.items():
            assert stats["store_page_locked"] is True, (rank, kind)
            assert stats["bytes_to_device"] > 0
            if local == 1:  # two nodes: the leaders exchange versions
                assert stats["bytes_inter_node_sent"] > 0 and stats["bytes_inter_node_received"] > 0
            else:
                assert stats["bytes_intra_node_shared"] > 0
            for name, value in references[kind].items():
                assert torch.equal(params[name], value), (rank, kind, delay, name)
