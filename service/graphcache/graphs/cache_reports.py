"""What GraphCache reports: one entry (`entries()`), the counters (`stats()`), and the outcome of a
warmup or a clear. Plain data; every byte figure is the allocator's (pool_ledger.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from graphcache.choices import CaptureMode
from graphcache.metrics import EVICTION_REASONS, FAILURE_REASONS

__all__ = ["CacheStats", "ClearReport", "EntryInfo", "WarmupReport"]


@dataclass
class EntryInfo:
    descriptor: str
    bytes: int  # allocator-measured graph-pool bytes
    capture_seconds: float
    hits: int
    last_use: float  # unix time
    pinned: bool
    graphs: int
    breaks: int
    # "pinned" / "lazy": in that shared pool, `bytes` = the pool's growth during this capture (may be
    # 0; the pool is freed only with its last graph). "private": its own pool, `bytes` all of it.
    pool: Literal["pinned", "lazy", "private"] = "private"
    # "full": one graph, nothing eager (uniform decode with its attention inside); "breakable":
    # graph segments around eager breaks.
    mode: CaptureMode = "breakable"
    # eviction_policy="gdsf": H = L + (hits + 1) * capture_seconds / MiB; the unpinned entry with the
    # lowest is evicted first. None under "lru" and for pinned entries (budgets never evict them).
    priority: float | None = None


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    captures: int = 0
    capture_seconds: float = 0.0
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    pool_bytes: int = 0
    entries: int = 0
    padded_tokens: int = 0
    pinned_pool_bytes: int = 0  # part of pool_bytes: the shared pinned pool, allocator-measured
    lazy_pool_bytes: int = (
        0  # part of pool_bytes: the shared lazy pool (lazy_pool="shared"), allocator-measured
    )
    # Lazy captures (a miss while serving) stall the step that missed: how many, for how long in all,
    # the worst one; and misses served eagerly because lazy captures had used their time share.
    lazy_captures: int = 0
    stall_seconds: float = 0.0
    worst_stall_seconds: float = 0.0
    deferred: int = 0


@dataclass
class WarmupReport:
    captured: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)  # already held (now pinned when pin=True)
    failed: dict[str, str] = field(default_factory=dict)  # descriptor -> reason
    seconds: float = 0.0
    pool_bytes: int = 0
    # captured (or held) but left evictable: pinning more would pass pin_share of the entry or byte budget
    unpinned: list[str] = field(default_factory=list)

    def merge(self, other: WarmupReport) -> None:
        """Add `other` (a later part of the same warmup) to this report."""
        self.captured += other.captured
        self.cached += other.cached
        self.failed.update(other.failed)
        self.unpinned += other.unpinned
        self.seconds += other.seconds
        self.pool_bytes = other.pool_bytes


@dataclass
class ClearReport:
    entries: int
    pool_bytes: int  # what the entries held, allocator-measured at capture
    bytes_freed: int  # allocator reserved bytes before minus after
