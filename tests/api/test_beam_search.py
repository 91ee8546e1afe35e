"""Beam search (use_beam_search, n = beam width, length_penalty) on the served tiny model, against a
brute-force beam search computed with transformers' own implementation of the same checkpoint: full
forward passes, log_softmax, the top 2 x width candidates of every beam at every step, vLLM's ranking.
The server's beams (tokens, order, text) must be the reference's; the combinations beam search cannot
honour are 400s naming the field.
"""

from __future__ import annotations

import functools
import math

import pytest
import pytest_asyncio
import torch
from graphcache.api.openai.beam_search import Beam, beam_score
from graphcache.config import Settings
from graphcache.model.tiny import default_model_dir
from helpers_api import serving

SMALL = {
    "device": "cpu",
    "dtype": "float32",
    "max_num_seqs": 8,
    "max_num_batched_tokens": 128,
    "warmup_decode_sizes": [],
    "capture_sizes": [1, 2, 4, 8, 16],
}
on_the_server = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    async with serving(Settings(cache_dir=cache, **SMALL)) as (client, app):
        yield client, app, default_model_dir(cache)


@functools.cache
def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_beams(path, prompt: list[int], width: int, max_tokens: int, penalty: float, eos: set[int]):
    """Beam search by brute force on transformers' model: every beam's next-token log probabilities from a
    full forward pass over prompt + beam."""
    model = _hf(path)
    live, ended = [Beam()], []
    for _ in range(max_tokens):
        candidates = []
        for beam in live:
            logits = model(torch.tensor([prompt + beam.tokens])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            top = torch.topk(logprobs, 2 * width)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                candidates.append(Beam(beam.tokens + [tok], beam.cumulative_logprob + lp, tok in eos))
        candidates.sort(key=lambda c: -c.cumulative_logprob)
        ended += [c for c in candidates if c.ended]
        live = [c for c in candidates if not c.ended][:width]
        if not live:
            break
    return sorted(ended + live, key=lambda b: -beam_score(b, len(prompt), penalty))[:width]


def test_beam_score_is_vllms():
    b = Beam([5, 6, 2], -3.0, ended=True)
    assert beam_score(b, 4, 1.0) == pytest.approx(-3.0 / 6)
    assert beam_score(b, 4, 2.0) == pytest.approx(-3.0 / 36)
    assert beam_score(Beam([5, 6], -3.0), 4, 0.5) == pytest.approx(-3.0 / math.sqrt(6))


@on_the_server
@pytest.mark.parametrize(("width", "max_tokens", "penalty"), [(2, 6, 1.0), (3, 5, 0.0), (4, 4, 2.0)])
async def test_completion_beams_are_the_brute_force_beams(served, width, max_tokens, penalty):
    client, app, path = served
    tok = app.state.engine.tokenizer
    prompt = tok.encode("Once upon a time")
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": max_tokens,
            "n": width,
            "use_beam_search": True,
            "length_penalty": penalty,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    expected = reference_beams(path, prompt, width, max_tokens, penalty, set(tok.eos_token_ids))
    got = [c["token_ids"] for c in body["choices"]]
    assert got == [b.tokens for b in expected]
    assert [c["index"] for c in body["choices"]] == list(range(width))
    for choice, beam in zip(body["choices"], expected, strict=True):
        kept = beam.tokens[:-1] if beam.ended else beam.tokens
        assert choice["text"] == tok.decode(kept)
        assert choice["finish_reason"] == ("stop" if beam.ended else "length")
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == sum(len(b.tokens) for b in expected)


@on_the_server
async def test_a_batch_of_prompts_gets_n_beams_each(served):
    client, app, path = served
    tok = app.state.engine.tokenizer
    prompts = [tok.encode("Once upon a time"), tok.encode("The cat")]
    r = await client.post(
        "/v1/completions",
        json={"prompt": prompts, "max_tokens": 3, "n": 2, "use_beam_search": True, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    got = [c["token_ids"] for c in r.json()["choices"]]
    expected = [
        b.tokens for p in prompts for b in reference_beams(path, p, 2, 3, 1.0, set(tok.eos_token_ids))
    ]
    assert got == expected


@on_the_server
async def test_chat_beams_are_the_brute_force_beams(served):
    client, app, path = served
    tok = app.state.engine.tokenizer
    messages = [{"role": "user", "content": "Hello there"}]
    ids = (await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": True})).json()[
        "tokens"
    ]
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "max_tokens": 4,
            "n": 3,
            "use_beam_search": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    expected = reference_beams(path, ids, 3, 4, 1.0, set(tok.eos_token_ids))
    assert [c["token_ids"] for c in r.json()["choices"]] == [b.tokens for b in expected]


@on_the_server
async def test_beam_search_via_the_openai_client(served):
    import openai

    client, _, _ = served
    oai = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    r = await oai.completions.create(
        model="graphcache-tiny",
        prompt="Once upon a time",
        max_tokens=3,
        n=2,
        extra_body={"use_beam_search": True, "length_penalty": 1.2},
    )
    assert len(r.choices) == 2 and all(c.text for c in r.choices)


@on_the_server
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"logprobs": 2}, "logprobs"),
        ({"logit_bias": {"5": 3}}, "logit_bias"),
        ({"stop": ["x"]}, "stop"),
        ({"best_of": 4}, "best_of"),
        ({"guided_regex": "[a-z]+"}, "use_beam_search"),
        ({"n": 33}, "n"),
    ],
)
async def test_what_beam_search_cannot_honour_is_a_400_naming_it(served, extra, param):
    client, _, _ = served
    body = {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, **extra}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@on_the_server
async def test_length_penalty_without_beam_search_is_a_400(served):
    client, _, _ = served
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "length_penalty": 2.0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
