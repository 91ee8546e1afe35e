"""GraphCache: the store of breakable captures, one per batch descriptor.

`run(desc)` replays the capture for `desc` when there is one; on a miss it captures (then replays)
when the policy admits it, else serves the step eagerly. The store captures, replays and closes
entries; what it holds is the policy's call (policy.py: budgets, eviction, pools, admission; wrapped by
agreed_policy.py at tensor parallel), and what happened is the journal's (journal.py). Memory and
eviction: docs/graph-pools.md.

Threading: one owner thread (the engine thread) drives the cache and all GPU work: `run`, `warmup`,
`clear`, `evict` raise RuntimeError from any other thread (a capture fails if another thread issues
CUDA calls; capture and replay state is not locked). `entries`, `stats`, `info` and `profile` only
read stored numbers and may be called from any thread.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import asdict
from typing import Any, Literal

import torch

from graphcache.choices import StepMode
from graphcache.graphs.agreed_policy import AgreedPolicy
from graphcache.graphs.agreement import Agreement, CaptureReport, Decision
from graphcache.graphs.cache_reports import CacheStats, ClearReport, EntryInfo, WarmupReport
from graphcache.graphs.capture import BreakableGraph, capture
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.entry import CacheEntry, capture_mode
from graphcache.graphs.journal import CacheJournal
from graphcache.graphs.policy import CachePolicy
from graphcache.graphs.policy_config import CachePolicyConfig
from graphcache.graphs.pool import GraphPool, all_graph_pools_bytes, new_pool, pool_bytes, reserved_bytes
from graphcache.metrics import Metrics

__all__ = ["CacheStats", "ClearReport", "EntryInfo", "GraphCache", "WarmupReport", "warmup_order"]

log = logging.getLogger(__name__)
Mode = StepMode


def warmup_order(descs: list[BatchDescriptor]) -> list[BatchDescriptor]:
    """Distinct descriptors, largest first: the largest capture sets the pinned pool's high-water mark."""
    return sorted(set(descs), key=lambda d: (d.num_tokens, d.num_reqs, d.uniform_decode), reverse=True)


def _failure(e: Exception) -> CaptureReport:
    reason = "oom" if isinstance(e, torch.OutOfMemoryError) else "error"
    return CaptureReport(False, reason, f"{type(e).__name__}: {e}")


class GraphCache:
    def __init__(
        self,
        step_fn: Callable[[BatchDescriptor], None],
        *,
        backend: Literal["cuda", "eager"],
        config: CachePolicyConfig,
        debug: bool = False,
        metrics: Metrics | None = None,
        input_tensors: Callable[[BatchDescriptor], list[torch.Tensor]] | None = None,
        measure_bytes: Callable[[BatchDescriptor, Any], int] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        agreement: Agreement | None = None,
        warm_key: Callable[[BatchDescriptor], Hashable] | None = None,
    ) -> None:
        """step_fn(desc): one step over the static buffers (what is captured). config: the policy's knobs.
        agreement: how per-rank capture outcomes are agreed with other tensor-parallel ranks
        (agreement.py); None = this process alone. warm_key(desc): the step's kernel family, what must
        compile or set up once (config.capture_warmup="per_kernel"; None = one family). A capture without
        a warm-up run that fails is retried with one before it counts as failed. debug + input_tensors:
        check at replay that the inputs did not move since capture. measure_bytes(desc, pool handle):
        a capture's pool bytes (default: the allocator's). clock: times captures (injectable so CPU
        tests and benchmarks can give captures a modelled cost)."""
        if backend not in ("cuda", "eager"):
            raise ValueError(f"backend must be 'cuda' or 'eager', got {backend!r}")
        self.step_fn, self.backend, self.config = step_fn, backend, config
        self.debug, self.metrics, self.input_tensors = debug, metrics, input_tensors
        self.measure_bytes = measure_bytes or (lambda desc, pool: pool_bytes(pool))
        self.clock, self.warm_key = clock, warm_key
        self.failpoint: Callable[[BatchDescriptor], None] | None = None  # tests inject capture failures
        self.warmed_up = False
        self._warmed: set[Hashable] = set()  # kernel families that ran eagerly on the capture stream
        self._entries: OrderedDict[BatchDescriptor, CacheEntry] = OrderedDict()  # LRU first
        self._owner: int | None = None
        self.journal = CacheJournal(metrics)
        policy = CachePolicy(
            config,
            backend=backend,
            entries=self._entries,
            close=self._close,
            journal=self.journal,
            clock=clock,
        )
        self.policy: CachePolicy | AgreedPolicy = (
            policy if agreement is None else AgreedPolicy(policy, agreement)
        )
        if metrics is not None:
            metrics.graph_backend.labels(backend).set(1)
            metrics.graph_max_entries.set(config.max_entries)
            metrics.graph_pool_budget_bytes.set(config.max_bytes)
            policy.update_gauges()

    # --- serving ---
    def run(self, desc: BatchDescriptor, real_tokens: int | None = None) -> Mode:
        """Run one step for `desc` over the static buffers: replay, capture then replay, or eager."""
        self._check_owner()
        self.journal.step(desc, real_tokens)
        entry = self._entries.get(desc)
        if entry is not None:
            self.policy.hit(entry)
            self._entries.move_to_end(desc)
            self._replay(entry)
            return "replay"
        self.journal.miss()
        if self.policy.wants_capture(desc) and self._capture_entry(desc, pinned=False, lazy=True) is not None:
            return "replay"  # the capture ran the step (see _capture_entry)
        self.step_fn(desc)
        return "eager"

    def _replay(self, entry: CacheEntry) -> None:
        if entry.addresses is not None and self.input_tensors is not None:
            now = [t.data_ptr() for t in self.input_tensors(entry.desc)]
            if now != entry.addresses:
                raise RuntimeError(
                    f"graph debug: input addresses of {entry.desc} moved since capture ({entry.addresses} -> "
                    f"{now}); the graph would read stale memory. Fix: allocate static buffers once and write "
                    "into them in place (copy_), never rebind them."
                )
        entry.last_use = time.time()
        entry.graph.replay()

    def _close(self, desc: BatchDescriptor) -> CacheEntry:
        """Remove the entry of `desc` and free its graphs (its pool goes back with its last graph)."""
        entry = self._entries.pop(desc)
        entry.graph.close()
        return entry

    # --- capture ---
    def _capture_entry(self, desc: BatchDescriptor, *, pinned: bool, lazy: bool = False) -> CacheEntry | None:
        """Make room, capture, measure, admit or refuse (the policy decides). None: serve eagerly.
        lazy: a miss while serving, subject to the capture-time budget (graphs/admission.py)."""
        policy = self.policy
        kind = policy.pools.kind_for(pinned)
        # Two agreed phases (at tp size 1 each is just this rank's outcome): first every rank's
        # pre-checks, so a rank that cannot capture stops the others before any of them runs the step
        # (whose collectives would wait for it); then the capture's outcome and measured bytes.
        verdict = policy.agree(self._precheck(desc, lazy))
        if verdict.reason == "deferred":
            policy.defer(desc)
            return None
        if verdict.ok and not policy.make_room(desc, kind):
            return None
        pool = policy.pools.pool_for(kind)
        graph: BreakableGraph | None = None
        if verdict.ok:
            try:
                graph, seconds = self._capture(desc, pool)
                report = CaptureReport(
                    True, bytes=int(self.measure_bytes(desc, pool.handle)), seconds=seconds
                )
            except Exception as e:
                report = _failure(e)
            verdict = policy.agree(report)
        if not verdict.ok:
            if graph is not None:
                graph.close()  # this rank captured it, another did not: abandoned everywhere
            policy.refuse(desc, verdict.reason, verdict.detail)
            self._settle_pool(pool, desc)
            if self.backend == "cuda":
                torch.cuda.empty_cache()  # give back what the failed capture's pool reserved
            return None
        assert graph is not None
        size, rank_growth = policy.pools.grow(pool, desc, verdict)  # verdict: max over ranks
        entry = CacheEntry(desc, graph, pool, size, verdict.seconds, pinned=pinned)
        if self.debug and self.input_tensors is not None:
            entry.addresses = [t.data_ptr() for t in self.input_tensors(desc)]
        if not policy.fit_after_capture(entry):
            graph.close()
            self._free_memory()
            return None
        self._entries[desc] = entry
        policy.admitted(entry, rank_growth, lazy)
        log.debug(
            "captured %s: %d graphs, %d breaks, %d bytes (%s pool), %.1f ms",
            desc,
            graph.num_graphs,
            graph.num_breaks,
            size,
            kind,
            entry.capture_seconds * 1e3,
        )
        if self.backend == "cuda":
            # Capture runs the eager ops over not-yet-computed inputs (the graphs did not run),
            # so they wrote garbage (e.g. KV slots of this step); one replay makes it right.
            # (The eager backend's capture already ran the step for real.)
            graph.replay()
        return entry

    def _precheck(self, desc: BatchDescriptor, lazy: bool) -> CaptureReport:
        """This rank's checks before a capture: the test failpoint, then the policy's (capture-time budget)."""
        try:
            if self.failpoint is not None:
                self.failpoint(desc)
        except Exception as e:
            return _failure(e)
        return self.policy.precheck(lazy)

    def _settle_pool(self, pool: GraphPool, desc: BatchDescriptor) -> None:
        """After a failed capture: drop the pool if no graph uses it, else re-measure it (what the failed
        capture reserved there stays until the pool goes)."""
        if pool.graphs == 0:
            self.policy.pools.forget(pool)  # its partial graphs were reset: never capture into it again
        else:
            measured = self.policy.agree(
                CaptureReport(True, bytes=int(self.measure_bytes(desc, pool.handle)))
            )
            pool.bytes, pool.rank_bytes = measured.bytes, measured.rank_bytes  # max over ranks; each rank's
            self.policy.update_gauges()

    def _capture(self, desc: BatchDescriptor, pool: GraphPool) -> tuple[BreakableGraph, float]:
        """Capture `desc` into `pool`; returns the graph and its seconds (a retry may have given the
        pool a fresh handle)."""
        key = self.warm_key(desc) if self.warm_key is not None else None
        warm = self.config.capture_warmup == "always" or key not in self._warmed
        t0 = self.clock()
        try:
            graph = capture(lambda: self.step_fn(desc), backend=self.backend, pool=pool.handle, warmup=warm)
        except Exception as e:
            # Not at tensor parallel > 1: a retry on one rank would run the step's collectives alone
            # (a hang); there the failure is agreed and remembered like any other.
            if warm or self.policy.size > 1:
                raise
            # Something in this step still needed its first eager call (a kernel's lazy setup):
            # capture.py has dropped the partial graphs; one more try, warmed up.
            log.info(
                "capture of %s without a warm-up run failed (%s: %s); retrying after one",
                desc,
                type(e).__name__,
                e,
            )
            if pool.graphs == 0:
                # The failed capture's reset may have released a pool no graph holds: never capture
                # into a released handle again (pool.py). A shared pool with live graphs stays valid.
                pool.handle = new_pool(self.backend)
            graph = capture(lambda: self.step_fn(desc), backend=self.backend, pool=pool.handle, warmup=True)
        self._warmed.add(key)
        return graph, self.clock() - t0

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
        report, t0 = WarmupReport(), time.perf_counter()
        todo = warmup_order(descs)
        policy = self.policy
        self.journal.decide(Decision("warmup", ",".join(map(str, todo)), pinned=pin))
        for i, desc in enumerate(todo):
            entry = self._entries.get(desc)
            pin_this = pin and (entry is not None and entry.pinned or policy.may_pin())
            if pin and not pin_this:
                report.unpinned.append(str(desc))
            if entry is not None:
                if pin_this and not entry.pinned:
                    self.journal.decide(Decision("pin", str(desc)))
                entry.pinned = entry.pinned or pin_this
                report.cached.append(str(desc))
            else:
                policy.negative.pop(desc, None)  # an explicit warmup retries past failures
                captured = self._capture_entry(desc, pinned=pin_this)
                if captured is not None:
                    report.captured.append(str(desc))
                    log.info(
                        "warmup %d/%d %s: %s capture, %.1f ms, %d bytes",
                        i + 1,
                        len(todo),
                        desc,
                        capture_mode(captured.graph),
                        captured.capture_seconds * 1e3,
                        captured.bytes,
                    )
                else:
                    report.failed[str(desc)] = policy.negative[desc][0]
                    log.info(
                        "warmup %d/%d %s: not captured (%s)", i + 1, len(todo), desc, policy.negative[desc][0]
                    )
            if progress is not None:
                progress(i + 1, len(todo), str(desc))
        report.seconds = time.perf_counter() - t0
        report.pool_bytes = policy.total_bytes()
        self.warmed_up = True
        return report

    def evict(self, desc: BatchDescriptor) -> bool:
        """Drop one entry (pinned or not) and return its memory. False if it was not cached.

        A private entry's pool is returned at once. An entry in a shared pool (pinned or lazy)
        leaves its blocks there (reused by later captures of that kind); the pool returns to the
        driver when its last entry is evicted, or on clear()."""
        self._check_owner()
        if desc not in self._entries:
            return False
        self.policy.drop(desc, "manual")
        self._free_memory()
        return True

    def clear(self) -> ClearReport:
        """Drop every entry (the shared pools too) and the negative cache; return the memory to the driver."""
        self._check_owner()
        if self.backend == "cuda":
            torch.cuda.synchronize()  # no replay may still be running on memory we free
        before, held, n = reserved_bytes(), self.policy.total_bytes(), len(self._entries)
        self.journal.decide(Decision("clear"))
        for desc in list(self._entries):
            self.policy.drop(desc, "clear")
        self.policy.cleared()
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
            for e in list(self._entries.values())
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
        s, pools = self.journal.stats, self.policy.pools
        return CacheStats(
            s.hits,
            s.misses,
            s.captures,
            s.capture_seconds,
            dict(s.evictions),
            dict(s.failures),
            self.policy.total_bytes(),
            len(self._entries),
            s.padded_tokens,
            pools.kind_bytes("pinned"),
            lazy_pool_bytes=pools.kind_bytes("lazy"),
            lazy_captures=s.lazy_captures,
            stall_seconds=s.stall_seconds,
            worst_stall_seconds=s.worst_stall_seconds,
            deferred=s.deferred,
        )

    def info(self) -> dict:
        """Everything above as JSON-able data (admin endpoint)."""
        policy, cfg, s = self.policy, self.config, self.journal.stats
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
                "entries": len(self._entries),
                "pool_bytes": policy.total_bytes(),
                "pinned_pool_bytes": policy.pools.kind_bytes("pinned"),
                "lazy_pool_bytes": policy.pools.kind_bytes("lazy"),
            },
            "lazy_pool": cfg.lazy_pool,
            "entries": [asdict(e) for e in self.entries()],
            # the allocator's own figure for all graph pools, to check the gauge against
            "allocator_pool_bytes": all_graph_pools_bytes() if self.backend == "cuda" else 0,
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
        return self.policy.pools.rank_bytes(self._entries.values(), self.policy.size)

    def decision_log(self) -> list[Decision]:
        """The cache's decisions in order (at tp > 1 equal on every rank; graphs/agreement.py)."""
        return list(self.journal.decisions)

    def __contains__(self, desc: BatchDescriptor) -> bool:
        return desc in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _check_owner(self) -> None:
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise RuntimeError(
                f"GraphCache is driven from thread {threading.current_thread().name!r} but is owned by thread id "
                f"{self._owner}: all capture, replay and GPU work must come from one thread (a capture fails if "
                "another thread issues CUDA calls). Fix: send the request to the engine thread's queue."
            )
