"""CacheJournal: what the graph cache did, kept three ways: the counters (`stats()`), the Prometheus
metrics, and the decision log (at tensor parallel equal on every rank: policy/agreement.py); plus the
traffic profile (uses per descriptor and each one's last capture), which survives eviction and clear."""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable

from graphcache.choices import CAPTURE_MODES
from graphcache.graphs.cache_reports import CacheStats
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.entry import CacheEntry, capture_mode
from graphcache.graphs.policy.agreement import Decision
from graphcache.graphs.policy.profile import build_profile
from graphcache.metrics import GraphCacheMetrics

__all__ = ["DECISION_LOG_MAX", "CacheJournal"]

log = logging.getLogger(__name__)
DECISION_LOG_MAX = 100_000  # decisions kept (captures, evictions, refusals: never one per step)


class CacheJournal:
    def __init__(self, metrics: GraphCacheMetrics | None) -> None:
        self.metrics = metrics
        self.stats = CacheStats()
        self.decisions: deque[Decision] = deque(maxlen=DECISION_LOG_MAX)
        # uses: steps that asked for a descriptor (hits + misses); captured: what its last capture
        # measured (mode, own bytes, seconds).
        self.uses: Counter[BatchDescriptor] = Counter()
        self.captured: dict[BatchDescriptor, tuple[str, int, float]] = {}

    def step(self, desc: BatchDescriptor, real_tokens: int | None) -> None:
        """A step asked for `desc` with `real_tokens` of its tokens real (None: not counted as padding)."""
        if real_tokens is not None:
            padded = desc.num_tokens - real_tokens
            if padded < 0:
                raise ValueError(f"{real_tokens} real tokens do not fit descriptor {desc}")
            self.stats.padded_tokens += padded
            if self.metrics is not None and padded:
                self.metrics.padded_tokens.inc(padded)
        self.uses[desc] += 1

    def hit(self) -> None:
        self.stats.hits += 1
        if self.metrics is not None:
            self.metrics.graph_hits.inc()

    def miss(self) -> None:
        self.stats.misses += 1
        if self.metrics is not None:
            self.metrics.graph_misses.inc()

    def decide(self, decision: Decision) -> None:
        self.decisions.append(decision)

    def admitted(self, entry: CacheEntry, decision: Decision, own_bytes: int, lazy: bool) -> None:
        """`entry` was captured and admitted; own_bytes: what it needs in a pool of its own (profile)."""
        seconds = entry.capture_seconds
        self.decisions.append(decision)
        self.captured[entry.desc] = (capture_mode(entry.graph), own_bytes, seconds)
        s = self.stats
        s.captures += 1
        s.capture_seconds += seconds
        if lazy:  # the step that missed, and every request in it, waited this long
            s.lazy_captures += 1
            s.stall_seconds += seconds
            s.worst_stall_seconds = max(s.worst_stall_seconds, seconds)
        if self.metrics is not None:
            self.metrics.graph_captures.inc()
            self.metrics.graph_capture_seconds.observe(seconds)
            if lazy:
                self.metrics.graph_capture_stall_seconds.observe(seconds)

    def evicted(self, entry: CacheEntry, reason: str, freed: bool) -> None:
        self.stats.evictions[reason] += 1
        self.decisions.append(Decision("evict", str(entry.desc), reason))
        if self.metrics is not None:
            self.metrics.graph_evictions.labels(reason).inc()
        log.info(
            "evicted graph %s (%s, %d bytes, %s pool%s)",
            entry.desc,
            reason,
            entry.bytes,
            entry.pool.kind,
            ", now freed" if freed else "",
        )

    def deferred(self, desc: BatchDescriptor) -> None:
        self.stats.deferred += 1
        self.decisions.append(Decision("defer", str(desc)))
        if self.metrics is not None:
            self.metrics.graph_captures_deferred.inc()

    def refused(self, desc: BatchDescriptor, reason: str, detail: str) -> None:
        self.decisions.append(Decision("refuse", str(desc), reason))
        self.stats.failures[reason] += 1
        if self.metrics is not None:
            self.metrics.graph_capture_failures.labels(reason).inc()
        log.warning("graph %s not cached (%s): %s; serving it eagerly until clear()", desc, reason, detail)

    def gauges(self, entries: Iterable[CacheEntry], total_bytes: int) -> None:
        """Set the entry and pool-byte gauges to what is held now."""
        if self.metrics is None:
            return
        entries = list(entries)
        self.metrics.graph_entries.set(len(entries))
        self.metrics.graph_pool_bytes.set(total_bytes)
        modes: Counter[str] = Counter(capture_mode(e.graph) for e in entries)
        for mode in CAPTURE_MODES:
            self.metrics.graph_entries_by_mode.labels(mode).set(modes[mode])

    def profile(self, min_uses: int) -> dict:
        return build_profile(dict(list(self.uses.items())), dict(list(self.captured.items())), min_uses)
