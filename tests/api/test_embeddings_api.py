"""POST /v1/embeddings through the official openai client (`client.embeddings.create`) on served tiny
embedding models, against transformers' own vectors (helpers_embedding.hf_embedding): floats and base64,
batches, token-id inputs, truncation, dimensions; the 400s that name the field; a generation model's 400 and
an embedding model's 400 on the generation endpoints; metrics; generation beside embeddings unaffected.
"""

from __future__ import annotations

import asyncio
import base64
import struct

import openai
import pytest
import pytest_asyncio
import torch
from graphcache.config import Settings
from helpers_api import serving
from helpers_embedding import embedding_checkpoint, hf_embedding
from test_api import assert_error, post_json, scrape

pytestmark = pytest.mark.asyncio(loop_scope="module")

SMALL = {
    "device": "cpu",
    "dtype": "float32",
    "max_num_seqs": 8,
    "max_num_batched_tokens": 32,  # a 40-token input is prefilled in two chunks
    "max_model_len": 128,
    "warmup_decode_sizes": [],
    "capture_sizes": [1, 2, 4, 8, 16],
    "drain_timeout_s": 2.0,
}
TEXTS = ["Once upon a time", "a", "The quick brown fox jumps over the lazy dog " * 4]
TOL = 1e-4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    """The sentence-transformers checkpoint with mean pooling and Matryoshka dimensions, served."""
    path = embedding_checkpoint("mean", matryoshka=True)
    settings = Settings(model=path, cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)
    async with serving(settings) as (client, app):
        oai = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
        yield oai, client, app, path


def ref(app, path, text: str, pooling: str, **kwargs) -> torch.Tensor:
    ids = app.state.engine.tokenizer.encode(text, True)
    return hf_embedding(path, ids, pooling, **kwargs)


def close(got, want: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()


async def test_float_and_base64_equal_hf(served):
    oai, _, app, path = served
    name = app.state.engine.model_name
    floats = await oai.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.object == "list" and floats.model == name
    for d, text in zip(floats.data, TEXTS, strict=True):
        close(d.embedding, ref(app, path, text, "mean"))
    tokens = sum(len(app.state.engine.tokenizer.encode(t, True)) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    # The client asks for base64 when no format is given, and decodes it itself.
    decoded = await oai.embeddings.create(model=name, input=TEXTS)
    for a, b in zip(decoded.data, floats.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)


async def test_invocations_answers_an_embedding_body_as_the_embeddings_route(served):
    _, client, app, _ = served
    body = {"model": app.state.engine.model_name, "input": TEXTS[:2], "encoding_format": "float"}
    direct, routed = (
        await client.post("/v1/embeddings", json=body),
        await client.post("/invocations", json=body),
    )
    assert direct.status_code == routed.status_code == 200, routed.text
    for a, b in zip(routed.json()["data"], direct.json()["data"], strict=True):  # batched apart: rounding
        assert a["embedding"] == pytest.approx(b["embedding"], abs=1e-6)


async def test_base64_is_little_endian_float32(served):
    _, client, app, path = served
    resp = await client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    assert resp.status_code == 200, resp.text
    raw = base64.b64decode(resp.json()["data"][0]["embedding"])
    values = struct.unpack(f"<{len(raw) // 4}f", raw)
    close(list(values), ref(app, path, TEXTS[0], "mean"))


async def test_token_ids_truncation_dimensions_and_normalize(served):
    oai, client, app, path = served
    ids = app.state.engine.tokenizer.encode(TEXTS[2], True)
    by_ids = await oai.embeddings.create(
        model=app.state.engine.model_name, input=[ids, ids[:3]], encoding_format="float"
    )
    close(by_ids.data[0].embedding, hf_embedding(path, ids, "mean"))
    close(by_ids.data[1].embedding, hf_embedding(path, ids[:3], "mean"))
    cut = await oai.embeddings.create(
        model=app.state.engine.model_name, input=ids, dimensions=16, encoding_format="float"
    )
    assert len(cut.data[0].embedding) == 16
    close(cut.data[0].embedding, hf_embedding(path, ids, "mean", dimensions=16))
    long = ids * 5  # past max_model_len (128)
    resp = await client.post("/v1/embeddings", json={"input": [long], "truncate_prompt_tokens": 20})
    assert resp.status_code == 200, resp.text
    close(resp.json()["data"][0]["embedding"], hf_embedding(path, long[-20:], "mean"))
    assert resp.json()["usage"]["prompt_tokens"] == 20
    raw = await client.post("/v1/embeddings", json={"input": ids, "normalize": False})
    close(raw.json()["data"][0]["embedding"], hf_embedding(path, ids, "mean", normalize=False))


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": 20}, "dimensions"),  # not one of the trained 16, 32, 64
        ({"input": "a", "dimensions": "16"}, "dimensions"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": [[1, 10**9]]}, "input"),
        ({"input": [[1, 2], [-1]]}, "input[1]"),
        ({"input": [[1], list(range(1, 130))]}, "input[1]"),  # 129 ids > max_model_len 128
        ({"input": "a", "model": "other"}, None),
        ({"input": ["a"] * 2049}, "input"),
    ],
)
async def test_bad_inputs_are_400s_naming_the_field(served, body, param):
    _, client, _, _ = served
    resp = await post_json(client, "/v1/embeddings", body)
    if body.get("model") == "other":
        assert_error(resp, 404, code="model_not_found")
        return
    assert_error(resp, 400, param=param)


async def test_a_long_input_is_refused_without_truncation(served):
    _, client, app, _ = served
    ids = list(range(1, 130))
    resp = await post_json(client, "/v1/embeddings", {"input": ids})
    err = assert_error(resp, 400, param="input", code="context_length_exceeded")
    assert "truncate_prompt_tokens" in err["message"]


async def test_generation_endpoints_refuse_an_embedding_model(served):
    _, client, _, _ = served
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"input": "hi"}),
    ):
        err = assert_error(await post_json(client, path, body), 400, param="model")
        assert "/v1/embeddings" in err["message"] and "--runner generate" in err["message"]
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"]  # /v1/models as for any model


async def test_embedding_requests_are_counted_in_the_metrics(served):
    oai, client, app, _ = served
    before = scrape((await client.get("/metrics")).text)
    await oai.embeddings.create(model=app.state.engine.model_name, input=TEXTS[:2])
    after = scrape((await client.get("/metrics")).text)
    tokens = sum(len(app.state.engine.tokenizer.encode(t, True)) for t in TEXTS[:2])
    done = [k for k in after if k.startswith("vllm:request_success_total") and "stop" in k]
    assert done and sum(after[k] - before.get(k, 0) for k in done) == 2
    prompt = [k for k in after if k.startswith("vllm:prompt_tokens_total")]
    assert prompt and sum(after[k] - before.get(k, 0) for k in prompt) == tokens


async def test_many_concurrent_requests_batch(served):
    oai, _, app, path = served
    texts = [f"sentence number {i} " * (1 + i % 5) for i in range(12)]
    answers = await asyncio.gather(
        *(
            oai.embeddings.create(model=app.state.engine.model_name, input=t, encoding_format="float")
            for t in texts
        )
    )
    for answer, text in zip(answers, texts, strict=True):
        close(answer.data[0].embedding, ref(app, path, text, "mean"))


async def test_detected_by_name_pools_the_last_token(tmp_path):
    """No sentence-transformers files: an embedding model by its name (tiny-Qwen3-Embedding), last-token
    pooling, normalized; without Matryoshka dimensions, `dimensions` is a 400."""
    path = embedding_checkpoint(None)
    async with serving(Settings(model=path, cache_dir=tmp_path, **SMALL)) as (client, app):
        oai = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
        got = await oai.embeddings.create(
            model=app.state.engine.model_name, input=TEXTS, encoding_format="float"
        )
        for d, text in zip(got.data, TEXTS, strict=True):
            close(d.embedding, ref(app, path, text, "last"))
        err = assert_error(
            await post_json(client, "/v1/embeddings", {"input": "a", "dimensions": 8}),
            400,
            param="dimensions",
        )
        assert "Matryoshka" in err["message"]


async def test_a_generation_model_refuses_embeddings_and_generates_beside_them(tmp_path):
    """The tiny generation model: /v1/embeddings is a 400 naming --runner pooling; completions run while
    embedding requests are refused, and give what they give alone."""
    settings = Settings(cache_dir=tmp_path, **SMALL)
    async with serving(settings) as (client, app):
        oai = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
        with pytest.raises(openai.BadRequestError) as e:
            await oai.embeddings.create(model=app.state.engine.model_name, input="hi")
        assert e.value.body["param"] == "model" and "--runner pooling" in e.value.body["message"]
        alone = await oai.completions.create(
            model=app.state.engine.model_name,
            prompt="Once",
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

        async def refused():
            resp = await client.post("/v1/embeddings", json={"input": "hi"})
            assert resp.status_code == 400

        together = await asyncio.gather(
            *[
                oai.completions.create(
                    model=app.state.engine.model_name,
                    prompt="Once",
                    max_tokens=8,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for _ in range(4)
            ],
            *[refused() for _ in range(4)],
        )
        for answer in together[:4]:
            assert answer.choices[0].text == alone.choices[0].text


async def test_runner_pooling_serves_a_generation_checkpoint_with_its_pooler_config(tmp_path):
    """--runner pooling (vLLM's --convert embed) on a plain Qwen3 checkpoint, with --pooler-config choosing
    mean pooling without normalization (the default, last token normalized, runs in
    tests/reliability/test_embeddings_server.py)."""
    from helpers_model import tiny_checkpoint

    path = tiny_checkpoint("qwen3")
    pooler = '{"pooling_type": "MEAN", "normalize": false}'
    settings = Settings(model=path, runner="pooling", pooler_config=pooler, cache_dir=tmp_path, **SMALL)
    async with serving(settings) as (client, app):
        resp = await client.post("/v1/embeddings", json={"input": TEXTS[0]})
        assert resp.status_code == 200, resp.text
        close(resp.json()["data"][0]["embedding"], ref(app, path, TEXTS[0], "mean", normalize=False))


async def test_the_engine_process_serves_embeddings(tmp_path):
    """With the step loop in a child process, the API process learns the model kind from the directory the
    engine loaded (its ready message), and the vectors cross the pipe."""
    from graphcache.engine.loop.process import EngineClient
    from graphcache.metrics import Metrics

    path = embedding_checkpoint("last")
    settings = Settings(model=path, cache_dir=tmp_path, engine_process=True, **SMALL)
    async with serving(settings, EngineClient(settings, Metrics())) as (client, app):
        oai = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
        got = await oai.embeddings.create(model=app.state.engine.model_name, input=TEXTS)
        for d, text in zip(got.data, TEXTS, strict=True):
            close(d.embedding, ref(app, path, text, "last"))
        assert (await post_json(client, "/v1/completions", {"prompt": "hi"})).status_code == 400
