"""GraphCache eviction policies on the eager backend: LRU (the default) and GDSF
(GreedyDual-Size-Frequency: H = L + (hits + 1) * capture seconds / MiB, lowest H evicted, L raised
to each budget-evicted H). Sizes come from `measure_bytes`, capture costs from an injected clock
that the fake step advances by its declared cost while it is being captured. Lazy entries get private
pools (lazy_pool="private"): the policies are compared where evicting one entry frees its bytes (in the
shared lazy pool only the last one does; tests/graphs/test_graph_cache.py covers that)."""

import json

import pytest
from graphcache.graphs.cache import GraphCache
from graphcache.graphs.capture import is_capturing
from graphcache.graphs.descriptor import BatchDescriptor as D
from graphcache.graphs.policy.config import CachePolicyConfig
from graphcache.graphs.policy.eviction import MIN_SIZE_BYTES

MiB = 1 << 20


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(policy, sizes, costs, **kw):
    """A cache whose captures of `d` take costs[d] seconds (on the fake clock) and hold sizes[d] bytes."""
    clock = FakeClock()

    def step(desc):
        if is_capturing():  # the eager backend's replay calls the step too: only capture costs time
            clock.now += costs.get(desc, 0.0)

    config = CachePolicyConfig(
        **{"max_entries": 64, "max_bytes": 1 << 40, "eviction_policy": policy, "lazy_pool": "private", **kw}
    )
    return GraphCache(
        step, backend="eager", measure_bytes=lambda d, pool: sizes.get(d, 0), config=config, clock=clock
    )


def held(cache):
    return {e.descriptor for e in cache.entries()}


a, b, c, d, e = D(1, 1, True), D(2, 2, True), D(4, 4, True), D(8, 8, True), D(16, 16, True)


def test_default_policy_is_lru_and_unknown_policy_names_the_choices():
    cache = GraphCache(
        lambda desc: None, backend="eager", config=CachePolicyConfig(max_entries=4, max_bytes=1 << 30)
    )
    assert cache.config.eviction_policy == "lru" and cache.info()["eviction"]["policy"] == "lru"
    with pytest.raises(ValueError, match="eviction_policy must be one of lru, gdsf") as err:
        CachePolicyConfig(max_entries=4, max_bytes=1 << 30, eviction_policy="lfu")
    assert "'lfu'" in str(err.value)


def test_capture_seconds_come_from_the_injected_clock():
    cache = make("lru", {a: 2 * MiB}, {a: 0.25})
    cache.run(a)
    cache.run(a)  # a replay: the fake step costs nothing outside a capture
    assert cache.entries()[0].capture_seconds == 0.25 and cache.stats().capture_seconds == 0.25


def _small_expensive_vs_large_cheap(policy):
    # small: 2 MiB, 100 ms capture, hit 3 times; large: 20 MiB, 10 ms capture, used last.
    # A new 2 MiB entry needs room in a 23 MiB budget: one of the two must go. (The newcomer is
    # the smallest batch, so its size hint is the smallest past capture, 2 MiB: see _size_hint.)
    small, large, new = b, c, a
    cache = make(
        policy,
        {small: 2 * MiB, large: 20 * MiB, new: 2 * MiB},
        {small: 0.100, large: 0.010, new: 0.050},
        max_bytes=23 * MiB,
    )
    cache.run(small)
    for _ in range(3):
        cache.run(small)
    cache.run(large)
    cache.run(large)  # the large one is the most recently used
    cache.run(new)
    return cache


def test_gdsf_keeps_frequent_expensive_small_entry_over_recent_cheap_large_one():
    lru = _small_expensive_vs_large_cheap("lru")
    assert held(lru) == {str(c), str(a)}  # LRU drops the small, expensive, popular entry
    gdsf = _small_expensive_vs_large_cheap("gdsf")
    assert held(gdsf) == {str(b), str(a)}  # GDSF drops the cheap large one
    assert gdsf.stats().evictions["bytes"] == 1
    # H(large) = 0 + 2 uses * 0.010 s / 20 MiB = 0.001 became L; the newcomer starts from it
    info = gdsf.info()
    assert info["eviction"] == {"policy": "gdsf", "gdsf_inflation": pytest.approx(0.001)}
    prio = {x["descriptor"]: x["priority"] for x in info["entries"]}
    assert prio[str(b)] == pytest.approx(4 * 0.100 / 2)  # last hit before any eviction: L was 0
    assert prio[str(a)] == pytest.approx(0.001 + 1 * 0.050 / 2)
    json.dumps(info)


def test_gdsf_priority_recomputed_on_hit_and_sizes_floored_at_one_mib():
    cache = make("gdsf", {a: 0, b: MIN_SIZE_BYTES // 4}, {a: 0.5, b: 0.5})
    cache.run(a)
    cache.run(b)
    assert [x.priority for x in cache.entries()] == [pytest.approx(0.5), pytest.approx(0.5)]  # both 1 MiB
    cache.run(a)
    cache.run(a)
    assert {x.descriptor: x.priority for x in cache.entries()}[str(a)] == pytest.approx(3 * 0.5)


def test_gdsf_ties_go_to_the_least_recently_used():
    cache = make("gdsf", dict.fromkeys((a, b, c), MiB), dict.fromkeys((a, b, c), 0.1), max_entries=2)
    cache.run(a)
    cache.run(b)  # same H as a, more recent
    cache.run(c)
    assert held(cache) == {str(b), str(c)}


def test_gdsf_ages_out_an_entry_popular_long_ago():
    # old: 1 MiB, 1 s, hit 5 times -> H = 6. Then a stream of one-off 1 MiB, 1 s descriptors
    # under a 2-entry budget: each newcomer evicts the previous one and L climbs by 1 each time,
    # until the newcomers' H reaches 6 and the old favourite (the least recently used on the tie) goes.
    stream = [D(n, n, False) for n in range(100, 110)]
    sizes, costs = {x: MiB for x in [a, *stream]}, {x: 1.0 for x in [a, *stream]}
    cache = make("gdsf", sizes, costs, max_entries=2)
    for _ in range(6):
        cache.run(a)
    assert cache.entries()[0].priority == pytest.approx(6.0)
    inflation = []
    for x in stream:
        cache.run(x)
        inflation.append(cache.info()["eviction"]["gdsf_inflation"])
        if str(a) not in held(cache):
            break
    # evictions of stream[0..4] raise L to 1..5; stream[6] arrives with a (H 6) and stream[5]
    # (H 5 + 1 = 6) held: the tie goes to a, popular but least recently used
    assert inflation == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert held(cache) == {str(stream[5]), str(stream[6])}
    # under LRU the same trace drops a at the second newcomer already
    lru = make("lru", sizes, costs, max_entries=2)
    for _ in range(6):
        lru.run(a)
    lru.run(stream[0])
    lru.run(stream[1])
    assert str(a) not in held(lru)


def test_clear_resets_inflation_and_manual_eviction_does_not_age():
    cache = make("gdsf", dict.fromkeys((a, b, c), MiB), dict.fromkeys((a, b, c), 1.0), max_entries=2)
    cache.run(a)
    cache.run(b)
    cache.run(c)  # evicts a (H 1): L = 1
    assert cache.info()["eviction"]["gdsf_inflation"] == 1.0
    cache.evict(b)  # manual: L unchanged
    assert cache.info()["eviction"]["gdsf_inflation"] == 1.0
    cache.clear()
    assert cache.info()["eviction"]["gdsf_inflation"] == 0.0


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_pinned_entries_never_evicted_by_budgets(policy):
    # pinned: cheap for their size (the lowest H of all) and the least recently used
    sizes = {a: MiB, b: MiB, c: 2 * MiB, d: 2 * MiB, e: 2 * MiB}
    costs = {a: 0.0001, b: 0.0001, c: 0.1, d: 0.1, e: 0.1}
    cache = make(policy, sizes, costs, max_bytes=6 * MiB)
    cache.warmup([a, b])  # pinned: 1 MiB of shared pool; room for two of c, d, e
    cache.run(c)
    cache.run(d)
    for _ in range(20):
        cache.run(e)  # each capture past the budget evicts an unpinned entry, never a or b
        cache.run(c)
        cache.run(d)
    for x in cache.entries():
        assert x.priority is None if (policy == "lru" or x.pinned) else x.priority > 0
    assert {str(a), str(b)} <= held(cache) and cache.stats().evictions["bytes"] >= 40
    assert all(x.pinned for x in cache.entries() if x.descriptor in (str(a), str(b)))
    # only pinned entries left: a capture is refused, not made room for
    cache2 = make(policy, sizes, costs, max_entries=2)
    cache2.warmup([a, b])
    assert cache2.run(c) == "eager" and cache2.stats().failures["budget"] == 1
    assert held(cache2) == {str(a), str(b)}


def test_gdsf_never_evicts_an_entry_pinned_after_lazy_admission():
    # an entry admitted lazily and pinned later by a warmup leaves the GDSF candidates
    cache = make("gdsf", {e: 40 * MiB, a: MiB, b: MiB}, {e: 0.001, a: 0.1, b: 0.1}, max_bytes=41 * MiB + 1)
    cache.run(a)
    cache.run(e)  # by far the lowest H
    cache.warmup([e])  # pinned now, still in its private pool
    cache.run(b)  # needs 1 MiB more than the budget has: a goes, e stays
    assert held(cache) == {str(e), str(b)} and cache.stats().evictions["bytes"] == 1
