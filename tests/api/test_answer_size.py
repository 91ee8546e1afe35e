"""The size of an answer is bounded before it is built, and built off the event loop (issue 35, item 5).

api/openai/answer_size.py estimates a request's answer from its fields and prompt lengths and refuses one over
MAX_ANSWER_BYTES with a 400 naming the field of its largest product; api/server/answer_json.py renders an answer
a choice (and a slice of a long list) at a time, the bytes JSONResponse would write. The served-process
half (/health while a large answer is built) is tests/reliability/test_big_answers.py.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import pytest_asyncio
from graphcache.api.openai import answer_size
from graphcache.api.openai.answer_size import ENTRY_BYTES, MAX_ANSWER_BYTES, check_answer_size, estimate
from graphcache.api.openai.choices import ChatShape, CompletionShape, Prompt
from graphcache.api.openai.fanout import Sampled
from graphcache.api.openai.logprobs import TokenText
from graphcache.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from graphcache.api.openai.sampling import base_params, plan
from graphcache.api.server.answer_json import SLICE, Lazy, render, render_text
from graphcache.api.server.errors import APIError
from graphcache.engine.sequence import TokenLogprob
from helpers_api import serving
from helpers_model import cpu_settings, tiny_checkpoint
from starlette.responses import JSONResponse

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MAX_MODEL_LEN = 1024


class WordTokenizer:
    """Token id -> a text of 0-6 characters (some multi-byte), like a real vocabulary's."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        t = ids[0]
        return ["", "a", "é", " the", "ing", " 日本", "\ufffd", "token"][t % 8] + (
            "" if t % 3 else str(t % 7)
        )


def _entry(rng: random.Random, k: int) -> TokenLogprob:
    return TokenLogprob(
        rng.randrange(1000),
        -rng.random() * 20,
        rng.randrange(1, 1000),
        [(rng.randrange(1000), -rng.random() * 20) for _ in range(k)],
    )


def _completion_case(rng, *, prompts=2, tokens=600, n=2, k=5, kp=3, gen=40, echo=True, as_ids=False):
    body = CompletionRequest(
        prompt=[[rng.randrange(1000) for _ in range(tokens)] for _ in range(prompts)],
        max_tokens=gen,
        n=n,
        echo=echo,
        logprobs=k,
        prompt_logprobs=kp,
        return_token_ids=True,
        return_tokens_as_token_ids=as_ids,
    )
    prompt_list = [Prompt(list(ids), f"echo {i} é" * 20) for i, ids in enumerate(body.prompts)]
    engine_kp = kp if kp is not None else (k if echo else None)  # as sampling.base_params asks the engine
    samples = []
    for p in range(prompts):
        for _ in range(n):
            ids = [rng.randrange(1000) for _ in range(gen)]
            samples.append(
                Sampled(
                    p,
                    parts=["generated é text"],
                    token_ids=ids,
                    logprobs=[_entry(rng, k) for _ in ids],
                    prompt_logprobs=None
                    if engine_kp is None
                    else [None] + [_entry(rng, engine_kp) for _ in range(tokens - 1)],
                    finish_reason="length",
                    prompt_tokens=tokens,
                    completion_tokens=gen,
                )
            )
    return body, prompt_list, samples


def _chat_case(rng, *, tokens=500, n=2, k=5, kp=2, gen=300, as_ids=False):
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=gen,
        n=n,
        logprobs=True,
        top_logprobs=k,
        prompt_logprobs=kp,
        return_token_ids=True,
        return_tokens_as_token_ids=as_ids,
    )
    prompt_list = [Prompt([rng.randrange(1000) for _ in range(tokens)])]
    samples = []
    for _ in range(n):
        ids = [rng.randrange(1000) for _ in range(gen)]
        samples.append(
            Sampled(
                0,
                parts=["an answer"],
                token_ids=ids,
                logprobs=[_entry(rng, k) for _ in ids],
                prompt_logprobs=None if kp is None else [None] + [_entry(rng, kp) for _ in range(tokens - 1)],
                finish_reason="length",
            )
        )
    return body, prompt_list, samples


def _shape(body, prompts, as_ids=False):
    cls = ChatShape if isinstance(body, ChatCompletionRequest) else CompletionShape
    return cls(body, {"id": "x", "created": 1, "model": "m"}, prompts, TokenText(WordTokenizer(), as_ids))


def _params(body, defaults=None):
    return base_params(body, [], None, defaults)


def _estimate(body, prompts, defaults=None) -> int:
    params = _params(body, defaults)
    return sum(p.nbytes for p in estimate(body, plan(body), params, prompts, MAX_MODEL_LEN))


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize(
    "obj",
    [
        {"a": 1, "b": [1, 2.5, None, True, 'é日本\ufffd\n"q"'], "c": {"d": {"e": []}}},
        {"long": list(range(3 * SLICE + 7)), "nested": [{"x": i, "y": [i] * 3} for i in range(SLICE + 1)]},
        {"ints as keys": {1: "a", 2: "b"}, "tuple": (1, 2), "empty": {}, "exact": list(range(SLICE))},
        [{"k": "v"}] * (SLICE * 2 + 1),
        "just a string",
    ],
)
def test_render_writes_what_json_response_and_json_dumps_write(obj):
    assert render(obj) == JSONResponse(obj).body
    assert render_text(obj) == json.dumps(obj, ensure_ascii=False)


def test_a_lazy_array_is_made_while_it_is_rendered():
    made = []

    def items():
        for i in range(3):
            made.append(i)
            yield {"i": i, "long": list(range(SLICE + 1))}

    assert (
        render({"choices": Lazy(items()), "after": 1})
        == JSONResponse(
            {"choices": [{"i": i, "long": list(range(SLICE + 1))} for i in range(3)], "after": 1}
        ).body
    )
    assert made == [0, 1, 2]


def test_render_refuses_nan_as_json_response_does():
    with pytest.raises(ValueError):
        render({"x": [math.nan] * (SLICE + 1)})


@pytest.mark.parametrize("as_ids", [False, True])
def test_shapes_render_what_their_full_answer_holds(as_ids):
    rng = random.Random(1)
    for body, prompts, samples in (
        _completion_case(rng, as_ids=as_ids),
        _chat_case(rng, as_ids=as_ids),
    ):
        usage = {"prompt_tokens": 1}
        # Two shapes: a completion shape tracks text offsets per choice while it builds.
        expected = JSONResponse(_shape(body, prompts, as_ids).full(samples, usage)).body
        assert _shape(body, prompts, as_ids).render(samples, usage) == expected


# --------------------------------------------------------------------------- the estimate


@pytest.mark.parametrize("as_ids", [False, True])
@pytest.mark.parametrize(
    "case",
    [
        dict(kind="completion"),
        dict(kind="completion", k=20, kp=20, n=1, prompts=3),
        dict(kind="completion", k=0, kp=None, echo=True),
        dict(kind="completion", k=20, kp=None, echo=False, gen=400),
        dict(kind="chat"),
        dict(kind="chat", k=20, kp=20, n=1),
        dict(kind="chat", k=0, kp=None, n=4),
    ],
)
def test_the_estimate_bounds_the_answer_and_is_not_far_over(case, as_ids):
    """The estimate is an upper bound of the JSON (every top list full, every token generated), within a
    small factor of it: the bound is neither dodged nor needlessly strict."""
    rng = random.Random(2)
    case = dict(case)
    kind = case.pop("kind")
    body, prompts, samples = (_completion_case if kind == "completion" else _chat_case)(
        rng, as_ids=as_ids, **case
    )
    size = len(_shape(body, prompts, as_ids).render(samples, {}))
    est = _estimate(body, prompts)
    assert size <= est <= 3 * size, (size, est)


def test_the_findings_request_is_a_400_naming_prompt_logprobs():
    """110 prompts x prompt_logprobs 20 with echo built a 413 MB answer; here a 400 before anything runs."""
    prompts = [Prompt([7] * 2000, "") for _ in range(110)]
    body = CompletionRequest(prompt=[[7] * 2000] * 110, max_tokens=1, echo=True, prompt_logprobs=20)
    with pytest.raises(APIError) as info:
        check_answer_size(body, plan(body), _params(body), prompts, 4096)
    error = info.value
    assert error.status == 400 and error.param == "prompt_logprobs" and error.code == "answer_too_large"
    assert "n 1 x 220,000 prompt tokens (110 prompts) x (prompt_logprobs 20 + 1) entries" in error.message
    assert "Lower prompt_logprobs" in error.message and "128.0 MiB" in error.message


def test_a_chat_without_max_tokens_counts_the_rest_of_the_context():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=20)
    prompts = [Prompt([7] * 100)]
    products = estimate(body, plan(body), _params(body), prompts, 131_072)
    assert products[0].param == "top_logprobs"
    assert (
        "130,972 tokens to generate (1 prompt, max_tokens unset: the rest of the context)" in products[0].what
    )
    assert products[0].nbytes == 130_972 * 21 * ENTRY_BYTES["chat_logprobs"]
    with pytest.raises(APIError) as info:  # 131k tokens x 21 entries: over the bound; max_tokens fixes it
        check_answer_size(body, plan(body), _params(body), prompts, 131_072)
    assert info.value.param == "top_logprobs" and "set max_completion_tokens" in info.value.message
    capped = body.model_copy(update={"max_completion_tokens": 4096})
    check_answer_size(capped, plan(capped), _params(capped), prompts, 131_072)


def test_best_of_counts_every_sample_it_collects():
    body = CompletionRequest(prompt="x", max_tokens=100, n=1, best_of=8, logprobs=5)
    one = CompletionRequest(prompt="x", max_tokens=100, n=1, logprobs=5)
    prompts = [Prompt([7] * 10)]
    assert _estimate(body, prompts) == 8 * _estimate(one, prompts)


# --------------------------------------------------------------------------- over HTTP


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served():
    settings = cpu_settings(tiny_checkpoint("qwen2"), max_model_len=MAX_MODEL_LEN)
    async with serving(settings) as (client, app):
        yield client, app


def _prompts(count: int, tokens: int) -> list[list[int]]:
    return [[(5 + 7 * i + 13 * t) % 400 + 5 for t in range(tokens)] for i in range(count)]


@in_module_loop
async def test_a_request_over_the_bound_is_a_400_before_it_reaches_the_engine(served, monkeypatch):
    client, app = served
    engine = app.state.engine

    def reached(*args, **kwargs):
        raise AssertionError("the engine was reached by a request whose answer is over the bound")

    monkeypatch.setattr(engine, "generate", reached)
    # The finding's request on this model's context: 110 prompts x 900 tokens x prompt_logprobs 20, echo.
    body = {"prompt": _prompts(110, 900), "max_tokens": 1, "echo": True, "prompt_logprobs": 20}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "prompt_logprobs" and error["code"] == "answer_too_large", error
    assert error["type"] == "invalid_request_error" and "prompt_logprobs" in error["message"], error
    # Echo with logprobs leads each choice with the prompt's logprobs: named "logprobs" (32 prompts of
    # 1,000 tokens: ~28 MiB, over a 16 MiB bound; this model's context cannot reach 128 MiB that way).
    monkeypatch.setattr(answer_size, "MAX_ANSWER_BYTES", 16 << 20)
    body = {"prompt": _prompts(32, 1000), "max_tokens": 1, "echo": True, "logprobs": 20}
    error = (await client.post("/v1/completions", json=body)).json()["error"]
    assert error["param"] == "logprobs" and "echo" in error["message"], error
    # A chat: n 128 x the rest of the context x (top_logprobs 20 + 1), over the real bound.
    monkeypatch.setattr(answer_size, "MAX_ANSWER_BYTES", MAX_ANSWER_BYTES)
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 128, "logprobs": True, "top_logprobs": 20}
    error = (await client.post("/v1/chat/completions", json=chat)).json()["error"]
    assert error["param"] == "top_logprobs" and "set max_completion_tokens" in error["message"], error


@in_module_loop
@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/v1/completions",
            {
                "prompt": _prompts(3, 200),
                "max_tokens": 4,
                "echo": True,
                "logprobs": 5,
                "prompt_logprobs": 5,
                "temperature": 0.0,
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hello there"}],
                "max_completion_tokens": 6,
                "n": 3,
                "logprobs": True,
                "top_logprobs": 5,
                "prompt_logprobs": 2,
                "temperature": 0.0,
            },
        ),
    ],
)
async def test_just_under_the_bound_is_served_and_just_over_is_not(served, monkeypatch, path, body):
    client, _ = served
    estimates: list[int] = []
    real = answer_size.estimate

    def spy(*args, **kwargs):
        products = real(*args, **kwargs)
        estimates.append(sum(p.nbytes for p in products))
        return products

    monkeypatch.setattr(answer_size, "estimate", spy)
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text[:300]
    bound = estimates[-1]
    assert len(response.content) <= bound < MAX_ANSWER_BYTES

    monkeypatch.setattr(answer_size, "MAX_ANSWER_BYTES", bound)  # just under (at) the bound: served
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text[:300]
    assert response.json()["choices"] and estimates[-1] == bound

    monkeypatch.setattr(answer_size, "MAX_ANSWER_BYTES", bound - 1)  # one byte over: refused
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["code"] == "answer_too_large"


@in_module_loop
async def test_a_streamed_echo_carries_the_prompts_logprobs_in_its_first_chunk(served):
    """The first chunk of an echoed stream with logprobs (built on the response pool) holds what the whole
    answer holds for the prompt."""
    client, _ = served
    body = {"prompt": _prompts(2, 300), "max_tokens": 3, "echo": True, "logprobs": 3, "temperature": 0.0}
    whole = (await client.post("/v1/completions", json=body)).json()["choices"]
    firsts: dict[int, dict] = {}
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    firsts.setdefault(choice["index"], choice)
    assert sorted(firsts) == [0, 1]
    for k, choice in firsts.items():
        streamed, answered = choice["logprobs"], whole[k]["logprobs"]
        assert len(streamed["tokens"]) >= 300
        for key in ("tokens", "text_offset"):
            assert streamed[key][:300] == answered[key][:300], key
        # The two requests may share their steps differently, and a batch of another shape sums in another
        # order: equal up to fp32 rounding (CI saw -36.703148 against -36.703144).
        assert streamed["token_logprobs"][0] is None is answered["token_logprobs"][0]
        assert streamed["token_logprobs"][1:300] == pytest.approx(answered["token_logprobs"][1:300], abs=1e-4)
        assert whole[k]["text"].startswith(choice["text"])
