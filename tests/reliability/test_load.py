"""Load: 8 concurrent clients (streaming and not, completions and chat) for a fixed time against a
real server process. Nothing may be lost: every request ends with exactly max_tokens tokens and
finish_reason "length", and the server's own counters agree with what the clients saw."""

from __future__ import annotations

import json
import subprocess

import pytest

from .support import PYTHON, REPO, load

MAX_TOKENS = 16


@pytest.mark.timeout(120)
async def test_mixed_load_completes_every_request_exactly(server):
    before = server.metrics()
    report = await load.run_load(load.LoadConfig(
        url=server.base_url, concurrency=8, duration_s=10.0, max_tokens=MAX_TOKENS, request_timeout_s=30.0))

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
    finished = (after.value("graphcache_requests_finished_total", reason="length")
                - before.value("graphcache_requests_finished_total", reason="length"))
    generated = (after.value("graphcache_generation_tokens_total")
                 - before.value("graphcache_generation_tokens_total"))
    assert finished == len(report.completed)
    assert generated == MAX_TOKENS * len(report.completed)
    for reason in ("abort", "error"):
        assert (after.value("graphcache_requests_finished_total", reason=reason)
                == before.value("graphcache_requests_finished_total", reason=reason))


@pytest.mark.timeout(60)
def test_load_cli_writes_a_json_report(server, tmp_path):
    """The command line the lead runs on the H200, shortened."""
    out = tmp_path / "load.json"
    result = subprocess.run(
        [PYTHON, str(REPO / "benchmarks" / "load.py"), "--url", server.base_url, "--concurrency", "4",
         "--num-requests", "8", "--max-tokens", "8", "--out", str(out)],
        capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "throughput" in result.stdout and "TTFT" in result.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["requests"] == 8 and summary["completed"] == 8 and summary["errors"] == 0
    assert summary["output_tokens"] == 64
    assert {"throughput_req_s", "output_tok_s", "ttft_s", "tpot_s", "e2e_latency_s"} <= set(summary)
