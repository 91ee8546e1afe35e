"""GraphCache: a graph store under its policy, one captured step per batch descriptor.

`run(desc)` replays the capture for `desc` when the store holds one; on a miss the policy decides
whether to capture it (then the capture served the step), else the step runs eagerly. The store
(store.py) gets, captures, replays, drops and lists entries and keeps the books of their pools, through
a capture backend chosen once (backend.py: CUDA graphs, or the eager fallback without CUDA); the policy
(policy/) decides what the store holds and calls it, never the other way round. Memory and eviction:
docs/graph-pools.md.

`run` is the per-step path: the owner check inline, the journal's step count, the dict's own `get`, and
on a hit the policy's hit count and the store's replay, each a method bound here once.

Threading: one owner thread (the engine thread) drives the cache and all GPU work: `run`, `warmup`,
`clear`, `evict` raise RuntimeError from any other thread (a capture fails if another thread issues
CUDA calls; capture and replay state is not locked). `entries`, `stats`, `info` and `profile` only
read stored numbers and may be called from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import asdict
from typing import Any, Literal

import torch

from graphcache.choices import StepMode
from graphcache.graphs.backend import make_backend
from graphcache.graphs.cache_reports import CacheStats, ClearReport, EntryInfo, WarmupReport
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.entry import capture_mode
from graphcache.graphs.policy.agreed_policy import AgreedPolicy
from graphcache.graphs.policy.agreement import Agreement, Decision
from graphcache.graphs.policy.config import CachePolicyConfig
from graphcache.graphs.policy.journal import CacheJournal
from graphcache.graphs.policy.policy import CachePolicy, warmup_order
from graphcache.graphs.store import GraphStore
from graphcache.metrics import GraphCacheMetrics

__all__ = ["CacheStats", "ClearReport", "EntryInfo", "GraphCache", "WarmupReport", "warmup_order"]

Mode = StepMode
_get_ident = threading.get_ident


class GraphCache:
    def __init__(
        self,
        step_fn: Callable[[BatchDescriptor], None],
        *,
        backend: Literal["cuda", "eager"],
        config: CachePolicyConfig,
        debug: bool = False,
        metrics: GraphCacheMetrics | None = None,
        input_tensors: Callable[[BatchDescriptor], list[torch.Tensor]] | None = None,
        measure_bytes: Callable[[BatchDescriptor, Any], int] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        agreement: Agreement | None = None,
        warm_key: Callable[[BatchDescriptor], Hashable] | None = None,
    ) -> None:
        """step_fn(desc): one step over the static buffers (what is captured). config: the policy's knobs.
        agreement: how per-rank capture outcomes are agreed with other tensor-parallel ranks
        (policy/agreement.py); None = this process alone. warm_key(desc): the step's kernel family, what
        must compile or set up once (config.capture_warmup="per_kernel"; None = one family). A capture
        without a warm-up run that fails is retried with one before it counts as failed. debug +
        input_tensors: check at replay that the inputs did not move since capture. measure_bytes(desc, pool
        handle): a capture's pool bytes (default: the allocator's). clock: times captures (injectable so
        CPU tests and benchmarks can give captures a modelled cost)."""
        self.backend, self.config = backend, config
        size = 1 if agreement is None else agreement.size
        self.store = GraphStore(
            step_fn,
            make_backend(backend),
            clock=clock,
            measure_bytes=measure_bytes,
            warm_key=warm_key,
            warm_always=config.capture_warmup == "always",
            retry_cold=size == 1,  # a retry on one rank would run the step's collectives alone (a hang)
            input_tensors=input_tensors if debug else None,
        )
        self.journal = CacheJournal(metrics)
        self.policy: CachePolicy = (
            CachePolicy(config, self.store, self.journal, clock)
            if agreement is None
            else AgreedPolicy(config, self.store, self.journal, clock, agreement)
        )
        self.warmed_up = False
        self._owner: int | None = None
        # The per-step path's calls, bound once (store and policy are never replaced).
        self._step, self._get, self._hit = self.journal.step, self.store.get, self.policy.hit
        self._replay = self.store.replay
        if metrics is not None:
            metrics.graph_backend.labels(backend).set(1)
            metrics.graph_max_entries.set(config.max_entries)
            metrics.graph_pool_budget_bytes.set(config.max_bytes)
            self.policy.budget.update_gauges()

    @property
    def failpoint(self) -> Callable[[BatchDescriptor], None] | None:
        """Test hook: called before each capture; an exception fails that capture (a pre-check)."""
        return self.policy.failpoint

    @failpoint.setter
    def failpoint(self, hook: Callable[[BatchDescriptor], None] | None) -> None:
        self.policy.failpoint = hook

    # --- serving ---
    def run(self, desc: BatchDescriptor, real_tokens: int | None = None) -> Mode:
        """Run one step for `desc` over the static buffers: replay, capture then replay, or eager."""
        if self._owner != _get_ident():
            self._claim()
        self._step(desc, real_tokens)
        entry = self._get(desc)
        if entry is not None:
            self._hit(entry)
            self._replay(entry)
            return "replay"
        self.journal.miss()
        if self.policy.miss(desc):
            return "replay"  # the capture ran the step (the store's add)
        self.store.step_fn(desc)
        return "eager"

    # --- admin ---
    def warmup(
        self,
        descs: list[BatchDescriptor],
        *,
        pin: bool = True,
        progress: Callable[[int, int, str], None] | None = None,
    ) -> WarmupReport:
        """Capture `descs` largest first (the largest sets the pool high-water mark), pinned within
        the policy's pin share."""
        self._check_owner()
        report = self.policy.warmup(descs, pin=pin, progress=progress)
        self.warmed_up = True
        return report

    def evict(self, desc: BatchDescriptor) -> bool:
        """Drop one entry (pinned or not) and return its memory. False if it was not cached.

        A private entry's pool is returned at once. An entry in a shared pool (pinned or lazy)
        leaves its blocks there (reused by later captures of that kind); the pool returns to the
        driver when its last entry is evicted, or on clear()."""
        self._check_owner()
        return self.policy.evict(desc)

    def clear(self) -> ClearReport:
        """Drop every entry (the shared pools too) and the negative cache; return the memory to the driver."""
        self._check_owner()
        return self.policy.clear()

    # --- inspection (any thread) ---
    def entries(self) -> list[EntryInfo]:
        """Entries least recently used first (LRU's eviction order; under GDSF the budgets evict
        the unpinned entry with the lowest `priority` first, ties least recently used)."""
        eviction = self.policy.eviction
        return [
            EntryInfo(
                str(e.desc),
                e.bytes,
                e.capture_seconds,
                e.hits,
                e.last_use,
                e.pinned,
                e.graph.num_graphs,
                e.graph.num_breaks,
                e.pool.kind,
                capture_mode(e.graph),
                eviction.priority(e),
            )
            for e in self.store.entries()
        ]

    def profile(self, min_uses: int = 1) -> dict:
        """The hot set as JSON-able data: every descriptor steps asked for at least `min_uses` times
        (cached or evicted; min_uses=0 adds those only captured, e.g. by warmup), most used first.

        Per descriptor: capture mode ("full" | "breakable", null if never captured), uses (steps that
        asked for it, hits + misses, since start: clear() keeps them), bytes (its last capture's own
        size, allocator-measured; 0 on the CPU) and capture_ms (its last capture). `parse_profile`
        reads it back; GRAPHCACHE_WARMUP_PROFILE and POST /admin/warmup {"profile": ...} warm it."""
        return self.journal.profile(min_uses)

    def stats(self) -> CacheStats:
        s, store = self.journal.stats, self.store
        return CacheStats(
            s.hits,
            s.misses,
            s.captures,
            s.capture_seconds,
            dict(s.evictions),
            dict(s.failures),
            store.total_bytes(),
            len(store),
            s.padded_tokens,
            store.pools.kind_bytes("pinned"),
            lazy_pool_bytes=store.pools.kind_bytes("lazy"),
            lazy_captures=s.lazy_captures,
            stall_seconds=s.stall_seconds,
            worst_stall_seconds=s.worst_stall_seconds,
            deferred=s.deferred,
        )

    def info(self) -> dict:
        """Everything above as JSON-able data (admin endpoint)."""
        policy, store, cfg, s = self.policy, self.store, self.config, self.journal.stats
        return {
            "backend": self.backend,
            "admission": {**policy.admission.info(), "deferred": s.deferred},
            "stalls": {
                "lazy_captures": s.lazy_captures,
                "seconds": s.stall_seconds,
                "worst_seconds": s.worst_stall_seconds,
            },
            # gdsf_inflation: GDSF's L (the H of the last entry a budget evicted); 0 under lru
            "eviction": {"policy": cfg.eviction_policy, "gdsf_inflation": policy.eviction.inflation},
            "warmed_up": self.warmed_up,
            "budgets": {"max_entries": cfg.max_entries, "max_bytes": cfg.max_bytes},
            "totals": {
                "entries": len(store),
                "pool_bytes": store.total_bytes(),
                "pinned_pool_bytes": store.pools.kind_bytes("pinned"),
                "lazy_pool_bytes": store.pools.kind_bytes("lazy"),
            },
            "lazy_pool": cfg.lazy_pool,
            "entries": [asdict(e) for e in self.entries()],
            # the allocator's own figure for all graph pools, to check the gauge against
            "allocator_pool_bytes": store.allocator_pool_bytes(),
            "negative": [
                {"descriptor": str(d), "reason": r, "detail": t}
                for d, (r, t) in list(policy.negative.items())
            ],
            "stats": asdict(self.stats()),
        }

    def rank_pool_bytes(self) -> list[int]:
        """Each tensor-parallel rank's own measurement of the pools held, in rank order (the budgets and
        stats use their max). Exact with shared pools, where summing the admits held is not: a shared
        pool keeps an evicted entry's growth until its last graph goes. At size 1: [stats().pool_bytes]."""
        return self.store.rank_bytes(self.policy.size)

    def decision_log(self) -> list[Decision]:
        """The cache's decisions in order (at tp > 1 equal on every rank; policy/agreement.py)."""
        return list(self.journal.decisions)

    def __contains__(self, desc: BatchDescriptor) -> bool:
        return desc in self.store

    def __len__(self) -> int:
        return len(self.store)

    # --- the owner thread ---
    def _check_owner(self) -> None:
        if self._owner != _get_ident():
            self._claim()

    def _claim(self) -> None:
        """The first thread to drive the cache owns it; any other raises."""
        me = _get_ident()
        if self._owner is None:
            self._owner = me
            return
        raise RuntimeError(
            f"GraphCache is driven from thread {threading.current_thread().name!r} but is owned by thread id "
            f"{self._owner}: all capture, replay and GPU work must come from one thread (a capture fails if "
            "another thread issues CUDA calls). Fix: send the request to the engine thread's queue."
        )
