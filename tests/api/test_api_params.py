"""Issue 12 items 1-3, API side: every field of vLLM's CompletionRequest and ChatCompletionRequest is
honoured or refused with a 400 naming it (never a 200 with the field dropped); n, best_of and batched
prompts fan out into concurrent engine requests.

The real Engine serves the embedded tiny model on the CPU. `Recorder` wraps Engine.generate: it keeps
what each engine request was given (ids, SamplingParams), and, where the engine does not produce log
probabilities yet (helpers are building that), fills them in with known values so the API's shapes
and best_of's ranking can be checked against them.
"""

from __future__ import annotations

import asyncio
import json
import logging

import openai
import pytest
import pytest_asyncio
from graphcache.api.openai import prompt_encoding, protocol
from graphcache.config import Settings
from graphcache.engine.errors import QueueFull
from graphcache.engine.sequence import SamplingParams, StructuredSpec
from helpers_api import SMALL_SERVER, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

SMALL = {
    **SMALL_SERVER,
    "drain_timeout_s": 2.0,
    "trust_request_chat_template": True,  # the chat_template field reaches the template, as vLLM's flag lets it
}

# The field names of vLLM's request models (vllm/entrypoints/openai/protocol.py of the guided_* era and
# the newer completion/protocol.py, chat_completion/protocol.py): the union, as facts.
VLLM_COMPLETION_FIELDS = {
    "model",
    "prompt",
    "prompt_embeds",
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "allowed_token_ids",
    "prompt_logprobs",
    "logprob_token_ids",
    "bad_words",
    "add_special_tokens",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "priority",
    "request_id",
    "session_id",
    "logits_processors",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "thinking_token_budget",
    "stream_interval",
}
VLLM_CHAT_FIELDS = {
    "messages",
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "thinking_token_budget",
    "include_reasoning",
    "parallel_tool_calls",
    "user",
    "best_of",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "prompt_logprobs",
    "logprob_token_ids",
    "allowed_token_ids",
    "bad_words",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structural_tag",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "priority",
    "request_id",
    "session_id",
    "logits_processors",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_prompt_text",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "stream_interval",
}


class Recorder:
    """Engine.generate, recording each request (the engine computes logprobs itself)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.original = engine.generate
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        self.chat_kwargs: list[dict] = []

    def generate(self, request_id, ids, params=None, **kw):
        self.calls.append((request_id, list(ids), params))
        return self.original(request_id, ids, params, **kw)

    @property
    def params(self) -> SamplingParams:
        assert self.calls, "the engine was not reached"
        return self.calls[-1][2]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    async with serving(Settings(cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)) as pair:
        yield pair


@pytest.fixture
def client(served):
    return served[0]


@pytest.fixture
def rec(served, monkeypatch):
    engine = served[1].state.engine
    recorder = Recorder(engine)
    monkeypatch.setattr(engine, "generate", recorder.generate)
    encode_job = prompt_encoding.encode_job

    def recording_encode_job(
        template, messages, add_generation_prompt, continue_final_message, variables, max_chars
    ):
        recorder.chat_kwargs.append(
            {
                "template": template,
                "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message,
                **variables,
            }
        )
        return encode_job(
            template, messages, add_generation_prompt, continue_final_message, variables, max_chars
        )

    # The render job a chat sends to its template worker: what the template will see.
    monkeypatch.setattr(prompt_encoding, "encode_job", recording_encode_job)
    return recorder


def sse(text: str) -> list:
    frames = [f[6:] for f in text.split("\n\n") if f]
    assert frames[-1] == "[DONE]", text[-300:]
    return [json.loads(f) for f in frames[:-1]]


REFUSED = "refused"
TEXT = "Once upon a time"
COMPLETION = {"prompt": TEXT, "max_tokens": 3, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3, "ignore_eos": True}


def p(**expected):
    """The check: the engine's SamplingParams carry these values."""

    def check(rec, body, _tok):
        for name, value in expected.items():
            assert getattr(rec.params, name) == value, (name, getattr(rec.params, name))

    return check


def structured(kind, value=None):
    def check(rec, body, _tok):
        assert rec.params.structured == StructuredSpec(kind, value), rec.params.structured

    return check


def choices(count):
    def check(rec, body, _tok):
        assert len(body["choices"]) == count and len(rec.calls) >= count

    return check


def _bad_words(rec, body, tok):
    assert tok.encode("hello", False) in rec.params.bad_words_token_ids
    assert tok.encode(" hello", False) in rec.params.bad_words_token_ids


def _truncated(first: bool):
    def check(rec, body, tok):
        ids = tok.encode(TEXT)
        assert rec.calls[-1][1] == (ids[:2] if first else ids[-2:])

    return check


def _completion_logprobs(rec, body, tok):
    lp = body["choices"][0]["logprobs"]
    assert rec.params.logprobs == 2 and len(lp["tokens"]) == 3 == len(lp["top_logprobs"])
    assert all(len(t) >= 1 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0


def _beams(rec, body, tok):
    """Beam search (api/openai/beam_search.py): one-token requests with 2 x width logprobs, n beams back."""
    assert rec.params.max_tokens == 1 and rec.params.logprobs == 4 and len(body["choices"]) == 2


def _echo(rec, body, tok):
    assert body["choices"][0]["text"].startswith(TEXT)


def _prompt_logprobs(rec, body, tok):
    assert rec.params.prompt_logprobs == 1
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(tok.encode(TEXT))


def _token_ids(rec, body, tok):
    assert len(body["choices"][0]["token_ids"]) == 3


def _as_ids(rec, body, tok):
    assert all(t.startswith("token_id:") for t in body["choices"][0]["logprobs"]["tokens"])


def _model_name(rec, body, tok):
    assert body["model"] == "graphcache-tiny"


def _no_bos(rec, body, tok):
    assert rec.calls[-1][1] == tok.encode(TEXT, False)


def _request_id(rec, body, tok):
    assert body["id"] == "cmpl-my-id"


def _ok(rec, body, tok):
    assert body["choices"]


def _stream(rec, body, tok):
    assert isinstance(body, list) and body[-1]["choices"][0]["finish_reason"] == "length"


def _stream_usage(rec, body, tok):
    assert body[-1]["choices"] == [] and body[-1]["usage"]["completion_tokens"] == 3


def _continuous(rec, body, tok):
    assert all(c["usage"] is not None for c in body)


def _best_of(rec, body, tok):
    assert len(rec.calls) == 2 and len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None


def _max_tokens(rec, body, tok):
    assert body["usage"]["completion_tokens"] == 2


SEED = -12345
# field -> (value, other fields it needs, check or REFUSED)
COMPLETION_CASES = {
    "model": ("graphcache-tiny", {}, _model_name),
    "prompt": ([5, 6, 7], {}, lambda rec, b, t: rec.calls[-1][1] == [5, 6, 7] or pytest.fail("ids")),
    "prompt_embeds": ("AAAA", {}, REFUSED),
    "best_of": (2, {}, _best_of),
    "echo": (True, {}, _echo),
    "frequency_penalty": (0.5, {}, p(frequency_penalty=0.5)),
    "presence_penalty": (-0.5, {}, p(presence_penalty=-0.5)),
    "repetition_penalty": (1.3, {}, p(repetition_penalty=1.3)),
    "logit_bias": ({"7": 5}, {}, p(logit_bias={7: 5.0})),
    "logprobs": (2, {}, _completion_logprobs),
    "max_tokens": (2, {}, _max_tokens),
    "n": (2, {}, choices(2)),
    "seed": (SEED, {}, p(seed=SEED)),
    "stop": ([f"zz{i}" for i in range(5)], {}, p(stop=[f"zz{i}" for i in range(5)])),
    "stream": (True, {}, _stream),
    "stream_options": ({"include_usage": True}, {"stream": True}, _stream_usage),
    "suffix": ("and then", {}, REFUSED),
    "temperature": (0.0, {}, p(temperature=0.0)),
    "top_p": (0.5, {}, p(top_p=0.5)),
    "top_k": (5, {}, p(top_k=5)),
    "min_p": (0.1, {}, p(min_p=0.1)),
    "user": ("user-42", {}, _ok),
    "session_id": ("session-1", {}, _ok),
    "request_id": ("my-id", {}, _request_id),
    "use_beam_search": (True, {"n": 2}, _beams),
    "watermarking": (True, {}, REFUSED),
    "length_penalty": (0.5, {"use_beam_search": True}, p(max_tokens=1, logprobs=2)),  # one-token beam steps
    "stop_token_ids": ([9], {}, p(stop_token_ids=[9])),
    "include_stop_str_in_output": (True, {}, p(include_stop_str_in_output=True)),
    "ignore_eos": (False, {}, p(ignore_eos=False)),
    "min_tokens": (2, {}, p(min_tokens=2)),
    "skip_special_tokens": (False, {}, p(skip_special_tokens=False)),
    "spaces_between_special_tokens": (False, {}, REFUSED),
    "truncate_prompt_tokens": (2, {}, _truncated(first=False)),
    "truncation_side": ("right", {"truncate_prompt_tokens": 2}, _truncated(first=True)),
    "allowed_token_ids": (
        [5, 6, 7],
        {},
        p(allowed_token_ids=(5, 6, 7)),
    ),  # one TokenIds, shared by the choices
    "prompt_logprobs": (1, {}, _prompt_logprobs),
    "logprob_token_ids": ([5], {"logprobs": 1}, REFUSED),
    "bad_words": (["hello"], {}, _bad_words),
    "add_special_tokens": (False, {}, _no_bos),
    "response_format": ({"type": "json_object"}, {}, structured("json")),
    "structured_outputs": ({"regex": "[a-z]+"}, {}, structured("regex", "[a-z]+")),
    "guided_json": ({"type": "object"}, {}, structured("json_schema", '{"type": "object"}')),
    "guided_regex": ("[0-9]+", {}, structured("regex", "[0-9]+")),
    "guided_choice": (["yes", "no"], {}, structured("choice", ("yes", "no"))),
    "guided_grammar": ('root ::= "yes" | "no"', {}, structured("grammar", 'root ::= "yes" | "no"')),
    "guided_decoding_backend": ("outlines", {}, REFUSED),
    "guided_whitespace_pattern": (r"\s*", {}, REFUSED),
    "priority": (
        0,
        {},
        p(priority=0),
    ),  # other values need --scheduling-policy priority (test_vllm_chat_parity)
    "logits_processors": (["my.module.Processor"], {}, REFUSED),
    "return_tokens_as_token_ids": (True, {"logprobs": 0}, _as_ids),
    "return_token_ids": (True, {}, _token_ids),
    "routed_experts_prompt_start": (1, {}, REFUSED),
    "return_token_offsets": (True, {}, REFUSED),
    "return_mm_kwargs": (False, {}, REFUSED),
    "cache_salt": ("salt-salt-salt", {}, REFUSED),
    "kv_transfer_params": ({"a": 1}, {}, REFUSED),
    "ec_transfer_params": ({"a": 1}, {}, REFUSED),
    "vllm_xargs": ({"a": 1}, {}, REFUSED),
    "repetition_detection": ({"max_pattern_size": 4}, {}, REFUSED),
    "thinking_token_budget": (10, {}, REFUSED),
    "stream_interval": (4, {}, REFUSED),
}


def _chat_logprobs(k):
    def check(rec, body, tok):
        content = body["choices"][0]["logprobs"]["content"]
        assert rec.params.logprobs == k and len(content) == 3
        assert all(len(c["top_logprobs"]) == k and c["bytes"] == list(c["token"].encode()) for c in content)

    return check


def _template_kwargs(**expected):
    def check(rec, body, tok):
        kwargs = rec.chat_kwargs[-1]
        for name, value in expected.items():
            assert kwargs.get(name) == value, (name, kwargs)

    return check


def _chat_echo(rec, body, tok):
    assert body["choices"][0]["message"]["content"].startswith("Sure,")


def _chat_prompt_logprobs(rec, body, tok):
    assert rec.params.prompt_logprobs == 1 and body["prompt_logprobs"][0] is None


def _chat_token_ids(rec, body, tok):
    assert len(body["choices"][0]["token_ids"]) == 3 and body["prompt_token_ids"] == rec.calls[-1][1]


def _chat_as_ids(rec, body, tok):
    assert all(c["token"].startswith("token_id:") for c in body["choices"][0]["logprobs"]["content"])


def _chat_truncated(rec, body, tok):
    assert len(rec.calls[-1][1]) == 2


TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
]


def _tools_rendered(rec, body, tok):
    """auto (the default with tools): the template sees the tools, nothing constrains the output."""
    assert rec.chat_kwargs[-1]["tools"] == TOOLS and rec.params.structured is None
    assert body["choices"][0]["finish_reason"] in ("length", "tool_calls")


def _tool_call_forced(parallel: bool):
    """required: a grammar forcing the call markup of f, one call or more (parallel_tool_calls)."""

    def check(rec, body, tok):
        spec = rec.params.structured
        assert spec.kind == "grammar" and "<tool_call>" in spec.value and '\\"f\\"' in spec.value, spec
        assert spec.value.startswith('start: call ("\\n" call)*' if parallel else "start: call\n"), spec
        assert rec.chat_kwargs[-1]["tools"] == TOOLS

    return check


SHARED = {name: case for name, case in COMPLETION_CASES.items() if name in VLLM_CHAT_FIELDS}
CHAT_CASES = {
    **SHARED,
    "model": ("graphcache-tiny", {}, _model_name),
    "messages": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {}, _ok),
    "request_id": ("my-id", {}, lambda rec, b, t: b["id"] == "chatcmpl-my-id" or pytest.fail(b["id"])),
    "echo": (
        True,
        {
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure,"}],
            "add_generation_prompt": False,
        },
        _chat_echo,
    ),
    "logprobs": (True, {}, _chat_logprobs(0)),
    "top_logprobs": (2, {"logprobs": True}, _chat_logprobs(2)),
    "return_tokens_as_token_ids": (True, {"logprobs": True}, _chat_as_ids),
    "return_token_ids": (True, {}, _chat_token_ids),
    "prompt_logprobs": (1, {}, _chat_prompt_logprobs),
    "truncate_prompt_tokens": (2, {}, _chat_truncated),
    "truncation_side": ("right", {"truncate_prompt_tokens": 2}, _chat_truncated),
    "max_completion_tokens": (2, {}, _max_tokens),
    "tools": (TOOLS, {}, _tools_rendered),
    "tool_choice": ("required", {"tools": TOOLS}, _tool_call_forced(parallel=True)),
    "parallel_tool_calls": (
        False,
        {"tools": TOOLS, "tool_choice": "required"},
        _tool_call_forced(parallel=False),
    ),
    "reasoning_effort": ("low", {}, _template_kwargs(reasoning_effort="low")),
    "include_reasoning": (False, {}, REFUSED),
    "add_generation_prompt": (False, {}, _template_kwargs(add_generation_prompt=False)),
    "continue_final_message": (
        True,
        {
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure,"}],
            "add_generation_prompt": False,
        },
        _template_kwargs(continue_final_message=True),
    ),
    "add_special_tokens": (True, {}, REFUSED),
    "documents": (
        [{"title": "t", "text": "x"}],
        {},
        _template_kwargs(documents=[{"title": "t", "text": "x"}]),
    ),
    "chat_template": ("{{ messages }}", {}, _template_kwargs(template="{{ messages }}")),
    "chat_template_kwargs": ({"enable_thinking": False}, {}, _template_kwargs(enable_thinking=False)),
    "media_io_kwargs": ({"image": {}}, {}, REFUSED),
    "mm_processor_kwargs": ({"a": 1}, {}, REFUSED),
    "structural_tag": ("{}", {}, REFUSED),
    "return_prompt_text": (True, {}, REFUSED),
}


async def test_the_tables_cover_every_vllm_field():
    assert set(COMPLETION_CASES) == VLLM_COMPLETION_FIELDS
    assert set(CHAT_CASES) == VLLM_CHAT_FIELDS
    refused_c = {n for n, c in COMPLETION_CASES.items() if c[2] is REFUSED}
    assert refused_c == set(protocol.REFUSED_COMPLETION) - {"structural_tag"}
    refused_chat = {n for n, c in CHAT_CASES.items() if c[2] is REFUSED}
    assert refused_chat == set(protocol.REFUSED_CHAT)


async def _send(client, path, base, name, value, extra):
    body = {**base, **extra, name: value}
    r = await client.post(path, json=body)
    return r, (sse(r.text) if body.get("stream") and r.status_code == 200 else r.json())


async def _honoured_or_refused(client, rec, path: str, base: dict, cases: dict, name: str) -> None:
    """One field sent with a non-default value: a 400 naming it (and nothing reaches the engine), or
    a 200 whose case check sees the field's effect."""
    value, extra, check = cases[name]
    r, body = await _send(client, path, base, name, value, extra)
    if check is REFUSED:
        assert r.status_code == 400, r.text
        assert body["error"]["param"] == name and name in body["error"]["message"], body
        assert not rec.calls
        return
    assert r.status_code == 200, r.text
    check(rec, body, rec.engine.tokenizer)


@pytest.mark.parametrize("name", sorted(COMPLETION_CASES))
async def test_completion_field_is_honoured_or_refused(client, rec, name):
    await _honoured_or_refused(client, rec, "/v1/completions", COMPLETION, COMPLETION_CASES, name)


@pytest.mark.parametrize("name", sorted(CHAT_CASES))
async def test_chat_field_is_honoured_or_refused(client, rec, name):
    await _honoured_or_refused(client, rec, "/v1/chat/completions", CHAT, CHAT_CASES, name)


# --------------------------------------------------------------------------- null, unknown, limits


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_null_means_default_for_every_optional_field(client, rec, path, base):
    nulls = {
        k: None
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "n",
            "stream",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "seed",
            "stop",
            "logit_bias",
            "min_tokens",
            "min_p",
            "best_of",
            "logprobs",
            "echo",
            "stream_options",
            "bad_words",
            "truncate_prompt_tokens",
            "response_format",
            "user",
            "priority",
            "use_beam_search",
            "skip_special_tokens",
        )
    }
    r = await client.post(path, json={**base, **nulls})
    assert r.status_code == 200, r.text
    params = rec.params
    assert (
        params.temperature,
        params.top_p,
        params.top_k,
        params.presence_penalty,
        params.repetition_penalty,
        params.min_p,
        params.logprobs,
    ) == (1.0, 1.0, 0, 0.0, 1.0, 0.0, None)


async def test_unknown_fields_are_logged_once_per_name(client, rec, caplog):
    with caplog.at_level(logging.WARNING, logger="graphcache.api"):
        for _ in range(2):
            r = await client.post("/v1/completions", json={**COMPLETION, "frobnicate_xyz": 1})
            assert r.status_code == 200, r.text
    assert len([m for m in caplog.messages if "frobnicate_xyz" in m]) == 1


@pytest.mark.parametrize(
    "body,param",
    [
        ({"n": 129}, "n"),
        ({"n": 2, "best_of": 100, "prompt": ["a", "b"]}, "best_of"),
        ({"prompt": ["a"] * 65, "n": 2}, "n"),
        ({"best_of": 3, "n": 2, "stream": True}, "best_of"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"min_tokens": 5}, "min_tokens"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
async def test_limits_and_conflicts_are_400(client, rec, body, param):
    r = await client.post("/v1/completions", json={**COMPLETION, **body})
    assert r.status_code == 400, r.text
    if param:
        assert r.json()["error"]["param"] == param, r.text
    assert not rec.calls


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {"chat_template_kwargs": {"allow_special_in_content": True}},
            "chat_template_kwargs",
        ),  # the guard stays
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs
        ({"tool_choice": "required"}, "tool_choice"),  # needs tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),  # unlisted
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools"),  # not a name
        ({"tools": TOOLS, "guided_choice": ["a"]}, "guided_choice"),  # two constraints
    ],
)
async def test_chat_conflicts_are_400(client, rec, body, param):
    r = await client.post("/v1/chat/completions", json={**CHAT, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not rec.calls


# --------------------------------------------------------------------------- fan-out


async def test_batched_prompts_with_n_are_indexed_prompt_major(client, rec):
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": ["Once upon", "Hello"],
            "n": 2,
            "max_tokens": 3,
            "ignore_eos": True,
            "seed": 7,
            "temperature": 1.0,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert len(rec.calls) == 4 and len({rid for rid, _, _ in rec.calls}) == 4
    assert all(rid.endswith(f"-{k}") for k, (rid, _, _) in enumerate(rec.calls))
    tok = rec.engine.tokenizer
    assert [c[1] for c in rec.calls] == [tok.encode("Once upon")] * 2 + [tok.encode("Hello")] * 2
    assert [c[2].seed for c in rec.calls] == [7, 8, 7, 8]  # choice i: seed + i
    usage = body["usage"]
    once = len(tok.encode("Once upon")) + len(tok.encode("Hello"))
    assert usage["prompt_tokens"] == once and usage["completion_tokens"] == 12
    assert usage["total_tokens"] == once + 12 and "cached_tokens" in usage["prompt_tokens_details"]


async def test_seeded_choices_match_single_requests(client, rec):
    """Choice i of a seeded n-request is the one-choice request with seed + i."""
    req = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "ignore_eos": True, "temperature": 1.0}
    many = (await client.post("/v1/completions", json={**req, "n": 3, "seed": 100})).json()
    for i in range(3):
        one = (await client.post("/v1/completions", json={**req, "seed": 100 + i})).json()
        assert many["choices"][i]["text"] == one["choices"][0]["text"]


async def test_best_of_keeps_the_most_likely_sample(client, rec):
    """best_of=3, n=1 returns the sample (seed + i) whose tokens have the highest summed logprob."""
    req = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True, "temperature": 1.0}
    best = (
        await client.post(
            "/v1/completions", json={**req, "seed": 50, "best_of": 3, "n": 1, "return_token_ids": True}
        )
    ).json()
    assert [c[2].logprobs for c in rec.calls] == [0, 0, 0]  # asked for internally, to rank
    assert best["choices"][0]["logprobs"] is None  # ... and not returned unasked
    assert best["usage"]["completion_tokens"] == 12  # every sample counts
    singles = [
        (
            await client.post(
                "/v1/completions", json={**req, "seed": 50 + i, "logprobs": 0, "return_token_ids": True}
            )
        ).json()["choices"][0]
        for i in range(3)
    ]
    ranked = max(singles, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    assert best["choices"][0]["token_ids"] == ranked["token_ids"]


async def test_streamed_choices_carry_their_index_and_summed_usage(client, rec):
    r = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = sse(r.text)
    roles = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert sorted(c["choices"][0]["index"] for c in roles) == [0, 1, 2]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]
    assert chunks[-1]["usage"]["completion_tokens"] == 9


async def test_one_refused_sequence_aborts_the_others(client, rec, served):
    engine = served[1].state.engine

    def refuse_third(request_id, ids, params=None, **kw):
        if request_id.endswith("-2"):
            raise QueueFull("full")
        return rec.generate(request_id, ids, params, **kw)

    engine.generate = refuse_third
    r = await client.post("/v1/completions", json={**COMPLETION, "n": 4, "max_tokens": 50})
    assert r.status_code == 429, r.text
    for _ in range(200):
        if not engine.stats()["in_flight"]:
            break
        await asyncio.sleep(0.02)
    assert engine.stats()["in_flight"] == 0


# --------------------------------------------------------------------------- the official client


async def test_openai_client_echo_logprobs_and_n(served, rec):
    client, app = served
    oai = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    done = await oai.completions.create(
        model="graphcache-tiny",
        prompt=TEXT,
        max_tokens=3,
        echo=True,
        logprobs=2,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert len(done.choices) == 2 and [c.index for c in done.choices] == [0, 1]
    lp = done.choices[0].logprobs
    n_prompt = len(app.state.engine.tokenizer.encode(TEXT))
    assert done.choices[0].text.startswith(TEXT)
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == sorted(lp.text_offset)
    chat = await oai.chat.completions.create(
        model="graphcache-tiny",
        messages=CHAT["messages"],
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
        seed=-1,
        stop=list("vwxyz"),
    )
    content = chat.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == 3 for c in content)
    with pytest.raises(openai.NotFoundError):
        await oai.chat.completions.create(model="gpt-4", messages=CHAT["messages"], max_tokens=1)
    with pytest.raises(openai.BadRequestError) as refused:
        await oai.completions.create(model="graphcache-tiny", prompt="x", suffix="y")
    assert refused.value.body["param"] == "suffix"
