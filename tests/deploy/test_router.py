"""Three graphcache replicas (the embedded tiny model, loopback ports) behind a real `vllm-router`.

- Cache locality: on a shared-prefix workload (24 system prompts, many user turns; each replica's KV cache
  holds less than the system prompts' working set), `cache_aware` and `kv_aware` (fed by the replicas' KV
  cache events) compute at most half the prefill tokens that `round_robin` does, summed over replicas.
- Failover: a replica killed with SIGKILL under load loses nothing silently (every request ends with a
  response or an HTTP error status, none hangs); new requests go to the live replicas once the router's
  health check drops it; restarted on its port, it rejoins.
- Drain: SIGTERM on one replica under load loses no request.

The table the benchmark prints (benchmarks/router_bench.py) is printed here too (pytest -s shows it).
Margins, not timings: the assertions compare token counts and statuses, never latencies.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import signal
import sys
import time
from pathlib import Path

import pytest

from .conftest import ROOT, find_tool

pytestmark = pytest.mark.slow


def _bench():
    name = "graphcache_benchmarks_router_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "router_bench.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[name]


bench = _bench()


@pytest.fixture(scope="module", autouse=True)
def _router_installed():
    if find_tool("vllm-router") is None:
        pytest.skip("vllm-router not installed: pip install -e '.[test]' (it pins vllm-router)")


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path


def test_kv_and_cache_aware_routing_compute_at_most_half_the_prefill_of_round_robin(log_dir):
    workload = bench.Workload()
    reports = {
        policy: bench.run_policy(policy, workload, bench.CPU_REPLICA, log_dir)
        for policy in ("round_robin", "cache_aware", "kv_aware")
    }
    print("\n" + bench.table(list(reports.values())))
    for report in reports.values():
        assert report.statuses == {"200": workload.requests}, report.statuses
    rr, ca, kv = reports["round_robin"], reports["cache_aware"], reports["kv_aware"]
    # Every replica served under round robin, and each holds less than the working set: it misses.
    assert all(r["requests"] == workload.requests / 3 for r in rr.per_replica)
    assert rr.hit_ratio < 0.5
    assert min(ca.prefill_computed, kv.prefill_computed) <= 0.5 * rr.prefill_computed
    # Both locality policies beat round robin by a margin (the better one by half, above).
    assert ca.prefill_computed <= 0.7 * rr.prefill_computed
    assert kv.prefill_computed <= 0.7 * rr.prefill_computed
    assert kv.hit_ratio > rr.hit_ratio + 0.15 and ca.hit_ratio > rr.hit_ratio + 0.15


def _fleet(log_dir: Path, policy: str = "round_robin"):
    reps = [bench.Replica(f"r{i}", log_dir, bench.CPU_REPLICA).start() for i in range(3)]
    router = bench.Router(reps, policy, log_dir).start()
    return reps, router


def _load(url: str, prompts: list[list[int]], concurrency: int = 4, stream: bool = False) -> list[cf.Future]:
    """Whole answers: a stream a replica's death cuts after its first byte cannot be retried by the router
    (the client sees it end without [DONE]); a whole answer can, and is."""
    pool = cf.ThreadPoolExecutor(concurrency)
    futures = [pool.submit(bench.send, url, p, 4, 30, stream) for p in prompts]
    pool.shutdown(wait=False)
    return futures


def _finished(futures, timeout_s: float = 120) -> list:
    """Every outcome; a request still running at the deadline is a hang and fails the test."""
    done, not_done = cf.wait(futures, timeout=timeout_s)
    assert not not_done, f"{len(not_done)} requests hung"
    return [f.result() for f in futures]


def test_sigkill_under_load_loses_nothing_and_the_replica_rejoins(log_dir):
    reps, router = _fleet(log_dir)
    try:
        prompts = bench.Workload(requests=150).prompts(reps[0].url)
        futures = _load(router.url, prompts)
        while sum(f.done() for f in futures) < 40:
            time.sleep(0.05)
        reps[1].signal(signal.SIGKILL)
        outcomes = _finished(futures)
        # An answer or an HTTP error status for every request: no client-side timeout, nothing cut off.
        statuses = [o.status for o in outcomes]
        assert all(isinstance(s, int) for s in statuses), {str(s): statuses.count(s) for s in statuses}
        assert sum(o.status == 200 for o in outcomes) >= 0.95 * len(outcomes)  # the router retried the rest
        # Within the router's health interval (1 s x 2 failures), new requests go to the live replicas.
        time.sleep(3)
        served = [r.counters()["requests"] for r in (reps[0], reps[2])]
        after = _finished(_load(router.url, prompts[:30]))
        assert [o.status for o in after] == [200] * 30
        assert sum(r.counters()["requests"] for r in (reps[0], reps[2])) - sum(served) == 30
        # Restarted on its port, it rejoins: round robin hands it its share again.
        reps[1].start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert [o.status for o in _finished(_load(router.url, prompts[:6]))] == [200] * 6
            if reps[1].counters()["requests"] > 0:
                break
            time.sleep(0.5)
        assert reps[1].counters()["requests"] > 0, "the restarted replica never got a request"
    finally:
        router.stop()
        for r in reps:
            r.stop()


def test_sigterm_drain_loses_no_request(log_dir):
    reps, router = _fleet(log_dir)
    try:
        prompts = bench.Workload(requests=120, seed=1).prompts(reps[0].url)
        futures = _load(router.url, prompts)
        while sum(f.done() for f in futures) < 30:
            time.sleep(0.05)
        reps[1].signal(signal.SIGTERM)
        outcomes = _finished(futures)
        assert [o.status for o in outcomes] == [200] * len(outcomes), {str(o.status) for o in outcomes}
        assert reps[1].proc.wait(30) == 0  # drained and exited cleanly
    finally:
        router.stop()
        for r in reps:
            r.stop()
