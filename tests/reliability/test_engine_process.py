"""engine_process=true (engine/loop/process.py): the step loop in a child process behaves, through HTTP, as the
in-process engine does: the same greedy outputs, the same 4xx bodies, admin calls proxied, one merged
/metrics, aborts on disconnect, and a killed child ends every request cleanly instead of hanging it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .support import InProcessServer, assert_clean_error, completion_body
from .test_sigterm import assert_clean_exit_log, new_request_after_sigterm, run_request

SETTINGS = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "drain_timeout_s": 10.0, "device": "cpu"}


@pytest.fixture(scope="module")
def servers(cache_dir):
    """(engine process server, in-process reference server), same model and settings."""
    started = []
    try:
        for engine_process in (True, False):
            server = InProcessServer(cache_dir, engine_process=engine_process, **SETTINGS)
            started.append(server)
            server.start()
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60.0, **kw)


def _stream_text(server, path: str, body: dict) -> tuple[str, list]:
    text, finish = "", []
    with httpx.stream(
        "POST", server.base_url + path, json={**body, "stream": True}, timeout=60.0
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            for choice in json.loads(line[5:])["choices"]:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if choice.get("finish_reason"):
                    finish.append(choice["finish_reason"])
    return text, finish


CHAT = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 24, "temperature": 0}
COMPLETION = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0}


def test_greedy_outputs_equal_the_in_process_engine(servers):
    child, ref = servers
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        answers = [_post(s, path, body).json() for s in (child, ref)]
        for a in answers:
            a.pop("id"), a.pop("created")
        assert answers[0] == answers[1], (path, answers)
        assert _stream_text(child, path, body) == _stream_text(ref, path, body), path
    many = [{**COMPLETION, "prompt": f"prompt number {i}", "n": 2, "logprobs": 2} for i in range(4)]
    for (
        body
    ) in many:  # several choices and logprobs cross the pipe too (values: batching may differ by float noise)
        got = [_post(s, "/v1/completions", body).json()["choices"] for s in (child, ref)]
        for a, b in zip(*got, strict=True):
            assert (a["text"], a["finish_reason"], a["logprobs"]["tokens"]) == (
                b["text"],
                b["finish_reason"],
                b["logprobs"]["tokens"],
            )
            assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-3)


def test_bad_input_gets_the_same_4xx_bodies(servers):
    child, ref = servers
    bad = [
        ("/v1/completions", {"prompt": list(range(1, 6)) * 1000, "max_tokens": 4}),  # longer than the context
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 4, "logit_bias": {"99999999": 1}},
        ),  # id out of range
        ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 10_000}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": -1}),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                },
            },
        ),
    ]
    for path, body in bad:
        got = [_post(s, path, body) for s in (child, ref)]
        assert 400 <= got[1].status_code < 500, got[1].text
        assert got[0].status_code == got[1].status_code, (body, got[0].text, got[1].text)
        assert got[0].json() == got[1].json()
        assert_clean_error(got[0])


def test_admin_calls_go_through_the_proxy(servers):
    child, ref = servers
    headers = child.admin_headers
    warm = httpx.post(child.base_url + "/admin/warmup", json={"sizes": [1, 2]}, headers=headers, timeout=120)
    assert warm.status_code == 200, warm.text
    info = httpx.get(child.base_url + "/admin/cache", headers=headers, timeout=30).json()
    assert {"1:1:decode", "2:2:decode"} <= {e["descriptor"] for e in info["entries"]}, info
    ref_info = httpx.get(ref.base_url + "/admin/cache", headers=headers, timeout=30).json()
    assert set(info) == set(ref_info)
    profile = httpx.get(
        child.base_url + "/admin/cache/profile", params={"min_uses": 0}, headers=headers, timeout=30
    )
    assert profile.status_code == 200 and "descriptors" in json.dumps(profile.json()), profile.text
    cleared = httpx.post(child.base_url + "/admin/clear", headers=headers, timeout=30)
    assert cleared.status_code == 200, cleared.text
    after = httpx.get(child.base_url + "/admin/cache", headers=headers, timeout=30).json()
    assert after["entries"] == [], after
    bad = httpx.post(child.base_url + "/admin/warmup", json={"sizes": [3]}, headers=headers, timeout=30)
    assert bad.status_code == 400


def test_metrics_merge_both_processes_without_duplicates(servers):
    child, _ = servers
    assert _post(child, "/v1/completions", {**COMPLETION, "max_tokens": 2}).status_code == 200
    assert _post(child, "/v1/completions", {"prompt": "x", "max_tokens": 10_000}).status_code == 400
    text = httpx.get(child.base_url + "/metrics", timeout=10).text
    families = list(text_string_to_metric_families(text))
    names = Counter(f.name for f in families)
    assert not [n for n, c in names.items() if c > 1], names
    types = Counter(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE"))
    assert not [n for n, c in types.items() if c > 1]
    for name in (
        "graphcache_steps",
        "graphcache_generation_tokens",
        "vllm:num_requests_running",
        "vllm:generation_tokens",
        "http_requests",
        "process_cpu_seconds",
        "graphcache_requests_rejected",
    ):
        assert name in names, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    assert (
        sum(v for (n, _), v in samples.items() if n == "graphcache_steps_total") > 0
    )  # recorded in the child
    assert samples[("graphcache_requests_rejected_total", (("reason", "invalid"),))] >= 1  # in the parent
    assert samples[("graphcache_ready", ())] == 1


async def _wait(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_client_disconnect_aborts_in_the_engine_process(servers):
    child, _ = servers
    engine = child.engine
    async with httpx.AsyncClient(base_url=child.base_url, timeout=60.0) as client:
        body = completion_body("a long one", 200, stream=True, ignore_eos=True)
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break  # the first token arrived: leave
    await _wait(lambda: engine.stats()["in_flight"] == 0)
    await _wait(
        lambda: (
            engine.stats().get("running") == 0
            and engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
        )
    )


@pytest.mark.timeout(180)
async def test_a_killed_engine_process_fails_requests_and_health(cache_dir):
    server = InProcessServer(cache_dir, engine_process=True, **SETTINGS).start()
    try:
        engine = server.engine
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0) as client:
            body = completion_body("never finishes", 240, stream=True, ignore_eos=True)
            plain = asyncio.create_task(client.post("/v1/completions", json={**body, "stream": False}))
            events = []
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        events.append(line[5:].strip())
                        if len(events) == 1:
                            os.kill(engine.pid, signal.SIGKILL)
            assert events[-1] == "[DONE]", events[-3:]
            assert "error" in json.loads(events[-2]), events[-2]
            answer = await asyncio.wait_for(plain, 30)
            assert_clean_error(answer, 500)
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "dead"
            late = await client.post("/v1/completions", json=completion_body("hi", 4))
            assert_clean_error(late, 503)
            assert "SIGKILL" in engine.error, engine.error
            admin = await client.get("/admin/cache", headers=server.admin_headers)
            assert admin.status_code == 503 and "SIGKILL" in admin.text
            assert (await client.get("/metrics")).status_code == 200  # the API's own series still served
    finally:
        server.stop()


@pytest.mark.timeout(240)
async def test_sigterm_drains_through_the_engine_process(server_factory):
    drain_timeout = 60.0
    server = server_factory(engine_process=True, drain_timeout_s=drain_timeout, max_num_seqs=4)
    started = [asyncio.Event() for _ in range(4)]
    tasks = [
        asyncio.create_task(
            run_request(server.base_url, stream=i % 2 == 0, max_tokens=120, started=started[i])
        )
        for i in range(4)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
    await asyncio.sleep(0.2)
    server.terminate()
    late = await new_request_after_sigterm(server.base_url)
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=drain_timeout + 30)
    code = await asyncio.to_thread(server.wait_exit, drain_timeout + 30)
    assert late in ("refused", "503"), late
    assert [o["kind"] for o in outcomes] == ["finished"] * 4, outcomes
    assert code == 0, f"exit code {code}:\n{server.log_tail()}"
    assert_clean_exit_log(server)


def test_tensor_parallel_with_engine_process_is_refused_naming_the_fix():
    from graphcache.config import Settings
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="GRAPHCACHE_ENGINE_PROCESS=false"):
        Settings(engine_process=True, tensor_parallel_size=2, device="cpu")


@pytest.mark.timeout(120)
def test_a_load_error_in_the_engine_process_turns_the_client_dead(tmp_path):
    from graphcache.config import Settings
    from graphcache.engine.errors import EngineDead
    from graphcache.engine.loop.frontend import EngineState
    from graphcache.engine.loop.process import EngineClient

    engine = EngineClient(Settings(model=tmp_path / "no-such-model", device="cpu", engine_process=True))
    engine.start()
    try:
        assert not engine.wait_ready(90)
        assert engine.state is EngineState.DEAD
        assert "model load failed" in engine.error, engine.error
        assert isinstance(engine.refusal(), EngineDead)
    finally:
        engine.shutdown(30)
    assert not engine._process.is_alive()


def test_outputs_cross_the_pipe_unchanged():
    """pack_outputs sends plain deltas as tuples and everything else as it is; unpacking gives back equal
    outputs (order within a step does not matter: one output per request)."""
    import pickle

    from graphcache.engine.loop.messages import pack_outputs, unpack_outputs
    from graphcache.engine.sequence import RequestOutput, TokenLogprob

    outputs = [
        RequestOutput("plain", "", [17, 4], False, None, 9, 2),
        RequestOutput("text", "hi", [5], False, None, 3, 1),  # detokenized in the engine
        RequestOutput("cached", "", [6], False, None, 32, 1, num_cached_tokens=16),  # first delta
        RequestOutput("logprobs", "", [7], False, None, 3, 1, logprobs=[TokenLogprob(7, -0.5, 1)]),
        RequestOutput("done", "", [2], True, "stop", 3, 4, stopped_on_token=True),
        RequestOutput("failed", "", [], True, "error", 3, 0, "boom"),
    ]
    packed = pickle.loads(pickle.dumps(pack_outputs(outputs)))
    assert [p[0] for p in packed[0]] == ["plain"]
    back = unpack_outputs(packed)
    assert sorted(back, key=lambda o: o.request_id) == sorted(outputs, key=lambda o: o.request_id)
