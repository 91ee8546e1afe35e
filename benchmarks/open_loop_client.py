"""The open-loop client: requests streamed at their send times, over one or several client processes.

One asyncio process parsing every SSE chunk of every stream adds its own event-loop lag to the TTFT it
measures once tens of streams run at once (BENCHMARKS.md §9.1 found the burst client, not the server, at
fault before). So the requests of a window may be split round-robin over `procs` client processes that
share one start time (perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process), and each
process runs a lag probe beside its requests: a 10 ms sleep in a loop whose overshoot is how late the
loop was able to look at a chunk. A p99 lag near the TTFT p99 says the client measured itself.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx

from benchmarks import workloads

__all__ = ["one", "send"]

LAG_PROBE_S = 0.010


async def one(client: httpx.AsyncClient, req: workloads.Request, send_at: float, logprobs: int) -> dict:
    """Sleep until send_at (perf_counter), stream the request; per-token-chunk arrival times."""
    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
    body = {
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if req.seed is not None:
        body["seed"] = req.seed
    if logprobs >= 0:
        body["logprobs"] = logprobs
    t0 = time.perf_counter()
    times, counts, usage = [], [], None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return {"ok": False, "error": error, "start": t0, "end": t0, "send_at": send_at}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices") or ())
                if n:
                    times.append(now)
                    counts.append(n)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
        return {"ok": False, "error": error, "start": t0, "end": time.perf_counter(), "send_at": send_at}
    tokens = usage["completion_tokens"] if usage else 0
    ok = tokens == req.max_tokens and sum(counts) == tokens
    itl = [(b - a) / n for a, b, n in zip(times, times[1:], counts[1:], strict=False) for _ in range(n)]
    return {
        "ok": ok,
        "tokens": tokens,
        "send_at": send_at,
        "start": t0,
        "end": time.perf_counter(),
        "ttft": times[0] - t0 if times else math.nan,
        "tpot": (times[-1] - times[0]) / (tokens - 1) if times and tokens > 1 else math.nan,
        "itl": itl,
        "error": None if ok else f"{tokens} tokens ({sum(counts)} in chunks), wanted {req.max_tokens}",
    }


async def _lag_probe(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(LAG_PROBE_S)
        lags.append(time.perf_counter() - t - LAG_PROBE_S)


async def _send_part(
    url: str, jobs: list[tuple[workloads.Request, float]], logprobs: int
) -> tuple[list, list]:
    """jobs: (request, absolute perf_counter send time). (results in jobs' order, event-loop lags in s)."""
    n = len(jobs) + 8
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    stop, lags = asyncio.Event(), []
    probe = asyncio.create_task(_lag_probe(stop, lags))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0), limits=limits) as client:
        results = await asyncio.gather(*(one(client, r, at, logprobs) for r, at in jobs))
    stop.set()
    await probe
    return list(results), lags


_barrier = None  # set in each client process by _init_worker
_start = None


def _init_worker(barrier, start) -> None:
    global _barrier, _start
    _barrier, _start = barrier, start


def _worker(job: tuple) -> tuple[list, list]:
    """One client process: ready -> barrier; the parent sets the start time -> barrier; send."""
    url, requests, offsets, logprobs = job
    _barrier.wait()  # imported and ready
    _barrier.wait()  # the start time is set
    t0 = _start.value
    return asyncio.run(
        _send_part(url, [(r, t0 + o) for r, o in zip(requests, offsets, strict=True)], logprobs)
    )


def send(
    url: str, requests: list[workloads.Request], offsets: list[float], *, procs: int = 1, logprobs: int = 0
) -> tuple[list[dict], list[float], float]:
    """Send requests[i] at start + offsets[i]: (results in the requests' order, client event-loop lags in s
    over every process, start on perf_counter)."""
    if procs <= 1 or len(requests) < 2 * procs:
        t0 = time.perf_counter() + 0.05
        results, lags = asyncio.run(
            _send_part(url, [(r, t0 + o) for r, o in zip(requests, offsets, strict=True)], logprobs)
        )
        return results, lags, t0
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, start = ctx.Barrier(procs + 1), ctx.Value("d", 0.0)
    jobs = [(url, requests[i::procs], offsets[i::procs], logprobs) for i in range(procs)]
    with ctx.Pool(procs, initializer=_init_worker, initargs=(barrier, start)) as pool:
        pending = pool.map_async(_worker, jobs)
        barrier.wait(timeout=120)
        t0 = start.value = time.perf_counter() + 0.05
        barrier.wait(timeout=30)
        parts = pending.get()
    results: list[dict] = [{}] * len(requests)
    lags: list[float] = []
    for i, (part, part_lags) in enumerate(parts):
        results[i::procs] = part
        lags += part_lags
    return results, lags, t0
