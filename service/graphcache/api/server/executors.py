"""Bounded worker pools for the API's CPU work, one per kind of work.

The event loop must never run work that grows with a request body, so such work runs in threads.
One shared pool (asyncio.to_thread's default) would let one kind of work starve the others: a burst
of large schemas to compile, or of large responses to build, would queue every tokenize call behind
it, and /tokenize or a small chat request would wait seconds for a thread. So each kind gets its own
small pool, and a request only ever waits behind work of its own kind:

  - `run_input`: tokenizing prompts and chats, decoding prompts for echo, and the checks that grow
    with the body (token-id lists). Tokenizers release the interpreter lock, so a few threads help.
  - `run_response`: building a finished answer (decoding logprob tokens, parsing tool calls).
  - Grammar compiling (output constraints) belongs in its own pool too, next to these two; until it
    has one, openai.py compiles through asyncio.to_thread.

Each call runs in a copy of the caller's context, so log records written in the worker carry the
request id (request_log.py reads it from a context variable), as asyncio.to_thread does.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["INPUT_WORKERS", "RESPONSE_WORKERS", "run_input", "run_response"]

T = TypeVar("T")

INPUT_WORKERS = 4
RESPONSE_WORKERS = 2

# Threads start on first use; the pools live as long as the process (their threads are daemons of
# concurrent.futures and are joined at interpreter exit, like the default pool's).
_input_pool = ThreadPoolExecutor(max_workers=INPUT_WORKERS, thread_name_prefix="graphcache-input")
_response_pool = ThreadPoolExecutor(max_workers=RESPONSE_WORKERS, thread_name_prefix="graphcache-response")


async def _run(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(pool, call)


async def run_input(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on the input pool (tokenizing, body-sized checks)."""
    return await _run(_input_pool, fn, *args, **kwargs)


async def run_response(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on the response pool (building finished answers)."""
    return await _run(_response_pool, fn, *args, **kwargs)
