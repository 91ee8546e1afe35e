"""A chat-template rendering process: render jobs in on stdin, results out on stdout.

api/server/render_pool.py starts a few of these and kills one whose render runs past its time limit, whose
client left, or that died. A template is code from the model directory or, when the operator trusts
request templates, from the client: jinja's sandbox stops it reaching the server, but not computing for
minutes or allocating gigabytes. In a process of its own such a template costs at most its time and
memory limits, and the server's interpreter, event loop and threads never wait on it.

The process imports only jinja2 (through model/chat_template.py) and holds no server state, so killing
it mid-render loses nothing. Its address space is capped (RLIMIT_AS) at start; it dies with its parent.

Frames, both ways: a 4-byte big-endian length, then the payload.
  job (JSON): {"template", "messages", "add_generation_prompt", "continue_final_message",
               "variables", "max_chars"}
  reply: b"T" + the rendered text (UTF-8, surrogates passed through), or b"E" + JSON
         {"kind": "compile" | "render" | "too_long" | "memory", "message"}
The text goes back unwrapped so that the parent decodes megabytes with one bytes.decode, not a JSON parse.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import resource
import signal
import sys
from typing import Any, BinaryIO

from graphcache.model.chat_template import (
    ChatTemplateError,
    InvalidChatTemplate,
    compile_client_template,
    render_chat,
    set_text_limit,
)

__all__ = ["main", "read_frame", "write_frame"]

_PR_SET_PDEATHSIG = 1


def read_frame(stream: BinaryIO) -> bytes | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    return stream.read(int.from_bytes(head, "big"))


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(len(payload).to_bytes(4, "big") + payload)
    stream.flush()


def _error(kind: str, message: str) -> bytes:
    return b"E" + json.dumps({"kind": kind, "message": message}).encode()


def render_job(job: dict[str, Any]) -> bytes:
    """One job's reply frame payload."""
    max_chars = job["max_chars"]
    try:
        compiled = compile_client_template(job["template"])
        set_text_limit(compiled, max_chars)
        text = render_chat(
            compiled,
            job["messages"],
            job["add_generation_prompt"],
            job["continue_final_message"],
            **job["variables"],
        )
    except InvalidChatTemplate as e:
        return _error("compile", e.message)
    except ChatTemplateError as e:
        return _error("render", e.message)
    except MemoryError:
        return _error("memory", "the chat template used more memory than its limit")
    if len(text) > max_chars:
        return _error("too_long", f"the chat template rendered {len(text)} characters, more than {max_chars}")
    return b"T" + text.encode("utf-8", "surrogatepass")


def _die_with_parent() -> None:
    """SIGKILL this process when the server goes, even mid-render (stdin's EOF is seen only between jobs)."""
    # Not glibc Linux: the parent's kill on shutdown, and stdin's EOF, still end it.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    memory_bytes = int(argv[0])
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (payload := read_frame(stdin)) is not None:
        try:
            reply = render_job(json.loads(payload))
        except MemoryError:  # decoding the job itself did not fit
            reply = _error("memory", "the chat did not fit the rendering process's memory limit")
        write_frame(stdout, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
