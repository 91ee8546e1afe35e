"""CachePolicy: which entries the graph cache holds, under an entry and a byte budget.

The store (cache.py) asks it whether a miss may capture (the negative cache, then admission.py),
to make room before a capture and to make the budget hold after it, and whether warmup may pin;
it evicts through the store's `close` and keeps the books (pool_ledger.py, journal.py).

Budgets only ever evict unpinned entries, in eviction.py's order, and are enforced before a capture
(room is made from the size hint), so memory never exceeds the budget by a whole graph. Evicting an
entry frees bytes only when it is its pool's last graph (pool.py plan_evictions), so a byte-budget
eviction takes the shortest run of victims in policy order that fits and evicts only the ones whose
pool it empties. A capture into a live shared pool needs only what exceeds the pool; after a capture
whose real size exceeded its hint, other pools are emptied if that fits; else the capture is refused
with the rest of its pool when all of it is evictable, or kept over budget with a warning when
refusing would return nothing (its pool holds pinned graphs).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from graphcache.graphs.admission import Admission
from graphcache.graphs.agreement import CaptureReport, Decision, Verdict, decide
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.entry import CacheEntry
from graphcache.graphs.eviction import make_eviction
from graphcache.graphs.journal import CacheJournal
from graphcache.graphs.policy_config import CachePolicyConfig
from graphcache.graphs.pool import GraphPool, PoolKind, emptied_by, plan_evictions
from graphcache.graphs.pool_ledger import PoolLedger

__all__ = ["CachePolicy"]

log = logging.getLogger(__name__)


class CachePolicy:
    """entries: the store's entries, least recently used first (read here; removed only through `close`).
    close(desc): the store drops the entry of `desc` and closes its graph."""

    size = 1  # tensor-parallel ranks that agree its per-rank inputs (agreed_policy.py wraps it for more)

    def __init__(
        self,
        config: CachePolicyConfig,
        *,
        backend: str,
        entries: OrderedDict[BatchDescriptor, CacheEntry],
        close: Callable[[BatchDescriptor], CacheEntry],
        journal: CacheJournal,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.entries, self._close, self.journal = entries, close, journal
        self.admission = Admission(config, clock)
        self.eviction = make_eviction(config.eviction_policy)
        self.pools = PoolLedger(backend, config.lazy_pool)
        self.negative: dict[BatchDescriptor, tuple[str, str]] = {}  # desc -> (reason, detail)

    # --- per-rank inputs ---
    def agree(self, report: CaptureReport) -> Verdict:
        """The verdict on this rank's report (a pre-check, a capture, a pool measurement): alone, its own."""
        return decide([report])

    def precheck(self, lazy: bool) -> CaptureReport:
        """A lazy capture waits while lazy captures have spent their share of serving time."""
        if lazy and not self.admission.within_budget():
            return CaptureReport(False, "deferred", "lazy captures spent their share of serving time")
        return CaptureReport(True)

    # --- decisions ---
    def wants_capture(self, desc: BatchDescriptor) -> bool:
        """A miss while serving: capture it now? (Never a descriptor that failed before clear().)"""
        return desc not in self.negative and self.admission.wants(desc)

    def may_pin(self) -> bool:
        """Pinned entries stay within pin_share of each budget, so lazy captures always keep room."""
        pinned = sum(e.pinned for e in list(self.entries.values()))
        return (
            pinned < self.config.pin_share * self.config.max_entries
            and self.pools.kind_bytes("pinned") < self.config.pin_share * self.config.max_bytes
        )

    def make_room(self, desc: BatchDescriptor, kind: PoolKind) -> bool:
        """Evict for the entry budget, then for the byte budget, before a capture. False: no room, and
        `desc` is refused as "budget"."""
        if self._room_for(desc, kind):
            return True
        self.refuse(
            desc,
            "budget",
            f"no room: {len(self.entries)} entries / {self.total_bytes()} bytes held, "
            "and evicting unpinned entries would not make enough (pinned entries are never evicted by "
            "the budgets; a shared pool is freed only with its last graph)",
        )
        return False

    def _room_for(self, desc: BatchDescriptor, kind: PoolKind) -> bool:
        if self.config.max_entries <= 0:
            return False
        while len(self.entries) >= self.config.max_entries:
            if not self._evict_first("entries"):
                return False
        return self._make_byte_room(desc, kind)

    def _make_byte_room(self, desc: BatchDescriptor, kind: PoolKind) -> bool:
        hint, total, target = self.pools.size_hint(desc), self.total_bytes(), self.pools.live(kind)

        def fits(freed: int, dropped: set[GraphPool]) -> bool:
            # A capture into a live shared pool reuses all of it (between replays every block there is
            # free scratch; the cuBLAS workspace lives outside every pool: capture.py), so its growth is
            # about what exceeds the pool: 0..hint. Fragmentation beyond that is caught after the capture.
            room = target.bytes if target is not None and target not in dropped else 0
            return total - freed + max(0, hint - room) <= self.config.max_bytes

        victims = plan_evictions(self.eviction_order(), fits)
        if victims is None:
            return False  # evicting nothing: no set of victims would make room
        self.evict_all(victims, "bytes")
        return True

    def fit_after_capture(self, entry: CacheEntry) -> bool:
        """The hint may have been short: make the budget hold with `entry` (captured, not yet admitted)
        counted. False: refused, its pool released (the store closes its graph). True: admit it (over
        budget only when refusing it would not return a byte)."""
        pool, desc, max_bytes = entry.pool, entry.desc, self.config.max_bytes
        # A shared pool's growth is already in total_bytes(); a private pool is not (no entry holds it yet).
        over = self.total_bytes() + (entry.bytes if pool.kind == "private" else 0) - max_bytes
        order = self.eviction_order()
        victims = plan_evictions(order, lambda freed, dropped: freed >= over)
        if victims is not None:  # other pools emptied: the capture fits (the usual case: [], it did)
            self.evict_all(victims, "bytes")
            return True
        # The capture's own pool never empties while it lives. Refuse it together with the rest of that
        # pool when all of it is evictable (a private pool, the first graph of a shared one, or a lazy pool
        # of unpinned entries): dropping the pool is the only way its bytes come back.
        mates = [e for e in order if e.pool is pool]
        if len(mates) == pool.graphs - 1:
            self.evict_all(mates, "bytes")
            self.pools.release(pool)
            self.refuse(
                desc,
                "budget",
                f"capture of {entry.bytes} bytes ({pool.kind} pool) exceeds the {max_bytes}-byte budget",
            )
            return False
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
            self.total_bytes(),
            max_bytes,
        )
        return True

    def admitted(self, entry: CacheEntry, rank_growth: tuple[int, ...], lazy: bool) -> None:
        """The store holds `entry` now (after the evictions above: its priority starts from the current L)."""
        self.eviction.touch(entry)
        own = self.pools.size_hints.get(entry.desc, entry.bytes)  # a shared capture's growth may be 0
        self.journal.admitted(
            entry,
            Decision(
                "admit", str(entry.desc), bytes=entry.bytes, rank_bytes=rank_growth, pinned=entry.pinned
            ),
            own,
            lazy,
        )
        if lazy:
            self.admission.spend(entry.capture_seconds)
        self.update_gauges()

    def hit(self, entry: CacheEntry) -> None:
        entry.hits += 1
        self.eviction.touch(entry)
        self.journal.hit()

    def defer(self, desc: BatchDescriptor) -> None:
        """A lazy capture over the capture-time budget: served eagerly now, captured at a later miss."""
        self.journal.deferred(desc)

    def refuse(self, desc: BatchDescriptor, reason: str, detail: str) -> None:
        self.negative[desc] = (reason, detail)
        self.journal.refused(desc, reason, detail)

    # --- eviction ---
    def eviction_order(self) -> list[CacheEntry]:
        """Unpinned entries in the order the budgets evict them."""
        return self.eviction.order([e for e in self.entries.values() if not e.pinned])

    def _evict_first(self, reason: str) -> bool:
        """Evict the first unpinned entry in eviction order. False: none left."""
        order = self.eviction_order()
        self.evict_all(order[:1], reason)
        return bool(order)

    def evict_all(self, victims: list[CacheEntry], reason: str) -> None:
        """Budget evictions: each victim ages what stays (GDSF's L)."""
        for victim in victims:
            self.eviction.evicted(victim)
            self.drop(victim.desc, reason)

    def drop(self, desc: BatchDescriptor, reason: str) -> None:
        """Drop the entry of `desc` (its graph closed; its pool freeable if it was the last graph there)."""
        entry = self._close(desc)
        freed = self.pools.release(entry.pool)
        self.journal.evicted(entry, reason, freed)
        self.update_gauges()

    def cleared(self) -> None:
        """Every entry was dropped: failures may be retried, miss counts and GDSF's L start over."""
        self.negative.clear()
        self.admission.reset()
        self.pools.reset()
        self.eviction.reset()

    # --- totals ---
    def total_bytes(self) -> int:
        return self.pools.total_bytes(self.entries.values())

    def update_gauges(self) -> None:
        self.journal.gauges(self.entries.values(), self.total_bytes())
