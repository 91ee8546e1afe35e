"""Clients that go away mid-request, while others keep loading the server: each disconnect aborts
its request at once (counted as finish reason "abort"), every KV block comes back, and the clients
that stayed get exactly what they asked for."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from .support import completion_body, load

# Long enough that no disconnected request could have finished on its own before the test is idle
# again (a tiny-model CPU step is ~ms: 1800 tokens is seconds), so an "abort" count can only come
# from the disconnects.
LONG_MAX_TOKENS = 1800
NUM_STREAM_LEAVERS = 6
NUM_NONSTREAM_LEAVERS = 2


async def leave_stream_after(base_url: str, chunks: int, chat: bool) -> int:
    """Open a stream, read `chunks` data events, hang up; returns the events read."""
    path, body = (
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "tell me everything"}],
                "max_tokens": LONG_MAX_TOKENS,
                "ignore_eos": True,
                "stream": True,
            },
        )
        if chat
        else ("/v1/completions", completion_body("tell me everything", LONG_MAX_TOKENS, stream=True))
    )
    seen = 0
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=30.0) as client,
        client.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                seen += 1
                if seen >= chunks:
                    break  # leaving the block closes the connection mid-stream
    return seen


async def leave_nonstream_after(base_url: str, seconds: float) -> None:
    """A non-streaming client that gives up (read timeout) while the server is still generating."""
    async with httpx.AsyncClient(base_url=base_url, timeout=seconds) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=completion_body("wait for me", LONG_MAX_TOKENS))


@pytest.mark.timeout(120)
async def test_disconnects_abort_free_blocks_and_spare_other_clients(server):
    before = server.metrics()
    leavers = [
        leave_stream_after(server.base_url, chunks=2 + i, chat=i % 2 == 1) for i in range(NUM_STREAM_LEAVERS)
    ]
    leavers += [leave_nonstream_after(server.base_url, 0.5) for _ in range(NUM_NONSTREAM_LEAVERS)]
    stayers = load.run_load(
        load.LoadConfig(
            url=server.base_url,
            concurrency=4,
            num_requests=24,
            duration_s=None,
            max_tokens=16,
            request_timeout_s=60.0,
        )
    )
    *left, report = await asyncio.wait_for(asyncio.gather(*leavers, stayers), timeout=90)

    assert report.num_errors == 0, report.error_summary()
    assert len(report.completed) == 24
    assert all(n >= 2 for n in left[:NUM_STREAM_LEAVERS])

    # Idle within seconds, although the leavers asked for thousands of tokens: they were aborted.
    after = server.wait_idle(timeout_s=20)
    assert after.value("graphcache_kv_cache_usage_ratio") == 0

    def delta(reason: str) -> float:
        return after.value("graphcache_requests_finished_total", reason=reason) - before.value(
            "graphcache_requests_finished_total", reason=reason
        )

    assert delta("abort") == NUM_STREAM_LEAVERS + NUM_NONSTREAM_LEAVERS
    assert delta("length") == 24, "exactly the clients that stayed finished by length"
    assert delta("error") == 0


async def send_and_hang_up(port: int, body: dict, linger_s: float) -> None:
    """Raw HTTP: the request goes out whole, the socket closes before any response byte (the server
    sends headers only with the first token, so an HTTP client could not leave this early)."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    await writer.drain()
    await asyncio.sleep(linger_s)
    writer.close()
    await writer.wait_closed()


@pytest.mark.timeout(60)
async def test_disconnect_before_the_first_token_is_aborted_too(server):
    """Hang up while the request waits for admission or its prefill: nothing may run on for nobody."""
    before = server.metrics()
    await asyncio.gather(
        *(
            send_and_hang_up(
                server.port, completion_body("gone", LONG_MAX_TOKENS, stream=stream), linger_s=0.01 * i
            )
            for i, stream in enumerate([True, False] * 3)
        )
    )
    # Twice idle, a second apart: a request that slipped in un-aborted would be running in between.
    await asyncio.sleep(0.5)
    server.wait_idle(timeout_s=20)
    await asyncio.sleep(1.0)
    after = server.wait_idle(timeout_s=20)

    def delta(reason: str) -> float:
        return after.value("graphcache_requests_finished_total", reason=reason) - before.value(
            "graphcache_requests_finished_total", reason=reason
        )

    # A request the server had not dispatched yet never enters the engine (nothing to abort); every
    # one that did was aborted, none ran its thousands of tokens to the end.
    assert delta("length") == 0
    assert delta("abort") <= 6
    assert after.value("graphcache_kv_cache_usage_ratio") == 0
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as client:
        response = await client.post("/v1/completions", json=completion_body(max_tokens=8))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
