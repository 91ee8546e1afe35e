"""A stream carries every token as it is made, also one with no text yet (an incomplete UTF-8 sequence, an
id past the tokenizer's vocabulary: benchmarks' random checkpoints widen the vocabulary to the real
model's, so most of their ids have none). As vLLM streams: a chunk with text "" (chat: content ""), so
the client's time to first token is the first token's, and `return_token_ids` loses no id.

The model: the embedded tokenizer (1,024 ids) on a tiny checkpoint of 8,192 ids, sampled, so most
generated ids decode to nothing."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from graphcache.config import Settings
from graphcache.model.tiny import make_tiny_model
from helpers_api import serving

pytestmark = pytest.mark.asyncio(loop_scope="module")
MAX_TOKENS = 16


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory):
    model = tmp_path_factory.mktemp("wide") / "model"
    make_tiny_model(model, model_vocab_size=8192)
    settings = Settings(
        model=model,
        cache_dir=tmp_path_factory.mktemp("cache"),
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        warmup_decode_sizes=[1],
        capture_sizes=[1, 2, 4],
    )
    async with serving(settings) as (c, _app):
        yield c


async def _stream(client, path: str, body: dict) -> list[dict]:
    chunks = []
    async with client.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("seed", [1, 2])
async def test_completion_stream_carries_each_token_id_and_the_text(client, seed):
    body = {
        "model": "model",
        "prompt": [5, 6, 7, 8],
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": seed,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    whole = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    chunks = await _stream(client, "/v1/completions", body)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [i for c in choices for i in c["token_ids"]] == whole["token_ids"]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert any(c["text"] == "" and c["token_ids"] for c in choices)  # ids with no text were still sent
    assert all(c["token_ids"] for c in choices)  # no chunk without a token


async def test_chat_stream_sends_tokens_with_no_text_as_empty_content(client):
    body = {
        "model": "model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    whole = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    chunks = await _stream(client, "/v1/chat/completions", body)
    deltas = [c["choices"][0] for c in chunks[1:] if c["choices"]]  # after the role chunk
    assert [i for d in deltas for i in d["token_ids"]] == whole["token_ids"]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == (whole["message"]["content"] or "")
    assert any(d["delta"] == {"content": ""} for d in deltas)
