"""CachePolicyConfig: the graph cache's knobs (budgets, admission, eviction, pools, capture warm-up),
validated once when built. `policy_config_from(settings)` is the one place Settings become one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ADMISSION_RULES", "CAPTURE_WARMUPS", "AdmissionRule", "EVICTION_POLICIES", "LAZY_POOLS", "CachePolicyConfig", "policy_config_from"]

AdmissionRule = Literal["auto", "always", "after_n", "never"]
ADMISSION_RULES: tuple[str, ...] = ("auto", "always", "after_n", "never")
EVICTION_POLICIES: tuple[str, ...] = ("lru", "gdsf")
LAZY_POOLS: tuple[str, ...] = ("shared", "private")
CAPTURE_WARMUPS: tuple[str, ...] = ("always", "per_kernel")


@dataclass(frozen=True)
class CachePolicyConfig:
    """max_entries / max_bytes: the budgets (entries held; allocator-measured pool bytes).
    admission, admission_min_misses, capture_time_share, capture_burst_seconds: which misses while
    serving may capture (graphs/admission.py). eviction_policy: "lru" | "gdsf" (graphs/eviction.py).
    pin_share: warmup pins at most this share of each budget. lazy_pool: where unpinned entries are
    captured, "shared" (one lazy pool) or "private" (one pool each; graphs/pool_ledger.py).
    capture_warmup: "always" runs the step eagerly before every capture; "per_kernel" only before the
    first capture of each kernel family (an eager run costs as much host time as the capture itself)."""

    max_entries: int
    max_bytes: int
    admission: Literal["auto", "always", "after_n", "never"] = "always"
    admission_min_misses: int = 2
    capture_time_share: float = 1.0
    capture_burst_seconds: float = 0.25
    eviction_policy: Literal["lru", "gdsf"] = "lru"
    pin_share: float = 1.0
    lazy_pool: Literal["shared", "private"] = "shared"
    capture_warmup: Literal["always", "per_kernel"] = "per_kernel"

    def __post_init__(self) -> None:
        if self.admission not in ADMISSION_RULES:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION_RULES)}, got {self.admission!r}")
        if not 0 < self.capture_time_share <= 1:
            raise ValueError(f"capture time share must be in (0, 1], got {self.capture_time_share}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be 'lru' or 'gdsf', got {self.eviction_policy!r}")
        if not 0 < self.pin_share <= 1:
            raise ValueError(f"pin_share must be in (0, 1], got {self.pin_share}")
        if self.lazy_pool not in LAZY_POOLS:
            raise ValueError(f"lazy_pool must be 'shared' or 'private', got {self.lazy_pool!r}")
        if self.capture_warmup not in CAPTURE_WARMUPS:
            raise ValueError(f"capture_warmup must be 'always' or 'per_kernel', got {self.capture_warmup!r}")


def policy_config_from(settings: Any) -> CachePolicyConfig:
    """The graph-cache knobs of a `graphcache.config.Settings` (the server's settings)."""
    s = settings
    return CachePolicyConfig(
        max_entries=s.cache_max_entries, max_bytes=s.cache_max_bytes, admission=s.admission,
        admission_min_misses=s.admission_min_misses, capture_time_share=s.capture_time_share,
        capture_burst_seconds=s.capture_burst_seconds, eviction_policy=s.eviction_policy,
        pin_share=s.cache_pin_share, lazy_pool=s.cache_lazy_pool, capture_warmup=s.capture_warmup)
