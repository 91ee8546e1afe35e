"""Compact JSON output (vLLM's disable_any_whitespace) on the served tiny model: the request's
`structured_outputs.disable_any_whitespace`, the server's json_disable_any_whitespace default, and the
vLLM serve flags that set it (--structured-outputs-config, --guided-decoding-backend NAME:disable-any-whitespace).

The tiny model's weights are random, so its output is pushed towards whitespace with logit_bias on every
whitespace-only token: with free whitespace the JSON then carries blanks (checked, so the switch is seen
to act), compact it carries none outside strings, whatever the bias.
"""

from __future__ import annotations

import functools
import json

import llguidance
import pytest
import pytest_asyncio
from graphcache.config import Settings
from graphcache.engine.sample.grammar_cache import grammar_source
from graphcache.engine.sequence import StructuredSpec
from helpers_api import serving

on_the_server = pytest.mark.asyncio(loop_scope="module")

SMALL = {
    "device": "cpu",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 128,
    "warmup_decode_sizes": [],
    "capture_sizes": [1, 2, 4, 8, 16],
}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["city", "days", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}


def whitespace_outside_strings(text: str) -> list[int]:
    """Positions of whitespace in `text` that are not inside a JSON string (escapes honoured)."""
    found, in_string, escaped = [], False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in " \t\n\r":
            found.append(i)
    return found


def test_the_whitespace_scan_sees_blanks_outside_strings_only():
    assert whitespace_outside_strings('{"a b": "c\\" d", "e":1}') == [7, 16]
    assert whitespace_outside_strings('{"a":[1,\n2]}') == [8]


@pytest.mark.parametrize("kind, value", [("json", None), ("json_schema", json.dumps(SCHEMA))])
def test_compact_specs_compile_to_a_grammar_without_free_whitespace(kind, value):
    compact = json.loads(grammar_source(StructuredSpec(kind, value, compact=True), "response_format"))
    loose = json.loads(grammar_source(StructuredSpec(kind, value), "response_format"))
    assert compact["grammars"][0]["json_schema"]["x-guidance"]["whitespace_flexible"] is False
    assert "x-guidance" not in loose["grammars"][0]["json_schema"]


def test_a_schemas_own_x_guidance_does_not_undo_compact():
    own = {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}
    grammar = grammar_source(StructuredSpec("json_schema", json.dumps(own), compact=True), "guided_json")
    assert json.loads(grammar)["grammars"][0]["json_schema"]["x-guidance"]["whitespace_flexible"] is False
    llguidance.LLMatcher.validate_grammar(grammar)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    async with serving(Settings(cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)) as (client, app):
        yield client, app


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def compact_server(tmp_path_factory):
    settings = Settings(cache_dir=tmp_path_factory.mktemp("cache"), json_disable_any_whitespace=True, **SMALL)
    async with serving(settings) as (client, app):
        yield client, app


@functools.cache
def _blank_bias(app) -> dict[str, float]:
    tok = app.state.engine.tokenizer
    vocab = tok.vocab_size
    blanks = [i for i in range(vocab) if (t := tok.decode([i])) and not t.strip()]
    assert blanks, "the tiny tokenizer has whitespace tokens"
    return {str(i): 30.0 for i in blanks}


async def _json_out(client, app, extra: dict, seed: int, path: str = "/v1/chat/completions") -> str:
    body = {
        "max_tokens": 48,
        "temperature": 1.0,
        "seed": seed,
        "logit_bias": _blank_bias(app),
        **extra,
    }
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "A trip as JSON"}]
    else:
        body["prompt"] = "A trip as JSON:"
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


SEEDS = range(4)


@on_the_server
async def test_free_whitespace_is_taken_when_pushed_towards_it(served):
    """The control: without the switch the biased model does write blanks between JSON tokens."""
    client, app = served
    outs = [await _json_out(client, app, {"response_format": FORMAT}, seed) for seed in SEEDS]
    assert any(whitespace_outside_strings(o) for o in outs), outs


@on_the_server
@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": FORMAT, "structured_outputs": {"disable_any_whitespace": True}},
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        {"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
        {"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": True}},
    ],
    ids=["response_format", "structured_outputs.json", "json_object", "guided_json"],
)
async def test_disable_any_whitespace_leaves_no_whitespace_outside_strings(served, extra):
    client, app = served
    for seed in SEEDS:
        out = await _json_out(client, app, extra, seed)
        assert out and whitespace_outside_strings(out) == [], out


@on_the_server
async def test_disable_any_whitespace_on_completions_too(served):
    client, app = served
    extra = {"response_format": FORMAT, "structured_outputs": {"disable_any_whitespace": True}}
    for seed in SEEDS:
        out = await _json_out(client, app, extra, seed, path="/v1/completions")
        assert out and whitespace_outside_strings(out) == [], out


@on_the_server
async def test_disable_any_whitespace_alone_constrains_nothing(served):
    """Like vLLM, the option is no constraint of its own: the text is free."""
    client, app = served
    r = await client.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 4, "structured_outputs": {"disable_any_whitespace": True}},
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["yes", 1])
@on_the_server
async def test_a_non_boolean_disable_any_whitespace_is_a_400_naming_it(served, value):
    client, _ = served
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": "hi",
            "max_tokens": 4,
            "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": value},
        },
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "structured_outputs.disable_any_whitespace"


@on_the_server
async def test_the_server_default_makes_json_compact(compact_server):
    client, app = compact_server
    for seed in SEEDS:
        out = await _json_out(client, app, {"response_format": FORMAT}, seed)
        assert out and whitespace_outside_strings(out) == [], out


@on_the_server
async def test_a_request_may_turn_the_server_default_off(compact_server):
    client, app = compact_server
    extra = {"response_format": FORMAT, "structured_outputs": {"disable_any_whitespace": False}}
    outs = [await _json_out(client, app, extra, seed) for seed in SEEDS]
    assert any(whitespace_outside_strings(o) for o in outs), outs


@on_the_server
async def test_compact_does_not_touch_regex_constraints(compact_server):
    client, _ = compact_server
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "guided_regex": "a b c"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a b c"
