"""Reasoning parsers: a chat answer's `<think>...</think>` text goes to `reasoning_content` (vLLM's
name for it, on messages and on stream deltas), the rest to `content`. The `reasoning_parser` setting
picks one:

  - deepseek_r1: DeepSeek-R1's template opens `<think>` in the prompt, so the answer starts inside the
    reasoning: everything up to `</think>` is reasoning (a `<think>` the model writes itself at the
    start is dropped), the rest content. An answer that never closes it (cut by max_tokens) is all
    reasoning, as in vLLM.
  - qwen3: Qwen3 writes `<think>...</think>` itself (and its template leaves an empty pair when
    thinking is off): text before `<think>` and after `</think>` is content, text inside reasoning;
    an answer cut inside the reasoning keeps what it thought as reasoning, streamed or not.
  - none: no parser; all text is content.

Tool calls are read from the content only (api/tool_parsers/), after the reasoning is split off.
One state machine serves both shapes: `split(text)` is a whole answer fed at once, so streamed
deltas always add up to the non-streamed split.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphcache.api.tool_parsers.base import partial_suffix
from graphcache.choices import REASONING_PARSERS

__all__ = ["THINK_END", "THINK_START", "ReasoningDelta", "ReasoningStream", "split_reasoning"]

THINK_START, THINK_END = "<think>", "</think>"
# The state a parser starts in: "open" (inside the reasoning, a leading <think> optional) or "before"
# (content until <think>).
_START_STATE = {"deepseek_r1": "open", "qwen3": "before"}
assert set(_START_STATE) | {"none"} == set(REASONING_PARSERS), "every reasoning_parser choice is handled"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Feed one choice's text deltas; each gives the reasoning and content text it adds (tags held back
    while a delta ends in what may be the start of one). finish() flushes what is held."""

    def __init__(self, parser: str) -> None:
        if parser not in _START_STATE:
            raise ValueError(f"reasoning_parser {parser!r} is not one of {', '.join(_START_STATE)}")
        self._state = _START_STATE[parser]  # open | before | reasoning | content
        self._buf = ""

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buf += text
        while self._buf:
            if self._state == "content":
                out.content += self._buf
                self._buf = ""
            elif self._state == "open":
                head = self._buf.lstrip()
                if THINK_START.startswith(head) and head != THINK_START:
                    break  # maybe the model's own <think>: wait for more
                if head.startswith(THINK_START):
                    self._buf = head[len(THINK_START) :]
                self._state = "reasoning"
            else:
                tag = THINK_START if self._state == "before" else THINK_END
                i = self._buf.find(tag)
                if i < 0:
                    keep = partial_suffix(self._buf, tag)
                    self._emit(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._emit(out, self._buf[:i])
                self._buf = self._buf[i + len(tag) :]
                self._state = "reasoning" if self._state == "before" else "content"
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._state == "open":
            self._state = "reasoning"
        self._emit(out, self._buf)
        self._buf = ""
        return out

    def _emit(self, out: ReasoningDelta, text: str) -> None:
        if self._state == "reasoning":
            out.reasoning += text
        else:
            out.content += text


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A whole answer -> (reasoning_content or None when there was none, content)."""
    stream = ReasoningStream(parser)
    a, b = stream.feed(text), stream.finish()
    return (a.reasoning + b.reasoning) or None, a.content + b.content
