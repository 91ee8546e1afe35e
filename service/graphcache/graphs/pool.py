"""Graph-pool memory, measured from the caching allocator (never estimated).

A pool is the allocator's private memory pool a capture allocates into; its id is the
(int, int) handle from `torch.cuda.graph_pool_handle()`. Its footprint is the sum of the
`total_size` of the allocator segments whose `segment_pool_id` equals that handle: what
the allocator reserved from the driver for it (cudaMalloc'd bytes), whether blocks in it
are in use or cached. vLLM's estimate (one graph's size times the count) overshoots 3x.

Lifetime (what makes sharing and eviction safe, see ../../docs/graph-pools.md): every
graph captured into a pool holds a use count on it; the allocator returns a pool's
segments to the driver (on `empty_cache`) only once the count is 0, i.e. after the last
graph on it was reset. While any graph lives the pool only grows; it never shrinks.
A handle whose pool fell to 0 must not be captured into again (the allocator asserts
that an existing pool still has users), so a dropped pool's handle is never reused.

On the eager backend a pool is an `EagerPool` (backend.py makes them): identity only (tests'
`measure_bytes` hooks tell pools apart by it), no memory.

`GraphPool` is the store's record of one pool (kind, handle, measured bytes, live graphs). What
follows from the lifetimes above for eviction (a graph frees its pool's bytes only if it was the
pool's last one) is the policy's rule: policy/budget.py `plan_evictions`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "POOL_KINDS",
    "EagerPool",
    "GraphPool",
    "PoolKind",
    "all_graph_pools_bytes",
    "pool_bytes",
    "pools_bytes",
    "reserved_bytes",
]


@dataclass(frozen=True)
class EagerPool:
    """Stand-in pool of the eager backend: a distinct identity, no memory."""

    id: int


PoolKind = Literal["pinned", "lazy", "private"]
POOL_KINDS: tuple[str, ...] = ("pinned", "lazy", "private")


@dataclass(eq=False)  # compared and hashed by identity: two records are two pools
class GraphPool:
    """One pool the cache captures into. kind: "pinned" / "lazy" (shared by every entry of that
    kind) or "private" (one entry's). bytes: allocator-measured after the last capture into it
    (a live pool only grows, so between captures it is exact). graphs: live captures in it
    (entries, and one being admitted); when it drops to 0 the record is dropped with the handle,
    which is never captured into again."""

    kind: PoolKind
    handle: Any
    bytes: int = 0
    graphs: int = 0
    rank_bytes: tuple[int, ...] = ()  # each tensor-parallel rank's own measurement (bytes is their max)


def _segments() -> list[dict]:
    # No arguments: the call every torch >= 2.1 accepts; segments of all devices.
    return torch.cuda.memory_snapshot()


def pools_bytes(pools: Iterable[Any]) -> dict[tuple[int, int], int]:
    """Reserved bytes per CUDA pool handle, from one allocator snapshot (pools with none: 0)."""
    wanted = {tuple(p): 0 for p in pools if p is not None and not isinstance(p, EagerPool)}
    if not wanted or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return wanted
    for seg in _segments():
        key = tuple(seg.get("segment_pool_id", (0, 0)))
        if key in wanted:
            wanted[key] += int(seg["total_size"])
    return wanted


def pool_bytes(pool: Any) -> int:
    """Bytes the allocator holds for one pool; 0 on the eager backend (None or EagerPool)."""
    if pool is None or isinstance(pool, EagerPool):
        return 0
    return pools_bytes([pool])[tuple(pool)]


def all_graph_pools_bytes() -> int:
    """Bytes in every private (graph) pool of the process, straight from the allocator.

    Independent of the cache's bookkeeping (which measures the pools it knows): operators
    and tests compare the two, and they differ only if something else captured graphs."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return sum(
        int(seg["total_size"]) for seg in _segments() if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
    )


def reserved_bytes() -> int:
    """All bytes the allocator holds on the current device (0 without CUDA)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return torch.cuda.memory_reserved()
