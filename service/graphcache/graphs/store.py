"""GraphStore: the captured graphs, one entry per batch descriptor, and the books of their pools.

The store gets, captures, replays, drops and lists entries, and does the GPU work of each through its
capture backend (backend.py). It decides nothing: which descriptor to capture, into which kind of pool,
whether a capture is admitted and what to evict are the policy's (policy/), which calls the store and
is never called back by it. So a capture is a few calls the policy strings together: `capture` (an
`Attempt`: the graph and what it measured, or why it failed), then `hold` (count it in its pool, once the
policy accepts the measurement) and `add`; or `abandon` (a failed or refused attempt) or `release` (a held
one refused after all).

Entries are kept in order of last use (least recently replayed first): `replay` moves its entry to the
end, so LRU eviction reads the order as it is. `get` is the dict's own bound method: the per-step lookup
costs no Python frame.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from graphcache.graphs.backend import CaptureBackend
from graphcache.graphs.capture import BreakableGraph
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.entry import CacheEntry
from graphcache.graphs.pool import GraphPool, PoolKind, reserved_bytes
from graphcache.graphs.pool_ledger import PoolLedger

__all__ = ["Attempt", "GraphStore", "failure_of"]

log = logging.getLogger(__name__)


def failure_of(e: BaseException) -> tuple[str, str]:
    """(reason, detail) of a capture that raised `e`: "oom" for an allocator out-of-memory, else "error"."""
    return ("oom" if isinstance(e, torch.OutOfMemoryError) else "error"), f"{type(e).__name__}: {e}"


@dataclass(eq=False)
class Attempt:
    """A capture not held yet: its graph (None when it failed before one existed), the pool it went
    into, and what this process measured (bytes of that pool, seconds) or why it failed."""

    desc: BatchDescriptor
    pool: GraphPool
    graph: BreakableGraph | None
    bytes: int = 0
    seconds: float = 0.0
    failed: str = ""  # "" | "oom" | "error"
    detail: str = ""


class GraphStore:
    def __init__(
        self,
        step_fn: Callable[[BatchDescriptor], None],
        backend: CaptureBackend,
        *,
        clock: Callable[[], float],
        measure_bytes: Callable[[BatchDescriptor, Any], int] | None = None,
        warm_key: Callable[[BatchDescriptor], Hashable] | None = None,
        warm_always: bool = False,
        retry_cold: bool = True,
        input_tensors: Callable[[BatchDescriptor], list[torch.Tensor]] | None = None,
    ) -> None:
        """step_fn(desc): one step over the static buffers (what is captured, and what an eager step runs).
        clock: times captures. measure_bytes(desc, pool handle): a capture's pool bytes (default: the
        backend's allocator figure). warm_key(desc): the step's kernel family, run eagerly before its first
        capture only (None: one family); warm_always: before every capture. retry_cold: a capture without
        a warm-up run that fails is retried once with one (off at tensor parallel > 1, where a retry on one
        rank would run the step's collectives alone). input_tensors: record each capture's input addresses
        and check them at every replay (debug)."""
        self.step_fn, self.backend, self.clock = step_fn, backend, clock
        self.measure_bytes = measure_bytes or (lambda desc, handle: backend.pool_bytes(handle))
        self.warm_key, self.warm_always, self.retry_cold = warm_key, warm_always, retry_cold
        self.input_tensors = input_tensors
        self.pools = PoolLedger(backend)
        self._warmed: set[Hashable] = set()  # kernel families that ran eagerly on the capture stream
        # Never rebound: `get` and `_move_to_end` are its bound methods.
        self._entries: OrderedDict[BatchDescriptor, CacheEntry] = OrderedDict()
        self.get: Callable[[BatchDescriptor], CacheEntry | None] = self._entries.get
        self._move_to_end = self._entries.move_to_end

    # --- entries ---
    def entries(self) -> list[CacheEntry]:
        """The entries, least recently used first (a copy: safe to read from any thread)."""
        return list(self._entries.values())

    def descriptors(self) -> list[BatchDescriptor]:
        return list(self._entries)

    def __contains__(self, desc: BatchDescriptor) -> bool:
        return desc in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def replay(self, entry: CacheEntry) -> None:
        """Run the step of a held entry: its graph replays over the static buffers."""
        if entry.addresses is not None:
            self._check_addresses(entry)
        self._move_to_end(entry.desc)
        entry.last_use = time.time()
        entry.graph.replay()

    def _check_addresses(self, entry: CacheEntry) -> None:
        assert self.input_tensors is not None  # addresses are recorded only with it
        now = [t.data_ptr() for t in self.input_tensors(entry.desc)]
        if now != entry.addresses:
            raise RuntimeError(
                f"graph debug: input addresses of {entry.desc} moved since capture ({entry.addresses} -> "
                f"{now}); the graph would read stale memory. Fix: allocate static buffers once and write "
                "into them in place (copy_), never rebind them."
            )

    def drop(self, desc: BatchDescriptor) -> tuple[CacheEntry, bool]:
        """Remove the entry of `desc` and close its graph. Returns it, and whether that was its pool's
        last graph (the pool is freeable now; its bytes return with `free_memory`)."""
        entry = self._entries.pop(desc)
        entry.graph.close()
        return entry, self.pools.release(entry.pool)

    # --- capture ---
    def capture(self, desc: BatchDescriptor, kind: PoolKind) -> Attempt:
        """Capture `desc` into the pool of `kind` (the live shared one, else a fresh one) and measure it.
        Never raises for a failed capture: the attempt says why (its partial graphs are already dropped)
        and names the pool the last try went into."""
        pool = self.pools.pool_for(kind)
        graph: BreakableGraph | None = None
        key = self.warm_key(desc) if self.warm_key is not None else None
        warm = self.warm_always or key not in self._warmed
        # The step is looked up at each call: on the eager backend the graph re-runs it at every replay.
        step, t0 = (lambda: self.step_fn(desc)), self.clock()
        try:
            try:
                graph = self.backend.capture(step, pool.handle, warm)
            except Exception as e:
                if warm or not self.retry_cold:
                    raise
                # Something in this step still needed its first eager call (a kernel's lazy setup):
                # capture.py has dropped the partial graphs; one more try, warmed up.
                log.info(
                    "capture of %s without a warm-up run failed (%s: %s); retrying after one",
                    desc,
                    type(e).__name__,
                    e,
                )
                pool = self._usable(pool)
                graph = self.backend.capture(step, pool.handle, True)
            self._warmed.add(key)
            seconds = self.clock() - t0
            size = int(self.measure_bytes(desc, pool.handle))
        except Exception as e:
            failed, detail = failure_of(e)
            self._usable(pool)  # the next capture of this kind must not go into a spoiled pool
            return Attempt(desc, pool, graph, failed=failed, detail=detail)
        return Attempt(desc, pool, graph, size, seconds)

    def _usable(self, pool: GraphPool) -> GraphPool:
        """The pool to capture into after a failed capture into `pool`: `pool` itself while it can take
        captures; else a fresh one of its kind (the ledger keeps the old one's graphs counted)."""
        if pool.graphs == 0:
            # The failed capture's reset may have released a pool no graph holds: never capture
            # into a released handle again (pool.py). A shared pool with live graphs stays valid.
            pool.handle = self.backend.new_pool()
            return pool
        if self.backend.accepts_captures(pool.handle):
            return pool
        log.warning(
            "graph pool %s can take no more captures after a failed one; moving to a fresh one", pool.handle
        )
        self.pools.retire(pool)
        return self.pools.pool_for(pool.kind)

    def hold(
        self,
        attempt: Attempt,
        *,
        size: int,
        rank_bytes: tuple[int, ...],
        seconds: float,
        pinned: bool,
    ) -> tuple[CacheEntry, tuple[int, ...]]:
        """Count a successful attempt's graph in its pool, now measured at `size` bytes (rank_bytes: each
        tensor-parallel rank's figure), and make its entry, not yet held (`add` holds it, `release` drops
        it). Returns the entry (its bytes: the pool's growth) and each rank's growth of the pool."""
        assert attempt.graph is not None, "only a successful attempt is held"
        grown, rank_growth = self.pools.grow(attempt.pool, attempt.desc, size, rank_bytes)
        entry = CacheEntry(attempt.desc, attempt.graph, attempt.pool, grown, seconds, pinned=pinned)
        if self.input_tensors is not None:
            entry.addresses = [t.data_ptr() for t in self.input_tensors(attempt.desc)]
        return entry, rank_growth

    def add(self, entry: CacheEntry) -> None:
        """Hold `entry` (from `hold`) as the most recently used, and run its step once more where the
        capture left the step's outputs wrong (the backend's `first_run`): the miss that captured it
        is served by then."""
        self._entries[entry.desc] = entry
        self.backend.first_run(entry.graph)

    def release(self, entry: CacheEntry) -> None:
        """Drop an entry `hold` made that will not be held: its graph, its count in its pool, its memory."""
        entry.graph.close()
        self.pools.release(entry.pool)
        self.backend.free_memory()

    def abandon(
        self, desc: BatchDescriptor, kind: PoolKind, attempt: Attempt | None
    ) -> tuple[GraphPool, int] | None:
        """A capture of `desc` into `kind` that will not be held (it failed, or the policy refused it;
        attempt None: it never ran). Closes its graph, then drops its pool if no graph uses it: its partial
        graphs were reset, so it is never captured into again. When other graphs keep the pool, returns it
        and its bytes measured anew (what the failed capture reserved there stays until the pool goes)."""
        if attempt is not None and attempt.graph is not None:
            attempt.graph.close()
        pool = attempt.pool if attempt is not None else self.pools.live(kind)
        if pool is None:
            return None
        if pool.graphs == 0:
            self.pools.forget(pool)
            return None
        return pool, int(self.measure_bytes(desc, pool.handle))

    def set_pool_bytes(self, pool: GraphPool, size: int, rank_bytes: tuple[int, ...]) -> None:
        """The bytes of `pool` as measured again (at tensor parallel the max over ranks, and each rank's)."""
        pool.bytes, pool.rank_bytes = size, rank_bytes

    # --- memory ---
    def give_back(self) -> None:
        """Return what a failed capture reserved to the driver."""
        self.backend.give_back()

    def free_memory(self) -> None:
        """Return the memory of dropped graphs (pools whose last graph went) to the driver."""
        self.backend.free_memory()

    def synchronize(self) -> None:
        self.backend.synchronize()

    def reserved_bytes(self) -> int:
        """All bytes the allocator holds on the device (0 without CUDA)."""
        return reserved_bytes()

    def allocator_pool_bytes(self) -> int:
        """Every graph pool's bytes from the allocator, to check the books against (0 on the eager backend)."""
        return self.backend.allocator_pool_bytes()

    def total_bytes(self) -> int:
        """Bytes held: the pinned pool, the lazy pool and every private pool (allocator-measured)."""
        return self.pools.total_bytes(self._entries.values())

    def rank_bytes(self, ranks: int) -> list[int]:
        """Each tensor-parallel rank's own measurement of the pools held, in rank order."""
        return self.pools.rank_bytes(self._entries.values(), ranks)
