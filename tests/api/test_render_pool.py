"""Chat templates render in killable worker processes (api/server/render_pool.py, api/server/render_worker.py) inside
a sandbox that refuses size blow-ups (model/chat_template.py): every hostile template input is a
ChatTemplateError (a 400 upstream), never a crash, a hang or a server-sized allocation."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from graphcache.api.server.render_pool import RenderLimitError, RenderPool, encode_job
from graphcache.model.chat_template import (
    ChatTemplateError,
    InvalidChatTemplate,
    compile_chat_template,
    compile_client_template,
    render_chat,
    set_text_limit,
)

pytestmark = pytest.mark.asyncio

CHAT = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}]
PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] + '\n' + m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ bos_token }}"
)
TEXT_LIMIT = 65536
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"

# Each of these answered 500, froze the interpreter or allocated gigabytes before the sandbox limits.
HOSTILE = {
    "power": "{{ 7 ** 10000000 }}",
    "big int": "{{ 10 ** 5000 }}",
    "int product": "{% set x = 2 ** 8000 %}{{ x * x }}",
    "string times": "{{ 'a' * 10**8 }}",
    "list times": "{{ ([1] * 10**8)|length }}",
    "doubling with +": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "format width": "{{ '%0100000000d' % 1 }}",
    "divide by zero": "{{ 1 / 0 }}",
    "range": "{% for i in range(10**6) %}{% endfor %}",
    "include": "{% include 'other.jinja' %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "filter type error": "{{ 1|join(',') }}",
    "attribute of undefined": "{{ messages[0].nothing.deeper }}",
    "escape attempt": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
}


def _render(source: str, chat=CHAT) -> str:
    compiled = compile_client_template(source)
    set_text_limit(compiled, TEXT_LIMIT)
    return render_chat(compiled, chat, True, False, bos_token="<s>")


@pytest.mark.parametrize("name", sorted(HOSTILE))
async def test_hostile_templates_are_template_errors_in_process(name):
    started = time.perf_counter()
    with pytest.raises(ChatTemplateError) as refused:
        _render(HOSTILE[name])
    assert refused.value.message
    assert time.perf_counter() - started < 10  # refused before computing: ms on any machine


async def test_deep_nesting_does_not_compile():
    with pytest.raises(InvalidChatTemplate, match="nests too deeply"):
        compile_client_template("{% if 1 %}" * 2000 + "{% endif %}" * 2000)


async def test_the_sandbox_keeps_ordinary_arithmetic_and_text():
    source = "{{ 2 ** 10 }} {{ 'ab' * 3 }} {{ [1, 2] + [3] }} {{ '%05d|%.2f' % (42, 1.5) }} {{ 7 % 3 }}"
    assert _render(source) == "1024 ababab [1, 2, 3] 00042|1.50 1"
    # The model path (compile_chat_template) is the same sandbox as a client's template.
    assert compile_chat_template(PLAIN).render(messages=CHAT, add_generation_prompt=False, bos_token="")


@pytest.fixture
async def pool():
    pool = RenderPool("test", workers=2, timeout_s=3.0, memory_mb=256)
    yield pool
    await pool.close()


def _job(source: str, chat=CHAT, max_chars: int = TEXT_LIMIT) -> bytes:
    return encode_job(source, chat, True, False, {"bos_token": "<s>"}, max_chars)


async def test_a_worker_renders_what_the_server_would(pool):
    assert await pool.render(_job(PLAIN)) == _render(PLAIN)
    # Lone surrogates and non-ASCII text come back as they went.
    odd = [{"role": "user", "content": "caf\u00e9 \ud800 \U0001f600"}]
    assert await pool.render(_job(PLAIN, odd)) == _render(PLAIN, odd)


@pytest.mark.parametrize("name", ["power", "string times", "recursion", "include", "format width"])
async def test_hostile_templates_are_template_errors_in_a_worker(pool, name):
    with pytest.raises(ChatTemplateError):
        await pool.render(_job(HOSTILE[name]))
    assert await pool.render(_job(PLAIN)) == _render(PLAIN)  # the pool still serves


async def test_a_template_that_does_not_compile_is_invalid(pool):
    with pytest.raises(InvalidChatTemplate, match="does not compile"):
        await pool.render(_job("{% for %}"))


async def test_past_the_time_limit_the_worker_is_killed_and_replaced(pool):
    pool.timeout_s = 1.0
    started = time.perf_counter()
    with pytest.raises(RenderLimitError) as refused:
        await pool.render(_job(NESTED_LOOPS))
    assert refused.value.setting == "chat_template_timeout_s"
    assert time.perf_counter() - started < 1.0 + 20  # the limit, plus a busy CI machine's margin
    pool.timeout_s = 30.0
    assert await pool.render(_job(PLAIN)) == _render(PLAIN)


async def test_past_the_memory_limit_the_render_is_refused(pool):
    # `~` concatenation is not an operator the sandbox can intercept: the address-space limit stops it.
    doubling = (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    )
    with pytest.raises(RenderLimitError) as refused:
        await pool.render(_job(doubling))
    assert refused.value.setting == "chat_template_memory_mb"
    assert await pool.render(_job(PLAIN)) == _render(PLAIN)


async def test_rendered_text_past_the_bound_is_refused(pool):
    with pytest.raises(RenderLimitError) as refused:
        await pool.render(_job(PLAIN, max_chars=20))
    assert refused.value.setting == "max_model_len"


async def test_a_cancelled_render_kills_its_worker(pool):
    task = asyncio.ensure_future(pool.render(_job(NESTED_LOOPS)))
    for _ in range(200):  # the worker is started and busy
        await asyncio.sleep(0.05)
        if pool._live:
            break
    (worker,) = pool._live
    pid = worker.proc.pid
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(worker.proc.wait(), 20)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not pool._live


async def test_close_kills_every_worker(pool):
    await pool.render(_job(PLAIN))
    procs = [w.proc for w in pool._live]
    assert procs
    await pool.close()
    for proc in procs:
        assert proc.returncode is not None
