"""Which rank refreshes which preconditioner block: greedy longest-processing-time over O(n^3) costs,
with every rank owning an equal share of each factor set.

Every rank computes the same assignment from data all replicas of a block have (the blocks' keys, sizes
and factor sets), so no message is needed to agree on it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def block_cost(n: int) -> int:
    """The work of one refresh of an n x n factor (an eigendecomposition or a QR sweep): O(n^3)."""
    return n**3


def assign_owners_by_set(sets: Sequence[Sequence[tuple[Hashable, int]]], ranks: Sequence[int],
                         loads: dict[int, int] | None = None) -> dict[Hashable, int]:
    """Assigns the ``(key, n)`` blocks of each set so that every rank owns ``B // len(ranks)`` of a set's
    ``B`` blocks, or one more; the extra blocks go to the ranks with the least load so far, so that the
    totals stay balanced too (sets of costlier blocks first). ``loads`` (rank -> cost already assigned) is
    updated in place, so that several assignments can share one balance.

    The blocks of a factor set are snapshotted, published and installed on the same step. If one rank
    owned most of them, it would copy most of that step's results into the node store while the others
    waited for it: on 2 GPUs, greedy balancing of the totals alone gave each rank every block of one of
    olmo-160m's 768 x 768 sets, and those sets' steps were the slowest."""
    if not ranks:
        raise ValueError("Invalid ranks=[]: at least one rank must own the blocks")
    loads = loads if loads is not None else {}
    for rank in ranks:
        loads.setdefault(rank, 0)
    owners: dict[Hashable, int] = {}
    ordered = [sorted(items, key=lambda item: (-block_cost(item[1]), item[0])) for items in sets if items]
    ordered.sort(key=lambda items: (-block_cost(items[0][1]), -len(items), items[0][0]))
    for items in ordered:
        turn = sorted(ranks, key=lambda r: (loads[r], r))
        for j, (key, n) in enumerate(items):
            owner = turn[j % len(turn)]
            owners[key] = owner
            loads[owner] += block_cost(n)
    return owners
