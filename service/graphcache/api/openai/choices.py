"""The response bodies of /v1/completions and /v1/chat/completions: whole answers and stream chunks.

Both shapes take the same inputs: the sequences' accumulated outputs (fanout.Sampled) or one output
delta of sequence k, whose choice index is k (streams never rank: best_of > n is not streamed).
Honoured presentation fields: echo, logprobs / top_logprobs (logprobs.py), prompt_logprobs,
return_token_ids, return_tokens_as_token_ids, stream_options (include_usage, continuous_usage_stats),
and for chats the reasoning split off into `reasoning` and `reasoning_content` (api/openai/reasoning.py,
with a reasoning_parser) and, with tools, the calls the model made (api/openai/tool_parsers/, the tool_call_parser
setting's format), as `tool_calls` and streamed tool_call deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphcache.api.openai.fanout import Sampled
from graphcache.api.openai.logprobs import TokenText, chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from graphcache.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from graphcache.api.openai.reasoning import ReasoningStream, split_reasoning
from graphcache.api.openai.tool_parsers import ToolCallDelta, ToolCallFormat, ToolCallStream, tool_call_format
from graphcache.api.server.answer_json import Lazy, render
from graphcache.engine.sequence import RequestOutput

__all__ = ["ChatShape", "CompletionShape", "Prompt"]


@dataclass
class Prompt:
    ids: list[int]
    echo_text: str = ""  # what echo prepends to each choice's text


class _Shape:
    def __init__(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        base: dict,
        prompts: list[Prompt],
        text_of: TokenText,
    ) -> None:
        self.body = body
        self.base = base
        self.prompts = prompts
        self.text_of = text_of
        self.client_logprobs = body.engine_logprobs is not None
        self.started: set[int] = set()  # sequences whose first chunk went out (echo goes in it)
        self.offsets: dict[int, int] = {}  # completions: text_offset reached per sequence

    def prompt_of(self, k: int) -> Prompt:
        return self.prompts[k // self.body.n]

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.base, "choices": [], "usage": usage}

    def _chunk(self, choice: dict, usage: dict | None) -> dict:
        chunk = {**self.base, "choices": [choice]}
        if self.body.include_usage:
            chunk["usage"] = usage if self.body.continuous_usage else None
        return chunk

    def opening(self, count: int, usage: dict | None) -> list[dict]:
        return []

    def heavy_chunk(self, k: int) -> bool:
        """Whether sequence k's next chunk may be large (built on the response pool: answer_json.chunk_data)."""
        return False

    def choice(self, k: int, s: Sampled) -> dict:
        raise NotImplementedError

    def answer(self, kept: list[Sampled], usage: dict, choices: list[dict] | Lazy) -> dict:
        raise NotImplementedError

    def full(self, kept: list[Sampled], usage: dict) -> dict:
        """The whole answer for the `kept` sequences."""
        return self.answer(kept, usage, [self.choice(k, s) for k, s in enumerate(kept)])

    def render(self, kept: list[Sampled], usage: dict) -> bytes:
        """full()'s JSON as JSONResponse writes it, built and rendered a choice at a time (api/server/answer_json.py):
        on the response pool, never on the event loop."""
        return render(self.answer(kept, usage, Lazy(self.choice(k, s) for k, s in enumerate(kept))))


class CompletionShape(_Shape):
    def _logprobs(self, k: int, ids: list[int], entries, prompt_entries, first: bool) -> dict:
        offset = self.offsets.get(k, 0)
        if first and self.body.echo:
            lp, offset = completion_logprobs(self.text_of, self.prompt_of(k).ids, prompt_entries, offset)
            more, offset = completion_logprobs(self.text_of, ids, entries, offset)
            lp = {key: lp[key] + more[key] for key in lp}
        else:
            lp, offset = completion_logprobs(self.text_of, ids, entries, offset)
        self.offsets[k] = offset
        return lp

    def _extras(self, choice: dict, k: int, token_ids: list[int], prompt_entries, first: bool) -> dict:
        if self.body.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                self.text_of, self.prompt_of(k).ids, prompt_entries
            )
        if self.body.return_token_ids:
            choice["token_ids"] = token_ids
            if first:
                choice["prompt_token_ids"] = self.prompt_of(k).ids
        return choice

    def heavy_chunk(self, k: int) -> bool:
        return self.body.echo and self.client_logprobs and k not in self.started  # the prompt's logprobs

    def choice(self, k: int, s: Sampled) -> dict:
        text = (self.prompt_of(k).echo_text if self.body.echo else "") + s.text
        logprobs = (
            self._logprobs(k, s.token_ids, s.logprobs, s.prompt_logprobs, True)
            if self.client_logprobs
            else None
        )
        choice = {
            "index": k,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": s.finish_reason,
            "stop_reason": s.stop_reason,
        }
        return self._extras(choice, k, s.token_ids, s.prompt_logprobs, True)

    def answer(self, kept: list[Sampled], usage: dict, choices: list[dict] | Lazy) -> dict:
        return {**self.base, "choices": choices, "usage": usage}

    def chunk(self, k: int, out: RequestOutput, usage: dict | None) -> dict | None:
        first = k not in self.started
        self.started.add(k)
        text = (self.prompt_of(k).echo_text if first and self.body.echo else "") + out.text
        logprobs = (
            self._logprobs(k, out.token_ids, out.logprobs, out.prompt_logprobs, first)
            if self.client_logprobs
            else None
        )
        # A chunk for every output with tokens, its text "" while the detokenizer holds them (an incomplete
        # UTF-8 sequence, ids with no text), as vLLM streams: the client sees the first token when it is
        # made, and return_token_ids loses no id.
        if not (text or out.finished or out.token_ids or (logprobs and logprobs["tokens"])):
            return None
        choice = {
            "index": k,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason if out.finished else None,
            "stop_reason": out.stop_reason if out.finished else None,
        }
        return self._chunk(self._extras(choice, k, out.token_ids, out.prompt_logprobs, first), usage)


class ChatShape(_Shape):
    """Chat choices. With a `reasoning_parser` other than "none" the reasoning is split off first into
    `reasoning` and `reasoning_content` (the same text: vLLM's current name and its earlier one). With
    `parse_tools` (tools given, tool_choice not "none") a whole answer's content is parsed into
    `tool_calls` by `tool_format` and a stream's deltas go through one of its stream parsers per
    choice; a choice that called tools and stopped on its own finishes with "tool_calls". A call cut
    off by max_tokens keeps the arguments it had, as its stream sent them, and finishes "length"."""

    body: ChatCompletionRequest  # a chat shape is built for a chat request
    parse_tools = False
    tool_format: ToolCallFormat = tool_call_format("hermes")
    reasoning_parser = "none"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_parsers: dict[int, ToolCallStream] = {}  # stream: choice index -> its parser
        self.reasoning: dict[int, ReasoningStream] = {}  # stream: choice index -> its splitter
        self._prompt_tail: str | None = None

    def _reasoning_context(self) -> tuple[str, dict | None]:
        """What the reasoning parser reads of the request: the prompt's last tokens as text (a template
        that ends it with `<think>` or `</think>`) and the template kwargs (enable_thinking)."""
        if self._prompt_tail is None:
            self._prompt_tail = self.text_of.tokenizer.decode(self.prompts[0].ids[-8:], False)
        body = self.body
        return self._prompt_tail, body.template_kwargs if isinstance(body, ChatCompletionRequest) else None

    def _logprobs(self, ids: list[int], entries) -> dict | None:
        if not self.client_logprobs:
            return None
        return {"content": chat_logprobs(self.text_of, ids, entries, self.body.top_logprobs)}

    def choice(self, k: int, s: Sampled) -> dict:
        echo = self.prompt_of(k).echo_text if self.body.echo else ""
        text, reasoning = s.text, None
        if self.reasoning_parser != "none":
            reasoning, text = split_reasoning(self.reasoning_parser, text, *self._reasoning_context())
        message: dict = {"role": "assistant", "content": echo + text}
        finish = s.finish_reason
        if self.parse_tools:
            content, calls = self.tool_format.parse(text, cut=s.finish_reason == "length")
            if calls:
                message = {
                    "role": "assistant",
                    "content": (echo + (content or "")) or None,
                    "tool_calls": calls,
                }
                finish = _tools_finish(finish)
        if self.reasoning_parser != "none":
            if not message["content"] and reasoning is not None:
                message["content"] = None  # all of it was reasoning
            message["reasoning"] = message["reasoning_content"] = reasoning
        choice = {
            "index": k,
            "message": message,
            "logprobs": self._logprobs(s.token_ids, s.logprobs),
            "finish_reason": finish,
            "stop_reason": s.stop_reason,
        }
        if self.body.return_token_ids:
            choice["token_ids"] = s.token_ids
        return choice

    def answer(self, kept: list[Sampled], usage: dict, choices: list[dict] | Lazy) -> dict:
        body = {**self.base, "object": "chat.completion", "choices": choices, "usage": usage}
        if self.body.prompt_logprobs is not None and kept:
            body["prompt_logprobs"] = vllm_prompt_logprobs(
                self.text_of, self.prompts[0].ids, kept[0].prompt_logprobs
            )
        if self.body.return_token_ids:
            body["prompt_token_ids"] = self.prompts[0].ids
        return body

    def opening(self, count: int, usage: dict | None) -> list[dict]:
        """The first chunk of every choice: the role (and, with echo, the echoed text)."""
        echo = self.prompts[0].echo_text if self.body.echo else ""
        chunks = []
        for k in range(count):
            chunk = self._chunk(
                {
                    "index": k,
                    "delta": {"role": "assistant", "content": echo},
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                },
                usage,
            )
            if k == 0 and self.body.return_token_ids:
                chunk["prompt_token_ids"] = self.prompts[0].ids
            chunks.append(chunk)
        return chunks

    def _delta(self, k: int, out: RequestOutput) -> tuple[dict, str | None]:
        """Choice k's delta for `out`, and its finish_reason (None until it finishes)."""
        finish = out.finish_reason if out.finished else None
        text, reasoning = out.text, ""
        if self.reasoning_parser != "none":
            splitter = self.reasoning.get(k)
            if splitter is None:
                splitter = self.reasoning[k] = ReasoningStream(
                    self.reasoning_parser, *self._reasoning_context()
                )
            split = splitter.feed(text)
            if out.finished:
                rest = splitter.finish()
                split.reasoning, split.content = (
                    split.reasoning + rest.reasoning,
                    split.content + rest.content,
                )
            text, reasoning = split.content, split.reasoning
        if not self.parse_tools:
            delta: dict = {"content": text} if text else {}
            if reasoning:
                delta["reasoning"] = delta["reasoning_content"] = reasoning
            return delta, finish
        parser = self.tool_parsers.setdefault(k, self.tool_format.stream())
        found = parser.feed(text)
        if out.finished:
            _merge(found, parser.finish())
            if parser.called_tools:
                finish = _tools_finish(finish)
        delta = {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}
        if found.content:
            delta["content"] = found.content
        if found.tool_calls:
            delta["tool_calls"] = found.tool_calls
        return delta, finish

    def chunk(self, k: int, out: RequestOutput, usage: dict | None) -> dict | None:
        logprobs = self._logprobs(out.token_ids, out.logprobs)
        delta, finish = self._delta(k, out)
        if not delta and out.token_ids and not self.parse_tools and self.reasoning_parser == "none":
            delta = {"content": ""}  # tokens with no text yet: a chunk all the same, as completions' (above)
        ids = self.body.return_token_ids and out.token_ids  # withheld by a parser: still sent, not lost
        if not (delta or out.finished or ids or (logprobs and logprobs["content"])):
            return None
        choice = {
            "index": k,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": out.stop_reason if out.finished else None,
        }
        if self.body.return_token_ids:
            choice["token_ids"] = out.token_ids
        return self._chunk(choice, usage)


def _tools_finish(finish: str | None) -> str | None:
    """A choice that called tools and ended on its own (a stop, or its grammar complete) finishes with
    "tool_calls"; one cut by max_tokens stays "length" (its last call's arguments may be incomplete)."""
    return "tool_calls" if finish == "stop" else finish


def _merge(into: ToolCallDelta, more: ToolCallDelta) -> None:
    """Add `more` to `into`, one entry per call index: an arguments fragment of the call `into` ends
    with joins that entry (clients accumulate deltas by index either way; fewer entries read better)."""
    into.content += more.content
    for entry in more.tool_calls:
        last = into.tool_calls[-1] if into.tool_calls else None
        if (
            last is not None
            and last["index"] == entry["index"]
            and set(entry) == {"index", "function"}
            and set(entry["function"]) == {"arguments"}
        ):
            last["function"]["arguments"] = (
                last["function"].get("arguments", "") + entry["function"]["arguments"]
            )
        else:
            into.tool_calls.append(entry)
