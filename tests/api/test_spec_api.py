"""The vllm:spec_decode_* series on /metrics, through the HTTP app with --speculative-config set."""

from __future__ import annotations

import json

import pytest
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine
from graphcache.metrics import Metrics
from helpers_api import serving
from helpers_model import tiny_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def scrape(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_spec_decode_series_on_metrics(tmp_path):
    settings = Settings(
        cache_dir=tmp_path,
        model=tiny_checkpoint("qwen2"),  # a tiny model whose greedy outputs loop over their context
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        capture_sizes=[1, 2, 4, 8, 16],
        warmup_decode_sizes=[1, 2],
        speculative_config=json.dumps(SPEC),
        speculative_step_payoff=False,  # drafts whatever a busy machine's step times say (helpers_model)
    )
    async with serving(settings, Engine(settings, Metrics())) as (client, _app):
        prompt = list(range(5, 13)) * 4  # a repeating prompt: the n-gram proposer drafts from it
        r = await client.post(
            "/v1/completions",
            json={
                "model": _app.state.engine.model_name,
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 24
        text = (await client.get("/metrics")).text
    samples = scrape(text)
    names = {k.split("{", 1)[0] for k in samples}
    for name in (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    ):
        assert name in names, name
    drafts = sum(v for k, v in samples.items() if k.startswith("vllm:spec_decode_num_drafts_total"))
    draft_tokens = sum(
        v for k, v in samples.items() if k.startswith("vllm:spec_decode_num_draft_tokens_total")
    )
    accepted = sum(
        v for k, v in samples.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total")
    )
    assert drafts >= 1 and draft_tokens >= drafts and 0 <= accepted <= draft_tokens
    per_pos = [k for k in samples if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")]
    assert len(per_pos) == SPEC["num_speculative_tokens"]


def draft_settings(tmp_path, model, speculative_config: str | None) -> Settings:
    """The draft-model tests' CPU server (admin token "t0ken"; decode graphs of 1 and 2 rows warmed)."""
    return Settings(
        cache_dir=tmp_path,
        model=model,
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        capture_sizes=[1, 2, 4, 8, 16],
        warmup_decode_sizes=[1, 2],
        admin_token="t0ken",
        speculative_config=speculative_config,
        speculative_step_payoff=False,  # the tests count drafts: no step-time rule may turn them off
    )


async def test_draft_model_served_through_the_api(tmp_path):
    """--speculative-config draft_model end to end: completions equal the unspeculated server's (greedy),
    the spec-decode series count the self-draft's drafts as all accepted, and /admin/cache shows the
    draft's own graph cache with its warmed decode descriptors."""
    model = tiny_checkpoint("qwen2")
    body = {"prompt": [5, 9, 14, 3, 7, 22], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    answers = []
    draft = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    for spec in (None, json.dumps(draft)):
        settings = draft_settings(tmp_path, model, spec)
        async with serving(settings, Engine(settings, Metrics())) as (client, app):
            r = await client.post("/v1/completions", json={"model": app.state.engine.model_name, **body})
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["text"])
            if spec is None:
                continue
            samples = scrape((await client.get("/metrics")).text)
            admin = {"Authorization": "Bearer t0ken"}
            cache = (await client.get("/admin/cache", headers=admin)).json()
            cleared = (await client.post("/admin/clear", headers=admin)).json()
            assert "draft" in cleared, cleared
            after_clear = (await client.get("/admin/cache", headers=admin)).json()["draft"]["entries"]
            assert (await client.post("/admin/warmup", headers=admin)).status_code == 200
            rewarmed = (await client.get("/admin/cache", headers=admin)).json()["draft"]["entries"]
    assert answers[0] == answers[1]
    drafts = sum(v for k, v in samples.items() if k.startswith("vllm:spec_decode_num_draft_tokens_total"))
    accepted = sum(
        v for k, v in samples.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total")
    )
    assert drafts > 0 and accepted == drafts  # the target's own checkpoint drafts its own picks
    descriptors = {e["descriptor"] for e in cache["draft"]["entries"]}
    assert {"1:1:decode", "2:2:decode"} <= descriptors, descriptors
    assert any(e["hits"] > 0 for e in cache["draft"]["entries"])
    assert (
        after_clear == []
    )  # /admin/clear drops the draft's graphs too, the configured warmup brings them back
    assert {"1:1:decode", "2:2:decode"} <= {e["descriptor"] for e in rewarmed}
    proposer = cache["draft"]["proposer"]
    assert proposer["steps"] > 0 and proposer["requests"] == 0 and proposer["failures"] == 0, proposer
    assert proposer["kv_blocks_free"] == proposer["kv_blocks"]


async def test_verify_and_draft_graphs_on_admin_cache_and_metrics(tmp_path):
    """With a draft model and steps that speculate: /admin/cache lists the target's verify descriptors beside
    its others and the draft's own descriptors under "draft"; /metrics counts the draft's graph cache in
    graphcache_draft_graph_* series (hits, captures, entries, pool bytes) while the target's graphcache_graph_*
    series keep their names and labels and count the target's steps alone."""
    model = tiny_checkpoint("qwen2")
    draft = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    settings = draft_settings(tmp_path, model, json.dumps(draft))
    engine = Engine(settings, Metrics())
    async with serving(settings, engine) as (client, app):
        name = app.state.engine.model_name
        for i in range(3):
            body = {
                "prompt": [5 + i, 9, 14, 3, 7, 22],
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await client.post("/v1/completions", json={"model": name, **body})
            assert r.status_code == 200, r.text
        cache = (await client.get("/admin/cache", headers={"Authorization": "Bearer t0ken"})).json()
        text = (await client.get("/metrics")).text
    samples = scrape(text)
    target = {e["descriptor"]: e for e in cache["entries"]}
    verify = [d for d in target if d.endswith(":verify")]
    assert verify and any(target[d]["hits"] > 0 for d in verify), sorted(target)
    drafts = {e["descriptor"]: e for e in cache["draft"]["entries"]}
    assert {"1:1:decode", "2:2:decode"} <= drafts.keys() and not any(d.endswith(":verify") for d in drafts)

    # The draft's series: its own graph cache's figures, as /admin/cache reports them.
    stats = cache["draft"]["stats"]
    assert samples["graphcache_draft_graph_cache_hits_total"] == stats["hits"] > 0
    assert samples["graphcache_draft_graph_cache_misses_total"] == stats["misses"]
    assert samples["graphcache_draft_graph_captures_total"] == stats["captures"] >= 2
    assert samples["graphcache_draft_graph_cache_entries"] == len(drafts)
    assert samples["graphcache_draft_graph_pool_bytes"] == cache["draft"]["totals"]["pool_bytes"]
    assert samples['graphcache_draft_graph_backend_info{backend="eager"}'] == 1
    for reason in ("entries", "bytes", "clear", "manual"):
        assert f'graphcache_draft_graph_evictions_total{{reason="{reason}"}}' in samples
    # The target's series as they were: unlabelled, counting the target's cache only.
    assert samples["graphcache_graph_cache_hits_total"] == cache["stats"]["hits"] > 0
    assert samples["graphcache_graph_captures_total"] == cache["stats"]["captures"]
    assert samples["graphcache_graph_cache_entries"] == len(target)
