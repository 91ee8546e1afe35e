"""Fields vLLM clients rely on, through the official openai client on the served tiny model: stop_reason
on every choice, root / parent / permission on model cards, echo with max_tokens 0 (the prompt and its
logprobs back), continue_final_message, add_generation_prompt, a per-request chat_template, the
server's chat_template setting, and skip_special_tokens false.

Expected values come from independent references: the tokenizer rendering and encoding the same chat
itself, a generation run first to pick stop strings and tokens that do occur, and a max_tokens 1 echo
whose prompt logprobs must equal the max_tokens 0 answer's.
"""

from __future__ import annotations

import json

import openai
import pytest
import pytest_asyncio
from graphcache.config import Settings
from helpers_api import SMALL_SERVER, serving
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.asyncio(loop_scope="module")

SMALL = {
    **SMALL_SERVER,
    "drain_timeout_s": 2.0,
    "trust_request_chat_template": True,  # vLLM's --trust-request-chat-template: request templates render
}
MODEL = "graphcache-tiny"
TEXT = "Once upon a time"
CHAT = [{"role": "user", "content": "Hello there"}]
# A template that shows its own marks: each message's content followed by "|".
OWN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
SERVER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    async with serving(Settings(cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)) as (client, app):
        oai = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
        yield oai, app


async def _greedy(oai, n: int = 8) -> openai.types.Completion:
    return await oai.completions.create(
        model=MODEL,
        prompt=TEXT,
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )


# --------------------------------------------------------------------------- stop_reason


async def test_stop_reason_names_the_stop_token_or_string(served):
    oai, _ = served
    first = (await _greedy(oai)).choices[0]
    assert first.finish_reason == "length" and first.model_extra["stop_reason"] is None
    ids = first.model_extra["token_ids"]
    stop_id = ids[3]
    by_token = await oai.completions.create(
        model=MODEL,
        prompt=TEXT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    choice = by_token.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id
    text = first.text
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].strip())
    by_string = await oai.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=8, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    choice = by_string.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    # Streams carry it too: null until the choice finishes, then the stop string.
    stream = await oai.completions.create(
        model=MODEL,
        prompt=TEXT,
        max_tokens=8,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert all(c.model_extra["stop_reason"] is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "stop" and chunks[-1].model_extra["stop_reason"] == stop


async def test_chat_choices_carry_stop_reason(served):
    oai, _ = served
    free = await oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert free.choices[0].model_extra["stop_reason"] is None
    text = free.choices[0].message.content
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].strip())
    stopped = await oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert stopped.choices[0].model_extra["stop_reason"] == stop
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert "stop_reason" in chunks[0].model_extra and chunks[-1].model_extra["stop_reason"] == stop


# --------------------------------------------------------------------------- model cards


async def test_model_cards_have_root_parent_and_permission(served):
    oai, _ = served
    (card,) = (await oai.models.list()).data
    one = await oai.models.retrieve(MODEL)
    for c in (card, one):
        extra = c.model_extra
        assert c.id == MODEL and extra["root"] and extra["parent"] is None
        (perm,) = extra["permission"]
        assert perm["object"] == "model_permission" and perm["allow_sampling"] and perm["organization"] == "*"


# --------------------------------------------------------------------------- echo without generation


async def test_echo_with_max_tokens_zero_returns_the_prompt_and_its_logprobs(served):
    oai, app = served
    n_prompt = len(app.state.engine.tokenizer.encode(TEXT))
    zero = await oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True, logprobs=1)
    (choice,) = zero.choices
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens == n_prompt
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt and lp.token_logprobs[0] is None
    # The reference: one generated token after the same echo; its prompt part must be the same.
    one = await oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, echo=True, logprobs=1)
    ref = one.choices[0].logprobs
    assert lp.tokens == ref.tokens[:n_prompt]
    assert lp.token_logprobs[1:] == pytest.approx(ref.token_logprobs[1:n_prompt], abs=1e-5)
    plain = await oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True)
    assert plain.choices[0].text == TEXT and plain.choices[0].logprobs is None
    stream = await oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True, stream=True)
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == TEXT and chunks[-1].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:
        await oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"


# --------------------------------------------------------------------------- chat prompt controls


async def _prompt_ids(oai, **body) -> list[int]:
    done = await oai.chat.completions.create(
        model=MODEL, max_tokens=1, extra_body={"return_token_ids": True, **body.pop("extra", {})}, **body
    )
    return done.model_extra["prompt_token_ids"]


async def test_add_generation_prompt_and_continue_final_message(served):
    oai, app = served
    tok = app.state.engine.tokenizer
    chat = [*CHAT, {"role": "assistant", "content": "Sure, the"}]
    with_opener = await _prompt_ids(oai, messages=CHAT)
    without = await _prompt_ids(oai, messages=CHAT, extra={"add_generation_prompt": False})
    assert with_opener == tok.encode(tok.apply_chat_template(CHAT, True), add_special_tokens=False)
    assert without == tok.encode(tok.apply_chat_template(CHAT, False), add_special_tokens=False)
    assert len(with_opener) > len(without)
    continued = await _prompt_ids(
        oai, messages=chat, extra={"add_generation_prompt": False, "continue_final_message": True}
    )
    closed = tok.apply_chat_template(chat, False)
    assert closed.rstrip().endswith("<|im_end|>")  # the template closes the turn; continuing cuts that
    expected = closed[: closed.rindex("Sure, the") + len("Sure, the")]
    assert continued == tok.encode(expected, add_special_tokens=False)
    with pytest.raises(openai.BadRequestError) as refused:
        await _prompt_ids(oai, messages=chat, extra={"continue_final_message": True})
    assert refused.value.body["param"] == "continue_final_message"


async def test_per_request_chat_template(served):
    oai, app = served
    tok = app.state.engine.tokenizer
    ids = await _prompt_ids(oai, messages=CHAT, extra={"chat_template": OWN_TEMPLATE})
    assert ids == tok.encode("Hello there|", add_special_tokens=False)
    # The model's own template is untouched for the next request.
    assert await _prompt_ids(oai, messages=CHAT) == tok.encode(
        tok.apply_chat_template(CHAT, True), add_special_tokens=False
    )
    with pytest.raises(openai.BadRequestError) as refused:
        await _prompt_ids(oai, messages=CHAT, extra={"chat_template": "{% for %}"})
    assert refused.value.body["param"] == "chat_template"
    # The sandbox holds for a client's template as for the model's.
    with pytest.raises(openai.BadRequestError):
        await _prompt_ids(oai, messages=CHAT, extra={"chat_template": "{{ ''.__class__.__mro__ }}"})


async def test_server_chat_template_setting(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(SERVER_TEMPLATE)
    settings = Settings(cache_dir=tmp_path_factory.mktemp("cache"), chat_template=str(path), **SMALL)
    async with serving(settings) as (client, app):
        tok = app.state.engine.tokenizer
        oai = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
        assert await _prompt_ids(oai, messages=CHAT) == tok.encode(
            "[user] Hello there\n", add_special_tokens=False
        )
        # A request's own template still wins over the server's.
        own = await _prompt_ids(oai, messages=CHAT, extra={"chat_template": OWN_TEMPLATE})
        assert own == tok.encode("Hello there|", add_special_tokens=False)
        tokenized = (await client.post("/tokenize", json={"messages": CHAT})).json()
        assert tokenized["tokens"] == tok.encode("[user] Hello there\n", add_special_tokens=False)
    inline = Settings(cache_dir=path.parent, chat_template=SERVER_TEMPLATE, **SMALL)
    assert inline.http.chat_template == SERVER_TEMPLATE
    with pytest.raises(ValueError, match="fix the path"):
        Settings(chat_template=str(path.parent / "missing.jinja"), **SMALL)


# --------------------------------------------------------------------------- special tokens in the text


async def test_skip_special_tokens_false_keeps_their_text(served):
    oai, app = served
    tok = app.state.engine.tokenizer
    marker = "<|im_end|>"
    forced = {"ignore_eos": True, "logit_bias": {str(tok.special_tokens[marker]): 100}}
    kept = await oai.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=2, extra_body={**forced, "skip_special_tokens": False}
    )
    skipped = await oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, extra_body=forced)
    assert kept.choices[0].text == marker * 2 and skipped.choices[0].text == ""
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=2,
        stream=True,
        extra_body={**forced, "skip_special_tokens": False},
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == marker * 2, json.dumps(text)


# --------------------------------------------------------------------------- vllm:request_params_n


def _n_series(app) -> tuple[float, float]:
    text = generate_latest(app.state.metrics.registry).decode()
    found = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("vllm:request_params_n_") and s.labels.get("model_name") == MODEL
    }
    return found["vllm:request_params_n_count"], found["vllm:request_params_n_sum"]


async def test_request_params_n_counts_each_prompt_with_its_n(served):
    oai, app = served
    count, total = _n_series(app)
    await oai.completions.create(model=MODEL, prompt=[TEXT, "Hello"], n=2, max_tokens=1)
    await oai.chat.completions.create(model=MODEL, messages=CHAT, n=3, max_tokens=1)
    assert _n_series(app) == (count + 3, total + 2 * 2 + 3)
