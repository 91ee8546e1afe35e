"""GraphCache: one breakable capture per batch descriptor, under an entry and a byte budget.

`run(desc)` replays the capture for `desc` when there is one; on a miss it admits and
captures (then replays), or serves the step eagerly. Every decision is counted.

Memory (see docs/graph-pools.md): graphs never run at the same time and each one's intermediates
are dead between its replays, so graphs sharing a pool cost about the largest capture, not the sum.
- Pinned entries (warmup, `pin=True`) are captured into ONE shared "pinned pool". The budgets never
  evict them; the pool goes back to the driver with its last graph (clear(), or manual eviction of
  every pinned entry).
- Lazily admitted entries (`run`, `warmup(pin=False)`, warmup past pin_share) are captured into ONE
  shared "lazy pool" (`lazy_pool="shared"`, the default), or into one private pool each
  (`lazy_pool="private"`: evicting one returns exactly its bytes; what the eviction-policy benchmark
  compares). An entry pinned after lazy admission stays in the pool it was captured into.
A shared pool's record (graphs/pool.py GraphPool) is created with its first capture and dropped with
its last graph; its handle is never captured into again (pool.py). Bytes are the allocator's, never
an estimate: total = pinned pool + lazy pool + sum of private pools. A shared entry's `bytes` is the
growth of its pool during its capture (0 when the pool already had room); `pool` in `entries()` says
which kind. Size hints are each descriptor's own-pool size, measured when it was captured into an
empty pool. Budgets are enforced before a capture (room is made first, from the size hint), so
memory never exceeds the budget by a whole graph.

Byte budget and shared pools (_make_room, _fit_after_capture): evicting an entry frees bytes only
when it is its pool's last graph (graphs/pool.py plan_evictions), so a budget eviction takes the
shortest run of victims in policy order that fits, and of those evicts only the ones whose pool it
empties: an entry of a pool that stays would free nothing. A capture into a live shared pool needs
only what exceeds the pool (max(0, hint - pool bytes)); when the budget still does not hold, the
victims may include every entry of the lazy pool, dropping it, after which the capture needs its
whole hint in a fresh one. Evicting nothing and refusing is chosen when no set of victims fits.
After a capture whose real size exceeded its hint, other pools are emptied if that fits; else the
capture is refused together with the rest of its pool when all of it is evictable (for the lazy pool:
dropping it is the only way its bytes come back), or kept over budget with a warning when refusing
would return nothing (its pool holds pinned graphs). Every loop is bounded by the entries held.

Eviction (budgets only ever evict unpinned entries), by `eviction_policy`:
- "lru" (default): the least recently used entry.
- "gdsf" (GreedyDual-Size-Frequency): the entry with the lowest priority
  H = L + frequency * cost / size, where cost = the entry's measured capture seconds (what a
  re-capture would cost; floored at MIN_COST_SECONDS), size = its bytes in MiB (floored at
  MIN_SIZE_BYTES = 1 MiB, so small or zero-byte entries, e.g. on the CPU, are not favoured without
  bound and nothing divides by zero), frequency = hits + 1 since admission. L, the inflation value,
  starts at 0 and is raised to the H of each entry a budget evicts (not by evict(); clear() resets
  it); new and hit entries start from the current L, so an entry popular long ago ages out once L
  passes its H. Ties: least recently used. H is recomputed on every hit. docs/graph-pools.md
  compares the two on a modelled trace (benchmarks/eviction_policy.py).

Threading: one owner thread (the engine thread) drives the cache and all GPU work: `run`,
`warmup`, `clear`, `evict` raise RuntimeError from any other thread. A capture in progress
fails if another thread issues unsafe CUDA calls, and capture/replay state is not locked.
`entries`, `stats`, `info` and `profile` only read stored numbers and may be called from any thread.

Profile (issue 11, "warmup learned from traffic"): every step counts one use of its descriptor
(hit or miss), and the counts survive eviction and clear(). `profile()` exports the hot set
(descriptor, capture mode, uses, bytes, capture ms) as JSON; `parse_profile()` reads it back, and
GRAPHCACHE_WARMUP_PROFILE / POST /admin/warmup {"profile": ...} warm exactly that set.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from graphcache.graphs.admission import Admission
from graphcache.graphs.agreement import Agreement, CaptureReport, Decision, Verdict, fingerprint
from graphcache.graphs.cache_reports import CacheStats, ClearReport, EntryInfo, WarmupReport
from graphcache.graphs.capture import BreakableGraph, capture
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.pool import (
    GraphPool,
    PoolKind,
    all_graph_pools_bytes,
    emptied_by,
    new_pool,
    plan_evictions,
    pool_bytes,
    reserved_bytes,
)
from graphcache.graphs.profile import build_profile
from graphcache.metrics import CAPTURE_MODES, Metrics

__all__ = ["EVICTION_POLICIES", "LAZY_POOLS", "CacheStats", "ClearReport", "EntryInfo", "GraphCache", "WarmupReport"]

log = logging.getLogger(__name__)
Mode = Literal["replay", "eager"]
EvictionPolicy = Literal["lru", "gdsf"]
EVICTION_POLICIES: tuple[str, ...] = ("lru", "gdsf")
LazyPool = Literal["shared", "private"]
LAZY_POOLS: tuple[str, ...] = ("shared", "private")
# GDSF floors: a capture never costs less than this (the eager backend's captures take
# microseconds), and an entry never weighs less than 1 MiB (shared-pool growths and CPU entries may
# be 0 bytes; real private pools are >= ~2 MiB, so the floor only matters off the GPU and for growths).
MIN_COST_SECONDS = 1e-6
MIN_SIZE_BYTES = 1 << 20
DECISION_LOG_MAX = 100_000   # decisions kept (captures, evictions, refusals: never one per step)


@dataclass
class _Entry:
    desc: BatchDescriptor
    graph: BreakableGraph
    pool: GraphPool  # the pool it was captured into (shared: `bytes` is that pool's growth then)
    bytes: int
    capture_seconds: float
    pinned: bool = False
    hits: int = 0
    last_use: float = field(default_factory=time.time)
    addresses: list[int] | None = None  # debug mode: input data_ptrs at capture
    priority: float = 0.0  # GDSF's H (see the module docstring); unused under LRU


def warmup_order(descs: list[BatchDescriptor]) -> list[BatchDescriptor]:
    """Distinct descriptors, largest first: the largest capture sets the pinned pool's high-water mark."""
    return sorted(set(descs), key=lambda d: (d.num_tokens, d.num_reqs, d.uniform_decode), reverse=True)


def _failure(e: Exception) -> CaptureReport:
    reason = "oom" if isinstance(e, torch.OutOfMemoryError) else "error"
    return CaptureReport(False, reason, f"{type(e).__name__}: {e}")


def _capture_mode(graph: BreakableGraph) -> Literal["full", "breakable"]:
    return "full" if graph.num_breaks == 0 else "breakable"


class GraphCache:
    def __init__(self, step_fn: Callable[[BatchDescriptor], None], *, backend: Literal["cuda", "eager"],
                 max_entries: int, max_bytes: int, admission: str = "always", admission_min_misses: int = 2,
                 capture_time_share: float = 1.0, capture_burst_seconds: float = 0.25,
                 debug: bool = False, metrics: Metrics | None = None,
                 input_tensors: Callable[[BatchDescriptor], list[torch.Tensor]] | None = None,
                 measure_bytes: Callable[[BatchDescriptor, Any], int] | None = None,
                 eviction_policy: EvictionPolicy = "lru", pin_share: float = 1.0,
                 clock: Callable[[], float] = time.perf_counter, agreement: Agreement | None = None,
                 capture_warmup: str = "per_kernel", warm_key: Callable[[BatchDescriptor], Hashable] | None = None,
                 lazy_pool: LazyPool = "shared") -> None:
        """agreement: how capture outcomes are agreed with other tensor-parallel ranks (graphs/agreement.py);
        None = this process alone, no collective. capture_warmup: "always" runs the step eagerly before
        every capture; "per_kernel" only before the first capture of each `warm_key(desc)` (the step's
        kernel family: what must compile or set up once; None = one family), since an eager run costs as
        much host time as the capture itself (BENCHMARKS.md §8). A capture without one that fails is
        retried with one before it counts as failed. lazy_pool: where unpinned entries are captured, "shared"
        (one lazy pool) or "private" (one pool each); see the module docstring."""
        if lazy_pool not in LAZY_POOLS:
            raise ValueError(f"lazy_pool must be 'shared' or 'private', got {lazy_pool!r}")
        self.lazy_pool = lazy_pool
        if capture_warmup not in ("always", "per_kernel"):
            raise ValueError(f"capture_warmup must be 'always' or 'per_kernel', got {capture_warmup!r}")
        self.capture_warmup, self.warm_key = capture_warmup, warm_key
        self._warmed: set[Hashable] = set()   # kernel families that ran eagerly on the capture stream
        if backend not in ("cuda", "eager"):
            raise ValueError(f"backend must be 'cuda' or 'eager', got {backend!r}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be 'lru' or 'gdsf', got {eviction_policy!r}")
        self.eviction_policy = eviction_policy
        # Times captures (capture_seconds, GDSF's cost). Injectable so CPU tests and the eviction
        # benchmark can give captures a deterministic, modelled cost.
        self.clock = clock
        self._inflation = 0.0  # GDSF's L: the H of the last entry a budget evicted (grows until clear())
        self.step_fn, self.backend = step_fn, backend
        self.max_entries, self.max_bytes = max_entries, max_bytes
        # Which misses while serving may capture (graphs/admission.py); warmup and admin always may.
        self._admission = Admission(admission, admission_min_misses, time_share=capture_time_share,
                                    burst_seconds=capture_burst_seconds, clock=clock)
        self.debug, self.metrics, self.input_tensors = debug, metrics, input_tensors
        if not 0 < pin_share <= 1:
            raise ValueError(f"pin_share must be in (0, 1], got {pin_share}")
        self.pin_share = pin_share   # warmup pins at most this share of max_entries and of max_bytes
        # Overridable so CPU tests can give entries a size; default: the pool's allocator bytes.
        self.measure_bytes = measure_bytes or (lambda desc, pool: pool_bytes(pool))
        self.failpoint: Callable[[BatchDescriptor], None] | None = None  # tests inject capture failures
        self.agreement = agreement or Agreement()
        self._decisions: deque[Decision] = deque(maxlen=DECISION_LOG_MAX)
        self.warmed_up = False
        self._entries: OrderedDict[BatchDescriptor, _Entry] = OrderedDict()  # LRU first
        self._negative: dict[BatchDescriptor, tuple[str, str]] = {}  # desc -> (reason, detail)
        self._size_hints: dict[BatchDescriptor, int] = {}  # measured bytes of past captures (own pool)
        # The profile: uses (steps that asked for a descriptor, hits + misses) and what its last capture
        # measured (mode, bytes, seconds). Both survive eviction and clear(): they describe the traffic.
        self._uses: Counter[BatchDescriptor] = Counter()
        self._captured: dict[BatchDescriptor, tuple[str, int, float]] = {}
        # The shared pools by kind ("pinned", and "lazy" when lazy_pool="shared"): each created on
        # its first capture, dropped with its last graph (never reused after: see pool.py).
        self._shared: dict[str, GraphPool | None] = {"pinned": None, "lazy": None}
        self._stats = CacheStats()
        self._owner: int | None = None
        if metrics is not None:
            metrics.graph_backend.labels(backend).set(1)
            metrics.graph_max_entries.set(max_entries)
            metrics.graph_pool_budget_bytes.set(max_bytes)
            self._update_gauges()

    # --- serving ---
    def run(self, desc: BatchDescriptor, real_tokens: int | None = None) -> Mode:
        """Run one step for `desc` over the static buffers: replay, capture then replay, or eager."""
        self._check_owner()
        if real_tokens is not None:
            padded = desc.num_tokens - real_tokens
            if padded < 0:
                raise ValueError(f"{real_tokens} real tokens do not fit descriptor {desc}")
            self._stats.padded_tokens += padded
            if self.metrics is not None and padded:
                self.metrics.padded_tokens.inc(padded)
        self._uses[desc] += 1
        entry = self._entries.get(desc)
        if entry is not None:
            entry.hits += 1
            if self.eviction_policy == "gdsf":
                entry.priority = self._gdsf_priority(entry)  # O(1); the eviction scan is O(entries)
            self._stats.hits += 1
            if self.metrics is not None:
                self.metrics.graph_hits.inc()
            self._entries.move_to_end(desc)
            self._replay(entry)
            return "replay"
        self._stats.misses += 1
        if self.metrics is not None:
            self.metrics.graph_misses.inc()
        if self._admit(desc) and self._capture_entry(desc, pinned=False, lazy=True) is not None:
            return "replay"  # the capture ran the step (see _capture_entry)
        self.step_fn(desc)
        return "eager"

    def _admit(self, desc: BatchDescriptor) -> bool:
        return desc not in self._negative and self._admission.wants(desc)

    def _replay(self, entry: _Entry) -> None:
        if entry.addresses is not None and self.input_tensors is not None:
            now = [t.data_ptr() for t in self.input_tensors(entry.desc)]
            if now != entry.addresses:
                raise RuntimeError(
                    f"graph debug: input addresses of {entry.desc} moved since capture ({entry.addresses} -> "
                    f"{now}); the graph would read stale memory. Fix: allocate static buffers once and write "
                    "into them in place (copy_), never rebind them.")
        entry.last_use = time.time()
        entry.graph.replay()

    # --- capture under budgets ---
    def _capture_entry(self, desc: BatchDescriptor, *, pinned: bool, lazy: bool = False) -> _Entry | None:
        """Make room, capture, measure, admit or refuse. None: serve eagerly (reason counted).

        Pinned captures go into the shared pinned pool; the others into the shared lazy pool, or into a
        fresh private pool under lazy_pool="private".
        lazy: a miss while serving; subject to the capture-time budget (graphs/admission.py).
        """
        kind = self._kind(pinned)
        # Two agreed phases (graphs/agreement.py; at tp size 1 each is just this rank's outcome): first
        # every rank's pre-checks, so a rank that cannot capture stops the others before any of them runs
        # the step (whose collectives would wait for it); then the capture's outcome and measured bytes.
        verdict = self._agree(self._precheck(desc, lazy=lazy))
        if verdict.reason == "deferred":
            self._defer(desc)
            return None
        if verdict.ok and not self._make_room(desc, kind):
            self._refuse(desc, "budget", f"no room: {len(self._entries)} entries / {self._total_bytes()} bytes "
                         "held, and evicting unpinned entries would not make enough (pinned entries are never "
                         "evicted by the budgets; a shared pool is freed only with its last graph)")
            return None
        pool = self._shared.get(kind)
        if pool is None:
            pool = GraphPool(kind, new_pool(self.backend))
            if kind != "private":
                self._shared[kind] = pool
        fresh, before, rank_before = pool.graphs == 0, pool.bytes, pool.rank_bytes
        graph: BreakableGraph | None = None
        if verdict.ok:
            try:
                graph, seconds = self._capture(desc, pool)
                report = CaptureReport(True, bytes=int(self.measure_bytes(desc, pool.handle)), seconds=seconds)
            except Exception as e:
                report = _failure(e)
            verdict = self._agree(report)
        if not verdict.ok:
            if graph is not None:
                graph.close()   # this rank captured it, another did not: abandoned everywhere
            self._refuse(desc, verdict.reason, verdict.detail)
            self._settle_pool(pool, desc)
            if self.backend == "cuda":
                torch.cuda.empty_cache()  # give back what the failed capture's pool reserved
            return None
        assert graph is not None
        measured, seconds = verdict.bytes, verdict.seconds   # max over ranks
        # The pool's memory is reserved and stays until its last graph goes: count it now, whatever
        # happens to this entry. Its growth, not the pool, is this entry's size (a private pool's
        # growth is all of it).
        pool.graphs += 1
        pool.bytes, pool.rank_bytes = measured, verdict.rank_bytes
        size = max(0, measured - before)
        # Each rank's own growth, for the per-rank gauge at tensor parallel (engine/worker/tp_runner.py sums the
        # admits it holds): a shared pool's whole size per admit would count it once per entry.
        ranks = len(verdict.rank_bytes)
        rank_before = rank_before if len(rank_before) == ranks else (0,) * ranks   # a fresh pool: nothing before
        rank_growth = tuple(max(0, now - was) for now, was in zip(verdict.rank_bytes, rank_before, strict=True))
        if fresh:
            self._size_hints[desc] = measured  # a capture into an empty pool: its own size
        entry = _Entry(desc, graph, pool, size, seconds, pinned=pinned)
        if self.debug and self.input_tensors is not None:
            entry.addresses = [t.data_ptr() for t in self.input_tensors(desc)]
        if not self._fit_after_capture(entry):
            return None
        entry.priority = self._gdsf_priority(entry)  # after the evictions above: from the current L
        self._entries[desc] = entry
        self._decisions.append(Decision("admit", str(desc), bytes=size, rank_bytes=rank_growth,
                                        pinned=pinned))
        # Profile bytes: what the capture needs on its own (a shared capture's growth may be 0 when the
        # pool already had room; its own-pool size is the size hint when measured).
        self._captured[desc] = (_capture_mode(graph), self._size_hints.get(desc, size), seconds)
        self._stats.captures += 1
        self._stats.capture_seconds += seconds
        if lazy:   # the step that missed, and every request in it, waited this long
            self._admission.spend(seconds)
            self._stats.lazy_captures += 1
            self._stats.stall_seconds += seconds
            self._stats.worst_stall_seconds = max(self._stats.worst_stall_seconds, seconds)
        if self.metrics is not None:
            self.metrics.graph_captures.inc()
            self.metrics.graph_capture_seconds.observe(seconds)
            if lazy:
                self.metrics.graph_capture_stall_seconds.observe(seconds)
        self._update_gauges()
        log.debug("captured %s: %d graphs, %d breaks, %d bytes (%s pool), %.1f ms", desc, graph.num_graphs,
                  graph.num_breaks, size, kind, seconds * 1e3)
        if self.backend == "cuda":
            # Capture runs the eager ops over not-yet-computed inputs (the graphs did not run),
            # so they wrote garbage (e.g. KV slots of this step); one replay makes it right.
            # (The eager backend's capture already ran the step for real.)
            graph.replay()
        return entry

    def _fit_after_capture(self, entry: _Entry) -> bool:
        """The hint may have been short: make the budget hold with `entry` (captured, not yet admitted)
        counted. False: refused, and its graph dropped. True: admit it (over budget only when refusing
        it would not return a byte)."""
        pool, desc = entry.pool, entry.desc
        # A shared pool's growth is already in _total_bytes(); a private pool is not (no entry holds it yet).
        over = self._total_bytes() + (entry.bytes if pool.kind == "private" else 0) - self.max_bytes
        order = self._eviction_order()
        victims = plan_evictions(order, lambda freed, dropped: freed >= over)
        if victims is not None:   # other pools emptied: the capture fits (the usual case: [], it did)
            self._evict_all(victims, "bytes")
            return True
        # The capture's own pool never empties while it lives. Refuse it together with the rest of that
        # pool when all of it is evictable (a private pool, the first graph of a shared one, or a lazy pool
        # of unpinned entries): dropping the pool is the only way its bytes come back.
        mates = [e for e in order if e.pool is pool]
        if len(mates) == pool.graphs - 1:
            self._evict_all(mates, "bytes")
            entry.graph.close()
            self._release(pool)
            self._refuse(desc, "budget", f"capture of {entry.bytes} bytes ({pool.kind} pool) exceeds the "
                         f"{self.max_bytes}-byte budget")
            self._free_memory()
            return False
        # The pool holds pinned graphs: refusing would not return a byte, so keep the graph and free what
        # can be freed; the over-budget bytes are counted, and lazy captures wait for room.
        self._evict_all(emptied_by(order), "bytes")
        log.warning("%s capture %s grew its pool by %d bytes to %d bytes held in all, over the %d-byte "
                    "budget; kept (that pool holds pinned graphs: its memory returns only with them, e.g. on "
                    "clear())", pool.kind, desc, entry.bytes, self._total_bytes(), self.max_bytes)
        return True

    def _settle_pool(self, pool: GraphPool, desc: BatchDescriptor) -> None:
        """After a failed capture: drop the pool if no graph uses it, else re-measure it (what the failed
        capture reserved there stays until the pool goes)."""
        if pool.graphs == 0:
            self._forget(pool)  # its partial graphs were reset: never capture into it again
        else:
            local = int(self.measure_bytes(desc, pool.handle))
            measured = self._agree(CaptureReport(True, bytes=local))
            pool.bytes, pool.rank_bytes = measured.bytes, measured.rank_bytes   # max over ranks; each rank's
            self._update_gauges()

    def _release(self, pool: GraphPool) -> bool:
        """One graph of `pool` was dropped. True when it was the last: the pool is freeable now (its
        bytes return on the next empty_cache) and its handle must not be captured into again."""
        pool.graphs -= 1
        if pool.graphs > 0:
            return False
        self._forget(pool)
        return True

    def _forget(self, pool: GraphPool) -> None:
        if self._shared.get(pool.kind) is pool:
            self._shared[pool.kind] = None

    def _kind(self, pinned: bool) -> PoolKind:
        if pinned:
            return "pinned"
        return "lazy" if self.lazy_pool == "shared" else "private"

    def _capture(self, desc: BatchDescriptor, pool: GraphPool) -> tuple[BreakableGraph, float]:
        """Capture `desc` into `pool`; returns the graph and its seconds (a retry may have given the
        pool a fresh handle)."""
        key = self.warm_key(desc) if self.warm_key is not None else None
        warm = self.capture_warmup == "always" or key not in self._warmed
        t0 = self.clock()
        try:
            graph = capture(lambda: self.step_fn(desc), backend=self.backend, pool=pool.handle, warmup=warm)
        except Exception as e:
            # Not at tensor parallel > 1: a retry on one rank would run the step's collectives alone
            # (a hang); there the failure is agreed and remembered like any other.
            if warm or self.agreement.size > 1:
                raise
            # Something in this step still needed its first eager call (a kernel's lazy setup):
            # capture.py has dropped the partial graphs; one more try, warmed up.
            log.info("capture of %s without a warm-up run failed (%s: %s); retrying after one", desc,
                     type(e).__name__, e)
            if pool.graphs == 0:
                # The failed capture's reset may have released a pool no graph holds: never capture
                # into a released handle again (pool.py). A shared pool with live graphs stays valid.
                pool.handle = new_pool(self.backend)
            graph = capture(lambda: self.step_fn(desc), backend=self.backend, pool=pool.handle, warmup=True)
        self._warmed.add(key)
        return graph, self.clock() - t0

    def _make_room(self, desc: BatchDescriptor, kind: PoolKind) -> bool:
        """Evict for the entry budget, then for the byte budget (see the module docstring). False: no room."""
        if self.max_entries <= 0:
            return False
        while len(self._entries) >= self.max_entries:
            if not self._evict_one("entries"):
                return False
        hint, total, target = self._size_hint(desc), self._total_bytes(), self._shared.get(kind)

        def fits(freed: int, dropped: set[GraphPool]) -> bool:
            # A capture into a live shared pool reuses all of it (between replays every block there is
            # free scratch; the cuBLAS workspace lives outside every pool: capture.py), so its growth is
            # about what exceeds the pool: 0..hint. Fragmentation beyond that is caught after the capture.
            room = target.bytes if target is not None and target not in dropped else 0
            return total - freed + max(0, hint - room) <= self.max_bytes

        victims = plan_evictions(self._eviction_order(), fits)
        if victims is None:
            return False   # evicting nothing: no set of victims would make room
        self._evict_all(victims, "bytes")
        return True

    def _size_hint(self, desc: BatchDescriptor) -> int:
        """Expected bytes of a capture of `desc`: its own past size, else the largest past
        capture of a batch no bigger (graph memory grows with batch size), else the smallest."""
        if desc in self._size_hints:
            return self._size_hints[desc]
        smaller = [b for d, b in self._size_hints.items() if d.num_tokens <= desc.num_tokens]
        if smaller:
            return max(smaller)
        return min(self._size_hints.values(), default=0)

    def _eviction_order(self) -> list[_Entry]:
        """Unpinned entries in the order the budgets evict them, by the eviction policy."""
        unpinned = [e for e in self._entries.values() if not e.pinned]
        if self.eviction_policy == "gdsf":
            # Lowest H first. A sort per eviction decision: entries number a few hundred at most (one per
            # capture size / descriptor) and a decision precedes a capture of ~20-200 ms, so O(n log n)
            # needs no heap kept in step with hits. The sort is stable and the dict is in LRU order: ties
            # go to the least recently used.
            unpinned.sort(key=lambda e: e.priority)
        return unpinned

    def _evict_one(self, reason: str) -> bool:
        """Evict the first unpinned entry in eviction order (freeing bytes only if it was its pool's
        last graph). False: none left."""
        order = self._eviction_order()
        self._evict_all(order[:1], reason)
        return bool(order)

    def _evict_all(self, victims: list[_Entry], reason: str) -> None:
        for victim in victims:
            if self.eviction_policy == "gdsf":
                self._inflation = max(self._inflation, victim.priority)  # age everything that stays
            self._drop(victim.desc, reason)

    def _gdsf_priority(self, entry: _Entry) -> float:
        """GDSF's H = L + frequency * cost / size (seconds of capture per MiB held, per use)."""
        cost = max(entry.capture_seconds, MIN_COST_SECONDS)
        size_mib = max(entry.bytes, MIN_SIZE_BYTES) / (1 << 20)
        return self._inflation + (entry.hits + 1) * cost / size_mib

    def _drop(self, desc: BatchDescriptor, reason: str) -> None:
        entry = self._entries.pop(desc)
        entry.graph.close()  # frees the graphs; the pool goes back on the next empty_cache, if it was its last
        freed = self._release(entry.pool)
        self._stats.evictions[reason] += 1
        self._decisions.append(Decision("evict", str(desc), reason))
        if self.metrics is not None:
            self.metrics.graph_evictions.labels(reason).inc()
        self._update_gauges()
        log.info("evicted graph %s (%s, %d bytes, %s pool%s)", desc, reason, entry.bytes, entry.pool.kind,
                 ", now freed" if freed else "")

    def _defer(self, desc: BatchDescriptor) -> None:
        """A lazy capture over the capture-time budget: served eagerly now, captured at a later miss."""
        self._stats.deferred += 1
        self._decisions.append(Decision("defer", str(desc)))
        if self.metrics is not None:
            self.metrics.graph_captures_deferred.inc()

    def _refuse(self, desc: BatchDescriptor, reason: str, detail: str) -> None:
        self._negative[desc] = (reason, detail)
        self._decisions.append(Decision("refuse", str(desc), reason))
        self._stats.failures[reason] += 1
        if self.metrics is not None:
            self.metrics.graph_capture_failures.labels(reason).inc()
        log.warning("graph %s not cached (%s): %s; serving it eagerly until clear()", desc, reason, detail)

    # --- admin ---
    def warmup(self, descs: list[BatchDescriptor], *, pin: bool = True,
               progress: Callable[[int, int, str], None] | None = None) -> WarmupReport:
        """Capture `descs` largest first (the largest sets the pool high-water mark), pinned."""
        self._check_owner()
        report, t0 = WarmupReport(), time.perf_counter()
        todo = warmup_order(descs)
        self._decisions.append(Decision("warmup", ",".join(map(str, todo)), pinned=pin))
        for i, desc in enumerate(todo):
            entry = self._entries.get(desc)
            pin_this = pin and (entry is not None and entry.pinned or self._may_pin())
            if pin and not pin_this:
                report.unpinned.append(str(desc))
            if entry is not None:
                if pin_this and not entry.pinned:
                    self._decisions.append(Decision("pin", str(desc)))
                entry.pinned = entry.pinned or pin_this
                report.cached.append(str(desc))
            else:
                self._negative.pop(desc, None)  # an explicit warmup retries past failures
                captured = self._capture_entry(desc, pinned=pin_this)
                if captured is not None:
                    report.captured.append(str(desc))
                    log.info("warmup %d/%d %s: %s capture, %.1f ms, %d bytes", i + 1, len(todo), desc,
                             _capture_mode(captured.graph), captured.capture_seconds * 1e3, captured.bytes)
                else:
                    report.failed[str(desc)] = self._negative[desc][0]
                    log.info("warmup %d/%d %s: not captured (%s)", i + 1, len(todo), desc, self._negative[desc][0])
            if progress is not None:
                progress(i + 1, len(todo), str(desc))
        report.seconds = time.perf_counter() - t0
        report.pool_bytes = self._total_bytes()
        self.warmed_up = True
        return report

    def _may_pin(self) -> bool:
        """Pinned entries stay within pin_share of each budget, so lazy captures always keep room."""
        pinned = sum(e.pinned for e in list(self._entries.values()))
        return (pinned < self.pin_share * self.max_entries
                and self._pool_bytes("pinned") < self.pin_share * self.max_bytes)

    def evict(self, desc: BatchDescriptor) -> bool:
        """Drop one entry (pinned or not) and return its memory. False if it was not cached.

        A private entry's pool is returned at once. An entry in a shared pool (pinned or lazy)
        leaves its blocks there (reused by later captures of that kind); the pool returns to the
        driver when its last entry is evicted, or on clear()."""
        self._check_owner()
        if desc not in self._entries:
            return False
        self._drop(desc, "manual")
        self._free_memory()
        return True

    def clear(self) -> ClearReport:
        """Drop every entry (the shared pools too) and the negative cache; return the memory to the driver."""
        self._check_owner()
        if self.backend == "cuda":
            torch.cuda.synchronize()  # no replay may still be running on memory we free
        before, held, n = reserved_bytes(), self._total_bytes(), len(self._entries)
        self._decisions.append(Decision("clear"))
        for desc in list(self._entries):
            self._drop(desc, "clear")
        self._negative.clear()
        self._admission.reset()
        self._shared = dict.fromkeys(self._shared)  # already so: their last entries were dropped
        self._inflation = 0.0  # nothing left to age against: GDSF starts over
        self._free_memory()
        return ClearReport(entries=n, pool_bytes=held, bytes_freed=max(0, before - reserved_bytes()))

    def _free_memory(self) -> None:
        if self.backend == "cuda":
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    # --- inspection (any thread) ---
    def entries(self) -> list[EntryInfo]:
        """Entries least recently used first (LRU's eviction order; under GDSF the budgets evict
        the unpinned entry with the lowest `priority` first, ties least recently used)."""
        gdsf = self.eviction_policy == "gdsf"
        return [EntryInfo(str(e.desc), e.bytes, e.capture_seconds, e.hits, e.last_use, e.pinned,
                          e.graph.num_graphs, e.graph.num_breaks, e.pool.kind,
                          _capture_mode(e.graph), e.priority if gdsf and not e.pinned else None)
                for e in list(self._entries.values())]

    def profile(self, min_uses: int = 1) -> dict:
        """The hot set as JSON-able data: every descriptor steps asked for at least `min_uses` times
        (cached or evicted; min_uses=0 adds those only captured, e.g. by warmup), most used first.

        Per descriptor: capture mode ("full" | "breakable", null if never captured), uses (steps that
        asked for it, hits + misses, since start: clear() keeps them), bytes (its last capture's own
        size, allocator-measured; 0 on the CPU) and capture_ms (its last capture). `parse_profile`
        reads it back; GRAPHCACHE_WARMUP_PROFILE and POST /admin/warmup {"profile": ...} warm it."""
        return build_profile(dict(list(self._uses.items())), dict(list(self._captured.items())), min_uses)

    def stats(self) -> CacheStats:
        s = self._stats
        return CacheStats(s.hits, s.misses, s.captures, s.capture_seconds, dict(s.evictions), dict(s.failures),
                          self._total_bytes(), len(self._entries), s.padded_tokens, self._pool_bytes("pinned"),
                          lazy_pool_bytes=self._pool_bytes("lazy"),
                          lazy_captures=s.lazy_captures, stall_seconds=s.stall_seconds,
                          worst_stall_seconds=s.worst_stall_seconds, deferred=s.deferred)

    def info(self) -> dict:
        """Everything above as JSON-able data (admin endpoint)."""
        return {
            "backend": self.backend,
            "admission": {**self._admission.info(), "deferred": self._stats.deferred},
            "stalls": {"lazy_captures": self._stats.lazy_captures, "seconds": self._stats.stall_seconds,
                       "worst_seconds": self._stats.worst_stall_seconds},
            # gdsf_inflation: GDSF's L (the H of the last entry a budget evicted); 0 under lru
            "eviction": {"policy": self.eviction_policy, "gdsf_inflation": self._inflation},
            "warmed_up": self.warmed_up,
            "budgets": {"max_entries": self.max_entries, "max_bytes": self.max_bytes},
            "totals": {"entries": len(self._entries), "pool_bytes": self._total_bytes(),
                       "pinned_pool_bytes": self._pool_bytes("pinned"), "lazy_pool_bytes": self._pool_bytes("lazy")},
            "lazy_pool": self.lazy_pool,
            "entries": [asdict(e) for e in self.entries()],
            # the allocator's own figure for all graph pools, to check the gauge against
            "allocator_pool_bytes": all_graph_pools_bytes() if self.backend == "cuda" else 0,
            "negative": [{"descriptor": str(d), "reason": r, "detail": t}
                         for d, (r, t) in list(self._negative.items())],
            "stats": asdict(self.stats()),
        }

    def rank_pool_bytes(self) -> list[int]:
        """Each tensor-parallel rank's own measurement of the pools held, in rank order (the budgets and
        stats use their max). Exact with shared pools, where summing the admits held is not: a shared
        pool keeps an evicted entry's growth until its last graph goes. At size 1: [stats().pool_bytes]."""
        pools = [p for p in list(self._shared.values()) if p is not None]
        pools += [e.pool for e in list(self._entries.values()) if e.pool.kind == "private"]
        return [sum(p.rank_bytes[r] if r < len(p.rank_bytes) else p.bytes for p in pools)
                for r in range(self.agreement.size)]

    def decision_log(self) -> list[Decision]:
        """The cache's decisions in order (at tp > 1 equal on every rank; graphs/agreement.py)."""
        return list(self._decisions)

    def __contains__(self, desc: BatchDescriptor) -> bool:
        return desc in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # --- helpers ---
    def _precheck(self, desc: BatchDescriptor, *, lazy: bool = False) -> CaptureReport:
        """This rank's checks before a capture: the test failpoint, and for a lazy capture the budget."""
        try:
            if self.failpoint is not None:
                self.failpoint(desc)
        except Exception as e:
            return _failure(e)
        if lazy and not self._admission.within_budget():
            return CaptureReport(False, "deferred", "lazy captures spent their share of serving time")
        return CaptureReport(True)

    def _agree(self, report: CaptureReport) -> Verdict:
        """The verdict every rank applies (rank 0's, from every rank's report); at size 1 this report's."""
        if self.agreement.size == 1:
            return self.agreement.agree(report)
        state = fingerprint([list(self._entries), list(self._negative), len(self._decisions)])
        verdict = self.agreement.agree(CaptureReport(report.ok, report.reason, report.detail, report.bytes,
                                                     report.seconds, state))
        if verdict.diverged:
            raise RuntimeError(verdict.diverged + "; restart the server (every rank starts from an empty cache), "
                               "and report it: the runner must apply every step and admin call on all ranks")
        return verdict

    def _total_bytes(self) -> int:
        """Allocator-measured: the pinned pool, the lazy pool and every private pool."""
        shared = sum(p.bytes for p in list(self._shared.values()) if p is not None)
        return shared + sum(e.bytes for e in list(self._entries.values()) if e.pool.kind == "private")

    def _pool_bytes(self, kind: str) -> int:
        pool = self._shared.get(kind)
        return pool.bytes if pool is not None else 0

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.graph_entries.set(len(self._entries))
            self.metrics.graph_pool_bytes.set(self._total_bytes())
            modes = Counter(_capture_mode(e.graph) for e in list(self._entries.values()))
            for mode in CAPTURE_MODES:
                self.metrics.graph_entries_by_mode.labels(mode).set(modes[mode])

    def _check_owner(self) -> None:
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise RuntimeError(
                f"GraphCache is driven from thread {threading.current_thread().name!r} but is owned by thread id "
                f"{self._owner}: all capture, replay and GPU work must come from one thread (a capture fails if "
                "another thread issues CUDA calls). Fix: send the request to the engine thread's queue.")
