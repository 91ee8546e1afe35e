"""KV cache exhaustion: a cache far too small for the batch the scheduler would like to run. Sequences
get preempted (their blocks freed, recomputed later); nothing deadlocks, every request finishes with
its exact token count, and the blocks all come back."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from .support import assert_clean_error, completion_body, load

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 16  # 256 tokens for 8 sequences of up to ~100 tokens each: preemption is certain
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server_settings():
    return {"max_num_seqs": 8, "block_size": BLOCK_SIZE, "num_kv_blocks": NUM_KV_BLOCKS}


@pytest.mark.timeout(150)
async def test_preemption_under_kv_pressure_finishes_everything(server):
    before = server.metrics()
    report = await load.run_load(
        load.LoadConfig(
            url=server.base_url, concurrency=8, duration_s=8.0, max_tokens=MAX_TOKENS, request_timeout_s=90.0
        )
    )

    assert report.num_errors == 0, report.error_summary()
    assert len(report.completed) >= 8

    after = server.wait_idle(timeout_s=30)
    preempted = after.value("graphcache_num_preemptions_total") - before.value(
        "graphcache_num_preemptions_total"
    )
    assert preempted > 0, "the KV cache was never exhausted: the test proves nothing"
    assert after.value("graphcache_kv_cache_usage_ratio") == 0
    finished = after.value("graphcache_requests_finished_total", reason="length") - before.value(
        "graphcache_requests_finished_total", reason="length"
    )
    assert finished == len(report.completed)

    # Recompute after preemption is the same greedy computation: a prompt gives one text, preempted or not.
    texts: dict[tuple[str, int], set[str]] = {}
    for r in report.completed:
        texts.setdefault((r.api, r.prompt_index), set()).add(r.text)
    diverged = {key: values for key, values in texts.items() if len(values) > 1}
    assert not diverged, f"greedy outputs differ between runs of one prompt: {diverged}"


@pytest.mark.timeout(60)
def test_a_request_that_can_never_fit_is_400_not_a_hang(server):
    """More tokens than the whole KV cache holds: refuse up front instead of preempting forever."""
    too_many = NUM_KV_BLOCKS * BLOCK_SIZE + 16
    with httpx.Client(base_url=server.base_url, timeout=30.0) as client:
        response = client.post("/v1/completions", json=completion_body(max_tokens=too_many))
    assert_clean_error(response, 400)


async def stream_and_leave(base_url: str, events_before_leaving: int) -> bool:
    """Hang up after that many SSE events; True if it did, False if the stream ended first (under load
    the server merges queued deltas into fewer events, so a whole completion can take fewer)."""
    body = completion_body("leaving under pressure", 200, stream=True)
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=60.0) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                data = line.removeprefix("data:").strip()
                if data == "[DONE]" or any(
                    c.get("finish_reason") for c in json.loads(data).get("choices", ())
                ):
                    return False  # it finished before this client could leave
                seen += 1
                if seen >= events_before_leaving:
                    return True
    return False


@pytest.mark.timeout(150)
async def test_disconnects_while_preempting_leak_no_blocks(server):
    """Clients hanging up while the scheduler preempts and recomputes: an aborted sequence may be
    running, preempted or waiting; in every state its blocks must come back."""
    before = server.metrics()
    leavers = [stream_and_leave(server.base_url, 1 + (i % 5) * 8) for i in range(10)]
    stayers = load.run_load(
        load.LoadConfig(
            url=server.base_url,
            concurrency=6,
            num_requests=18,
            duration_s=None,
            max_tokens=MAX_TOKENS,
            request_timeout_s=90.0,
        )
    )
    *left, report = await asyncio.wait_for(asyncio.gather(*leavers, stayers), timeout=120)
    assert report.num_errors == 0, report.error_summary()
    after = server.wait_idle(timeout_s=30)
    assert after.value("graphcache_kv_cache_usage_ratio") == 0
    aborted = after.value("graphcache_requests_finished_total", reason="abort") - before.value(
        "graphcache_requests_finished_total", reason="abort"
    )
    # A client that hung up before the end is an abort; one whose stream ended first is not.
    assert aborted == sum(left) and sum(left) >= 5, (aborted, left)
    assert after.value("graphcache_num_preemptions_total") > before.value("graphcache_num_preemptions_total")
