"""`graphcache serve` with GRAPHCACHE_TENSOR_PARALLEL_SIZE=2 on the CPU (gloo): the server process starts its
worker rank itself. Greedy completions (plain, streamed, a chunked long prompt) equal a TP=1 server's;
admin clear + warmup while a stream runs leave both ranks' cache decision logs equal (/admin/cache's
per-rank digests) and /metrics shows per-rank pool bytes; SIGTERM stops both processes (exit 0); a
killed worker makes the server report the engine dead and requests fail cleanly, with no hang."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from .support import assert_clean_error, completion_body

LONG_PROMPT = " ".join(["the graph cache keeps captured shapes warm"] * 12)  # > 64 tokens: chunked prefill
PROMPTS = ["Once upon a time", "hello hello", LONG_PROMPT]
SETTINGS = dict(
    max_num_batched_tokens=64,
    max_num_seqs=4,
    warmup_decode_sizes=[1, 2],
    num_kv_blocks=64,
    device="cpu",
    dtype="float32",
)
START_TIMEOUT_S = 240.0


def worker_pids(server_pid: int) -> list[int]:
    """The server's tensor-parallel workers: its children that multiprocessing spawned (not its resource tracker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            pids.append(int(entry.name))
    return pids


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def completions(base_url: str) -> list[str]:
    texts = []
    with httpx.Client(base_url=base_url, timeout=120.0) as client:
        for prompt in PROMPTS:
            response = client.post("/v1/completions", json=completion_body(prompt, 12))
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        texts.append(stream_text(client, PROMPTS[0], 12))
    return texts


def stream_text(client: httpx.Client, prompt: str, max_tokens: int) -> str:
    text = []
    with client.stream(
        "POST", "/v1/completions", json=completion_body(prompt, max_tokens, stream=True)
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                payload = json.loads(line[5:])
                assert "error" not in payload, payload
                text += [c["text"] for c in payload["choices"]]
    return "".join(text)


@pytest.mark.timeout(900)
def test_tp2_server_serves_like_tp1_and_stops_cleanly(server_factory):
    reference = server_factory("tp1", **SETTINGS)
    expected = completions(reference.base_url)
    reference.stop()
    assert len(set(expected)) > 1 and all(expected), expected

    server = server_factory("tp2", tensor_parallel_size=2, **SETTINGS)
    workers = worker_pids(server.proc.pid)
    assert len(workers) == 1, workers
    assert completions(server.base_url) == expected

    # Admin clear + warmup while a stream runs: every rank applies them between the same steps.
    streamed: list[str] = []
    with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
        background = threading.Thread(target=lambda: streamed.append(stream_text(client, PROMPTS[1], 60)))
        background.start()
        time.sleep(0.3)
        headers = server.admin_headers
        assert client.post("/admin/clear", headers=headers).status_code == 200
        warm = client.post("/admin/warmup", headers=headers, json={"sizes": [4, 2]})
        assert warm.status_code == 200, warm.text
        assert client.post("/admin/warmup", headers=headers).status_code == 200  # the configured set again
        background.join(120)
        assert streamed and streamed[0].startswith(expected[1])
    info = server.cache_info()
    ranks = info["tensor_parallel"]["ranks"]
    assert len(ranks) == 2 and ranks[0]["decisions"] == ranks[1]["decisions"] > 0, ranks
    assert ranks[0]["decision_digest"] == ranks[1]["decision_digest"], ranks
    metrics = server.metrics()
    assert metrics.value("graphcache_graph_pool_rank_bytes", rank="1") == ranks[1]["pool_bytes"]

    server.terminate()
    assert server.wait_exit(120) == 0, server.log_tail()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in workers), "the worker rank outlived the server"


@pytest.mark.timeout(600)
def test_killed_worker_makes_the_server_report_the_engine_dead(server_factory):
    server = server_factory("tp2-kill", tensor_parallel_size=2, **SETTINGS)
    (worker,) = worker_pids(server.proc.pid)
    os.kill(worker, signal.SIGKILL)
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead", health.text
        response = client.post("/v1/completions", json=completion_body("after the worker died", 4))
        assert_clean_error(response, 503)
        cache = client.get("/admin/cache", headers=server.admin_headers)
        assert cache.status_code == 503 and "rank 1" in cache.json()["error"]["message"], cache.text
    server.terminate()
    assert server.wait_exit(60) is not None, "the server hangs after its worker died"
