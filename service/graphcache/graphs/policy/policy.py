"""CachePolicy: which captures the graph store holds, decided over what the store reports.

The policy asks the store (graphs/store.py) and tells it what to do; the store never calls back. On a
miss while serving it decides whether to capture (the negative cache of failed captures, then
admission.py); a capture goes in two agreed phases (at tensor parallel every per-rank input becomes a
verdict all ranks share, agreed_policy.py; alone it is this rank's own): first the pre-checks (the
test failpoint, the capture-time budget), so a rank that cannot capture stops the others before any
runs the step (whose collectives would wait for it); then the capture's outcome and measured bytes.
Between them budget.py makes room; after them it makes the byte budget hold. Warmup captures pinned
within pin_share; what happened goes to the journal (journal.py: counters, metrics, decision log,
traffic profile).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from graphcache.graphs.cache_reports import ClearReport, WarmupReport
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.entry import CacheEntry, capture_mode
from graphcache.graphs.policy.admission import Admission
from graphcache.graphs.policy.agreement import CaptureReport, Decision, Verdict, decide
from graphcache.graphs.policy.budget import Budget
from graphcache.graphs.policy.config import CachePolicyConfig
from graphcache.graphs.policy.eviction import make_eviction
from graphcache.graphs.policy.journal import CacheJournal
from graphcache.graphs.pool import PoolKind
from graphcache.graphs.store import Attempt, GraphStore, failure_of

__all__ = ["CachePolicy", "warmup_order"]

log = logging.getLogger(__name__)


def warmup_order(descs: list[BatchDescriptor]) -> list[BatchDescriptor]:
    """Distinct descriptors, largest first: the largest capture sets the pinned pool's high-water mark (a
    shape's LoRA variant, with the adapters' intermediates, before its plain one)."""
    return sorted(
        set(descs), key=lambda d: (d.num_tokens, d.num_reqs, d.uniform_decode, d.verify, d.lora), reverse=True
    )


class CachePolicy:
    size = 1  # tensor-parallel ranks that agree its per-rank inputs (AgreedPolicy for more)

    def __init__(
        self,
        config: CachePolicyConfig,
        store: GraphStore,
        journal: CacheJournal,
        clock: Callable[[], float],
    ) -> None:
        self.config, self.store, self.journal = config, store, journal
        self.admission = Admission(config, clock)
        self.eviction = make_eviction(config.eviction_policy)
        self.budget = Budget(config, store, self.eviction, journal)
        self.negative: dict[BatchDescriptor, tuple[str, str]] = {}  # desc -> (reason, detail)
        self.failpoint: Callable[[BatchDescriptor], None] | None = None  # tests inject capture failures
        self._touch = self.eviction.touch  # bound once: called at every hit

    # --- per-rank inputs ---
    def agree(self, report: CaptureReport) -> Verdict:
        """The verdict on this rank's report (a pre-check, a capture, a pool measurement): alone, its own."""
        return decide([report])

    def _precheck(self, desc: BatchDescriptor, lazy: bool) -> CaptureReport:
        """This rank's checks before a capture: the test failpoint, then the capture-time budget (a lazy
        capture waits while lazy captures have spent their share of serving time)."""
        try:
            if self.failpoint is not None:
                self.failpoint(desc)
        except Exception as e:
            return CaptureReport(False, *failure_of(e))
        if lazy and not self.admission.within_budget():
            return CaptureReport(False, "deferred", "lazy captures spent their share of serving time")
        return CaptureReport(True)

    # --- serving ---
    def hit(self, entry: CacheEntry) -> None:
        entry.hits += 1
        self._touch(entry)
        self.journal.hit()

    def miss(self, desc: BatchDescriptor) -> bool:
        """A miss while serving: capture `desc` now if the policy admits it. True: captured and held,
        and the capture served the step. (Never a descriptor that failed before clear().)"""
        return (
            desc not in self.negative
            and self.admission.wants(desc)
            and self.capture(desc, pinned=False, lazy=True) is not None
        )

    def kind_for(self, pinned: bool) -> PoolKind:
        if pinned:
            return "pinned"
        return "lazy" if self.config.lazy_pool == "shared" else "private"

    def capture(self, desc: BatchDescriptor, *, pinned: bool, lazy: bool = False) -> CacheEntry | None:
        """Make room, capture through the store, agree the outcome, hold or refuse. None: not held (the
        step is the caller's to run eagerly). lazy: a miss while serving, under the capture-time budget."""
        store, kind = self.store, self.kind_for(pinned)
        verdict = self.agree(self._precheck(desc, lazy))
        if verdict.reason == "deferred":
            self.journal.deferred(desc)  # served eagerly now, captured at a later miss
            return None
        if verdict.ok:
            no_room = self.budget.make_room(desc, kind)
            if no_room is not None:
                self.refuse(desc, "budget", no_room)
                return None
        attempt: Attempt | None = None
        if verdict.ok:
            attempt = store.capture(desc, kind)
            verdict = self.agree(
                CaptureReport(
                    not attempt.failed, attempt.failed, attempt.detail, attempt.bytes, attempt.seconds
                )
            )
        if not verdict.ok:
            # Failed here or on another rank (then this rank's graph is dropped too): remembered until clear().
            self._abandon(desc, kind, attempt, verdict)
            return None
        assert attempt is not None
        entry, rank_growth = store.hold(
            attempt, size=verdict.bytes, rank_bytes=verdict.rank_bytes, seconds=verdict.seconds, pinned=pinned
        )
        over = self.budget.fit(entry)
        if over is not None:
            self.refuse(desc, "budget", over)
            store.release(entry)
            return None
        store.add(entry)
        self._admitted(entry, rank_growth, lazy)
        log.debug(
            "captured %s: %d graphs, %d breaks, %d bytes (%s pool), %.1f ms",
            desc,
            entry.graph.num_graphs,
            entry.graph.num_breaks,
            entry.bytes,
            kind,
            entry.capture_seconds * 1e3,
        )
        return entry

    def _abandon(
        self, desc: BatchDescriptor, kind: PoolKind, attempt: Attempt | None, verdict: Verdict
    ) -> None:
        self.refuse(desc, verdict.reason, verdict.detail)
        kept = self.store.abandon(desc, kind, attempt)
        if kept is not None:  # the pool serves other graphs: its measurement is agreed like any other
            pool, size = kept
            measured = self.agree(CaptureReport(True, bytes=size))
            self.store.set_pool_bytes(pool, measured.bytes, measured.rank_bytes)
            self.budget.update_gauges()
        self.store.give_back()  # what the failed capture's pool reserved

    def _admitted(self, entry: CacheEntry, rank_growth: tuple[int, ...], lazy: bool) -> None:
        """The store holds `entry` (after the budget's evictions: its priority starts from the current L)."""
        self._touch(entry)
        own = self.store.pools.size_hints.get(entry.desc, entry.bytes)  # a shared capture's growth may be 0
        self.journal.admitted(
            entry,
            Decision(
                "admit", str(entry.desc), bytes=entry.bytes, rank_bytes=rank_growth, pinned=entry.pinned
            ),
            own,
            lazy,
        )
        if lazy:
            self.admission.spend(entry.capture_seconds)
        self.budget.update_gauges()

    def refuse(self, desc: BatchDescriptor, reason: str, detail: str) -> None:
        self.negative[desc] = (reason, detail)
        self.journal.refused(desc, reason, detail)

    # --- admin ---
    def warmup(
        self,
        descs: list[BatchDescriptor],
        *,
        pin: bool = True,
        progress: Callable[[int, int, str], None] | None = None,
    ) -> WarmupReport:
        """Capture `descs` largest first (the largest sets the pool high-water mark), pinned within
        pin_share; held ones are pinned in place. Past failures are retried."""
        report, t0 = WarmupReport(), time.perf_counter()
        todo = warmup_order(descs)
        self.journal.decide(Decision("warmup", ",".join(map(str, todo)), pinned=pin))
        for i, desc in enumerate(todo):
            entry = self.store.get(desc)
            pin_this = pin and (entry is not None and entry.pinned or self.budget.may_pin())
            if pin and not pin_this:
                report.unpinned.append(str(desc))
            if entry is not None:
                if pin_this and not entry.pinned:
                    self.journal.decide(Decision("pin", str(desc)))
                entry.pinned = entry.pinned or pin_this
                report.cached.append(str(desc))
            else:
                self.negative.pop(desc, None)  # an explicit warmup retries past failures
                captured = self.capture(desc, pinned=pin_this)
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
                    report.failed[str(desc)] = self.negative[desc][0]
                    log.info(
                        "warmup %d/%d %s: not captured (%s)", i + 1, len(todo), desc, self.negative[desc][0]
                    )
            if progress is not None:
                progress(i + 1, len(todo), str(desc))
        report.seconds = time.perf_counter() - t0
        report.pool_bytes = self.store.total_bytes()
        return report

    def evict(self, desc: BatchDescriptor) -> bool:
        """Drop one entry, pinned or not (its pool goes back with its last graph). False: not held."""
        if desc not in self.store:
            return False
        self.budget.drop(desc, "manual")
        self.store.free_memory()
        return True

    def clear(self) -> ClearReport:
        """Drop every entry (the shared pools go with their last graphs) and forget past failures; miss
        counts and GDSF's L start over. The memory goes back to the driver."""
        store = self.store
        store.synchronize()  # no replay may still be running on memory we free
        before, held, n = store.reserved_bytes(), store.total_bytes(), len(store)
        self.journal.decide(Decision("clear"))
        for desc in store.descriptors():
            self.budget.drop(desc, "clear")
        self.negative.clear()
        self.admission.reset()
        self.eviction.reset()
        store.free_memory()
        return ClearReport(entries=n, pool_bytes=held, bytes_freed=max(0, before - store.reserved_bytes()))
