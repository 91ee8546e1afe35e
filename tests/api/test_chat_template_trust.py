"""Who may bring a chat template, and templates that do not compile (issue 35, items 1 and 3).

A template sent with a request is code the server runs: refused (400) unless the operator starts the
server with --trust-request-chat-template, as vLLM does, in the chat_template field and in
chat_template_kwargs, on /v1/chat/completions and /tokenize. A model template or a configured one that
does not compile fails the start in one line naming it, instead of answering every chat with an error.
"""

from __future__ import annotations

import pytest
import pytest_asyncio
from graphcache.config import Settings
from graphcache.model.tokenizer import Tokenizer
from helpers_api import serving
from test_startup import assert_load_failed, serve

in_module_loop = pytest.mark.asyncio(loop_scope="module")

SMALL = {"device": "cpu", "max_num_seqs": 4, "max_num_batched_tokens": 64, "warmup_decode_sizes": []}
CHAT = [{"role": "user", "content": "Hello there"}]
OWN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def untrusted(tmp_path_factory):
    async with serving(Settings(cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)) as pair:
        yield pair


@in_module_loop
@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {"chat_template": OWN_TEMPLATE}),
        ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": OWN_TEMPLATE}}),
        ("/tokenize", {"chat_template": OWN_TEMPLATE}),
        ("/tokenize", {"chat_template_kwargs": {"chat_template": OWN_TEMPLATE}}),
    ],
)
async def test_request_templates_are_refused_by_default(untrusted, path, extra):
    client, _ = untrusted
    response = await client.post(path, json={"messages": CHAT, "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "chat_template_not_trusted"
    assert error["param"] == "chat_template"
    assert "--trust-request-chat-template" in error["message"]
    # The same chat without a template of its own is served.
    plain = await client.post(path, json={"messages": CHAT, "max_tokens": 2})
    assert plain.status_code == 200, plain.text


@in_module_loop
async def test_template_fields_need_the_chat_form_of_tokenize(untrusted):
    client, _ = untrusted
    response = await client.post("/tokenize", json={"prompt": "hi", "chat_template": OWN_TEMPLATE})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template"


@in_module_loop
async def test_trusted_request_templates_render_from_either_field(tmp_path_factory):
    settings = Settings(cache_dir=tmp_path_factory.mktemp("cache"), trust_request_chat_template=True, **SMALL)
    async with serving(settings) as (client, app):
        expected = app.state.engine.tokenizer.encode("Hello there|", add_special_tokens=False)
        for extra in (
            {"chat_template": OWN_TEMPLATE},
            {"chat_template_kwargs": {"chat_template": OWN_TEMPLATE}},
        ):
            response = await client.post("/tokenize", json={"messages": CHAT, **extra})
            assert response.json()["tokens"] == expected, response.text
        failed = await client.post("/tokenize", json={"messages": CHAT, "chat_template": "{{ 1 / 0 }}"})
        assert failed.status_code == 400
        assert failed.json()["error"]["code"] == "chat_template_error"
        assert "ZeroDivisionError" in failed.json()["error"]["message"]


def test_a_model_template_that_does_not_compile_is_named(tmp_path):
    from graphcache.model.tiny import make_default_model

    path = make_default_model(tmp_path / "tiny")
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(ValueError, match="chat_template.jinja does not compile") as refused:
        Tokenizer(path).check_chat_template()
    assert "--chat-template" in str(refused.value)


def test_serve_refuses_a_model_whose_template_does_not_compile(tmp_path):
    from graphcache.model.tiny import make_default_model

    path = make_default_model(tmp_path / "tiny")
    (path / "chat_template.jinja").write_text("{% if messages %}unclosed")
    out, seconds = serve("--model", str(path), "--device", "cpu", "--port", "0", "--no-engine-process")
    assert_load_failed(out, seconds, "chat_template.jinja does not compile", "fix the template")


def test_a_configured_template_that_does_not_compile_fails_the_start(tmp_path):
    file = tmp_path / "chat.jinja"
    file.write_text("{{ unclosed")
    out, seconds = serve(
        "--chat-template", str(file), "--device", "cpu", "--port", "0", "--no-engine-process"
    )
    assert_load_failed(out, seconds, "chat.jinja does not compile", "fix the template")
