"""GraphCache behaviour on the eager backend: admission, LRU, budgets, pinning, negative cache,
clear, stats, padding, owner thread, failpoint, debug addresses, metrics."""

import threading

import pytest
import torch

from service.graphs.cache import GraphCache
from service.graphs.capture import eager_break
from service.graphs.descriptor import BatchDescriptor as D
from service.metrics import Metrics


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


def make(runner=None, sizes=None, **kw):
    runner = runner or Runner()
    sizes = sizes or {}
    kw = {"max_entries": 8, "max_bytes": 1 << 30, **kw}
    cache = GraphCache(runner.step, backend="eager", measure_bytes=lambda d, pool: sizes.get(d, 0), **kw)
    return cache, runner


def test_always_captures_on_first_miss_then_replays():
    cache, r = make()
    d = D(8, 8, True)
    assert cache.run(d) == "replay"  # captured (ran the step) then served
    assert cache.run(d) == "replay"
    s = cache.stats()
    assert (s.misses, s.hits, s.captures, s.steps_replay, s.steps_eager) == (1, 1, 1, 2, 0)
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
    cache, _ = make(max_bytes=250, sizes={a: 100, b: 100, c: 100})
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
    assert cache.stats().failures["budget"] == 1 and {str(a), str(b)} == {e.descriptor for e in cache.entries()}
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
    assert {n["descriptor"]: n["reason"] for n in cache.info()["negative"]} == {"2:2:decode": "error",
                                                                              "4:4:decode": "oom"}
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
    assert info["backend"] == "eager" and info["totals"] == {"entries": 1, "pool_bytes": 42}
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
    assert val("graphcache_steps_total", {"mode": "replay"}) == 2


def test_zero_entries_means_no_capture():
    cache, _ = make(max_entries=0)
    assert cache.run(D(1, 1, True)) == "eager"
    assert cache.stats().failures["budget"] == 1
