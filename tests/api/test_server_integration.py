"""The real `graphcache serve` process on a free loopback port, driven by the official `openai`
client: completions and chat (streaming and not), /metrics parsed with prometheus-client,
admin warmup/clear agreeing with the metrics, the admin gate, and a clean SIGTERM drain.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
TOKEN = "integration-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(base: str) -> dict[str, float]:
    """{"name{label=value}": value}, summed over labels under the bare name too."""
    out: dict[str, float] = {}
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
            if labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    port = free_port()
    env = {
        **os.environ,
        "GRAPHCACHE_CACHE_DIR": str(tmp / "cache"),
        "GRAPHCACHE_ADMIN_TOKEN": TOKEN,
        "GRAPHCACHE_LOG_FORMAT": "json",
    }
    log_path = tmp / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "graphcache.cli",
        "serve",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "128",
        "--capture-sizes",
        "1,2,4,8,16,32",
        "--warmup-decode-sizes",
        "1,2",
        "--drain-timeout-s",
        "20",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"server exited early:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"server not ready in 120 s:\n{log_path.read_text()[-4000:]}"
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield proc, base, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server[1]}/v1", api_key="not-needed", max_retries=0, timeout=60)


def test_health_and_model(server, client):
    assert httpx.get(f"{server[1]}/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["graphcache-tiny"]


def test_json_log_has_no_ansi_no_probe_lines_at_info_and_the_weight_progress(server):
    """The server has answered /ready polls and /metrics scrapes by now (the fixture polled /ready)."""
    base, log_path = server[1], server[2]
    assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
    httpx.get(
        f"{base}/v1/models", timeout=10
    )  # traffic, logged at INFO, so the log is flushed past the probes
    text = log_path.read_text()
    assert "\x1b" not in text and "\\u001b" not in text  # no ANSI escape, raw or JSON-escaped
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert not any("color_message" in r for r in records)
    access = [r for r in records if r["logger"] == "graphcache.access"]
    assert any(r["path"] == "/v1/models" and r["level"] == "info" for r in access), access
    assert not [r for r in access if r["path"] in ("/ready", "/metrics", "/health")], access  # DEBUG only
    assert any(r["msg"].startswith("loaded weights 1/1 (model.safetensors)") for r in records)


def test_completions_and_chat_with_openai_client_move_the_metrics(server, client):
    base = server[1]
    before = scrape(base)

    done = client.completions.create(
        model="graphcache-tiny", prompt="Once upon a time", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 8

    stream = client.completions.create(
        model="graphcache-tiny",
        prompt="Hello",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"

    chat = client.chat.completions.create(
        model="graphcache-tiny",
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5

    parts = list(
        client.chat.completions.create(
            model="graphcache-tiny",
            messages=[{"role": "user", "content": "Hi!"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert streamed == chat.choices[0].message.content  # greedy: streaming and not agree
    assert parts[-1].choices[0].finish_reason == "length"

    after = scrape(base)
    assert after["graphcache_requests_finished_total"] - before["graphcache_requests_finished_total"] == 4
    assert after["graphcache_generation_tokens_total"] - before["graphcache_generation_tokens_total"] == 24
    assert after["graphcache_steps_total"] > before["graphcache_steps_total"]
    assert after["graphcache_prompt_tokens_total"] > before["graphcache_prompt_tokens_total"]
    assert (
        after["graphcache_time_to_first_token_seconds_count"]
        - before["graphcache_time_to_first_token_seconds_count"]
        == 4
    )
    assert after["graphcache_ready"] == 1


def test_openai_client_sees_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="graphcache-tiny", prompt="x", max_tokens=10**9)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):  # an unknown model is a 404, as OpenAI and vLLM answer
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_responses_api_with_openai_client(client):
    """/v1/responses on the real server: a whole response, and a stream through responses.stream."""
    r = client.responses.create(
        model="graphcache-tiny",
        instructions="Be brief.",
        input="Hello",
        max_output_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "response" and r.status == "incomplete" and r.output_text
    assert r.usage.output_tokens == 4 and r.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(
        model="graphcache-tiny", input="Hello", max_output_tokens=4, extra_body={"ignore_eos": True}
    ) as stream:
        events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == text != ""


def test_admin_warmup_clear_and_metrics_agree(server):
    base = server[1]
    assert httpx.get(f"{base}/admin/cache").status_code == 401
    assert httpx.get(f"{base}/admin/cache", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert httpx.post(f"{base}/admin/clear", headers={"Authorization": "Bearer nope"}).status_code == 403

    r = httpx.post(
        f"{base}/admin/warmup", headers=AUTH, json={"sizes": [4], "descriptors": ["32:2"]}, timeout=60
    )
    assert r.status_code == 200, r.text
    report = r.json()
    assert set(report["captured"]) | set(report["cached"]) == {"4:4:decode", "32:2"} and not report["failed"]
    info = httpx.get(f"{base}/admin/cache", headers=AUTH).json()
    assert {"4:4:decode", "32:2", "1:1:decode", "2:2:decode"} <= {e["descriptor"] for e in info["entries"]}
    metrics = scrape(base)
    assert metrics["graphcache_graph_cache_entries"] == info["totals"]["entries"] == len(info["entries"])
    assert metrics["graphcache_graph_captures_total"] >= info["totals"]["entries"]

    cleared = httpx.post(f"{base}/admin/clear", headers=AUTH, timeout=60).json()
    assert cleared["entries"] == len(info["entries"])
    info = httpx.get(f"{base}/admin/cache", headers=AUTH).json()
    assert info["entries"] == [] and scrape(base)["graphcache_graph_cache_entries"] == 0


def test_sigterm_drains_in_flight_and_exits_0(server):
    """Runs last in the module: SIGTERM while a stream runs; the stream finishes, the process exits 0."""
    proc, base, log_path = server
    body = {"prompt": "A long story", "max_tokens": 60, "ignore_eos": True, "stream": True}
    result: dict = {}

    def stream() -> None:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            result["status"] = r.status_code
            result["text"] = "".join(r.iter_text())

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 30
    while scrape(base).get("graphcache_num_requests_running", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    reader.join(60)
    assert proc.wait(60) == 0, log_path.read_text()[-4000:]
    assert result["status"] == 200 and result["text"].endswith("data: [DONE]\n\n")
    assert '"finish_reason": "length"' in result["text"], result["text"][-500:]
    assert "Traceback" not in log_path.read_text()
