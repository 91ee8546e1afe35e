"""Operators clearing and re-warming the graph cache while traffic runs: no request fails, and every
greedy output equals an eager reference (a separate server with enforce_eager, so no graph is ever
involved there). Clear drops graphs mid-traffic; the next steps must capture again or run eagerly,
never replay something freed."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from .support import ServerProcess, load

MAX_TOKENS = 16
APIS = ("completions", "chat")


@pytest.fixture(scope="module")
def server_settings():
    # Captures allowed for every decode size the load produces; warmup pins 1..8 at start.
    return {"max_num_seqs": 8, "warmup_decode_sizes": [1, 2, 4, 8]}


@pytest.fixture(scope="module")
def eager_reference(cache_dir, log_dir) -> dict[tuple[str, int], str]:
    """(api, prompt index) -> greedy text from a server that never captures, one request at a time."""
    ref = ServerProcess(
        cache_dir,
        log_dir,
        name="eager-reference",
        enforce_eager=True,
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )
    try:
        ref.start()
        texts = {}
        with httpx.Client(base_url=ref.base_url, timeout=30.0) as client:
            for api in APIS:
                config = load.LoadConfig(max_tokens=MAX_TOKENS, api=api)
                for index, prompt in enumerate(config.prompts):
                    path, body = load.build_request(config, "graphcache-tiny", api, False, prompt)
                    body.pop("model")
                    response = client.post(path, json=body)
                    assert response.status_code == 200, response.text
                    choice = response.json()["choices"][0]
                    texts[(api, index)] = (
                        choice["text"] if api == "completions" else choice["message"]["content"]
                    )
        metrics = ref.metrics()
        assert metrics.value("graphcache_steps_total", mode="replay") == 0, "the reference must be eager"
        return texts
    finally:
        ref.stop()


async def admin_loop(server, stop: asyncio.Event) -> list[tuple[str, int, str]]:
    """clear / warmup / inspect, over and over, until told to stop; returns (call, status, body)."""
    calls = []
    async with httpx.AsyncClient(
        base_url=server.base_url, headers=server.admin_headers, timeout=30.0
    ) as client:
        while not stop.is_set():
            for method, path, body in (
                ("POST", "/admin/clear", None),
                ("GET", "/admin/cache", None),
                ("POST", "/admin/warmup", {"sizes": [1, 2, 4, 8]}),
                ("POST", "/admin/warmup", {"descriptors": ["16:2", "32:4"]}),
                ("GET", "/admin/cache", None),
            ):
                response = await client.request(method, path, json=body)
                calls.append((f"{method} {path}", response.status_code, response.text[:300]))
                await asyncio.sleep(0.05)
    return calls


@pytest.mark.timeout(180)
async def test_clear_and_warmup_under_load_lose_nothing_and_match_eager(server, eager_reference):
    before = server.metrics()
    stop = asyncio.Event()
    admin = asyncio.create_task(admin_loop(server, stop))
    try:
        report = await load.run_load(
            load.LoadConfig(
                url=server.base_url,
                concurrency=8,
                duration_s=8.0,
                max_tokens=MAX_TOKENS,
                request_timeout_s=60.0,
            )
        )
    finally:
        stop.set()
        calls = await asyncio.wait_for(admin, timeout=60)

    assert report.num_errors == 0, report.error_summary()
    failed_admin = [c for c in calls if c[1] != 200]
    assert not failed_admin, failed_admin[:5]
    assert sum(1 for c in calls if c[0] == "POST /admin/clear") >= 3, "the admin loop hardly ran"

    mismatches = [
        (r.api, r.stream, r.prompt_index, r.text, eager_reference[(r.api, r.prompt_index)])
        for r in report.completed
        if r.text != eager_reference[(r.api, r.prompt_index)]
    ]
    assert not mismatches, f"{len(mismatches)} of {len(report.completed)} differ from eager: {mismatches[:3]}"

    after = server.wait_idle()
    # The traffic really ran through graphs, and the clears really dropped them.
    assert after.value("graphcache_steps_total", mode="replay") > before.value(
        "graphcache_steps_total", mode="replay"
    )
    assert after.value("graphcache_graph_evictions_total", reason="clear") > before.value(
        "graphcache_graph_evictions_total", reason="clear"
    )
    assert after.value("graphcache_graph_captures_total") > before.value("graphcache_graph_captures_total")
    assert after.value("graphcache_requests_finished_total", reason="error") == before.value(
        "graphcache_requests_finished_total", reason="error"
    )


@pytest.mark.timeout(60)
def test_admin_cache_and_metrics_agree_after_the_storm(server):
    info = server.cache_info()
    metrics = server.metrics()
    entries = info.get("entries")
    assert isinstance(entries, list)
    assert metrics.value("graphcache_graph_cache_entries") == len(entries)


@pytest.mark.timeout(180)
async def test_cache_thrash_under_load_matches_eager(server_factory, eager_reference):
    """A cache of 2 entries for a load that needs a dozen shapes: every few steps a capture evicts
    another (LRU), entries are replaced while traffic replays them. Outputs must not notice."""
    thrash = server_factory(
        name="cache-thrash", max_num_seqs=8, cache_max_entries=2, warmup_decode_sizes=[], admission="always"
    )
    before = thrash.metrics()
    report = await load.run_load(
        load.LoadConfig(
            url=thrash.base_url, concurrency=8, duration_s=6.0, max_tokens=MAX_TOKENS, request_timeout_s=60.0
        )
    )
    assert report.num_errors == 0, report.error_summary()
    mismatches = [
        (r.api, r.stream, r.prompt_index, r.text, eager_reference[(r.api, r.prompt_index)])
        for r in report.completed
        if r.text != eager_reference[(r.api, r.prompt_index)]
    ]
    assert not mismatches, f"{len(mismatches)} of {len(report.completed)} differ from eager: {mismatches[:3]}"
    after = thrash.wait_idle()
    evicted = after.value("graphcache_graph_evictions_total", reason="entries") - before.value(
        "graphcache_graph_evictions_total", reason="entries"
    )
    assert evicted >= 5, f"only {evicted} evictions: the cache did not thrash"
    assert after.value("graphcache_graph_cache_entries") <= 2
