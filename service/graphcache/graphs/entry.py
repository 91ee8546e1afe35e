"""CacheEntry: one captured graph the cache holds, keyed by its batch descriptor."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from graphcache.choices import CaptureMode
from graphcache.graphs.capture import BreakableGraph
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.pool import GraphPool

__all__ = ["CacheEntry", "capture_mode"]


@dataclass
class CacheEntry:
    desc: BatchDescriptor
    graph: BreakableGraph
    pool: GraphPool  # the pool it was captured into (shared: `bytes` is that pool's growth then)
    bytes: int
    capture_seconds: float
    pinned: bool = False
    hits: int = 0
    last_use: float = field(default_factory=time.time)
    addresses: list[int] | None = None  # debug mode: input data_ptrs at capture
    priority: float = 0.0  # GDSF's H (graphs/policy/eviction.py); unused under LRU


def capture_mode(graph: BreakableGraph) -> CaptureMode:
    """How `graph` runs: "full" (one graph, nothing eager) or "breakable" (segments around eager breaks)."""
    return "full" if graph.num_breaks == 0 else "breakable"
