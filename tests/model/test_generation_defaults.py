"""The checkpoint's sampling defaults (issue 25): generation_config.json fills the fields a request leaves
out (`--generation-config auto`, the default), `vllm` ignores them, a directory supplies its own; a field
the request sends wins; GET /v1/models says which defaults are in force."""

from __future__ import annotations

import json
import logging

import pytest
from graphcache.api.openai import sampling
from graphcache.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from graphcache.config import Settings
from graphcache.model.generation_defaults import GenerationConfigError, generation_defaults, read_defaults
from graphcache.model.tiny import make_default_model
from helpers_api import serving
from pydantic import ValidationError

SMALL = {
    "device": "cpu",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "warmup_decode_sizes": [1],
    "capture_sizes": [1, 2, 4],
}
NEAR_GREEDY = {"temperature": 0.01, "top_k": 1}


def write_generation_config(directory, **fields) -> None:
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], **fields}))


# --------------------------------------------------------------------------- reading the file


def test_the_fields_read_and_their_request_names(tmp_path):
    write_generation_config(
        tmp_path,
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.05,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        max_new_tokens=512,
        num_beams=1,
    )
    assert read_defaults(tmp_path / "generation_config.json") == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.05,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "max_tokens": 512,
    }


def test_do_sample_false_is_ignored_as_vllm_does(tmp_path):
    write_generation_config(tmp_path, do_sample=False, temperature=0.6)
    assert read_defaults(tmp_path / "generation_config.json") == {"temperature": 0.6}
    write_generation_config(tmp_path, do_sample=False)
    assert read_defaults(tmp_path / "generation_config.json") == {}  # no greedy default from do_sample


def test_values_a_request_could_not_send_are_left_out_with_a_warning(tmp_path, caplog):
    write_generation_config(tmp_path, temperature=3.0, top_p=0, top_k=True, max_new_tokens=0, min_p=0.1)
    with caplog.at_level(logging.WARNING):
        assert read_defaults(tmp_path / "generation_config.json") == {"min_p": 0.1}
    assert "temperature=3.0 is outside" in caplog.text and "max_new_tokens=0" in caplog.text


def test_the_modes(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    write_generation_config(model, temperature=0.5)
    write_generation_config(other, top_p=0.5)
    assert generation_defaults("auto", model) == {"temperature": 0.5}
    assert generation_defaults("auto", tmp_path) == {}  # no generation_config.json: none
    assert generation_defaults("vllm", model) == {}
    assert generation_defaults(str(other), model) == {"top_p": 0.5}
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(GenerationConfigError, match="not valid JSON.*--generation-config vllm"):
        generation_defaults("auto", model)


def test_the_setting(tmp_path, monkeypatch):
    assert Settings().model.generation_config == "auto"
    monkeypatch.setenv("GRAPHCACHE_GENERATION_CONFIG", "vllm")
    assert Settings().model.generation_config == "vllm"
    write_generation_config(tmp_path, temperature=0.5)
    assert Settings(generation_config=str(tmp_path)).model.generation_config == str(tmp_path)
    with pytest.raises(
        ValidationError, match="neither auto, vllm nor a directory holding a generation_config"
    ):
        Settings(generation_config=str(tmp_path / "nope"))


# --------------------------------------------------------------------------- applied to a request


def params(body, defaults, room=None):
    return sampling.base_params(body, [], None, defaults, room)


def test_a_field_left_out_or_null_takes_the_default_a_field_sent_wins():
    defaults = {"temperature": 0.01, "top_k": 1, "top_p": 0.9, "repetition_penalty": 1.1, "min_p": 0.2}
    left_out = params(CompletionRequest(prompt="hi"), defaults)
    assert (left_out.temperature, left_out.top_k, left_out.top_p) == (0.01, 1, 0.9)
    assert (left_out.repetition_penalty, left_out.min_p) == (1.1, 0.2)
    null = params(CompletionRequest.model_validate({"prompt": "hi", "temperature": None}), defaults)
    assert null.temperature == 0.01
    sent = params(CompletionRequest(prompt="hi", temperature=1.0, top_k=-1), defaults)
    assert (sent.temperature, sent.top_k, sent.top_p) == (1.0, 0, 0.9)
    at_api_default = params(CompletionRequest(prompt="hi", temperature=1.0), defaults)  # sent, though default
    assert at_api_default.temperature == 1.0
    assert params(CompletionRequest(prompt="hi"), {}).temperature == 1.0  # none: the API's default


def test_max_new_tokens_bounds_the_default_max_tokens_as_vllm():
    defaults = {"max_tokens": 8}
    assert params(CompletionRequest(prompt="hi"), defaults).max_tokens == 8  # min(16, 8)
    assert params(CompletionRequest(prompt="hi"), {"max_tokens": 100}).max_tokens == 16  # min(16, 100)
    assert params(CompletionRequest(prompt="hi", max_tokens=50), defaults).max_tokens == 50  # sent: wins
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert params(chat, {"max_tokens": 100}, room=30).max_tokens == 30  # the context left
    assert params(chat, {"max_tokens": 100}, room=300).max_tokens == 100
    assert params(chat, {}, room=30).max_tokens is None  # none: the rest of the context, as before
    named = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5)
    assert params(named, {"max_tokens": 100}, room=300).max_tokens == 5


# --------------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_default_model(tmp_path_factory.mktemp("gen") / "tiny")
    write_generation_config(path, **NEAR_GREEDY)
    return path


async def texts(client, n: int = 3, **fields) -> list[str]:
    out = []
    for _ in range(n):
        body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True, **fields}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


async def test_auto_applies_the_checkpoints_defaults(model_dir, tmp_path):
    settings = Settings(model=model_dir, cache_dir=tmp_path, **SMALL)
    async with serving(settings) as (client, _):
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["generation_defaults"] == NEAR_GREEDY
        assert len(set(await texts(client))) == 1  # temperature and top_k from the checkpoint
        sampled = await texts(client, temperature=1.0, top_k=-1)  # the request's own values win
        assert len(set(sampled)) > 1, sampled


async def test_the_engine_process_applies_them_too(model_dir, tmp_path):
    """With the step loop in a child process, the API process reads the defaults from the directory the
    engine loaded (its ready message)."""
    from graphcache.engine.loop.process import EngineClient
    from graphcache.metrics import Metrics

    settings = Settings(model=model_dir, cache_dir=tmp_path, engine_process=True, **SMALL)
    async with serving(settings, EngineClient(settings, Metrics())) as (client, _):
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["generation_defaults"] == NEAR_GREEDY
        assert len(set(await texts(client))) == 1


async def test_vllm_ignores_them(model_dir, tmp_path):
    settings = Settings(model=model_dir, cache_dir=tmp_path, generation_config="vllm", **SMALL)
    async with serving(settings) as (client, _):
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["generation_defaults"] == {}
        sampled = await texts(client)
        assert len(set(sampled)) > 1, sampled  # temperature 1, no top_k: the API's defaults


async def test_a_directory_supplies_them(model_dir, tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    write_generation_config(own, temperature=0.0)
    settings = Settings(model=model_dir, cache_dir=tmp_path, generation_config=str(own), **SMALL)
    async with serving(settings) as (client, _):
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["generation_defaults"] == {"temperature": 0.0}
