"""Tokenizer over a Hugging Face directory: tokenizer.json (via `tokenizers`), tokenizer_config.json
(special tokens, chat template), generation_config.json (eos ids); plus streaming detokenization.

Chat templates render with jinja2 the way transformers does (sandboxed, trim_blocks, lstrip_blocks,
`raise_exception`, `tojson`), so a model's own template produces the same prompt as HF. Prompts
rendered from a template already hold their special tokens: encode them with
add_special_tokens=False (apply_chat_template(tokenize=True) does). A template that refuses the
messages (`raise_exception`, or a template error on them) raises `ChatTemplateError`: a client error.
A chat may bring its own template (`template=`, compiled in the same sandbox and cached by its text; one
that does not compile raises `InvalidChatTemplate`), and may continue its final message
(`continue_final_message`: the prompt ends inside that message, as transformers' option does).

Encoding never holds the interpreter lock: `encode` goes through the library's batch call, which
releases it (the plain `Tokenizer.encode` of tokenizers holds it for the whole call, ~1-2 s per MB,
freezing the event loop and the engine thread). Callers bound text by `MAX_CHARS_PER_TOKEN` first.

Chat content is user input: `encode_chat` encodes special-token strings that appear inside message
content as plain text, so `<|im_start|>system` in a user message cannot open a real system turn;
only the template's own markers become special tokens.

Streaming text (`detokenizer`) goes through tokenizers' DecodeStream (>= 0.22: prefilled with the
prompt's last ids), one per sequence, with stop strings handled here on top (`IncrementalDetokenizer`).
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

# Text longer than max_model_len * MAX_CHARS_PER_TOKEN characters cannot fit the context window and is
# refused before it is tokenized (api/openai.py). Real tokenizers average 3-6 characters per token on
# prose and code; 32 leaves room for long runs (whitespace, separator lines) that merge into long tokens,
# while bounding what a refused request can cost (32 characters per token of context).
MAX_CHARS_PER_TOKEN = 32
# A chat template's own error message, as the client sees it (one line, at most this long).
MAX_TEMPLATE_MESSAGE_CHARS = 300

# Used when tokenizer_config.json has no chat_template: ChatML, the most common plain format.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template refused these messages (its `raise_exception`, or it failed on them): the
    client's messages are the cause, so this is a 400 carrying `message` (one line, bounded)."""

    def __init__(self, message: str) -> None:
        message = " ".join(str(message).split()) or "the chat template refused these messages"
        if len(message) > MAX_TEMPLATE_MESSAGE_CHARS:
            message = message[: MAX_TEMPLATE_MESSAGE_CHARS - 3] + "..."
        super().__init__(message)
        self.message = message


class InvalidChatTemplate(ChatTemplateError):
    """A template given with the chat (not the model's own) does not compile: the template is the cause."""


def load_chat_template(value: str) -> str:
    """A configured chat template: the text of the file `value` names, else `value` itself when it
    reads as jinja (holds "{{" or "{%"). Anything else is a path that does not exist: ValueError naming it."""
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template {value!r} is neither a readable file nor a jinja template; fix the path")


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as a serialized AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file} is missing; graphcache needs a fast tokenizer file "
                "(save one with transformers' tokenizer.save_pretrained)"
            )
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.chat_template = self._find_chat_template(path, cfg)
        self.eos_token_ids = self._find_eos_ids(path)
        self._template = None  # compiled lazily: jinja2 is only needed for chat
        # The batch calls release the interpreter lock; encode_batch_fast (tokenizers >= 0.21) skips offsets.
        self._encode_fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        # Special tokens (control markers), and a copy of the tokenizer that encodes them as plain text
        # (made on first use: only chats whose content holds such a string need it).
        self.special_tokens: dict[str, int] = {
            t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }
        self._special_ids = frozenset(self.special_tokens.values())
        self._special_prefixes = frozenset(t[:2] for t in self.special_tokens)
        self._special_re = (
            re.compile("|".join(re.escape(t) for t in sorted(self.special_tokens, key=len, reverse=True)))
            if self.special_tokens
            else None
        )
        self._plain: HFTokenizer | None = None
        self._max_id: int | None = None  # the largest id with a token (text_stream computes it once)

    # --- vocabulary ---
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _find_eos_ids(self, path: Path) -> list[int]:
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            f = path / name
            if f.is_file():
                eos = json.loads(f.read_text()).get("eos_token_id")
                ids += [eos] if isinstance(eos, int) else list(eos or [])
        eos_id = self.token_to_id(self.eos_token)
        if eos_id is not None:
            ids.append(eos_id)
        return list(dict.fromkeys(ids))  # dedupe, keep order

    @staticmethod
    def _find_chat_template(path: Path, cfg: dict[str, Any]) -> str:
        jinja_file = path / "chat_template.jinja"  # transformers >= 4.50 saves it beside the config
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return template or DEFAULT_CHAT_TEMPLATE

    # --- text <-> ids ---
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; special-token strings in it become special tokens. Releases the interpreter
        lock while it runs (bound the text first: see MAX_CHARS_PER_TOKEN)."""
        return self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` with special-token strings encoded as ordinary text (never as control tokens),
        no BOS/EOS added. Releases the interpreter lock."""
        if self._plain is None:
            plain = HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True  # a separate object: the shared one is never mutated
            self._plain = plain
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    def has_special_text(self, text: str) -> bool:
        """Does `text` contain a special token's string (e.g. "<|im_start|>")?"""
        if self._special_re is None or not any(p in text for p in self._special_prefixes):
            return False
        return self._special_re.search(text) is not None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- chat ---
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        template: str | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        """Render messages ([{"role", "content"}], plus tool messages and assistant tool_calls, see
        `normalize_chat`) to the model's prompt text (or, tokenize=True, its ids by `encode_chat`:
        content's special-token strings as plain text). `tools=[OpenAI tool dicts]` reaches the
        template as `tools`, the HF convention.

        Raises ChatTemplateError when the template refuses the messages (`raise_exception`, or any
        template error while rendering them). A template that does not compile is a server problem
        and raises jinja2's TemplateSyntaxError as it is; `template` (the chat's own, else the model's is
        used) that does not compile raises InvalidChatTemplate. continue_final_message: the prompt stops
        right after the final message's content, so the model continues that message."""
        if tokenize:
            return self.encode_chat(
                messages,
                add_generation_prompt,
                template=template,
                continue_final_message=continue_final_message,
                **extra,
            )
        import jinja2

        if template is not None:
            try:
                compiled = _compile_cached(template)
            except jinja2.TemplateSyntaxError as e:
                raise InvalidChatTemplate(f"chat_template does not compile: {e}") from None
        else:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            compiled = self._template
        messages = normalize_chat(messages)
        try:
            rendered = compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
                **extra,
            )
        except _TemplateRaised as e:
            raise ChatTemplateError(e.message) from None
        except jinja2.TemplateError as e:  # undefined attributes, sandbox refusals: caused by the messages
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None
        return _cut_after_final(rendered, messages) if continue_final_message else rendered

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        allow_special_in_content: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template: str | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> list[int]:
        """The prompt ids of a chat: the template's own markers are special tokens; special-token strings
        inside client text (message content, tool calls, tool definitions) are encoded as plain text
        (allow_special_in_content=True: as special tokens, for trusted clients). Releases the
        interpreter lock while encoding. `tools` (OpenAI tool dicts) goes to the template.

        Without such strings in any client text (the usual case) this is exactly render + encode, token
        for token HF's `apply_chat_template(tokenize=True)`. Otherwise each special string in client
        text is swapped for a random placeholder before rendering (so the template sees no marker it did
        not write), the rendered text is encoded, and every stretch of text between two of the
        template's own special tokens that holds a client one is re-encoded with special tokens split
        (the same per-stretch encoding the library does between special tokens; only a
        sentencepiece-style `prepend_scheme: first` tokenizer may start such a stretch with a different
        first token)."""
        messages = normalize_chat(messages)
        extra = {"template": template, "continue_final_message": continue_final_message, **extra}
        if allow_special_in_content or not any(self.has_special_text(t) for t in _strings((messages, tools))):
            return self.encode(
                self.apply_chat_template(messages, add_generation_prompt, tools=tools, **extra),
                add_special_tokens=False,
            )
        tag = str(secrets.randbelow(10**18))
        originals: list[str] = []

        def placeholder(match: re.Match) -> str:
            originals.append(match.group(0))
            return f"\U000f0000{tag}.{len(originals) - 1}\U000f0001"

        def mask(text: str) -> str:
            return self._special_re.sub(placeholder, text)

        rendered = self.apply_chat_template(
            _map_strings(messages, mask), add_generation_prompt, tools=_map_strings(tools, mask), **extra
        )
        # Put the special strings back, remembering where client text put them.
        parts: list[str] = []
        content_spans: list[tuple[int, int]] = []
        pos = length = 0
        for match in re.finditer(f"\U000f0000{tag}\\.(\\d+)\U000f0001", rendered):
            parts.append(rendered[pos : match.start()])
            length += match.start() - pos
            original = originals[int(match.group(1))]
            content_spans.append((length, length + len(original)))
            parts.append(original)
            length += len(original)
            pos = match.end()
        parts.append(rendered[pos:])
        text = "".join(parts)
        return self._splice_plain(text, content_spans)

    def _splice_plain(self, text: str, content_spans: list[tuple[int, int]]) -> list[int]:
        """Encode `text`; where a special token came from a content span, re-encode the stretch between
        the template's special tokens around it as plain text."""
        enc = self._tok.encode_batch([text], add_special_tokens=False)[0]
        starts = [a for a, _ in content_spans]

        def from_content(start: int, end: int) -> bool:
            i = bisect.bisect_right(starts, end - 1) - 1  # the last span starting before `end`
            return i >= 0 and content_spans[i][1] > start

        out: list[int] = []
        region_char, region_tok, tainted = 0, 0, False

        def flush(end_char: int, end_tok: int) -> None:
            if tainted:
                out.extend(self.encode_plain(text[region_char:end_char]))
            else:
                out.extend(enc.ids[region_tok:end_tok])

        for i, (tid, (start, end)) in enumerate(zip(enc.ids, enc.offsets, strict=True)):
            if tid not in self._special_ids:
                continue
            if from_content(start, end):
                tainted = True
                continue
            flush(start, i)  # a template marker: it stays special
            out.append(tid)
            region_char, region_tok, tainted = end, i + 1, False
        flush(len(text), len(enc.ids))
        return out

    def detokenizer(
        self,
        prompt_ids: list[int] | None = None,
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, stop, skip_special_tokens)

    def text_stream(
        self, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> TokenTextStream:
        """Output ids -> text, incrementally, for one sequence after `prompt_ids` (see TokenTextStream)."""
        if self._max_id is None:  # ids past it (a model's padded vocabulary) decode to nothing
            self._max_id = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        return TokenTextStream(
            self._tok,
            prompt_ids,
            skip_special_tokens,
            self._special_ids if skip_special_tokens else frozenset(),
            self._max_id,
        )


class _TemplateRaised(Exception):
    """A template's own `raise_exception(message)`."""

    def __init__(self, message: Any) -> None:
        super().__init__(str(message))
        self.message = str(message)


def normalize_chat(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as HF chat templates expect them: an assistant message's `tool_calls[i].function.arguments`
    as a dict (OpenAI sends a JSON string; Qwen/Hermes templates render it with `tojson`). Tool
    messages ({"role": "tool", "content", "tool_call_id"}) pass as they are. Raises ChatTemplateError
    for arguments that are not a JSON object."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            fixed = []
            for i, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        args = None
                    if not isinstance(args, dict):
                        raise ChatTemplateError(
                            f"tool_calls[{i}].function.arguments must be a JSON object "
                            "(as a string), as the model produced it"
                        )
                    call = {**call, "function": {**fn, "arguments": args}}
                fixed.append(call)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def _strings(value: Any):
    """Every string inside nested dicts/lists (keys too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _map_strings(value: Any, fn) -> Any:
    """A copy of nested dicts/lists with fn applied to every string (keys too)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value


def _cut_after_final(rendered: str, messages: list[dict[str, Any]]) -> str:
    """`rendered` up to the end of the final message's content (its last occurrence: the template may
    repeat it earlier, never after). Templates that strip content are matched on the stripped text."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text content")
    for text in (content, content.strip()):
        at = rendered.rfind(text)
        if at >= 0:
            return rendered[: at + len(text)]
    raise ChatTemplateError("the chat template does not render the final message's content as sent")


@functools.lru_cache(maxsize=16)
def _compile_cached(source: str):
    """Chats' own templates, compiled once per distinct text (clients resend the same one)."""
    return _compile_template(source)


def _compile_template(source: str):
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 ships with transformers and the server deps
        raise RuntimeError("chat templates need jinja2: pip install jinja2") from e

    def raise_exception(message: str):
        raise _TemplateRaised(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators=None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Streaming text for one sequence: add(new_ids) -> the new text that is safe to emit.

    Never emits broken UTF-8: a character split across tokens comes out once its last token arrives
    (`text_stream` below). With stop strings it also holds back the last len(longest stop) - 1
    characters (they may start a stop string), and once a stop string appears it truncates the text
    before it and sets `stopped` to that string (the earliest one in the text; of those starting at
    the same place, the shortest). Any number of stop strings cost one regex search per step over the
    new characters plus the held-back tail. add(ids, find_stop=False) (before min_tokens) decodes
    without looking for stops; a stop string found later must end in text decoded after that. Call
    finish() at the end of the sequence for whatever was held back. `text` is everything emitted so
    far. Without stop strings, the concatenation of add()s and finish() is exactly the text a
    whole decode gives the output ids (after the prompt's context: see `text_stream`).

    `tokenizer` is a `Tokenizer` (its ids -> text through tokenizers' DecodeStream) or any object with
    `decode(ids, skip_special_tokens)` (test doubles; a sliding-window decode, `WindowTextStream`).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int] | None = None,
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._ids_to_text = (
            tokenizer.text_stream(prompt_ids, skip_special_tokens)
            if isinstance(tokenizer, Tokenizer)
            else WindowTextStream(tokenizer, prompt_ids, skip_special_tokens)
        )
        self._decoded = ""  # with stop strings: all decoded completion text (may run ahead of `text`)
        self._emitted: list[str] = []  # the pieces add() and finish() returned
        self._num_emitted = 0  # their total length
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        # Shortest first: at one position the regex takes the first alternative that matches.
        self._stop_re = (
            re.compile("|".join(re.escape(s) for s in sorted(set(self.stop), key=len))) if self.stop else None
        )
        self._stop_ends_after = 0  # a stop string must end past this many decoded chars (min_tokens)
        self.stopped: str | None = None

    def add(self, token_ids: list[int], find_stop: bool = True) -> str:
        if self.stopped is not None:
            return ""
        new = self._ids_to_text.add(token_ids)
        if self._stop_re is None:  # the common streaming case: nothing to hold back or search
            if new:
                self._emitted.append(new)
            return new
        self._decoded += new
        if not find_stop:
            self._stop_ends_after = len(self._decoded)
        return self._emit(final=False, find_stop=find_stop)

    def finish(self) -> str:
        """End of sequence: flush held-back text (a trailing broken character decodes as U+FFFD)."""
        if self.stopped is None:
            tail = self._ids_to_text.finish()
            if self._stop_re is None:
                if tail:
                    self._emitted.append(tail)
                return tail
            self._decoded += tail
        return self._emit(final=True)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def _emit(self, final: bool, find_stop: bool = True) -> str:
        if self.stopped is None and self._stop_re is not None and find_stop:
            # A new stop string can only start within the last (hold) chars already emitted, and must
            # end after the text decoded while stops were off.
            pos = max(self._num_emitted - self._hold, self._stop_ends_after - self._hold, 0)
            while (hit := self._stop_re.search(self._decoded, pos)) is not None:
                at = hit.start()
                late = [
                    s
                    for s in self.stop
                    if at + len(s) > self._stop_ends_after and self._decoded.startswith(s, at)
                ]
                if late:
                    self.stopped = min(late, key=len)
                    self._decoded = self._decoded[:at]
                    break
                pos = at + 1
        end = len(self._decoded)
        if not final and self.stopped is None and self.stop:
            end = max(end - self._hold, self._num_emitted)
        delta = self._decoded[self._num_emitted : end]
        if delta:
            self._emitted.append(delta)
            self._num_emitted += len(delta)
        return delta


# Prompt ids decoded as left context of the first output token: sentencepiece-style decoders drop a
# word's leading space when it comes first in a decode, and byte-level tokens need their neighbours.
PROMPT_CONTEXT_IDS = 5
# A text stream trims the ids it keeps (for finish() and restarts) back to the context past this many.
_MAX_KEPT_IDS = 256


class TokenTextStream:
    """Output ids -> their text, one sequence, through tokenizers' `DecodeStream` (Rust: one call per
    add, decoding only a few ids; tokenizers >= 0.21 takes the prompt's context as `ids`).

    The concatenation of add()s and finish() equals decode(context + output)[len(decode(context)):],
    where context is the prompt's last PROMPT_CONTEXT_IDS ids (so the first output token keeps the
    leading space a whole-sequence decode gives it; for byte-level BPE it is exactly decode(output)).
    Around DecodeStream this adds:
    - ids that decode to nothing (special tokens when they are skipped, ids the vocabulary lacks) are
      dropped before the stream sees them: DecodeStream only moves its window on new text, so a run
      of them would otherwise make every step decode the whole run (O(n^2) per stream);
    - finish(): DecodeStream holds back a tail that decodes to a broken character (U+FFFD) forever;
      at the end of the sequence that tail is decoded as it is (as a whole decode would);
    - a prompt context that ends inside a character (raw token-id prompts) is cut before that
      character: DecodeStream would take context ending in U+FFFD for output text;
    - a decoder whose output for more ids does not extend its output for fewer (DecodeStream's
      InvalidPrefix error: decoders that rewrite across tokens) falls back to what a window decode
      gives, and the stream restarts from there (such text cannot be streamed exactly by anyone).
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        prompt_ids: list[int] | None,
        skip_special_tokens: bool,
        silent_ids: frozenset[int],
        max_id: int,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._silent = silent_ids
        self._max_id = max_id
        context = self._clean_context(self._audible(list(prompt_ids or [])))
        self._ids = context  # the context, then every output id the stream was given
        self._clean = len(context)  # ids[:clean] decode to text already returned (a clean boundary)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _clean_context(self, ids: list[int]) -> list[int]:
        """The last PROMPT_CONTEXT_IDS of `ids`, less a trailing unfinished character."""
        context = ids[-PROMPT_CONTEXT_IDS:]
        while context and self._decode(context).endswith("\ufffd"):
            context.pop()
        return context

    def _audible(self, ids: list[int]) -> list[int]:
        silent, max_id = self._silent, self._max_id
        return [i for i in ids if i not in silent and 0 <= i <= max_id]

    def add(self, token_ids: list[int]) -> str:
        if len(token_ids) == 1:  # the per-step case: DecodeStream takes an int faster than a list
            new = token_ids[0]
            if new in self._silent or not 0 <= new <= self._max_id:
                return ""
            self._ids.append(new)
        else:
            new = self._audible(token_ids)
            if not new:
                return ""
            self._ids += new
        try:
            text = self._stream.step(self._tok, new)
        except Exception:  # tokenizers raises a plain Exception for InvalidPrefix: the decoder rewrote text
            return self._restart()
        if text is None:
            return ""
        if len(self._ids) > _MAX_KEPT_IDS:  # only the context before the next pending ids is needed
            del self._ids[:-PROMPT_CONTEXT_IDS]
        self._clean = len(self._ids)
        return text

    def finish(self) -> str:
        """The held-back tail, decoded as it is (an unfinished character as U+FFFD)."""
        return self._restart() if self._clean < len(self._ids) else ""

    def _restart(self) -> str:
        """Window-decode the ids past the last clean boundary, then start a fresh DecodeStream there."""
        start = max(self._clean - PROMPT_CONTEXT_IDS, 0)
        text = self._decode(self._ids[start:])[len(self._decode(self._ids[start : self._clean])) :]
        self._ids = self._clean_context(self._ids)  # DecodeStream wants context that decodes clean
        self._clean = len(self._ids)
        self._stream = DecodeStream(ids=self._ids, skip_special_tokens=self._skip)
        return text


class WindowTextStream:
    """Output ids -> their text for any object with decode(ids, skip_special_tokens) (test doubles):
    a sliding window of ids (prefix/read offsets) so each step costs O(window), not O(sequence
    length). The same contract as TokenTextStream, which real tokenizers use."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int] | None, skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])
        self._prefix = max(len(self._ids) - PROMPT_CONTEXT_IDS, 0)
        self._read = len(self._ids)

    def add(self, token_ids: list[int], final: bool = False) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full = self._tok.decode(self._ids[self._prefix :], self._skip)
        if not final and full.endswith("\ufffd"):
            return ""
        # New ids that decode to nothing still move the window on: else every later step re-decodes
        # a growing tail (O(n^2) per stream).
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(prefix_text) :]

    def finish(self) -> str:
        return self.add([], final=True) if self._read < len(self._ids) else ""
