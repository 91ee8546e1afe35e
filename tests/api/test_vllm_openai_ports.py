"""vLLM's OpenAI-API tests for completions, chat and prompt validation (tests/entrypoints/openai/
test_completion.py, test_chat.py, test_prompt_validation.py, test_chat_echo.py), rewritten for graphcache:
the same behaviours, through the openai client, against the served tiny model. Tokenization and logit-bias
errors are ported in test_tools_endpoints.py and test_logit_bias_errors.py; custom roles, /invocations and
continuous usage in test_vllm_chat_parity.py.

Where vLLM's test checks a real model's text or exact token counts of its tokenizer (zephyr's
"usage == (5, 6, 11)", a JSON answer a model writes unconstrained, the LoRA adapters), the behaviour is
checked with the tiny model's own counts instead, or listed in docs/API.md ("vLLM's OpenAI-API tests") as
an exception.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import pytest_asyncio
from graphcache.config import Settings
from helpers_api import SMALL_SERVER, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "graphcache-tiny"
PROMPT = "Hello, my name is"
CHAT = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "what is 1+1?"},
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    async with serving(Settings(cache_dir=tmp_path_factory.mktemp("cache"), **SMALL_SERVER)) as (client, app):
        yield openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client), app


# --------------------------------------------------------------------------- completions (test_completion.py)


async def test_single_completion(served):
    oai, app = served
    n_prompt = len(app.state.engine.tokenizer.encode(PROMPT))
    r = await oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert r.id and r.choices and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.completion_tokens, r.usage.prompt_tokens) == (5, n_prompt)
    assert r.usage.total_tokens == 5 + n_prompt
    ids = await oai.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0)
    assert len(ids.choices[0].text) >= 1 and ids.usage.prompt_tokens == 5


async def test_no_logprobs(served):
    oai, _ = served
    r = await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=None)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("k", [0, 5])
async def test_zero_and_some_logprobs(served, k):
    oai, _ = served
    r = await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=k)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert all(k <= len(top) <= k + 1 for top in lp.top_logprobs)  # the top k, plus the sampled token
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5


@pytest.mark.parametrize("k", [21, 30])
async def test_too_many_completion_logprobs(served, k):
    oai, _ = served
    with pytest.raises(openai.BadRequestError):
        await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=k)
    with pytest.raises(openai.BadRequestError):
        stream = await oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=k, stream=True
        )
        async for _ in stream:
            pass


@pytest.mark.parametrize(
    ("prompt_logprobs", "ok"), [(-1, False), (0, True), (1, True), (5, True), (None, True)]
)
async def test_prompt_logprobs_completion(served, prompt_logprobs, ok):
    oai, _ = served
    params = {"prompt": ["A robot may not injure another robot", "My name is"], "model": MODEL}
    extra = {"prompt_logprobs": prompt_logprobs} if prompt_logprobs is not None else {}
    if not ok:
        with pytest.raises(openai.BadRequestError):
            await oai.completions.create(**params, max_tokens=2, extra_body=extra)
        return
    r = await oai.completions.create(**params, max_tokens=2, extra_body=extra)
    for choice in r.choices:
        if prompt_logprobs is None:
            assert choice.model_extra.get("prompt_logprobs") is None
        else:
            entries = choice.model_extra["prompt_logprobs"]
            assert entries[0] is None and all(
                prompt_logprobs <= len(e) <= prompt_logprobs + 1 for e in entries[1:]
            )


async def test_completion_streaming(served):
    oai, _ = served
    whole = await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0)
    stream = await oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0, stream=True
    )
    chunks, finish = [], None
    async for chunk in stream:
        chunks.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.choices[0].finish_reason and "".join(chunks) == whole.choices[0].text


async def test_parallel_streaming(served):
    """n choices streamed: every index gets text, each choice as long as its own non-streamed peer."""
    oai, _ = served
    stream = await oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        n=3,
        temperature=1.0,
        stream=True,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    texts = ["", "", ""]
    finished = set()
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2} and all(texts)


async def test_completion_stream_options(served):
    oai, _ = served
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0}
    # include_usage false: no usage anywhere
    stream = await oai.completions.create(**base, stream=True, stream_options={"include_usage": False})
    assert all(c.usage is None for c in [c async for c in stream])
    # include_usage: null on every chunk, then one chunk without choices carrying it
    stream = await oai.completions.create(**base, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5
    # stream_options without stream: a 400
    for opts in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": True}):
        with pytest.raises(openai.BadRequestError):
            await oai.completions.create(**base, stream=False, stream_options=opts)


async def test_batch_completions(served):
    oai, _ = served
    r = await oai.completions.create(model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=5, temperature=0.0)
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
    r = await oai.completions.create(
        model=MODEL,
        prompt=[PROMPT, PROMPT],
        max_tokens=5,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    stream = await oai.completions.create(
        model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=5, temperature=0.0, stream=True
    )
    texts = ["", ""]
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[0] == texts[1] and texts[0]
    # beam search: n = 2 beams per prompt, different from each other
    beams = await oai.completions.create(
        model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=5, n=2, extra_body={"use_beam_search": True}
    )
    assert len(beams.choices) == 4
    assert beams.choices[0].text != beams.choices[1].text and beams.choices[0].text == beams.choices[2].text


async def test_logits_bias(served):
    oai, app = served
    tok = app.state.engine.tokenizer
    target = tok.encode(" robot", add_special_tokens=False)[-1]
    got = (
        (
            await oai.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=5,
                temperature=0.0,
                logit_bias={str(target): 100},
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
        )
        .choices[0]
        .model_extra["token_ids"]
    )
    assert got == [target] * 5
    # -100 on every token the first answer used: none of them comes back
    first = (
        (
            await oai.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=5,
                temperature=0.0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
        )
        .choices[0]
        .model_extra["token_ids"]
    )
    again = (
        (
            await oai.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=5,
                temperature=0.0,
                logit_bias={str(t): -100 for t in first},
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
        )
        .choices[0]
        .model_extra["token_ids"]
    )
    assert not set(first) & set(again)


async def test_allowed_token_ids(served):
    oai, _ = served
    r = await oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0.0,
        extra_body={"allowed_token_ids": [42], "return_token_ids": True, "ignore_eos": True},
    )
    assert r.choices[0].model_extra["token_ids"] == [42, 42]


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["a", "b"]},
        "age": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


async def test_structured_outputs_json_completion(served):
    """vLLM's test_guided_json_completion with a schema a random model must still complete (bounded
    values, compact): the output validates."""
    oai, _ = served
    for _ in range(3):
        r = await oai.completions.create(
            model=MODEL,
            prompt="Give an example JSON",
            max_tokens=40,
            temperature=1.0,
            extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        )
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


async def test_structured_outputs_choice_and_regex_completion(served):
    oai, _ = served
    r = await oai.completions.create(
        model=MODEL,
        prompt="The best language is",
        max_tokens=10,
        n=2,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["Python", "Java", "C++"]}},
    )
    assert all(c.text in ("Python", "Java", "C++") for c in r.choices)
    r = await oai.completions.create(
        model=MODEL,
        prompt="An IP:",
        max_tokens=20,
        temperature=1.0,
        extra_body={
            "structured_outputs": {
                "regex": r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
            }
        },
    )
    parts = r.choices[0].text.split(".")
    assert len(parts) == 4 and all(0 <= int(p) <= 255 for p in parts)


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_json": {"type": "object", "properties": {"x": {"type": "nope"}}}},
        {"guided_regex": "[.*"},
        {"guided_grammar": "root ::= (("},
    ],
)
async def test_invalid_constraints_are_400(served, extra):
    oai, _ = served
    with pytest.raises(openai.BadRequestError):
        await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body=extra)


async def test_echo_logprob_completion(served):
    oai, app = served
    tok = app.state.engine.tokenizer
    for prompt in (PROMPT, tok.encode(PROMPT)):
        r = await oai.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0, echo=True, logprobs=1
        )
        expected = prompt if isinstance(prompt, str) else tok.decode(prompt, skip_special_tokens=False)
        assert r.choices[0].text.startswith(expected)
        lp = r.choices[0].logprobs
        n_prompt = len(tok.encode(PROMPT))
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 5


# --------------------------------------------------------------------------- chat (test_chat.py)


async def test_no_logprobs_chat(served):
    oai, _ = served
    r = await oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=5, temperature=0.0, logprobs=False
    )
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("k", [0, 5])
async def test_zero_and_some_logprobs_chat(served, k):
    oai, _ = served
    r = await oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=5, temperature=0.0, logprobs=True, top_logprobs=k
    )
    content = r.choices[0].logprobs.content
    assert content is not None and all(len(c.top_logprobs) == k for c in content)


async def test_too_many_chat_logprobs(served):
    oai, _ = served
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(
            model=MODEL, messages=CHAT, max_completion_tokens=5, logprobs=True, top_logprobs=21
        )
    r = await oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=5, logprobs=True, top_logprobs=20
    )
    assert all(len(c.top_logprobs) == 20 for c in r.choices[0].logprobs.content)


@pytest.mark.parametrize(("prompt_logprobs", "ok"), [(-1, False), (1, True), (None, True)])
async def test_prompt_logprobs_chat(served, prompt_logprobs, ok):
    oai, _ = served
    extra = {"prompt_logprobs": prompt_logprobs} if prompt_logprobs is not None else {}
    if not ok:
        with pytest.raises(openai.BadRequestError):
            await oai.chat.completions.create(
                model=MODEL, messages=CHAT, max_completion_tokens=5, extra_body=extra
            )
        return
    r = await oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=5, extra_body=extra
    )
    if prompt_logprobs is None:
        assert r.model_extra.get("prompt_logprobs") is None
    else:
        assert r.model_extra["prompt_logprobs"][0] is None and len(r.model_extra["prompt_logprobs"]) > 1


async def test_more_than_one_prompt_logprobs_chat(served):
    oai, _ = served
    r = await oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=5, extra_body={"prompt_logprobs": 2}
    )
    assert all(2 <= len(e) <= 3 for e in r.model_extra["prompt_logprobs"][1:])


async def test_single_chat_session(served):
    oai, app = served
    r = await oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=10,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 10
    assert choice.message.role == "assistant" and choice.message.content
    assert len(choice.logprobs.content[0].top_logprobs) == 5
    # the conversation goes on with the answer in it
    messages = [
        *CHAT,
        {"role": "assistant", "content": choice.message.content},
        {"role": "user", "content": "express your result in json"},
    ]
    again = await oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10)
    assert again.choices[0].message.content is not None


async def test_chat_streaming(served):
    oai, _ = served
    whole = await oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0.0
    )
    stream = await oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0.0, stream=True
    )
    parts, finish, roles = [], None, []
    async for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        if delta.content:
            parts.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"] and finish == whole.choices[0].finish_reason
    assert "".join(parts) == whole.choices[0].message.content


async def test_chat_completion_stream_options(served):
    oai, _ = served
    base = {"model": MODEL, "messages": CHAT, "max_completion_tokens": 10, "temperature": 0.0}
    stream = await oai.chat.completions.create(**base, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(**base, stream=False, stream_options={"include_usage": True})


async def test_structured_outputs_chat(served):
    oai, _ = served
    r = await oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = await oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])
async def test_long_seed(served, seed):
    oai, _ = served
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5, seed=seed)


async def test_complex_message_content(served):
    oai, _ = served
    parts = [{"type": "text", "text": "what is 1+1? please provide the result without any other text."}]
    r = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_completion_tokens=5, temperature=0.0
    )
    plain = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": parts[0]["text"]}],
        max_completion_tokens=5,
        temperature=0.0,
    )
    assert r.choices[0].message.content == plain.choices[0].message.content


async def test_extra_fields_allowed(served):
    oai, _ = served
    r = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}],
        max_completion_tokens=5,
        temperature=0.0,
    )
    assert r.choices[0].message.content is not None


async def test_chat_echo(served):
    """test_chat_echo.py: echo prepends the last message's content when it is the assistant's."""
    oai, _ = served
    messages = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    r = await oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=3,
        temperature=0.0,
        extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert r.choices[0].message.content.startswith("The answer is")


# --------------------------------------------------------------------------- prompt validation (test_prompt_validation.py)


async def test_empty_prompt(served):
    oai, _ = served
    with pytest.raises(openai.BadRequestError, match="empty"):
        await oai.completions.create(model=MODEL, prompt="", max_tokens=5, temperature=0.0)


async def test_out_of_vocab_token_ids(served):
    oai, _ = served
    with pytest.raises(openai.BadRequestError, match="vocabulary|token"):
        await oai.completions.create(model=MODEL, prompt=[999999], max_tokens=5, temperature=0.0)


async def test_prompt_longer_than_the_context_is_400(served):
    oai, app = served
    with pytest.raises(openai.BadRequestError):
        await oai.completions.create(
            model=MODEL, prompt=[5] * (app.state.engine.max_model_len + 1), max_tokens=5
        )
