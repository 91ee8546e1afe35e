"""Budget: the entry and byte budgets over the store's entries, kept by evicting unpinned entries.

Budgets only ever evict unpinned entries, in eviction.py's order, and are enforced before a capture
(room is made from the size hint), so memory never exceeds the budget by a whole graph. Evicting an
entry frees bytes only when it is its pool's last graph (graphs/pool.py: a pool lives while any graph
captured into it does), so a byte-budget eviction takes the shortest run of victims in policy order that
fits and evicts only the ones whose pool it empties (`plan_evictions`). A capture into a live shared
pool needs only what exceeds the pool; after a capture whose real size exceeded its hint, other pools
are emptied if that fits; else the capture is refused with the rest of its pool when all of it is
evictable, or kept over budget with a warning when refusing would return nothing (its pool holds
pinned graphs). Pinning (warmup) stays within pin_share of each budget, so lazy captures keep room.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.entry import CacheEntry
from graphcache.graphs.policy.config import CachePolicyConfig
from graphcache.graphs.policy.eviction import Eviction
from graphcache.graphs.policy.journal import CacheJournal
from graphcache.graphs.pool import GraphPool, PoolKind
from graphcache.graphs.store import GraphStore

__all__ = ["Budget", "emptied_by", "plan_evictions"]

log = logging.getLogger(__name__)


class _Pooled(Protocol):
    pool: GraphPool


P = TypeVar("P", bound=_Pooled)


def plan_evictions(candidates: Sequence[P], fits: Callable[[int, set[GraphPool]], bool]) -> list[P] | None:
    """Which of `candidates` (evictable entries, in the eviction policy's order) to evict for `fits`.

    fits(freed, dropped) says whether the budget holds once `freed` bytes went back, `dropped`
    being the pools emptied for it (a capture into a shared pool needs less while that pool lives).
    Evicting an entry frees its pool's bytes only when it was the pool's last graph (pool.graphs
    counts them all: pinned entries and a capture being admitted are never candidates, so their
    pools never empty here). The shortest prefix of `candidates` that fits is taken, less those
    entries whose pool it does not empty: evicting them would free nothing. [] when it already fits;
    None when evicting every candidate would not do: then nothing should be evicted."""
    left: dict[GraphPool, int] = {}
    dropped: set[GraphPool] = set()
    freed = 0
    if fits(freed, dropped):
        return []
    for i, entry in enumerate(candidates):
        pool = entry.pool
        left[pool] = left.get(pool, pool.graphs) - 1
        if left[pool] == 0:
            dropped.add(pool)
            freed += pool.bytes
            if fits(freed, dropped):
                return [e for e in candidates[: i + 1] if e.pool in dropped]
    return None


def emptied_by(candidates: Sequence[P]) -> list[P]:
    """Those of `candidates` whose pool evicting all of them would empty (the ones that free bytes)."""
    count: dict[GraphPool, int] = {}
    for e in candidates:
        count[e.pool] = count.get(e.pool, 0) + 1
    return [e for e in candidates if count[e.pool] == e.pool.graphs]


class Budget:
    def __init__(
        self, config: CachePolicyConfig, store: GraphStore, eviction: Eviction, journal: CacheJournal
    ) -> None:
        self.config, self.store, self.eviction, self.journal = config, store, eviction, journal

    def may_pin(self) -> bool:
        """Pinned entries stay within pin_share of each budget, so lazy captures always keep room."""
        pinned = sum(e.pinned for e in self.store.entries())
        return (
            pinned < self.config.pin_share * self.config.max_entries
            and self.store.pools.kind_bytes("pinned") < self.config.pin_share * self.config.max_bytes
        )

    def make_room(self, desc: BatchDescriptor, kind: PoolKind) -> str | None:
        """Evict for the entry budget, then for the byte budget, before a capture of `desc` into `kind`.
        None: there is room now; else why there is none (then nothing was evicted for the bytes)."""
        if self._room_for(desc, kind):
            return None
        return (
            f"no room: {len(self.store)} entries / {self.store.total_bytes()} bytes held, "
            "and evicting unpinned entries would not make enough (pinned entries are never evicted by "
            "the budgets; a shared pool is freed only with its last graph)"
        )

    def _room_for(self, desc: BatchDescriptor, kind: PoolKind) -> bool:
        if self.config.max_entries <= 0:
            return False
        while len(self.store) >= self.config.max_entries:
            if not self._evict_first("entries"):
                return False
        return self._make_byte_room(desc, kind)

    def _make_byte_room(self, desc: BatchDescriptor, kind: PoolKind) -> bool:
        pools = self.store.pools
        hint, total, target = pools.size_hint(desc), self.store.total_bytes(), pools.live(kind)

        def fits(freed: int, dropped: set[GraphPool]) -> bool:
            # A capture into a live shared pool reuses all of it (between replays every block there is
            # free scratch; the cuBLAS workspace lives outside every pool: capture.py), so its growth is
            # about what exceeds the pool: 0..hint. Fragmentation beyond that is caught after the capture.
            room = target.bytes if target is not None and target not in dropped else 0
            return total - freed + max(0, hint - room) <= self.config.max_bytes

        victims = plan_evictions(self.order(), fits)
        if victims is None:
            return False  # evicting nothing: no set of victims would make room
        self.evict_all(victims, "bytes")
        return True

    def fit(self, entry: CacheEntry) -> str | None:
        """The hint may have been short: make the byte budget hold with `entry` (captured and counted in
        its pool, not held yet) included. None: hold it (over budget only when refusing it would not
        return a byte). Else why it must be refused; the rest of its pool was evicted with it in mind."""
        pool, desc, max_bytes = entry.pool, entry.desc, self.config.max_bytes
        # A shared pool's growth is already in total_bytes(); a private pool is not (no entry holds it yet).
        over = self.store.total_bytes() + (entry.bytes if pool.kind == "private" else 0) - max_bytes
        order = self.order()
        victims = plan_evictions(order, lambda freed, dropped: freed >= over)
        if victims is not None:  # other pools emptied: the capture fits (the usual case: [], it did)
            self.evict_all(victims, "bytes")
            return None
        # The capture's own pool never empties while it lives. Refuse it together with the rest of that
        # pool when all of it is evictable (a private pool, the first graph of a shared one, or a lazy pool
        # of unpinned entries): dropping the pool is the only way its bytes come back.
        mates = [e for e in order if e.pool is pool]
        if len(mates) == pool.graphs - 1:
            self.evict_all(mates, "bytes")
            return f"capture of {entry.bytes} bytes ({pool.kind} pool) exceeds the {max_bytes}-byte budget"
        # The pool holds pinned graphs: refusing would not return a byte, so keep the graph and free what
        # can be freed; the over-budget bytes are counted, and lazy captures wait for room.
        self.evict_all(emptied_by(order), "bytes")
        log.warning(
            "%s capture %s grew its pool by %d bytes to %d bytes held in all, over the %d-byte "
            "budget; kept (that pool holds pinned graphs: its memory returns only with them, e.g. on "
            "clear())",
            pool.kind,
            desc,
            entry.bytes,
            self.store.total_bytes(),
            max_bytes,
        )
        return None

    # --- eviction ---
    def order(self) -> list[CacheEntry]:
        """Unpinned entries in the order the budgets evict them."""
        return self.eviction.order([e for e in self.store.entries() if not e.pinned])

    def _evict_first(self, reason: str) -> bool:
        """Evict the first unpinned entry in eviction order. False: none left."""
        order = self.order()
        self.evict_all(order[:1], reason)
        return bool(order)

    def evict_all(self, victims: list[CacheEntry], reason: str) -> None:
        """Budget evictions: each victim ages what stays (GDSF's L)."""
        for victim in victims:
            self.eviction.evicted(victim)
            self.drop(victim.desc, reason)

    def drop(self, desc: BatchDescriptor, reason: str) -> None:
        """Drop the entry of `desc` from the store (budget, manual or clear), and say so."""
        entry, freed = self.store.drop(desc)
        self.journal.evicted(entry, reason, freed)
        self.update_gauges()

    def update_gauges(self) -> None:
        self.journal.gauges(self.store.entries(), self.store.total_bytes())
