"""Graph-cache decisions agreed across tensor-parallel ranks (graphs/agreement.py), on 2 gloo processes.

Both ranks drive their own GraphCache with the same steps and admin calls (what rank 0's broadcast gives
them in the server); rank 1 alone fails one capture and measures too many bytes for another (and 10% more
for every capture). The decision logs, entries, negative caches and step modes must be identical on both ranks
throughout, with lazy entries in the shared lazy pool; each rank's reported pool bytes must be what it holds.
"""

from __future__ import annotations

import json

from graphcache.graphs.cache import GraphCache
from graphcache.graphs.descriptor import BatchDescriptor as D
from graphcache.graphs.policy.agreement import Agreement, CaptureReport, GroupAgreement, decide
from graphcache.graphs.policy.config import CachePolicyConfig
from graphcache.graphs.policy.profile import parse_profile
from helpers_dist import gloo_group, run_ranks

FAILS_ON_RANK_1 = D(16, 4)
TOO_BIG_ON_RANK_1 = D(32, 32, True)
BUDGET = 2000


def _decisions_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, world, port):
        held: dict = {}

        def measure(desc, pool):
            # A capture needs 10 bytes a token on rank 0, 11 on rank 1 (which measures one at 3x the budget),
            # and reuses what its pool holds: a pool holds its largest capture (the pinned and the lazy pool).
            need = 3 * BUDGET if rank == 1 and desc == TOO_BIG_ON_RANK_1 else (10 + rank) * desc.num_tokens
            held[pool] = max(held.get(pool, 0), need)
            return held[pool]

        def failpoint(desc):
            if rank == 1 and desc == FAILS_ON_RANK_1:
                raise RuntimeError("injected capture failure")

        ticks = iter(range(10**6))
        cache = GraphCache(
            lambda desc: None,
            backend="eager",
            config=CachePolicyConfig(max_entries=5, max_bytes=BUDGET, pin_share=0.5),
            measure_bytes=measure,
            agreement=GroupAgreement(),
            clock=lambda: next(ticks) * (1 + rank),
        )  # per-rank seconds: agreed as the max
        cache.failpoint = failpoint
        trace: list = []
        rank_bytes: list = []  # (the cache's per-rank figures, what this rank's pools hold): per rank, not compared

        def own_pools():
            return sum(held[h] for h in {e.pool.handle for e in cache.store.entries()})

        def step(desc):
            trace.append([str(desc), cache.run(desc, real_tokens=desc.num_tokens)])

        def snapshot(label):
            trace.append(
                [
                    label,
                    [(e.descriptor, e.pool, e.bytes) for e in cache.entries()],
                    sorted(n["descriptor"] for n in cache.info()["negative"]),
                    cache.stats().pool_bytes,
                ]
            )
            rank_bytes.append([cache.rank_pool_bytes(), own_pools()])

        report = cache.warmup([D(1, 1, True), D(2, 2, True), D(4, 4, True)])  # 2 pinned (pin_share 0.5)
        trace.append(["warmup", report.captured, report.unpinned, report.failed])
        for desc in [
            D(8, 8, True),
            D(4, 4, True),
            FAILS_ON_RANK_1,
            FAILS_ON_RANK_1,
            TOO_BIG_ON_RANK_1,
            D(64, 8),
            D(8, 2),
            D(16, 16, True),
            D(1, 1, True),
            D(8, 8, True),
        ]:
            step(desc)
        snapshot("after lazy captures")
        trace.append(["evict", cache.evict(D(8, 8, True))])
        profile = cache.profile()
        cache.clear()
        snapshot("after clear")
        report = cache.warmup(parse_profile(profile), pin=False)  # a profile warmup
        trace.append(["profile warmup", report.captured, report.failed])
        step(D(2, 2, True))
        snapshot("end")
        log = [vars(d) | {"rank_bytes": list(d.rank_bytes)} for d in cache.decision_log()]
        negative = {n["descriptor"]: n["detail"] for n in cache.info()["negative"]}
        gdsf = [e.capture_seconds for e in cache.entries()]
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(
                {"log": log, "trace": trace, "negative": negative, "seconds": gdsf, "rank_bytes": rank_bytes},
                f,
            )


def test_decision_logs_identical_on_both_ranks(tmp_path):
    run_ranks(_decisions_rank, 2, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["log"] == r1["log"]
    assert r0["trace"] == r1["trace"]
    assert r0["negative"] == r1["negative"]
    assert r0["seconds"] == r1["seconds"]  # capture seconds agreed (max), so GDSF would rank alike
    # Each rank's pool bytes as the cache reports them (from the agreed reports) equal what its pools hold.
    for rank, r in enumerate((r0, r1)):
        assert [reported[rank] for reported, _ in r["rank_bytes"]] == [held for _, held in r["rank_bytes"]]
    assert [reported for reported, _ in r0["rank_bytes"]] == [reported for reported, _ in r1["rank_bytes"]]
    log = [(d["op"], d["desc"], d["reason"]) for d in r0["log"]]
    # The injected failure on rank 1 alone was abandoned on both, remembered (negative cache) on both,
    # and its second step ran eagerly without another attempt.
    assert log.count(("refuse", str(FAILS_ON_RANK_1), "error")) == 2  # the step, then the profile warmup
    assert "rank 1: RuntimeError: injected capture failure" in r0["negative"][str(FAILS_ON_RANK_1)]
    modes = [t[1] for t in r0["trace"] if t[0] == str(FAILS_ON_RANK_1)]
    assert modes == ["eager", "eager"]
    # Rank 1's bytes alone refused a capture on both ranks. It was captured into the shared lazy pool, which
    # only dropping the pool could bring back within budget: its other entry went with it, on both ranks.
    refused = log.index(("refuse", str(TOO_BIG_ON_RANK_1), "budget"))
    assert log[refused - 1] == ("evict", "8:8:decode", "bytes")
    lazy = next(t for t in r0["trace"] if t[0] == "after lazy captures")
    assert {pool for _, pool, _ in lazy[1]} == {"pinned", "lazy"}
    # Budget evictions, a manual one, the clear, pins and per-rank bytes in the log.
    assert ["evict", True] in r0["trace"] and ("evict", "8:8:decode", "manual") in log
    assert ("clear", "", "") in log
    assert {reason for op, _, reason in log if op == "evict"} == {"entries", "bytes", "manual", "clear"}
    assert [d["rank_bytes"] for d in r0["log"] if d["op"] == "admit"][0] == [40, 44]
    assert sum(op == "warmup" for op, _, _ in log) == 2
    # Lazy captures replayed later on both ranks.
    assert ["4:4:decode", "replay"] in r0["trace"] and ["8:8:decode", "replay"] in r0["trace"]


def test_decide_rule():
    ok = [CaptureReport(True, bytes=10, seconds=1.0), CaptureReport(True, bytes=30, seconds=0.5)]
    v = decide(ok)
    assert v.ok and v.bytes == 30 and v.seconds == 1.0 and v.rank_bytes == (10, 30)
    v = decide([CaptureReport(True, bytes=10), CaptureReport(False, "oom", "OutOfMemoryError: x")])
    assert not v.ok and v.reason == "oom" and v.detail == "rank 1: OutOfMemoryError: x"
    v = decide([CaptureReport(True, state=1), CaptureReport(True, state=2)])
    assert not v.ok and "diverged" in v.diverged


def test_single_process_agreement_needs_no_group():
    assert Agreement().size == 1 and Agreement().agree(CaptureReport(True, bytes=7)).bytes == 7
    cache = GraphCache(
        lambda desc: None, backend="eager", config=CachePolicyConfig(max_entries=2, max_bytes=1 << 30)
    )
    cache.run(D(4, 4, True))
    cache.run(D(8, 8, True))
    cache.run(D(16, 16, True))
    assert [(d.op, d.desc, d.reason) for d in cache.decision_log()] == [
        ("admit", "4:4:decode", ""),
        ("admit", "8:8:decode", ""),
        ("evict", "4:4:decode", "entries"),
        ("admit", "16:16:decode", ""),
    ]
