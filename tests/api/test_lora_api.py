"""LoRA adapters through the HTTP API on the CPU (--enable-lora): a request picks an adapter by its `model`
name (the openai client too), GET /v1/models lists the adapters with their base model as parent, an
unknown name is a 404, and concurrent requests mixing adapters and the base model each generate what a
server of that adapter merged into the weights generates (greedy)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import pytest_asyncio
from graphcache.config import Settings
from helpers_api import serving
from helpers_lora import peft_adapter
from helpers_model import tiny_checkpoint

pytest.importorskip("peft")
pytestmark = pytest.mark.asyncio(loop_scope="module")

SMALL = {
    "device": "cpu",
    "dtype": "float32",
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "warmup_decode_sizes": [],
    "warmup_mixed_sizes": [],
    "capture_sizes": [1, 2, 4, 8, 16, 32, 64],
}
PROMPTS = ["Once upon a time", "The quick brown fox", "In the beginning"]


@pytest.fixture(scope="module")
def base():
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base):
    return {
        "sql": peft_adapter(base, r=8, alpha=16, seed=21, magnitude=0.2),
        "chat": peft_adapter(
            base, r=4, alpha=4, targets=("q_proj", "v_proj", "down_proj"), seed=22, magnitude=0.3
        ),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(base, adapters):
    modules = [f"{name}={adapter}" for name, (adapter, _) in adapters.items()]
    settings = Settings(
        model=base, served_model_name="base", enable_lora=True, lora_modules=modules, max_loras=2, **SMALL
    )
    async with serving(settings) as pair:
        yield pair


async def _greedy(client: httpx.AsyncClient, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


async def _reference(path, prompts) -> list[str]:
    async with serving(Settings(model=path, served_model_name="ref", **SMALL)) as (client, _):
        return [await _greedy(client, "ref", p) for p in prompts]


async def test_models_lists_adapters_with_the_base_as_parent(served, adapters):
    client, _ = served
    cards = {c["id"]: c for c in (await client.get("/v1/models")).json()["data"]}
    assert set(cards) == {"base", "sql", "chat"}
    assert cards["base"]["parent"] is None
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == str(adapters["sql"][0])
    one = await client.get("/v1/models/chat")
    assert one.status_code == 200 and one.json()["parent"] == "base"


async def test_unknown_model_is_a_404_model_not_found(served):
    client, _ = served
    r = await client.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and "nope" not in r.text


async def test_mixed_concurrent_requests_each_equal_their_merged_model(served, adapters, base):
    client, _ = served
    jobs = [(model, p) for p in PROMPTS for model in ("base", "sql", "chat")]
    got = await asyncio.gather(*(_greedy(client, m, p) for m, p in jobs))
    expected = {
        "base": await _reference(base, PROMPTS),
        "sql": await _reference(adapters["sql"][1], PROMPTS),
        "chat": await _reference(adapters["chat"][1], PROMPTS),
    }
    for (model, prompt), text in zip(jobs, got, strict=True):
        assert text == expected[model][PROMPTS.index(prompt)], (model, prompt)
    assert expected["sql"] != expected["base"]  # the adapter changes what is generated


async def test_the_openai_client_selects_an_adapter_by_name(served):
    client, app = served
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
    async with openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
    ) as oai:
        out = await oai.completions.create(
            model="sql", prompt=PROMPTS[0], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.model == "sql"
        assert out.choices[0].text == await _greedy(client, "sql", PROMPTS[0])
        models = [m.id async for m in oai.models.list()]
        assert models == ["base", "sql", "chat"]


ADMIN = {"Authorization": "Bearer admin-secret"}


async def test_runtime_load_and_unload_under_traffic(base, adapters, tmp_path):
    settings = Settings(
        model=base,
        served_model_name="base",
        enable_lora=True,
        allow_runtime_lora_updating=True,
        admin_token="admin-secret",
        max_loras=1,
        **SMALL,
    )
    sql_dir, sql_merged = adapters["sql"]
    expected = await _reference(sql_merged, PROMPTS[:1])
    async with serving(settings) as (client, app):
        load = {"lora_name": "sql", "lora_path": str(sql_dir)}
        assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 401  # admin token
        r = await client.post("/v1/load_lora_adapter", json=load, headers=ADMIN)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
        again = await client.post("/v1/load_lora_adapter", json=load, headers=ADMIN)
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        assert "sql" in [c["id"] for c in (await client.get("/v1/models")).json()["data"]]
        # requests running with it while it is unloaded finish with it
        running = [asyncio.create_task(_greedy(client, "sql", PROMPTS[0])) for _ in range(3)]
        await asyncio.sleep(0.05)
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=ADMIN)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
        assert [await t for t in running] == expected * 3
        gone = await client.post("/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 1})
        assert gone.status_code == 404
        missing = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=ADMIN)
        assert missing.status_code == 404 and "cannot be found" in missing.json()["error"]["message"]
        # loaded again (another adapter under the same name): its own outputs, not the old KV's
        chat_dir, chat_merged = adapters["chat"]
        r = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(chat_dir)}, headers=ADMIN
        )
        assert r.status_code == 200
        assert await _greedy(client, "sql", PROMPTS[0]) == (await _reference(chat_merged, PROMPTS[:1]))[0]
        bad = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)}, headers=ADMIN
        )
        assert bad.status_code == 400 and "adapter_config.json is missing" in bad.json()["error"]["message"]
        assert "bad" not in [c["id"] for c in (await client.get("/v1/models")).json()["data"]]


async def test_runtime_updates_are_off_unless_allowed(served):
    client, _ = served
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
    # no admin token configured: admin is off (403 naming the token) before anything else
    assert r.status_code in (403, 404)


async def test_metrics_show_the_adapters_slots_and_load_times(served):
    client, _ = served
    await _greedy(client, "chat", PROMPTS[0])
    text = (await client.get("/metrics")).text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1, info
    assert (
        'max_lora="2"' in info[0]
        and "running_lora_adapters=" in info[0]
        and "waiting_lora_adapters=" in info[0]
    )
    assert float(info[0].rsplit(" ", 1)[1]) > 1e9  # the wall time of the last change, as vLLM
    assert "graphcache_lora_slots 2.0" in text
    in_use = next(line for line in text.splitlines() if line.startswith("graphcache_lora_slots_in_use "))
    assert 1 <= float(in_use.split()[1]) <= 2
    count = next(line for line in text.splitlines() if line.startswith("graphcache_lora_load_seconds_count"))
    assert float(count.split()[1]) >= 1


async def test_adapters_through_the_engine_process(base, adapters):
    """--engine-process: the runtime load and unload cross the pipe; adapters from the start and loaded
    ones generate what their merged models do."""
    from graphcache.engine.loop.process import EngineClient
    from graphcache.metrics import Metrics

    sql_dir, sql_merged = adapters["sql"]
    chat_dir, chat_merged = adapters["chat"]
    settings = Settings(
        model=base,
        served_model_name="base",
        enable_lora=True,
        lora_modules=[f"sql={sql_dir}"],
        allow_runtime_lora_updating=True,
        admin_token="admin-secret",
        max_loras=2,
        engine_process=True,
        **SMALL,
    )
    async with serving(settings, EngineClient(settings, Metrics())) as (client, _):
        load = {"lora_name": "chat", "lora_path": str(chat_dir)}
        r = await client.post("/v1/load_lora_adapter", json=load, headers=ADMIN)
        assert r.status_code == 200, r.text
        got = [await _greedy(client, m, PROMPTS[0]) for m in ("sql", "chat")]
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert (
            await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}, headers=ADMIN)
        ).status_code == 404
    assert got == [(await _reference(path, PROMPTS[:1]))[0] for path in (sql_merged, chat_merged)]
