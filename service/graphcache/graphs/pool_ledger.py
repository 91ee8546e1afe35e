"""PoolLedger: the store's books of its pools: which pool a capture of a kind goes into, and the bytes
every pool holds (graphs/pool.py measures).

Pinned entries share one "pinned" pool; lazily admitted (unpinned) entries share one "lazy" pool, or
get a "private" pool each (evicting one returns exactly its bytes); which kind a capture takes is the
policy's call. A shared pool's record is made with its first capture and dropped with its last graph;
its handle is never captured into again (pool.py). A shared pool a failed capture spoiled is retired: its
kind gets a fresh pool, and the retired one stays counted until its last graph goes. Total bytes = pinned
pool + lazy pool + retired pools + every private pool. A shared entry's bytes are its pool's growth during
its capture (0 when the pool had room); size hints are each descriptor's own-pool size, measured when it
was captured into an empty pool.
"""

from __future__ import annotations

from collections.abc import Iterable

from graphcache.graphs.backend import CaptureBackend
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.entry import CacheEntry
from graphcache.graphs.pool import GraphPool, PoolKind

__all__ = ["PoolLedger"]


class PoolLedger:
    def __init__(self, backend: CaptureBackend) -> None:
        self.backend = backend
        # The shared pools by kind: each made on its first capture, dropped with its last graph.
        self.shared: dict[str, GraphPool | None] = {"pinned": None, "lazy": None}
        # Shared pools that take no more captures (store.py _usable), counted until their last graph goes.
        self.retired: list[GraphPool] = []
        self.size_hints: dict[BatchDescriptor, int] = {}  # measured bytes of past captures (own pool)

    def live(self, kind: str) -> GraphPool | None:
        """The shared pool of `kind` while it holds graphs; None for "private" and for a dropped pool."""
        return self.shared.get(kind)

    def pool_for(self, kind: PoolKind) -> GraphPool:
        """The pool a capture of `kind` goes into: the live shared one, else a fresh one."""
        pool = self.shared.get(kind)
        if pool is None:
            pool = GraphPool(kind, self.backend.new_pool())
            if kind != "private":
                self.shared[kind] = pool
        return pool

    def grow(
        self, pool: GraphPool, desc: BatchDescriptor, size: int, rank_bytes: tuple[int, ...]
    ) -> tuple[int, tuple[int, ...]]:
        """A capture of `desc` into `pool` is held, its pool measured at `size` bytes (at tensor parallel
        the max over ranks; rank_bytes: each rank's figure). Counts the graph and the pool's memory now,
        whatever happens to the entry (it stays until the pool's last graph goes). Returns the entry's size
        (its pool's growth; a private pool's growth is all of it) and each rank's own growth (the per-rank
        gauge sums them: a shared pool's whole size per entry would count it once per entry)."""
        fresh, before, rank_before = pool.graphs == 0, pool.bytes, pool.rank_bytes
        pool.graphs += 1
        pool.bytes, pool.rank_bytes = size, rank_bytes
        ranks = len(rank_bytes)
        rank_before = (
            rank_before if len(rank_before) == ranks else (0,) * ranks
        )  # a fresh pool: nothing before
        rank_growth = tuple(max(0, now - was) for now, was in zip(rank_bytes, rank_before, strict=True))
        if fresh:
            self.size_hints[desc] = size  # a capture into an empty pool: its own size
        return max(0, size - before), rank_growth

    def release(self, pool: GraphPool) -> bool:
        """One graph of `pool` was dropped. True when it was the last: the pool is freeable now (its
        bytes return on the next empty_cache) and its handle must not be captured into again."""
        pool.graphs -= 1
        if pool.graphs > 0:
            return False
        self.forget(pool)
        return True

    def forget(self, pool: GraphPool) -> None:
        if self.shared.get(pool.kind) is pool:
            self.shared[pool.kind] = None
        if pool in self.retired:
            self.retired.remove(pool)

    def retire(self, pool: GraphPool) -> None:
        """`pool` takes no more captures: the next capture of its kind gets a fresh pool; its graphs and
        bytes stay counted here until the last of them is dropped."""
        if self.shared.get(pool.kind) is pool:
            self.shared[pool.kind] = None
            self.retired.append(pool)

    def _held(self) -> list[GraphPool]:
        return [p for p in list(self.shared.values()) if p is not None] + list(self.retired)

    def size_hint(self, desc: BatchDescriptor) -> int:
        """Expected bytes of a capture of `desc`: its own past size, else the largest past
        capture of a batch no bigger (graph memory grows with batch size), else the smallest."""
        if desc in self.size_hints:
            return self.size_hints[desc]
        smaller = [b for d, b in self.size_hints.items() if d.num_tokens <= desc.num_tokens]
        if smaller:
            return max(smaller)
        return min(self.size_hints.values(), default=0)

    def total_bytes(self, entries: Iterable[CacheEntry]) -> int:
        """Allocator-measured: the pinned pool, the lazy pool, the retired pools and every private pool."""
        shared = sum(p.bytes for p in self._held())
        return shared + sum(e.bytes for e in list(entries) if e.pool.kind == "private")

    def kind_bytes(self, kind: str) -> int:
        return sum(p.bytes for p in self._held() if p.kind == kind)

    def rank_bytes(self, entries: Iterable[CacheEntry], ranks: int) -> list[int]:
        """Each tensor-parallel rank's own measurement of the pools held, in rank order."""
        pools = self._held()
        pools += [e.pool for e in list(entries) if e.pool.kind == "private"]
        return [
            sum(p.rank_bytes[r] if r < len(p.rank_bytes) else p.bytes for p in pools) for r in range(ranks)
        ]
