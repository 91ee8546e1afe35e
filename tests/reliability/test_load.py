"""Load: 8 concurrent clients (streaming and not, completions and chat) for a fixed time against a
real server process. Nothing may be lost: every request ends with exactly max_tokens tokens and
finish_reason "length", and the server's own counters agree with what the clients saw."""

from __future__ import annotations

import asyncio
import json
import subprocess

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .support import PYTHON, REPO, load

MAX_TOKENS = 16


@pytest.mark.timeout(120)
async def test_mixed_load_completes_every_request_exactly(server):
    before = server.metrics()
    report = await load.run_load(
        load.LoadConfig(
            url=server.base_url, concurrency=8, duration_s=10.0, max_tokens=MAX_TOKENS, request_timeout_s=30.0
        )
    )

    assert report.num_errors == 0, report.error_summary()
    assert len(report.completed) >= 16, f"too little traffic to mean anything: {report.summary()}"
    kinds = {(r.stream, r.api) for r in report.completed}
    assert kinds == {(True, "completions"), (False, "completions"), (True, "chat"), (False, "chat")}
    assert all(r.completion_tokens == MAX_TOKENS and r.finish_reason == "length" for r in report.results)

    summary = report.summary()
    assert summary["ttft_s"]["p50"] is not None and summary["ttft_s"]["p99"] >= summary["ttft_s"]["p50"]
    assert summary["tpot_s"]["p50"] is not None and summary["tpot_s"]["p99"] >= summary["tpot_s"]["p50"]

    # The server counted exactly what the clients got: nothing finished twice, nothing vanished.
    after = server.wait_idle()
    finished = after.value("graphcache_requests_finished_total", reason="length") - before.value(
        "graphcache_requests_finished_total", reason="length"
    )
    generated = after.value("graphcache_generation_tokens_total") - before.value(
        "graphcache_generation_tokens_total"
    )
    assert finished == len(report.completed)
    assert generated == MAX_TOKENS * len(report.completed)
    for reason in ("abort", "error"):
        assert after.value("graphcache_requests_finished_total", reason=reason) == before.value(
            "graphcache_requests_finished_total", reason=reason
        )


@pytest.mark.timeout(60)
def test_load_cli_writes_a_json_report(server, tmp_path):
    """The command line the lead runs on the H200, shortened."""
    out = tmp_path / "load.json"
    result = subprocess.run(
        [
            PYTHON,
            str(REPO / "benchmarks" / "load.py"),
            "--url",
            server.base_url,
            "--concurrency",
            "4",
            "--num-requests",
            "8",
            "--max-tokens",
            "8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "throughput" in result.stdout and "TTFT" in result.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["requests"] == 8 and summary["completed"] == 8 and summary["errors"] == 0
    assert summary["output_tokens"] == 64
    assert {"throughput_req_s", "output_tok_s", "ttft_s", "tpot_s", "e2e_latency_s"} <= set(summary)


# --- the load generator's own honesty, against a stub that misbehaves on purpose ------------------


def misbehaving_app():
    """An OpenAI-looking stub: short completions, a stream without [DONE], a 503, and a hang."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "stub"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        await asyncio.sleep(
            0.05
        )  # yield: in-process transport would otherwise answer before other clients start
        prompt = body["prompt"]
        if prompt.startswith("The quick"):  # one token short
            return {
                "choices": [{"text": "x", "finish_reason": "length"}],
                "usage": {"completion_tokens": body["max_tokens"] - 1, "prompt_tokens": 1},
            }
        if prompt.startswith("Once"):  # right count, wrong reason
            return {
                "choices": [{"text": "x", "finish_reason": "stop"}],
                "usage": {"completion_tokens": body["max_tokens"], "prompt_tokens": 1},
            }
        if prompt.startswith("A cache"):
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)
        if prompt.startswith("Explain"):  # a stream that stops without [DONE]

            async def cut():
                yield 'data: {"choices": [{"text": "x", "finish_reason": null}]}\n\n'

            return StreamingResponse(cut(), media_type="text/event-stream")
        await asyncio.sleep(3600)  # hang: only the generator's own timeout ends this

    return app


@pytest.mark.timeout(60)
async def test_load_generator_counts_every_wrong_ending_and_never_hangs():
    transport = httpx.ASGITransport(app=misbehaving_app())
    # Five clients, five requests: client i sends prompt i (each takes its slot before any answer).
    config = load.LoadConfig(
        url="http://stub",
        concurrency=5,
        num_requests=5,
        duration_s=None,
        max_tokens=4,
        mode="nonstream",
        api="completions",
        request_timeout_s=1.0,
        prompts=load.DEFAULT_PROMPTS[:5],
    )
    async with httpx.AsyncClient(transport=transport, base_url="http://stub") as client:
        t0 = asyncio.get_running_loop().time()
        report = await load.run_load(config, client=client)
        elapsed = asyncio.get_running_loop().time() - t0
    assert len(report.results) == 5 and report.completed == []
    kinds = {r.prompt_index: r.error_kind for r in report.results}
    assert kinds == {0: "token_count", 1: "finish_reason", 2: "http_503", 3: "protocol", 4: "timeout"}, kinds
    assert elapsed < 10, f"bounded by the per-request timeout, took {elapsed:.1f}s"
