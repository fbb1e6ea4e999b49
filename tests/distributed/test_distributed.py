"""Distributed Asteria on real processes: 4 CPU processes over Gloo, declared as 2 nodes x 2 ranks."""

from __future__ import annotations

import copy
import re

import dist_workers as W
import pytest
import torch

from asteria.distributed import assign_owners_by_set, block_cost
from asteria.distributed.topology import moves_host_tensors

# fp32 tolerance between DDP's averaged shard gradients and the full batch's gradient (SOAP's sign-like
# first steps amplify the rounding more than Shampoo's).
TOLS = {"shampoo": dict(rtol=2e-4, atol=2e-5), "soap": dict(rtol=1e-3, atol=2e-4)}


@pytest.fixture
def clean_shm():
    before = W.segments()
    yield
    assert W.segments() - before == set(), "a shared-memory segment was left in /dev/shm"


def test_ownership_is_balanced_by_cubic_cost_and_deterministic():
    # One block per set: greedy longest-processing-time over the totals.
    items = [(("a", i), n) for i, n in enumerate([64, 8, 32, 32, 16, 64, 8])]
    owners = assign_owners_by_set([[item] for item in items], [0, 1, 2])
    assert owners == assign_owners_by_set([[item] for item in reversed(items)], [0, 1, 2])
    loads = {r: sum(block_cost(n) for key, n in items if owners[key] == r) for r in range(3)}
    # The two 64s go to different ranks; the rest fills the third first.
    assert owners[("a", 0)] != owners[("a", 5)]
    assert max(loads.values()) == block_cost(64)
    with pytest.raises(ValueError, match="Invalid ranks"):
        assign_owners_by_set([items], [])


def test_every_rank_owns_an_equal_share_of_each_set():
    """Two sets whose blocks alternate in key order (a matrix's two modes): balancing the totals alone gave
    each rank all of one set. Now each set splits evenly and the totals stay balanced."""
    sets = [[((block, mode), 8) for block in range(6)] for mode in range(2)] + [[(("odd", i), 16) for i in range(3)]]
    owners = assign_owners_by_set(sets, [0, 1])
    assert owners == assign_owners_by_set([list(reversed(s)) for s in reversed(sets)], [0, 1])
    for blocks in sets:
        counts = [sum(owners[key] == r for key, _ in blocks) for r in (0, 1)]
        assert abs(counts[0] - counts[1]) <= 1, counts
    loads = [sum(block_cost(n) for blocks in sets for key, n in blocks if owners[key] == r) for r in (0, 1)]
    assert abs(loads[0] - loads[1]) == block_cost(16)  # the odd 16-block; each set of 8s splits 3 / 3
    shared = {0: block_cost(16) * 2}  # loads carried over from another domain fill the other rank first
    owners = assign_owners_by_set([[(("x", i), 16) for i in range(3)]], [0, 1], shared)
    assert [owners[("x", i)] for i in range(3)] == [1, 0, 1]
    assert shared == {0: block_cost(16) * 3, 1: block_cost(16) * 2}


# (optimizer, S, steps, lag_steps, stagger): with lag_steps=1 every version after the sync refreshes is used
# one step after its snapshot, on every rank; staggered, each step refreshes and exchanges the sets of one phase.
DDP_RUNS = [("shampoo", 0, 6, None, False), ("shampoo", 3, 12, None, False), ("soap", 1, 10, None, False),
            ("kl-shampoo", 3, 12, 1, True), ("soap-qr", 1, 10, None, False)]
TOLS["kl-shampoo"] = TOLS["soap-qr"] = TOLS["soap"]
# Every weight's dimension 0 splits into shards that coincide with the single-process blocks
# (max_preconditioner_dim 8, shards of 8 or 16 rows), so per-shard blocking is whole-parameter blocking
# and the runs must agree up to the gradient reduction's rounding.
SHARDED_RUNS = [("fsdp", "shampoo", 0, 6, False), ("hsdp", "shampoo", 0, 6, False), ("hsdp", "soap", 1, 8, False),
                ("hsdp", "kl-shampoo", 1, 10, True), ("hsdp+plain", "shampoo", 1, 6, False)]
# (optimizer, S, steps before the checkpoint, steps after): checkpoints taken with versions in flight.
RESUME_RUNS = [("shampoo", 2, 7, 6), ("soap", 1, 6, 5)]
# (the optimizers of the two pairs, steps): each pair of ranks trains with its own optimizer over its own group.
SUBGROUP_RUN = (("shampoo", "soap"), 8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One set of 4 processes runs every DDP, FSDP2 and HSDP training run; the tests check its results."""
    out = tmp_path_factory.mktemp("training")
    before = W.segments()
    codes = W.launch(W.training_worker, out, DDP_RUNS, SHARDED_RUNS, RESUME_RUNS, SUBGROUP_RUN, timeout=180)
    leftover = W.segments() - before
    return out, codes, leftover


def test_ddp_matches_single_process_and_replicas_stay_identical(trained):
    out, codes, leftover = trained
    results = W.load(out / "ddp")
    assert codes == [0] * W.WORLD
    assert leftover == set(), "a shared-memory segment was left in /dev/shm"
    runs = DDP_RUNS
    for rank, result in enumerate(results):
        assert result["segment_visible"] is False
        assert "Invalid deterministic=False" in result["nondeterministic"]
        assert "Invalid stagger=True: the ranks' factor sets differ" in result["uneven_stagger"]
    # Split sets asked for on several ranks: the groups are cut there, the sets sliced on one process; the
    # same refresh units, and the replicas end where one process ends.
    reference, groups, sets = W.split_run(None)
    for result in results:
        params, rank_groups, rank_sets = result["split"]
        assert rank_sets == sets and rank_groups > groups
        for name, value in reference.items():
            torch.testing.assert_close(params[name], value, **TOLS["shampoo"], msg=f"split {name}")
    for kind, staleness, steps, lag_steps, stagger in runs:
        per_rank = [r["runs"][(kind, staleness, lag_steps)] for r in results]
        reference = W.single_process(kind, staleness, steps, lag_steps, stagger)
        for rank, run in enumerate(per_rank):
            # Replicas bitwise identical; within S intervals at every step.
            assert run["identical"], (kind, staleness)
            assert (len(set(run["phases"])) > 1) == stagger and run["phases"] == per_rank[0]["phases"]
            assert max(run["staleness"]) <= (staleness if lag_steps is None else 1)
            for name, value in reference.items():
                torch.testing.assert_close(run["params"][name], value, **TOLS[kind], msg=f"{kind} S={staleness} {name}")
            assert run["state_layout"]["rank"] == rank and run["state_layout"]["world_size"] == W.WORLD
            assert "Invalid state_dict: saved on rank" in run["foreign_load"]
            assert run["state_keys"] == ["format", f"rank{rank}"]
            assert (f"Invalid state_dict: it holds the state of ['rank{(rank + 1) % W.WORLD}'], and this optimizer "
                    f"runs on rank {rank}") in run["foreign_wrapped"]
        stats = per_rank[0]["stats"]
        assert [s["rank"] for s in stats] == [0, 1, 2, 3]
        assert all(s["max_staleness_seen"] <= staleness for s in stats)
        # The default lag is one interval (f = 2), at most the bound.
        assert all(s["lag_steps"] == (min(2, 2 * staleness) if lag_steps is None else lag_steps) for s in stats)
        assert all(s["stagger_split"] is False for s in stats)  # the default splits groups on one process only
        # Every block has exactly one owner; all ranks own some.
        assert sum(s["owned_blocks"] for s in stats) == stats[0]["blocks"]
        assert all(s["owned_blocks"] > 0 for s in stats)
        # Every snapshotted version is refreshed once; at the end the newest S versions (not yet due)
        # may still be on the workers when the counts are read. A staggered set makes one more version.
        expected, done = stats[0]["blocks"] * (steps // 2 + stagger), sum(s["refreshes"] for s in stats)
        assert expected - stats[0]["blocks"] * staleness <= done <= expected, (kind, staleness, done, expected)
        # Only node leaders (ranks 0 and 2) talk across nodes; what one sends the other receives.
        assert stats[1]["bytes_inter_node_sent"] == stats[3]["bytes_inter_node_sent"] == 0
        assert stats[0]["bytes_inter_node_sent"] > 0 and stats[2]["bytes_inter_node_sent"] > 0
        assert stats[0]["bytes_inter_node_sent"] == stats[2]["bytes_inter_node_received"]
        assert stats[2]["bytes_inter_node_sent"] == stats[0]["bytes_inter_node_received"]
        assert all(s["bytes_intra_node_shared"] > 0 for s in stats)
    # SOAP's first-basis rule reaches the ranks' engines: with the full eigendecomposition they would end elsewhere.
    qr, eigh = results[0]["runs"][("soap-qr", 1, None)]["params"], W.single_process("soap", 1, 10)
    assert any(not torch.allclose(qr[name], value, **TOLS["soap"]) for name, value in eigh.items())
    soap = [r["runs"][("soap", 1, None)]["stats"] for r in results][0]
    skipped = sum(s["exchanges_skipped"] for s in soap)
    # Kept bases move nothing; the engine also counts the skips of the version still pending at the end.
    assert 0 < skipped <= sum(s["refreshes_skipped"] for s in soap)


@pytest.mark.parametrize("victim", [2, 3])
def test_a_dead_rank_makes_the_others_raise_within_the_timeout(tmp_path, clean_shm, victim):
    timeout_s = 6.0
    codes = W.launch(W.kill_worker, tmp_path, victim, 3, timeout_s, timeout=60)
    assert codes[victim] == 17
    assert [c for r, c in enumerate(codes) if r != victim] == [0] * (W.WORLD - 1)
    outcomes = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(W.WORLD) if r != victim]
    for outcome in outcomes:
        assert outcome["raised"] is not None, outcome
        assert 0 <= outcome["seconds"] < timeout_s + 5, outcome
        assert "rank " in outcome["message"], outcome


def test_every_rank_says_why_refreshes_failed(tmp_path, clean_shm):
    """A rank's refresh_errors name every block whose refreshes failed: its own with the engine's message, the
    others' with the rank that owns them."""
    assert W.launch(W.failure_worker, tmp_path) == [0] * W.WORLD, W.errors(tmp_path)
    for rank in range(W.WORLD):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        errors = saved["errors"]
        assert sorted(errors) == sorted(saved["blocks"]), rank
        for block, why in errors.items():
            if block in saved["owned"]:
                assert "injected worker exception" in why, (rank, block, why)
            else:
                assert re.fullmatch(r"the refresh failed on its owner, rank \d .*", why), (rank, block, why)


@pytest.mark.parametrize("stall", [False, True])
def test_a_dead_or_stalled_rank_stops_its_own_group_only(tmp_path, clean_shm, stall):
    """Two pairs of ranks, each with an optimizer over its own group: when rank 1 dies, or hangs, rank 0
    raises within timeout_s (the group's own timeout is 10 times longer), naming a rank; the other pair
    trains on to the end."""
    timeout_s = 6.0
    codes = W.launch(W.kill_worker, tmp_path, 1, 3, timeout_s, True, stall, timeout=60)
    assert codes == [0, 17, 0, 0]
    outcomes = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 2, 3)}
    assert outcomes[0]["raised"] is not None and 0 <= outcomes[0]["seconds"] < timeout_s + 5, outcomes[0]
    assert "rank " in outcomes[0]["message"], outcomes[0]
    assert all(outcomes[r]["raised"] is None and outcomes[r]["steps"] == 11 for r in (2, 3)), outcomes


def test_fsdp2_and_hsdp_match_single_process(trained):
    out, codes, _ = trained
    results = W.load(out / "sharded")
    assert codes == [0] * W.WORLD
    runs = SHARDED_RUNS
    for layout, kind, staleness, steps, stagger in runs:
        per_rank = [r[(layout, kind, staleness, stagger)] for r in results]
        if stagger:
            # Staggered by the shards' own sets, whose phases differ from the whole model's: no single-process
            # reference. Both replicas of each shard (ranks r and r + 2, on two nodes) hold the same phases
            # and end bit for bit equal.
            assert len(set(per_rank[0]["phases"])) > 1
            assert all(run["phases"] == per_rank[0]["phases"] for run in per_rank)
            for rank in (0, 1):
                for name, value in per_rank[rank]["local"].items():
                    assert torch.equal(per_rank[rank + 2]["local"][name], value), (rank, name)
            reference = None
        else:
            reference = W.single_process(kind, staleness, steps, extra=layout == "hsdp+plain")
        for rank, run in enumerate(per_rank):
            for name, value in (reference or {}).items():
                torch.testing.assert_close(run["params"][name], value, **TOLS[kind], msg=f"{layout} {kind} {name}")
            if layout == "fsdp":
                assert run["domains"] == [[rank]]  # each shard is its own: no exchange
                assert run["stats"]["bytes_inter_node_sent"] == 0
            elif layout == "hsdp+plain":
                # Ranks 0 and 2 lead both the world's domain (the plain parameter) and their shard's: the two
                # domains' exchanges share one channel between them, in one order on both sides.
                assert run["domains"] == [[0, 1, 2, 3], [rank % 2, rank % 2 + 2]]
                assert (run["stats"]["bytes_inter_node_sent"] > 0) and run["stats"]["bytes_intra_node_shared"] > 0
            else:
                assert run["domains"] == [[rank % 2, rank % 2 + 2]]  # replicas of a shard, across nodes
                assert run["stats"]["bytes_inter_node_sent"] > 0
                assert run["stats"]["bytes_intra_node_shared"] == 0


def test_optimizers_over_subgroups_match_single_process(trained):
    """Two pairs of ranks, each with its own optimizer over its own Gloo group, at once: on one host (a shared
    store) and across two (an exchange). Each pair's replicas stay identical and end where one process ends;
    only the pair's own ranks take part in anything (a group of its own for the exchange would have
    needed the other pair's ranks to create it)."""
    out, codes, leftover = trained
    assert codes == [0] * W.WORLD
    assert leftover == set(), "a shared-memory segment was left in /dev/shm"
    results = W.load(out / "subgroups")
    kinds, steps = SUBGROUP_RUN
    references = {kind: W.single_process(kind, 1, steps) for kind in kinds}
    pairs = {"hosts": [[0, 1], [2, 3]], "across": [[0, 2], [1, 3]], "declared": [[0, 1], [2, 3]]}
    for layout, layout_pairs in pairs.items():
        for g, pair in enumerate(layout_pairs):
            for rank in pair:
                run = results[rank][layout]
                assert run["kind"] == kinds[g] and run["identical"], (layout, rank)
                for name, value in references[kinds[g]].items():
                    torch.testing.assert_close(run["params"][name], value, **TOLS[kinds[g]],
                                               msg=f"{layout} rank {rank} {name}")
                stats = run["stats"]
                assert [s["rank"] for s in stats] == pair and all(s["world_size"] == 2 for s in stats)
                assert sum(s["owned_blocks"] for s in stats) == stats[0]["blocks"]
                if layout == "hosts":  # one node: the pair shares its store, nothing crosses nodes
                    assert all(s["local_world_size"] == 2 and s["bytes_inter_node_sent"] == 0 for s in stats)
                    assert all(s["bytes_intra_node_shared"] > 0 for s in stats)
                else:  # two nodes of one rank: each sends what the other receives
                    assert all(s["local_world_size"] == 1 and s["bytes_inter_node_sent"] > 0 for s in stats)
                    assert stats[0]["bytes_inter_node_sent"] == stats[1]["bytes_inter_node_received"]
                    assert stats[1]["bytes_inter_node_sent"] == stats[0]["bytes_inter_node_received"]
                assert f"rank {rank} is not in it" in results[rank][f"{layout}_foreign"]
    for rank in range(3):
        assert ("Invalid process_group: its ranks [0, 1, 2] fall on the hosts of LOCAL_WORLD_SIZE=2 ranks as "
                "{0: 2, 1: 1}") in results[rank]["uneven"]
    # FSDP2 within each of two stages of a mesh, an optimizer per stage over the stage's row: each rank
    # refreshes its own shards, and the stage ends where one process ends.
    for rank, result in enumerate(results):
        stage = result["stages"]
        assert stage["kind"] == kinds[rank // 2] and stage["domains"] == [[rank]]
        assert stage["stats"]["world_size"] == 2 and stage["stats"]["bytes_inter_node_sent"] == 0
        for name, value in references[stage["kind"]].items():
            torch.testing.assert_close(stage["params"][name], value, **TOLS[stage["kind"]], msg=f"stage {rank} {name}")


def test_a_subgroup_of_an_unnamed_backend_runs_on_its_gloo(tmp_path):
    """A default group initialised without a backend name: torch reports its groups' backend as 'undefined'
    and runs their CPU tensors on Gloo, which is all the optimizer needs."""
    codes = W.launch(W.unnamed_backend_worker, tmp_path, world=3, timeout=60)
    assert codes == [0, 0, 0], W.errors(tmp_path)
    results = W.load(tmp_path, world=3)
    reference = W.single_process("shampoo", 1, 6)
    for rank in (0, 1):
        assert results[rank]["backend"] == "undefined" and results[rank]["stats"]["world_size"] == 2
        for name, value in reference.items():
            torch.testing.assert_close(results[rank]["params"][name], value, **TOLS["shampoo"], msg=name)


@pytest.mark.parametrize("backend, moves", [("gloo", True), ("cpu:gloo", True), ("cpu:gloo,cuda:nccl", True),
                                            ("cuda:nccl,cpu:gloo", True), ("nccl", False), ("cuda:nccl", False),
                                            ("cpu:mpi,cuda:nccl", False), ("mpi", False)])
def test_a_subgroup_must_run_host_tensors_on_gloo(backend, moves):
    """The backends ``dist.get_backend_config`` names (NCCL groups themselves cannot be made on this machine)."""
    assert moves_host_tensors(backend) is moves


def test_every_rank_resumes_bit_for_bit_from_its_own_checkpoint(trained):
    """4 Gloo processes (2 nodes x 2 ranks): a checkpoint taken with refreshes in flight, loaded into a
    fresh model and optimizer on the same ranks, continues exactly as the uninterrupted run; so does one
    saved and loaded through torch.distributed.checkpoint."""
    out, codes, _ = trained
    assert codes == [0] * W.WORLD
    results = W.load(out / "resume")
    for run in RESUME_RUNS:
        key = run[:2]
        for rank, result in enumerate(results):
            assert result[key]["identical"], (key, rank)
            assert result[key]["dcp_identical"], (key, rank)  # the same through torch.distributed.checkpoint
            assert result[key]["in_flight"] > 0, (key, rank)  # the checkpoint did carry pending versions
            request, snapshot, layout, due = result[key]["malformed"]  # spoiled entries were refused by name first
            assert re.search(r"Invalid state_dict\['refresher'\]\['scheduled'\]\[0\]\['requests'\]\[\d+\]="
                             r"\(1.0,\): must be \(scale, eps, skip_tol, relative_eps\)", request), request
            assert re.search(r"\['scheduled'\]\[0\]\['snapshots'\]\[\d+\]='torch.float32 \(\d+, \d+, 1\)': "
                             r"must be torch.float32", snapshot), snapshot
            assert re.search(r"Invalid state_dict\['refresher'\]\['distributed'\]=\{\}: must be a dict with the "
                             r"saving rank's world_size", layout), layout  # (before: a raw KeyError, half loaded)
            assert re.search(r"Invalid state_dict\['refresher'\]\['scheduled'\]\[0\]\['due'\]=\d+: must be in "
                             r"\[\d+, \d+\]: version \d+ of .* is snapshotted at step \d+", due), due
            assert result[key]["layout"]["rank"] == rank and result[key]["layout"]["world_size"] == W.WORLD


def test_scheduled_versions_of_older_checkpoints_list_every_set():
    from asteria.distributed.resume import _with_set_indices

    legacy = {"version": 3, "due": 9, "requests": [(1.0, 0.1, 0.0), (1.0, 0.2, 0.0)], "snapshots": ["a", None]}
    entry = _with_set_indices(legacy, 2)
    assert entry["requests"] == {0: (1.0, 0.1, 0.0), 1: (1.0, 0.2, 0.0)} and entry["snapshots"] == {0: "a", 1: None}
    assert _with_set_indices(entry, 2) is entry
    with pytest.raises(ValueError, match="Invalid a scheduled version: it lists 2 requests and 2 snapshots, one per "
                                         "factor set: this optimizer has 3"):
        _with_set_indices(legacy, 3)


def test_the_due_check_reads_each_refreshers_format_of_the_versions_in_flight():
    """One process's refresher saves an entry per version of a set; the distributed one an entry per version with
    the sets it requested, keyed by set index (or, before staggered multi-rank schedules, listed for every set)."""
    from asteria.optim.checkpoint import scheduled_sets

    request = (1.0, 1e-8, 0.0, 0.0)
    assert scheduled_sets(({"set": 1, "version": 3, "due": 9}, {"set": 0, "version": 4, "due": 12})) == [
        (0, 1, 3, 9), (1, 0, 4, 12)]
    assert scheduled_sets(({"version": 3, "due": 9, "requests": {0: request, 2: request}},
                           {"version": 4, "due": 12, "requests": [request, request]})) == [
        (0, 0, 3, 9), (0, 2, 3, 9), (1, 0, 4, 12), (1, 1, 4, 12)]
    assert scheduled_sets(()) == scheduled_sets(None) == []


def test_older_checkpoint_formats_pass_the_refresher_check():
    """What ``load_state`` still reads, ``check_state`` accepts: failure counts as NumPy arrays, one
    ``newest_version`` for every set, requests without skip_tol, requests and snapshots listed per set (None
    where this rank owns no block); and it names what it refuses."""
    from types import SimpleNamespace

    import numpy as np

    from asteria.distributed.refresher import DistributedRefresher

    refresher = object.__new__(DistributedRefresher)  # the check reads only the sets, snapshot rings and layout
    refresher.sets = [SimpleNamespace(batch=2, name="set 0"), SimpleNamespace(batch=1, name="set 1")]
    refresher.snapshots = [torch.zeros(3, 2, 4, 4), None]
    layout = {"world_size": 2, "local_world_size": 1, "rank": 0, "owners": [[0, 1], [1]]}
    refresher.identity = lambda: layout
    old = {"distributed": dict(layout), "newest_version": 3,
           "consecutive_failures": [np.zeros(2, np.int64), np.zeros(1, np.int64)],
           "scheduled": ({"version": 3, "due": 9, "requests": [(1.0, 1e-8), ([1.0], 1e-8, 0.0)],  # no skip_tol
                          "snapshots": [torch.ones(2, 4, 4), None]},)}
    refresher.check_state(old)
    for change, match in (
            (lambda s: s.update(newest_version=-1), r"\['newest_version'\]=-1: must be an int >= 0"),
            (lambda s: s["consecutive_failures"].__setitem__(0, np.zeros(3, np.int64)),
             r"\['consecutive_failures'\]\[0\]=\[0, 0, 0\]: must be 2 ints"),
            (lambda s: s["scheduled"][0]["snapshots"].__setitem__(1, torch.ones(1, 4, 4)),
             r"\['scheduled'\]\[0\]\['snapshots'\]\[1\]='Tensor': must be None: this rank owns no block"),
            (lambda s: s["scheduled"][0].update(requests={0: (1.0, 1e-8, 0.0), "x": (1.0, 1e-8, 0.0)},
                                                snapshots={0: None, "x": None}),
             r"\['scheduled'\]\[0\]\['requests'\]=\[0, 'x'\]: must be keyed by factor set indices"),
            (lambda s: s.update(distributed={}), r"\['distributed'\]=\{\}: must be a dict with the saving rank's"),
            (lambda s: s.update(scheduled=s["scheduled"] * 2), r"\['scheduled'\]\[1\]\['version'\]=3: must differ"),
            (lambda s: s["scheduled"][0].update(version=4), r"\['version'\]=4: must be at most 3, the newest version"),
            (lambda s: s["distributed"].update(rank=1), r"saved by rank 1 of world size 2 .*: rank 1 != 0")):
        bad = copy.deepcopy(old)
        change(bad)
        with pytest.raises(ValueError, match=match):
            refresher.check_state(bad)
