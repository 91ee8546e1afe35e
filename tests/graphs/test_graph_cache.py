"""GraphCache behaviour on the eager backend: admission, LRU, budgets, pinning, negative cache,
clear, stats, padding, owner thread, failpoint, debug addresses, metrics, and the byte
accounting of the shared pinned and lazy pools vs private pools (through the `measure_bytes` hook)."""

import threading
from dataclasses import fields

import pytest
import torch
from graphcache.graphs.cache import GraphCache
from graphcache.graphs.capture import eager_break, is_capturing
from graphcache.graphs.descriptor import BatchDescriptor as D
from graphcache.graphs.policy.config import CachePolicyConfig
from graphcache.metrics import Metrics

KNOBS = {f.name for f in fields(CachePolicyConfig)}  # the policy's; the other keywords are the store's


@eager_break
def attention_like(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x.cumsum(0))


class Runner:
    """Static buffers and a step function, like the engine's runner."""

    def __init__(self):
        self.x, self.mid, self.out = torch.randn(8), torch.empty(8), torch.empty(8)
        self.calls: list[D] = []

    def step(self, desc: D) -> None:
        self.calls.append(desc)
        attention_like(self.x * 2, self.mid)
        self.out.copy_(self.mid + 1)

    def expected(self) -> torch.Tensor:
        return (self.x * 2).cumsum(0) + 1


class FakePools:
    """`measure_bytes` hook modelling the allocator: a capture of `d` into a pool reserves up
    to sizes[d] there, reusing what the pool already holds (so a shared pool holds the largest
    capture, a private pool exactly its one capture); a pool never shrinks while it lives."""

    def __init__(self, sizes):
        self.sizes, self.held = sizes, {}

    def __call__(self, desc, pool):
        self.held[pool] = max(self.held.get(pool, 0), self.sizes.get(desc, 0))
        return self.held[pool]


def make(runner=None, sizes=None, **kw):
    runner = runner or Runner()
    pools = FakePools(sizes or {})
    config = CachePolicyConfig(
        **{"max_entries": 8, "max_bytes": 1 << 30, **{k: v for k, v in kw.items() if k in KNOBS}}
    )
    cache = GraphCache(
        runner.step,
        backend="eager",
        measure_bytes=pools,
        config=config,
        **{k: v for k, v in kw.items() if k not in KNOBS},
    )
    cache.fake_pools = pools
    return cache, runner


def test_always_captures_on_first_miss_then_replays():
    cache, r = make()
    d = D(8, 8, True)
    assert cache.run(d) == "replay"  # captured (ran the step) then served
    assert cache.run(d) == "replay"
    s = cache.stats()
    assert (s.misses, s.hits, s.captures) == (1, 1, 1)
    assert cache.entries()[0].breaks == 1
    r.x.copy_(torch.randn(8))
    r.out.fill_(float("nan"))
    cache.run(d)
    torch.testing.assert_close(r.out, r.expected())


def test_after_n_admission():
    cache, _ = make(admission="after_n", admission_min_misses=3)
    d = D(4, 4, True)
    assert [cache.run(d) for _ in range(4)] == ["eager", "eager", "replay", "replay"]
    assert cache.stats().misses == 3 and cache.stats().hits == 1


def test_never_admission_serves_eagerly_but_warmup_captures():
    cache, r = make(admission="never")
    d = D(2, 2, True)
    assert cache.run(d) == "eager" and cache.run(d) == "eager"
    assert len(cache) == 0 and r.calls == [d, d]
    rep = cache.warmup([d])
    assert rep.captured == ["2:2:decode"] and cache.warmed_up
    assert cache.run(d) == "replay"


def test_lru_order_and_entry_budget():
    cache, _ = make(max_entries=2)
    a, b, c = D(1, 1, True), D(2, 2, True), D(4, 4, True)
    cache.run(a)
    cache.run(b)
    cache.run(a)  # a is now most recent: b is the LRU victim
    cache.run(c)
    assert [e.descriptor for e in cache.entries()] == ["1:1:decode", "4:4:decode"]
    assert cache.stats().evictions["entries"] == 1


def test_byte_budget_makes_room_before_capture():
    a, b, c = D(1, 1, True), D(2, 2, True), D(4, 4, True)
    cache, _ = make(max_bytes=250, sizes={a: 100, b: 100, c: 100}, lazy_pool="private")
    for d in (a, b, c):
        cache.run(d)
    assert [e.descriptor for e in cache.entries()] == ["2:2:decode", "4:4:decode"]
    s = cache.stats()
    assert s.pool_bytes == 200 and s.evictions["bytes"] == 1 and s.failures["budget"] == 0


def test_entry_bigger_than_budget_is_refused_and_remembered():
    a, big = D(1, 1, True), D(8, 8, True)
    cache, r = make(max_bytes=150, sizes={a: 100, big: 200})
    cache.run(a)
    assert cache.run(big) == "eager"
    assert big not in cache and cache.stats().failures["budget"] == 1
    calls = len(r.calls)
    assert cache.run(big) == "eager"  # remembered: not recaptured
    assert len(r.calls) == calls + 1 and cache.stats().captures == 1
    assert cache.info()["negative"][0]["reason"] == "budget"


def test_pinned_entries_never_evicted_by_budget():
    a, b, c = D(1, 1, True), D(2, 2, True), D(4, 4, True)
    cache, _ = make(max_entries=2, sizes={a: 10, b: 10, c: 10})
    cache.warmup([a, b])
    assert all(e.pinned for e in cache.entries())
    assert cache.run(c) == "eager"  # only pinned remain: refuse
    assert cache.stats().failures["budget"] == 1 and {str(a), str(b)} == {
        e.descriptor for e in cache.entries()
    }
    assert cache.evict(a)  # manual eviction may drop a pinned entry
    assert cache.stats().evictions["manual"] == 1


def test_warmup_largest_first_progress_and_cached():
    cache, r = make()
    seen = []
    descs = [D(1, 1, True), D(8, 8, True), D(4, 4, True)]
    rep = cache.warmup(descs, progress=lambda i, n, d: seen.append((i, n, d)))
    assert r.calls == [D(8, 8, True), D(4, 4, True), D(1, 1, True)]
    assert [s[0] for s in seen] == [1, 2, 3] and seen[0][2] == "8:8:decode"
    assert rep.captured == ["8:8:decode", "4:4:decode", "1:1:decode"]
    rep2 = cache.warmup(descs)
    assert len(rep2.cached) == 3 and not rep2.captured


def test_capture_failure_error_and_oom_are_counted_remembered_and_reset_by_clear():
    cache, r = make()
    bad, oom = D(2, 2, True), D(4, 4, True)

    def failpoint(d):
        if d == bad:
            raise RuntimeError("injected")
        if d == oom:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    cache.failpoint = failpoint
    assert cache.run(bad) == "eager" and cache.run(oom) == "eager"
    assert cache.run(bad) == "eager"
    f = cache.stats().failures
    assert f["error"] == 1 and f["oom"] == 1
    assert {n["descriptor"]: n["reason"] for n in cache.info()["negative"]} == {
        "2:2:decode": "error",
        "4:4:decode": "oom",
    }
    cache.failpoint = None
    rep = cache.clear()
    assert rep.entries == 0 and cache.info()["negative"] == []
    assert cache.run(bad) == "replay"


def test_clear_drops_everything():
    a, b = D(1, 1, True), D(2, 2, True)
    cache, _ = make(sizes={a: 5, b: 7})
    cache.warmup([a])
    cache.run(b)
    rep = cache.clear()
    assert (rep.entries, rep.pool_bytes) == (2, 12)
    assert len(cache) == 0 and cache.stats().evictions["clear"] == 2 and cache.stats().pool_bytes == 0


def test_padding_counted():
    cache, _ = make()
    cache.run(D(8, 8, True), real_tokens=5)
    cache.run(D(8, 8, True), real_tokens=8)
    assert cache.stats().padded_tokens == 3
    with pytest.raises(ValueError):
        cache.run(D(8, 8, True), real_tokens=9)


def test_owner_thread_enforced():
    cache, _ = make()
    cache.run(D(1, 1, True))
    errors = []

    def other():
        try:
            cache.run(D(1, 1, True))
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "one thread" in errors[0]
    cache.stats()  # inspection is allowed from anywhere
    cache.info()


def test_debug_mode_checks_input_addresses():
    r = Runner()
    cache, _ = make(runner=r, debug=True, input_tensors=lambda d: [r.x])
    d = D(1, 1, True)
    cache.run(d)
    cache.run(d)
    r.x = torch.randn(8)  # rebinding a static buffer: the capture would read stale memory
    with pytest.raises(RuntimeError, match="addresses"):
        cache.run(d)


def test_entries_and_info_json():
    import json

    a = D(1, 1, True)
    cache, _ = make(sizes={a: 42})
    cache.warmup([a])
    cache.run(a)
    e = cache.entries()[0]
    assert (e.descriptor, e.bytes, e.hits, e.pinned) == ("1:1:decode", 42, 1, True)
    assert e.capture_seconds >= 0 and e.last_use > 1e9
    info = json.loads(json.dumps(cache.info()))
    assert info["backend"] == "eager"
    assert info["totals"] == {"entries": 1, "pool_bytes": 42, "pinned_pool_bytes": 42, "lazy_pool_bytes": 0}
    assert info["entries"][0]["pool"] == "pinned" and info["lazy_pool"] == "shared"
    assert info["budgets"]["max_entries"] == 8


def test_metrics_updated():
    m = Metrics()
    a = D(1, 1, True)
    cache, _ = make(metrics=m, sizes={a: 64})
    cache.run(a, real_tokens=1)
    cache.run(a)

    def val(name, labels=None):
        return m.registry.get_sample_value(name, labels or {})

    assert val("graphcache_graph_cache_hits_total") == 1
    assert val("graphcache_graph_cache_misses_total") == 1
    assert val("graphcache_graph_captures_total") == 1
    assert val("graphcache_graph_pool_bytes") == 64
    assert val("graphcache_graph_cache_entries") == 1
    assert val("graphcache_graph_backend_info", {"backend": "eager"}) == 1
    assert val("graphcache_steps_total", {"mode": "replay"}) == 0  # steps are the engine's to count


def test_zero_entries_means_no_capture():
    cache, _ = make(max_entries=0)
    assert cache.run(D(1, 1, True)) == "eager"
    assert cache.stats().failures["budget"] == 1


# --- pinned pool vs private pools: byte accounting ---

a8, b4, c2, x6, y1 = D(8, 8, True), D(4, 4, True), D(2, 2, True), D(6, 6, True), D(1, 1, True)


def pools_of(cache):
    return {e.descriptor: (e.pool, e.bytes) for e in cache.entries()}


def shared(cache, kind):
    """The shared pool record of `kind` ("pinned" | "lazy"), None when there is none."""
    return cache.store.pools.shared[kind]


def truth(cache):
    """What the fake allocator holds for the pools the cache's graphs live in."""
    return sum(cache.fake_pools.held[p] for p in {e.pool.handle for e in cache.store.entries()})


def test_pinned_entries_share_one_pool_and_count_its_growth():
    cache, _ = make(sizes={a8: 100, b4: 60, c2: 130, x6: 50})
    rep = cache.warmup([c2, a8, b4])  # captured largest first: a8, b4, c2
    assert rep.captured == ["8:8:decode", "4:4:decode", "2:2:decode"]
    # one shared pool: a8 reserves 100, b4 fits in it (growth 0), c2 needs 30 more
    assert pools_of(cache) == {
        "8:8:decode": ("pinned", 100),
        "4:4:decode": ("pinned", 0),
        "2:2:decode": ("pinned", 30),
    }
    assert len({cache.store.get(d).pool for d in (a8, b4, c2)}) == 1
    s = cache.stats()
    assert s.pinned_pool_bytes == 130 == s.pool_bytes == rep.pool_bytes
    assert cache.run(x6) == "replay"  # lazily admitted: the (new) lazy pool, its full size
    assert pools_of(cache)["6:6:decode"] == ("lazy", 50)
    assert cache.store.get(x6).pool is not cache.store.get(a8).pool
    assert cache.stats().pool_bytes == 130 + 50 and cache.stats().pinned_pool_bytes == 130
    assert cache.info()["totals"] == {
        "entries": 4,
        "pool_bytes": 180,
        "pinned_pool_bytes": 130,
        "lazy_pool_bytes": 50,
    }


def test_unpinned_warmup_and_already_cached_entries_keep_private_pools():
    cache, _ = make(sizes={a8: 100, b4: 60}, lazy_pool="private")
    cache.warmup([a8], pin=False)
    cache.run(b4)
    cache.warmup([a8, b4])  # already held: pinned now, but they stay in their private pools
    assert pools_of(cache) == {"8:8:decode": ("private", 100), "4:4:decode": ("private", 60)}
    assert all(e.pinned for e in cache.entries())
    assert cache.stats().pool_bytes == 160 and cache.stats().pinned_pool_bytes == 0


def test_budget_counts_pinned_growth_not_full_size_and_evicts_private_for_real():
    cache, _ = make(max_bytes=200, sizes={a8: 100, b4: 90, x6: 60, y1: 60, c2: 40}, lazy_pool="private")
    cache.warmup([a8, b4])  # b4's hint is a8's 100, but it fits in the pinned pool: no growth
    assert cache.stats().pool_bytes == 100 and not cache.info()["negative"]
    cache.run(x6)  # private 60: 160
    cache.run(y1)  # hint 60 (no smaller capture known: the smallest) -> 220 > 200: evict x6 first
    assert pools_of(cache) == {
        "8:8:decode": ("pinned", 100),
        "4:4:decode": ("pinned", 0),
        "1:1:decode": ("private", 60),
    }
    assert cache.stats().evictions["bytes"] == 1 and cache.stats().pool_bytes == 160
    # a pinned capture that fits in the pool needs no room; one that grows it makes room first
    cache.warmup([c2])
    assert pools_of(cache)["2:2:decode"] == ("pinned", 0) and cache.stats().evictions["bytes"] == 1


def test_pinned_capture_whose_growth_cannot_fit_is_refused_only_when_that_frees_it():
    # First pinned capture over budget: the pool holds only it, so refusing frees it all.
    cache, _ = make(max_bytes=50, sizes={a8: 100})
    rep = cache.warmup([a8])
    assert rep.failed == {"8:8:decode": "budget"} and shared(cache, "pinned") is None
    assert cache.stats().pool_bytes == 0 and cache.stats().pinned_pool_bytes == 0
    # Later pinned capture that grows the pool past the budget (hint short): its memory is
    # reserved in the shared pool either way, so it is kept and the bytes are counted.
    cache, _ = make(max_bytes=120, sizes={a8: 100, b4: 150})
    cache.warmup([a8])
    rep = cache.warmup([b4])
    assert rep.captured == ["4:4:decode"] and pools_of(cache)["4:4:decode"] == ("pinned", 50)
    assert cache.stats().pool_bytes == 150
    assert cache.run(y1) == "eager"  # no room for lazy captures until the budget allows
    assert cache.stats().failures["budget"] == 1


def _fail_on(desc, exc):
    def failpoint(d):
        if desc is None or d == desc:
            raise exc

    return failpoint


def test_failed_pinned_capture_keeps_accounting_and_pool():
    cache, _ = make(sizes={a8: 100, b4: 60, c2: 40})
    cache.failpoint = _fail_on(b4, RuntimeError("injected"))
    rep = cache.warmup([a8, b4, c2])
    assert rep.failed == {"4:4:decode": "error"} and rep.captured == ["8:8:decode", "2:2:decode"]
    assert cache.stats().pinned_pool_bytes == 100 and cache.stats().failures["error"] == 1
    assert len({cache.store.get(d).pool for d in (a8, c2)}) == 1
    # failing the first pinned capture leaves no pool behind
    cache, _ = make(sizes={a8: 100})
    cache.failpoint = _fail_on(None, torch.OutOfMemoryError("injected"))
    assert cache.warmup([a8]).failed == {"8:8:decode": "oom"}
    assert shared(cache, "pinned") is None and cache.stats().pool_bytes == 0


def test_manual_eviction_of_pinned_entries_frees_the_pool_with_the_last():
    cache, _ = make(sizes={a8: 100, b4: 60, x6: 50})
    cache.warmup([a8, b4])
    cache.run(x6)
    first_pool = shared(cache, "pinned").handle
    assert cache.evict(a8)  # the pool still serves b4: nothing returns, the bytes stay counted
    assert cache.stats().pinned_pool_bytes == 100 and cache.stats().pool_bytes == 150
    assert cache.evict(x6)  # the lazy pool's only graph: its bytes go at once
    assert cache.stats().pool_bytes == 100 and shared(cache, "lazy") is None
    assert cache.evict(b4)  # the last pinned graph: the pool goes
    assert shared(cache, "pinned") is None and cache.stats().pool_bytes == 0
    cache.warmup([b4])  # a new pool (a dropped handle is never captured into again)
    assert shared(cache, "pinned").handle != first_pool and pools_of(cache) == {"4:4:decode": ("pinned", 60)}


def test_clear_drops_pinned_and_lazy_pools():
    cache, _ = make(sizes={a8: 100, b4: 60, c2: 130, x6: 50})
    cache.warmup([a8, b4, c2])
    cache.run(x6)
    old = shared(cache, "pinned").handle
    rep = cache.clear()
    assert (rep.entries, rep.pool_bytes) == (4, 180)
    assert shared(cache, "pinned") is None and shared(cache, "lazy") is None and len(cache) == 0
    s = cache.stats()
    assert (s.pool_bytes, s.pinned_pool_bytes, s.lazy_pool_bytes, s.evictions["clear"]) == (0, 0, 0, 4)
    cache.warmup([b4, a8])
    assert shared(cache, "pinned").handle != old
    assert pools_of(cache) == {"8:8:decode": ("pinned", 100), "4:4:decode": ("pinned", 0)}


def test_pool_bytes_gauge_counts_pinned_pool_once():
    m = Metrics()
    cache, _ = make(metrics=m, sizes={a8: 100, b4: 60, x6: 50})
    cache.warmup([a8, b4])
    cache.run(x6)
    assert m.registry.get_sample_value("graphcache_graph_pool_bytes") == 150
    cache.clear()
    assert m.registry.get_sample_value("graphcache_graph_pool_bytes") == 0


def test_warmup_pins_at_most_its_share_of_the_budgets():
    cache, _ = make(max_entries=4, pin_share=0.5)
    report = cache.warmup([D(8, 8, True), D(4, 4, True), D(2, 2, True), D(1, 1, True)])
    assert len(report.captured) == 4 and report.unpinned == ["2:2:decode", "1:1:decode"]
    assert sum(e.pinned for e in cache.entries()) == 2
    cache.run(D(16, 2))  # a lazy capture still finds room: an unpinned one is evicted
    assert D(16, 2) in cache and len(cache) == 4


# --- capture_warmup: which captures run their step eagerly first (issue 11: capture time) ---


def _record_warmups(monkeypatch, fail_without_warmup=frozenset()):
    """Patch the cache's capture() to record (descriptor, warmup) and fail cold captures of some descs."""
    import graphcache.graphs.backend as backend_mod

    seen, real = [], backend_mod.capture

    def fake(step, *, backend, pool=None, warmup=False):
        seen.append(warmup)
        if not warmup and _record_warmups.current in fail_without_warmup:
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(step, backend=backend, pool=pool, warmup=warmup)

    monkeypatch.setattr(backend_mod, "capture", fake)
    return seen


def test_per_kernel_warmup_runs_once_per_family_and_always_runs_every_time(monkeypatch):
    seen = _record_warmups(monkeypatch)
    family = {8: "a", 16: "a", 32: "b", 64: "b"}
    cache, _ = make(warm_key=lambda d: family[d.num_tokens])
    for n in (8, 16, 32, 64):
        _record_warmups.current = n
        cache.run(D(n, n, True))
    assert seen == [True, False, True, False]  # the first of each family only

    seen.clear()
    cache, _ = make(capture_warmup="always")
    for n in (8, 16):
        cache.run(D(n, n, True))
    assert seen == [True, True]
    with pytest.raises(ValueError, match="capture_warmup"):
        make(capture_warmup="sometimes")


def test_capture_failing_without_warmup_is_retried_with_one_then_cached(monkeypatch):
    seen = _record_warmups(monkeypatch, fail_without_warmup={16})
    cache, r = make(warm_key=lambda d: "one family")
    for n in (8, 16):
        _record_warmups.current = n
        assert cache.run(D(n, n, True)) == "replay"
    assert seen == [True, False, True]  # 16: cold capture failed, the warmed retry worked
    assert D(16, 16, True) in cache and cache.stats().failures == {"error": 0, "oom": 0, "budget": 0}
    r.out.fill_(float("nan"))
    cache.run(D(16, 16, True))
    assert torch.equal(r.out, r.expected())


# --- admission "auto" and the capture-time budget (issue 11: captures never stall serving) ---


def test_auto_admission_captures_decode_at_once_and_mixed_at_the_nth_miss():
    cache, _ = make(admission="auto", admission_min_misses=3)
    assert cache.run(D(8, 8, True)) == "replay"  # uniform decode: first miss
    mixed = D(32, 32, False)
    assert [cache.run(mixed) for _ in range(4)] == ["eager", "eager", "replay", "replay"]
    with pytest.raises(ValueError, match="admission"):
        make(admission="sometimes")


class FakeClock:
    """Seconds advance only when the test says (serving) and by each capture's modelled cost."""

    def __init__(self, capture_cost: float) -> None:
        self.now, self.capture_cost = 0.0, capture_cost

    def __call__(self) -> float:
        return self.now


def test_capture_time_budget_defers_lazy_captures_and_reports_stalls():
    clock = FakeClock(0.05)
    r = Runner()

    def step(desc):  # a capture costs 50 ms of (fake) time; a replay or eager step nothing
        r.step(desc)
        clock.now += clock.capture_cost if is_capturing() else 0.0

    cache = GraphCache(
        step,
        backend="eager",
        config=CachePolicyConfig(
            max_entries=64, max_bytes=1 << 30, capture_time_share=0.1, capture_burst_seconds=0.08
        ),
        clock=clock,
    )
    modes = [cache.run(D(n, n, True)) for n in (1, 2, 4, 8)]
    # The burst (80 ms, plus 10% of the time spent capturing) pays for two 50 ms captures; the third is
    # over budget: eager, not refused.
    assert modes == ["replay", "replay", "eager", "eager"]
    s = cache.stats()
    assert s.lazy_captures == 2 and s.deferred == 2 and s.failures == {"error": 0, "oom": 0, "budget": 0}
    assert s.stall_seconds == pytest.approx(0.1) and s.worst_stall_seconds == pytest.approx(0.05)
    clock.now += 0.5 + 0.01  # 0.5 s of serving earns 50 ms of capture at a 10% share
    assert cache.run(D(4, 4, True)) == "replay"  # captured at a later miss
    assert cache.run(D(8, 8, True)) == "eager"  # and the budget is spent again
    assert cache.info()["admission"]["deferred"] == 3
    assert cache.info()["stalls"]["lazy_captures"] == 3
    # warmup and admin captures are never limited
    rep = cache.warmup([D(16, 16, True), D(32, 32, True)])
    assert len(rep.captured) == 2


def test_no_warmed_retry_at_tensor_parallel(monkeypatch):
    """At tp > 1 a retry on one rank would run the step's collectives alone: the failure is agreed instead."""
    from graphcache.graphs.policy.agreement import Agreement, decide

    class TwoRanks(Agreement):
        size = 2

        def agree(self, report):
            return decide([report])

    seen = _record_warmups(monkeypatch, fail_without_warmup={16})
    cache, _ = make(warm_key=lambda d: "one family", agreement=TwoRanks())
    for n in (8, 16):
        _record_warmups.current = n
        cache.run(D(n, n, True))
    assert seen == [True, False]  # no retry
    assert D(16, 16, True) not in cache and cache.stats().failures["error"] == 1


# --- the shared lazy pool (lazy_pool="shared", the default) ---


def test_lazy_entries_share_one_pool_and_count_its_growth():
    m = Metrics()
    cache, _ = make(metrics=m, sizes={a8: 100, b4: 60, c2: 130})
    for d in (a8, b4, c2):
        assert cache.run(d) == "replay"
    # a8 reserves 100, b4 fits in it (growth 0), c2 needs 30 more: the pool holds the largest, not the sum
    assert pools_of(cache) == {
        "8:8:decode": ("lazy", 100),
        "4:4:decode": ("lazy", 0),
        "2:2:decode": ("lazy", 30),
    }
    assert len({cache.store.get(d).pool for d in (a8, b4, c2)}) == 1
    s = cache.stats()
    assert s.lazy_pool_bytes == s.pool_bytes == 130 == truth(cache) and s.pinned_pool_bytes == 0
    assert cache.rank_pool_bytes() == [130]  # one process: its own measurement is the total
    assert m.registry.get_sample_value("graphcache_graph_pool_bytes") == 130
    assert cache.info()["totals"]["lazy_pool_bytes"] == 130
    # size hints stay each descriptor's own-pool size: known only for a8, captured into the empty pool
    assert cache.store.pools.size_hints == {a8: 100}
    profile = {p["descriptor"]: p["bytes"] for p in cache.profile()["descriptors"] if p["mode"]}
    assert profile == {"8:8:decode": 100, "4:4:decode": 0, "2:2:decode": 30}


def test_evicting_every_lazy_entry_drops_the_pool_and_never_reuses_its_handle():
    cache, _ = make(sizes={a8: 100, b4: 60, x6: 80})
    cache.run(a8)
    cache.run(b4)
    first = shared(cache, "lazy")
    assert cache.evict(a8)  # b4 still holds the pool: nothing returns, the bytes stay counted
    assert cache.stats().pool_bytes == 100 == truth(cache) and shared(cache, "lazy") is first
    assert cache.evict(b4)  # the last graph: the pool goes with it
    assert shared(cache, "lazy") is None and cache.stats().pool_bytes == 0
    assert cache.stats().evictions["manual"] == 2
    cache.run(x6)
    fresh = shared(cache, "lazy")
    assert fresh is not first and fresh.handle != first.handle
    assert pools_of(cache) == {"6:6:decode": ("lazy", 80)} and cache.store.pools.size_hints[x6] == 80


def test_entry_budget_in_the_lazy_pool_evicts_without_counting_freed_bytes():
    cache, _ = make(max_entries=2, sizes={a8: 100, b4: 60, c2: 40})
    cache.run(a8)
    cache.run(b4)
    cache.run(c2)  # the entry budget evicts a8, the pool's largest: the pool still holds 100 for b4 and c2
    assert cache.stats().evictions["entries"] == 1 and a8 not in cache
    assert cache.stats().pool_bytes == 100 == truth(cache)


def test_lazy_capture_that_outgrows_the_budget_drops_the_whole_lazy_pool():
    big = D(16, 16, True)
    cache, _ = make(max_bytes=200, sizes={y1: 40, c2: 50, big: 250})
    cache.run(y1)
    cache.run(c2)
    assert cache.stats().pool_bytes == 50
    # big's hint is c2's 50, which the pool already holds: captured into it, the pool grows to 250. Evicting
    # y1 or c2 alone frees nothing while big's graph lives, so the only way back under budget is refusing
    # big together with the rest of its pool.
    assert cache.run(big) == "eager"
    assert len(cache) == 0 and shared(cache, "lazy") is None and cache.stats().pool_bytes == 0
    s = cache.stats()
    assert s.evictions["bytes"] == 2 and s.failures["budget"] == 1
    assert cache.info()["negative"][0]["descriptor"] == "16:16:decode"
    assert cache.run(y1) == "replay" and pools_of(cache) == {"1:1:decode": ("lazy", 40)}  # a fresh pool


def test_pinned_capture_drops_the_lazy_pool_when_only_that_makes_room():
    cache, _ = make(max_bytes=200, sizes={a8: 150, y1: 40, c2: 30})
    cache.run(a8)  # lazy pool: 150
    cache.run(y1)  # fits in it: growth 0
    # A pinned capture of c2, hint 150 (no smaller capture known: the smallest), into the empty pinned pool:
    # 150 + 150 > 200. Evicting a8 alone would free nothing (y1 holds the pool), so both go, in LRU order.
    rep = cache.warmup([c2])
    assert rep.captured == ["2:2:decode"] and cache.stats().evictions["bytes"] == 2
    assert pools_of(cache) == {"2:2:decode": ("pinned", 30)} and shared(cache, "lazy") is None
    assert cache.stats().pool_bytes == 30 == truth(cache)


def test_no_eviction_when_evicting_everything_would_not_make_room():
    # Pinned pool 100 of a 150 budget; a lazy pool of 40. A capture whose hint is 100 cannot fit even with the
    # lazy pool gone (100 + 100 > 150): refused, and the lazy entries stay (evicting them would gain nothing).
    for lazy_pool in ("shared", "private"):
        cache, _ = make(max_bytes=150, sizes={a8: 100, y1: 40, x6: 100}, lazy_pool=lazy_pool)
        cache.run(y1)
        cache.warmup([a8])
        assert cache.stats().pool_bytes == 140
        cache.store.pools.size_hints[x6] = 100  # known from an earlier capture
        assert cache.run(x6) == "eager"
        s = cache.stats()
        assert s.failures["budget"] == 1 and sum(s.evictions.values()) == 0 and y1 in cache


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_budget_eviction_with_a_shared_lazy_pool_terminates_and_stays_within_budget(policy):
    import random

    rng = random.Random(7)
    descs = [D(n, n, n % 3 == 0) for n in range(1, 41)]
    sizes = {d: rng.randint(10, 300) for d in descs}  # some alone exceed what the budget leaves
    sizes.update(zip(descs[:3], (10, 20, 30), strict=True))
    cache, _ = make(max_entries=12, max_bytes=250, sizes=sizes, eviction_policy=policy)
    cache.warmup(descs[:3])  # pinned: 30 bytes of pinned pool
    drops = 0
    for _ in range(600):
        pool = shared(cache, "lazy")
        cache.run(rng.choice(descs))
        drops += pool is not None and shared(cache, "lazy") is not pool
        s = cache.stats()
        # Within budget after every step, and every byte counted is held: a pool is freed only with its last graph.
        assert s.pool_bytes <= 250 and s.pool_bytes == truth(cache)
        assert s.pool_bytes == s.pinned_pool_bytes + s.lazy_pool_bytes and len(cache) <= 12
    s = cache.stats()
    assert s.captures > 100 and s.hits > 100 and s.evictions["bytes"] > 0 and s.failures["budget"] > 0
    assert drops > 0  # the lazy pool was dropped for the budget (and later captures started a fresh one)
    assert all(e.pinned for e in cache.entries() if e.descriptor in map(str, descs[:3]))


def test_private_lazy_pool_keeps_one_pool_per_entry():
    cache, _ = make(sizes={a8: 100, b4: 60}, lazy_pool="private")
    cache.run(a8)
    cache.run(b4)
    assert pools_of(cache) == {"8:8:decode": ("private", 100), "4:4:decode": ("private", 60)}
    assert shared(cache, "lazy") is None and cache.stats().lazy_pool_bytes == 0
    assert cache.evict(a8) and cache.stats().pool_bytes == 60 == truth(cache)  # its bytes go at once
    assert cache.info()["lazy_pool"] == "private"
    with pytest.raises(ValueError, match="lazy_pool"):
        make(lazy_pool="pooled")


def test_failed_lazy_capture_leaves_the_shared_pool_consistent():
    def fail_capturing(desc):
        def step(d):
            r.step(d)
            if d == desc and is_capturing():
                raise RuntimeError("injected mid-capture failure")

        return step

    r = Runner()
    cache, _ = make(runner=r, sizes={a8: 100, b4: 60, c2: 130})
    cache.run(a8)
    pool = shared(cache, "lazy")
    cache.store.step_fn = fail_capturing(c2)
    assert cache.run(c2) == "eager" and cache.stats().failures["error"] == 1
    # The pool still serves a8; what the failed capture reserved there is re-measured and stays counted.
    assert shared(cache, "lazy") is pool and pool.graphs == 1
    assert cache.stats().pool_bytes == 130 == truth(cache)
    cache.store.step_fn = r.step
    assert cache.run(b4) == "replay" and pools_of(cache)["4:4:decode"] == ("lazy", 0)
    assert shared(cache, "lazy") is pool and pool.graphs == 2
    # A failure in the first capture of a lazy pool leaves no pool behind.
    cache, _ = make(runner=r, sizes={a8: 100})
    cache.store.step_fn = fail_capturing(a8)
    assert cache.run(a8) == "eager"
    assert shared(cache, "lazy") is None and cache.stats().pool_bytes == 0 and len(cache) == 0


def test_warmed_retry_keeps_a_live_lazy_pool_and_renews_an_empty_ones_handle(monkeypatch):
    import graphcache.graphs.backend as backend_mod

    handles, real = [], backend_mod.capture

    def fake(step, *, backend, pool=None, warmup=False):
        handles.append(pool)
        if not warmup and fail_cold:
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(step, backend=backend, pool=pool, warmup=warmup)

    monkeypatch.setattr(backend_mod, "capture", fake)
    fail_cold = False
    cache, _ = make(warm_key=lambda d: d.num_tokens >= 4)  # two kernel families
    cache.run(D(1, 1, True))  # family False, warm capture: the lazy pool's first graph
    cache.run(D(2, 2, True))  # cold capture into the same, live pool
    live = shared(cache, "lazy").handle
    fail_cold = True
    cache.evict(D(1, 1, True))
    cache.evict(D(2, 2, True))  # the pool is gone
    cache.run(D(4, 4, True))  # family True, warm: a fresh pool
    fresh = shared(cache, "lazy").handle
    assert fresh != live
    handles.clear()
    assert cache.run(D(8, 8, True)) == "replay"  # cold fails, the warmed retry goes into the same live pool
    assert handles == [fresh, fresh] and shared(cache, "lazy").handle == fresh
    cache.evict(D(4, 4, True))
    cache.evict(D(8, 8, True))  # the pool is gone again
    handles.clear()
    assert cache.run(D(16, 16, True)) == "replay"  # cold capture into a new, empty pool fails: its reset may
    cold, retry = handles  # have released the pool, so the retry takes a new handle
    assert cold != retry and shared(cache, "lazy").handle == retry and cold != fresh


def test_a_failed_capture_that_spoils_a_live_shared_pool_moves_its_kind_to_a_fresh_pool(monkeypatch):
    """A capture_end that fails leaves torch's pinned host allocator recording into the pool (capture.py
    _spoiled_pools), so that pool takes no capture again: the retry and every later capture of its kind go
    into a fresh pool, while the old pool's graphs keep replaying and stay counted until they are dropped."""
    import graphcache.graphs.backend as backend_mod

    spoiled, handles, real = set(), [], backend_mod.capture

    def fake(step, *, backend, pool=None, warmup=False):
        handles.append(pool)
        if not warmup and fail_cold:
            spoiled.add(pool)  # what a real invalidated capture does to its pool
            raise RuntimeError("operation failed due to a previous error during capture")
        return real(step, backend=backend, pool=pool, warmup=warmup)

    monkeypatch.setattr(backend_mod, "capture", fake)
    monkeypatch.setattr(
        backend_mod.EagerBackend, "accepts_captures", lambda self, handle: handle not in spoiled
    )
    fail_cold = False
    cache, _ = make(warm_key=lambda d: d.num_tokens >= 4)  # two kernel families
    cache.run(D(4, 4, True))  # family True, warm: the lazy pool's first graph
    cache.run(D(1, 1, True))  # family False, warm: its second
    old = shared(cache, "lazy")
    fail_cold = True
    handles.clear()
    assert cache.run(D(8, 8, True)) == "replay"  # family True again: cold, fails, retried warm elsewhere
    fresh = shared(cache, "lazy")
    assert fresh is not old and handles == [old.handle, fresh.handle] and fresh.graphs == 1
    assert cache.store.pools.retired == [old] and old.graphs == 2
    assert cache.run(D(1, 1, True)) == "replay" and cache.run(D(4, 4, True)) == "replay"
    cache.evict(D(1, 1, True))
    cache.evict(D(4, 4, True))  # the old pool's last graph: it leaves the books
    assert cache.store.pools.retired == [] and shared(cache, "lazy") is fresh
