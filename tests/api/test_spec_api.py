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
