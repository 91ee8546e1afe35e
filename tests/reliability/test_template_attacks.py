"""Hostile chat templates against a real server that trusts request templates (issue 35, items 1-3, 5).

Before, a request's template rendered on the server's own threads: `7 ** 10000000` held the interpreter
(`/health` 8.25 s), `'a' * 10**8` took the server to a 15.8 GB peak, and four nested-loop templates held
the tokenizing threads for a minute after their clients left. Now templates render in killable worker
processes, under time, memory and size limits, and the sandbox refuses arithmetic and repetition
blow-ups before computing them. Every attack must get a 400 (never a 500) while `/health` stays quick (nine
probes in ten under 1 s, none past half of the old 8.25 s freeze) and an unrelated stream keeps at least half of
its rate alone. Margins suit a busy 2-core CI box, where one probe in a run can wait over a second for a core.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from .support import assert_clean_error

TIMEOUT_S = 2.0
ATTACKERS = 4
ATTACK_SECONDS = 3.0
ATTACK_RATE = 20  # requests a second per attacking client
STREAM_TOKENS = 32
HEALTH_P90_S = 1.0
HEALTH_MAX_S = 4.0  # half of the 8.25 s that `7 ** 10000000` froze /health for on the server's own thread
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
ATTACKS = {
    "power": "{{ 7 ** 10000000 }}",
    "string times": "{{ 'a' * 10**8 }}",
    "nested loops": NESTED_LOOPS,
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}
OWN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"


@pytest.fixture(scope="module")
def server_settings():
    return {
        "trust_request_chat_template": True,
        "chat_template_timeout_s": TIMEOUT_S,
        "chat_template_memory_mb": 256,
        "max_model_len": 1024,
    }


def _chat(template: str | None = None, max_tokens: int = 1, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}
    if template is not None:
        body["chat_template"] = template
    return body


def _probe(base_url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert client.get("/health").status_code == 200
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)


def _stream_rate(base_url: str, seconds: float) -> float:
    """Tokens a second of back-to-back streams over `seconds`."""
    body = {"prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    tokens, started = 0, time.perf_counter()
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        while time.perf_counter() - started < seconds:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                tokens += sum(1 for line in response.iter_lines() if line.startswith("data: {"))
    return tokens / (time.perf_counter() - started)


def _attack(base_url: str, template: str, deadline: float, out: list[httpx.Response]) -> None:
    """Attacks back to back, each client at most ATTACK_RATE a second: what is measured is what a
    template costs the server, not how a flood of cheap 400s shares two CPU cores with the stream."""
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        while time.monotonic() < deadline:
            started = time.monotonic()
            out.append(client.post("/v1/chat/completions", json=_chat(template)))
            time.sleep(max(0.0, 1 / ATTACK_RATE - (time.monotonic() - started)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_template_attacks_do_not_freeze_health_or_streams(server, attack):
    alone = _stream_rate(server.base_url, 2.0)
    health: list[float] = []
    responses: list[httpx.Response] = []
    stop = threading.Event()
    prober = threading.Thread(target=_probe, args=(server.base_url, stop, health))
    deadline = time.monotonic() + ATTACK_SECONDS
    attackers = [
        threading.Thread(target=_attack, args=(server.base_url, ATTACKS[attack], deadline, responses))
        for _ in range(ATTACKERS)
    ]
    prober.start()
    for thread in attackers:
        thread.start()
    under_attack = _stream_rate(server.base_url, ATTACK_SECONDS)
    for thread in attackers:
        thread.join(120)
    stop.set()
    prober.join(60)

    assert responses, "no attack was answered"
    for response in responses:
        assert response.status_code == 400, response.text
        assert assert_clean_error(response, 400)["code"] == "chat_template_error"
    health.sort()
    assert health[int(0.9 * (len(health) - 1))] < HEALTH_P90_S, (attack, health[-10:])
    assert health[-1] < HEALTH_MAX_S, (attack, health[-10:])
    assert under_attack >= 0.5 * alone, (attack, under_attack, alone)


def _tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (the template workers), MB."""
    total, pids = 0.0, [pid]
    while pids:
        p = pids.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            for tid in os.listdir(f"/proc/{p}/task"):
                pids += [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += int(status.split("VmRSS:")[1].split()[0]) / 1024
    return total


@pytest.mark.timeout(120)
def test_a_huge_rendered_text_costs_no_memory(server):
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
        client.post("/v1/chat/completions", json=_chat(OWN_TEMPLATE))  # the request pool's worker is up
        baseline = _tree_rss_mb(server.proc.pid)
        peak, done = baseline, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _tree_rss_mb(server.proc.pid))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            for template in ("{{ 'a' * 10**8 }}", "{{ 'a' * 10**7 }}", "{{ ('a' * 10000) * 10000 }}"):
                response = client.post("/v1/chat/completions", json=_chat(template))
                assert assert_clean_error(response, 400)["code"] == "chat_template_error"
            # Just under the sandbox's bound the text is built, then refused as longer than the context.
            response = client.post("/tokenize", json={**_chat("{{ 'a' * 32000 }}"), "max_tokens": None})
            assert response.status_code in (200, 400), response.text
        finally:
            done.set()
            sampler.join(30)
    assert peak - baseline < 200, (baseline, peak)


@pytest.mark.timeout(180)
def test_templates_whose_clients_left_free_their_workers(server):
    """Four nested-loop templates whose clients leave at once must not hold anything afterwards."""
    body = json.dumps(_chat(NESTED_LOOPS)).encode()
    for _ in range(ATTACKERS):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                server.base_url + "/v1/chat/completions",
                content=body,
                headers={"Content-Type": "application/json"},
                timeout=0.5,
            )
    started = time.perf_counter()
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
        assert client.post("/tokenize", json={"messages": _chat()["messages"]}).status_code == 200
        assert client.post("/v1/chat/completions", json=_chat()).status_code == 200
        # The request-template workers are free again too: killed when their clients left.
        own = client.post("/tokenize", json={"messages": _chat()["messages"], "chat_template": OWN_TEMPLATE})
        assert own.status_code == 200, own.text
    # Before: 57-59 s. A killed worker is replaced in well under a second; the margin is CI's.
    assert time.perf_counter() - started < TIMEOUT_S + 5
