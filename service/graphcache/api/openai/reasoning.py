"""Reasoning parsers: a chat answer's thinking goes to `reasoning` and `reasoning_content` (current
vLLM's name and its earlier one, both sent, on messages and on stream deltas), the rest to `content`.
The `reasoning_parser` setting picks one:

  - deepseek_r1: DeepSeek-R1's template opens `<think>` in the prompt, so the answer starts inside the
    reasoning: everything up to `</think>` is reasoning (a `<think>` the model writes itself at the
    start is dropped, with whitespace before it), the rest content. An answer that never closes it
    (cut by max_tokens) is all reasoning, as in vLLM.
  - qwen3: as vLLM's qwen3 parser. With thinking on (the default) the answer starts inside the
    reasoning, whether the template put `<think>` in the prompt (Qwen3 thinking models, Qwen3.5) or
    the model writes it first (hybrid Qwen3): reasoning up to `</think>`, or up to a `<tool_call>`
    written before any `</think>` (the call and what follows are content); an answer that never
    closes it is all reasoning. With thinking off (chat_template_kwargs enable_thinking false, or a
    prompt that ends with `</think>`, as Qwen3's template closes an empty thought) the answer is
    content, and only a `<think>...</think>` the model writes itself is reasoning.
  - none: no parser; all text is content.

For either parser a prompt that ends with `</think>` means the reasoning is over: the answer is
content (an explicit `<think>...</think>` in it still reasoning).

Tool calls are read from the content only (api/openai/tool_parsers/), after the reasoning is split off.
One state machine serves both shapes: `split_reasoning(text)` is a whole answer fed at once, so
streamed deltas always add up to the non-streamed split. A whole answer's reasoning is "" (not None)
when the answer entered its reasoning but wrote none, as vLLM's non-streamed parsers give it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from graphcache.api.openai.tool_parsers.base import partial_suffix
from graphcache.choices import REASONING_PARSERS

__all__ = [
    "THINK_END",
    "THINK_START",
    "TOOL_CALL_START",
    "ReasoningDelta",
    "ReasoningStream",
    "split_reasoning",
]

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START = "<tool_call>"  # qwen3: a call written before </think> ends the reasoning
_PARSERS = ("deepseek_r1", "qwen3")
assert set(_PARSERS) | {"none"} == set(REASONING_PARSERS), "every reasoning_parser choice is handled"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _start_state(parser: str, prompt_tail: str, template_kwargs: Mapping[str, Any] | None) -> str:
    """The state an answer starts in: "open" (inside the reasoning, a leading <think> optional) or
    "before" (content until <think>)."""
    if prompt_tail.rstrip().endswith(THINK_END):
        return "before"
    if parser == "qwen3" and (template_kwargs or {}).get("enable_thinking") is False:
        return "before"
    return "open"


class ReasoningStream:
    """Feed one choice's text deltas; each gives the reasoning and content text it adds (tags held back
    while a delta ends in what may be the start of one). finish() flushes what is held.

    `prompt_tail`: the end of the rendered prompt (a `</think>` there closed the reasoning);
    `template_kwargs`: the request's chat_template_kwargs (qwen3 reads enable_thinking)."""

    def __init__(
        self, parser: str, prompt_tail: str = "", template_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        if parser not in _PARSERS:
            raise ValueError(f"reasoning_parser {parser!r} is not one of {', '.join(_PARSERS)}")
        self._state = _start_state(parser, prompt_tail, template_kwargs)  # open|before|reasoning|content
        self._ends = (THINK_END, TOOL_CALL_START) if parser == "qwen3" else (THINK_END,)
        self._buf = ""
        self.entered = False  # the answer was in its reasoning at some point

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
                self._state, self.entered = "reasoning", True
            elif self._state == "before":
                i = self._buf.find(THINK_START)
                if i < 0:
                    keep = len(self._buf) - partial_suffix(self._buf, THINK_START)
                    out.content += self._buf[:keep]
                    self._buf = self._buf[keep:]
                    break
                out.content += self._buf[:i]
                self._buf = self._buf[i + len(THINK_START) :]
                self._state, self.entered = "reasoning", True
            else:
                found = [(i, tag) for tag in self._ends if (i := self._buf.find(tag)) >= 0]
                if not found:
                    keep = len(self._buf) - max(partial_suffix(self._buf, tag) for tag in self._ends)
                    out.reasoning += self._buf[:keep]
                    self._buf = self._buf[keep:]
                    break
                i, tag = min(found)
                out.reasoning += self._buf[:i]
                # </think> is dropped; a <tool_call> stays, as the start of the content
                self._buf = self._buf[i + len(tag) :] if tag == THINK_END else self._buf[i:]
                self._state = "content"
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._state == "open":
            self._state, self.entered = "reasoning", True
        if self._state == "reasoning":
            out.reasoning += self._buf
        else:
            out.content += self._buf
        self._buf = ""
        return out


def split_reasoning(
    parser: str, text: str, prompt_tail: str = "", template_kwargs: Mapping[str, Any] | None = None
) -> tuple[str | None, str]:
    """A whole answer -> (reasoning: None when the answer had none, "" when it entered its reasoning
    and wrote nothing there; content)."""
    stream = ReasoningStream(parser, prompt_tail, template_kwargs)
    a, b = stream.feed(text), stream.finish()
    return (a.reasoning + b.reasoning) if stream.entered else None, a.content + b.content
