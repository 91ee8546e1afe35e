"""Which unpinned entry the budgets evict first: LRU, or GDSF (GreedyDual-Size-Frequency).

GDSF: the entry with the lowest priority H = L + frequency * cost / size goes first, where cost = the
entry's measured capture seconds (what a re-capture would cost; floored at MIN_COST_SECONDS), size =
its bytes in MiB (floored at MIN_SIZE_BYTES, so small or zero-byte entries, e.g. on the CPU, are not
favoured without bound and nothing divides by zero), frequency = hits + 1 since admission. L, the
inflation value, starts at 0 and is raised to the H of each entry a budget evicts (not by a manual
eviction; reset() on clear); new and hit entries start from the current L, so an entry popular long
ago ages out once L passes its H. Ties: least recently used. docs/graph-pools.md compares the two.
"""

from __future__ import annotations

from typing import Protocol

from graphcache.graphs.entry import CacheEntry

__all__ = ["MIN_COST_SECONDS", "MIN_SIZE_BYTES", "Eviction", "Gdsf", "Lru", "make_eviction"]

# GDSF floors: a capture never costs less than this (the eager backend's captures take microseconds),
# and an entry never weighs less than 1 MiB (shared-pool growths and CPU entries may be 0 bytes; real
# private pools are >= ~2 MiB, so the floor only matters off the GPU and for growths).
MIN_COST_SECONDS = 1e-6
MIN_SIZE_BYTES = 1 << 20


class Eviction(Protocol):
    name: str
    inflation: float

    def order(self, unpinned: list[CacheEntry]) -> list[CacheEntry]:
        """`unpinned` (least recently used first) in the order the budgets evict them."""
        ...

    def touch(self, entry: CacheEntry) -> None:
        """`entry` was admitted or hit."""
        ...

    def evicted(self, entry: CacheEntry) -> None:
        """A budget evicted `entry`."""
        ...

    def reset(self) -> None:
        """The cache was cleared."""
        ...

    def priority(self, entry: CacheEntry) -> float | None:
        """What `entries()` reports as the entry's priority; None when the policy has none."""
        ...


class Lru:
    """The least recently used entry first: the store's own order."""

    name, inflation = "lru", 0.0

    def order(self, unpinned: list[CacheEntry]) -> list[CacheEntry]:
        return unpinned

    def touch(self, entry: CacheEntry) -> None:
        pass

    def evicted(self, entry: CacheEntry) -> None:
        pass

    def reset(self) -> None:
        pass

    def priority(self, entry: CacheEntry) -> float | None:
        return None


class Gdsf:
    """The lowest H first (see the module docstring)."""

    name = "gdsf"

    def __init__(self) -> None:
        self.inflation = 0.0  # L: the H of the last entry a budget evicted (grows until reset())

    def order(self, unpinned: list[CacheEntry]) -> list[CacheEntry]:
        # A sort per eviction decision: entries number a few hundred at most (one per capture size /
        # descriptor) and a decision precedes a capture of ~20-200 ms, so O(n log n) needs no heap kept in
        # step with hits. The sort is stable and `unpinned` is in LRU order: ties go to the least recently used.
        return sorted(unpinned, key=lambda e: e.priority)

    def touch(self, entry: CacheEntry) -> None:
        """H = L + frequency * cost / size (seconds of capture per MiB held, per use); O(1)."""
        cost = max(entry.capture_seconds, MIN_COST_SECONDS)
        size_mib = max(entry.bytes, MIN_SIZE_BYTES) / (1 << 20)
        entry.priority = self.inflation + (entry.hits + 1) * cost / size_mib

    def evicted(self, entry: CacheEntry) -> None:
        self.inflation = max(self.inflation, entry.priority)  # age everything that stays

    def reset(self) -> None:
        self.inflation = 0.0  # nothing left to age against: start over

    def priority(self, entry: CacheEntry) -> float | None:
        return None if entry.pinned else entry.priority


def make_eviction(name: str) -> Eviction:
    """The eviction policy called `name` ("lru" | "gdsf"; CachePolicyConfig validated it)."""
    return Gdsf() if name == "gdsf" else Lru()
