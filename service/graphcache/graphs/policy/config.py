"""CachePolicyConfig: the graph cache's knobs (budgets, admission, eviction, pools, capture warm-up),
validated once when built. `policy_config_from(graph_cache)` builds one from the server's graph-cache
settings, whose policy fields carry the same names."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from graphcache.choices import (
    ADMISSION_RULES,
    CAPTURE_WARMUPS,
    EVICTION_POLICIES,
    LAZY_POOLS,
    AdmissionRule,
    CaptureWarmup,
    EvictionPolicy,
    LazyPool,
)

__all__ = ["CachePolicyConfig", "policy_config_from"]


@dataclass(frozen=True)
class CachePolicyConfig:
    """max_entries / max_bytes: the budgets (entries held; allocator-measured pool bytes).
    admission, admission_min_misses, capture_time_share, capture_burst_seconds: which misses while
    serving may capture (policy/admission.py). eviction_policy: "lru" | "gdsf" (policy/eviction.py).
    pin_share: warmup pins at most this share of each budget. lazy_pool: where unpinned entries are
    captured, "shared" (one lazy pool) or "private" (one pool each; graphs/pool_ledger.py).
    capture_warmup: "always" runs the step eagerly before every capture; "per_kernel" only before the
    first capture of each kernel family (an eager run costs as much host time as the capture itself).
    Built directly (tests, benchmarks) as well as from Settings, so it checks its own values."""

    max_entries: int
    max_bytes: int
    admission: AdmissionRule = "always"
    admission_min_misses: int = 2
    capture_time_share: float = 1.0
    capture_burst_seconds: float = 0.25
    eviction_policy: EvictionPolicy = "lru"
    pin_share: float = 1.0
    lazy_pool: LazyPool = "shared"
    capture_warmup: CaptureWarmup = "per_kernel"

    def __post_init__(self) -> None:
        for name, allowed in (
            ("admission", ADMISSION_RULES),
            ("eviction_policy", EVICTION_POLICIES),
            ("lazy_pool", LAZY_POOLS),
            ("capture_warmup", CAPTURE_WARMUPS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not 0 < self.capture_time_share <= 1:
            raise ValueError(f"capture time share must be in (0, 1], got {self.capture_time_share}")
        if not 0 < self.pin_share <= 1:
            raise ValueError(f"pin_share must be in (0, 1], got {self.pin_share}")


def policy_config_from(graph_cache: Any) -> CachePolicyConfig:
    """The policy of a `graphcache.settings.graph_cache.GraphCacheSettings` (settings.graph_cache)."""
    return CachePolicyConfig(**{f.name: getattr(graph_cache, f.name) for f in fields(CachePolicyConfig)})
