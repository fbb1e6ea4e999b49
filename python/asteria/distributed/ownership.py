"""Which rank refreshes which preconditioner block: greedy longest-processing-time over O(n^3) costs.

Every rank computes the same assignment from data all replicas of a block have (the blocks' keys and
sizes), so no message is needed to agree on it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def block_cost(n: int) -> int:
    """The work of one refresh of an n x n factor (an eigendecomposition or a QR sweep): O(n^3)."""
    return n**3


def assign_owners(items: Sequence[tuple[Hashable, int]], ranks: Sequence[int],
                  loads: dict[int, int] | None = None) -> dict[Hashable, int]:
    """Assigns each ``(key, n)`` item to one of ``ranks``, largest cost first, each to the rank with the
    least load so far (ties: the lower rank; equal costs in key order). ``loads`` (rank -> cost already
    assigned) is updated in place, so that several assignments can share one balance."""
    if not ranks:
        raise ValueError("Invalid ranks=[]: at least one rank must own the blocks")
    loads = loads if loads is not None else {}
    for rank in ranks:
        loads.setdefault(rank, 0)
    owners: dict[Hashable, int] = {}
    for key, n in sorted(items, key=lambda item: (-block_cost(item[1]), item[0])):
        owner = min(ranks, key=lambda r: (loads[r], r))
        owners[key] = owner
        loads[owner] += block_cost(n)
    return owners
