"""Chat templates render in killable worker processes (api/server/render_worker.py), never in the server.

A template is code: jinja's sandbox keeps it from the server's objects, but one expression can hold
the interpreter for minutes (`7 ** 10000000` is one C call, which no thread or signal interrupts) and
one loop can allocate gigabytes. So each render is a job for a worker process with a wall-time limit
(the worker is killed past it), an address-space limit (set in the worker) and a bound on the rendered
text (the context window in characters, checked in the worker before anything is tokenized). A job
whose client leaves is killed too: the awaiting task is cancelled, and cancelling kills the worker.

Two pools per server: the model's (and the server's configured) template, and request templates
(only with trust_request_chat_template), so that slow request templates queue behind each other and
never in front of ordinary chats. Workers start on first use; a killed one is replaced by the next job.
The added cost for an ordinary chat is one job's round trip over pipes (benchmarks/template_render.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any

from graphcache.model.chat_template import ChatTemplateError, InvalidChatTemplate

__all__ = ["RenderLimitError", "RenderPool", "encode_job"]

log = logging.getLogger("graphcache.api")


class RenderLimitError(ChatTemplateError):
    """A render passed one of the limits: `setting` names the setting that raises it."""

    def __init__(self, message: str, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


def encode_job(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    variables: dict[str, Any],
    max_chars: int,
) -> bytes:
    """A job's frame payload (JSON). Build it off the event loop: it grows with the chat."""
    job = {
        "template": template,
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "variables": variables,
        "max_chars": max_chars,
    }
    return json.dumps(job).encode()


@dataclass(eq=False)
class _Worker:
    proc: asyncio.subprocess.Process

    async def call(self, payload: bytes) -> bytes:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(len(payload).to_bytes(4, "big") + payload)
        await self.proc.stdin.drain()
        head = await self.proc.stdout.readexactly(4)
        return await self.proc.stdout.readexactly(int.from_bytes(head, "big"))

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


class RenderPool:
    """Up to `workers` rendering processes; `render` waits for a free one."""

    def __init__(self, name: str, workers: int, timeout_s: float, memory_mb: int) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._slots = asyncio.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()  # idle and busy: close() kills them all
        self._reaping: set[asyncio.Task] = set()

    async def render(self, payload: bytes) -> str:
        """The rendered text of one job (`encode_job`). Raises InvalidChatTemplate (the template does
        not compile), ChatTemplateError (it refused or failed on the messages) or RenderLimitError."""
        async with self._slots:
            worker = self._idle.pop() if self._idle else await self._spawn()
            try:
                reply = await asyncio.wait_for(worker.call(payload), self.timeout_s)
            except TimeoutError:
                self._discard(worker)
                raise RenderLimitError(
                    f"the chat template took longer than {self.timeout_s:g} s to render",
                    "chat_template_timeout_s",
                ) from None
            except (asyncio.IncompleteReadError, ConnectionError):  # it died: out of memory, or killed
                self._discard(worker)
                raise RenderLimitError(
                    f"the chat template's rendering process ended (past its {self.memory_mb} MB limit?)",
                    "chat_template_memory_mb",
                ) from None
            except BaseException:  # cancelled (the client left, or shutdown): its state is unknown
                self._discard(worker)
                raise
            self._idle.append(worker)
        return _reply_text(reply)

    async def _spawn(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "graphcache.api.server.render_worker",
            str(self.memory_mb << 20),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C goes to the server, which ends its workers
        )
        worker = _Worker(proc)
        self._live.add(worker)
        return worker

    def _discard(self, worker: _Worker) -> None:
        self._live.discard(worker)
        worker.kill()
        task = asyncio.ensure_future(worker.proc.wait())  # reap it, off the caller's path
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def warm(self) -> None:
        """Start one worker now, so the first chat does not wait for a process to start."""
        async with self._slots:
            if not self._idle:
                self._idle.append(await self._spawn())

    async def close(self) -> None:
        """Kill every worker, idle or busy (a busy one's job then fails as a worker that died)."""
        for worker in list(self._live):
            self._discard(worker)
        self._idle.clear()
        if self._reaping:
            await asyncio.wait(self._reaping, timeout=2.0)


def _reply_text(reply: bytes) -> str:
    if reply[:1] == b"T":
        return reply[1:].decode("utf-8", "surrogatepass")
    error = json.loads(reply[1:])
    kind, message = error["kind"], error["message"]
    if kind == "compile":
        raise InvalidChatTemplate(message)
    if kind == "memory":
        raise RenderLimitError(message, "chat_template_memory_mb")
    if kind == "too_long":
        raise RenderLimitError(message, "max_model_len")
    raise ChatTemplateError(message)
