"""Tokenizer over a Hugging Face directory: tokenizer.json (via `tokenizers`), tokenizer_config.json
(special tokens, chat template), generation_config.json (eos ids).

The chat template renders through model/chat_template.py (text -> text, the way transformers does);
prompts rendered from a template already hold their special tokens, so they are encoded with
add_special_tokens=False (apply_chat_template(tokenize=True) does). Streaming text comes from
model/detokenizer.py's objects, which `detokenizer` and `text_stream` hand out per sequence. This file
holds what needs the vocabulary: ids <-> text, and the chat encoding that keeps client text plain.

Encoding never holds the interpreter lock: `encode` goes through the library's batch call, which
releases it (the plain `Tokenizer.encode` of tokenizers holds it for the whole call, ~1-2 s per MB,
freezing the event loop and the engine thread). Callers bound text by `MAX_CHARS_PER_TOKEN` first.

Chat content is user input: `encode_chat` encodes special-token strings that appear inside message
content as plain text, so `<|im_start|>system` in a user message cannot open a real system turn;
only the template's own markers become special tokens.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from tokenizers import Tokenizer as HFTokenizer

from graphcache.model.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    compile_chat_template,
    compile_client_template,
    load_chat_template,
    normalize_chat,
    render_chat,
)
from graphcache.model.detokenizer import IncrementalDetokenizer, TokenTextStream

if TYPE_CHECKING:
    import jinja2

__all__ = ["MAX_CHARS_PER_TOKEN", "PreparedChat", "Tokenizer"]

# Text longer than max_model_len * MAX_CHARS_PER_TOKEN characters cannot fit the context window and is
# refused before it is tokenized (api/openai/routes.py). Real tokenizers average 3-6 characters per token on
# prose and code; 32 leaves room for long runs (whitespace, separator lines) that merge into long tokens,
# while bounding what a refused request can cost (32 characters per token of context).
MAX_CHARS_PER_TOKEN = 32


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as a serialized AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass(frozen=True)
class PreparedChat:
    """A chat ready for its template: messages and tools with client special-token strings masked.
    tag None: nothing was masked (the usual case); else placeholders `\\U000f0000{tag}.{i}\\U000f0001`
    stand for originals[i]."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tag: str | None = None
    originals: list[str] = field(default_factory=list)


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
        self.chat_template, self.chat_template_origin = self._find_chat_template(path, cfg)
        self.eos_token_ids = self._find_eos_ids(path)
        self._template: jinja2.Template | None = None  # compiled lazily: jinja2 is only needed for chat
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

    def vocabulary(self) -> dict[str, int]:
        """Every token's id, added tokens included (a draft model must map tokens as the target does)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """Each id's string in the vocabulary ("Ġworld", not " world"), as transformers' method of that
        name; None for an id the vocabulary lacks."""
        return [self._tok.id_to_token(i) for i in ids]

    @functools.cached_property
    def special_affixes(self) -> tuple[list[int], list[int]]:
        """The ids `encode(text, add_special_tokens=True)` puts before and after the text's own (BOS; EOS
        where the tokenizer adds one): what add_special_tokens adds to ids encoded without it."""
        plain = self.encode("a", add_special_tokens=False)
        full = self.encode("a", add_special_tokens=True)
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                return full[:i], full[i + len(plain) :]
        return [], []  # a post-processor that rewrites the text's own ids: nothing to add around them

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
    def _find_chat_template(path: Path, cfg: dict[str, Any]) -> tuple[str, str]:
        """The model's chat template and where it came from (for errors)."""
        jinja_file = path / "chat_template.jinja"  # transformers >= 4.50 saves it beside the config
        if jinja_file.is_file():
            return jinja_file.read_text(), str(jinja_file)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template:
            return template, str(path / "tokenizer_config.json")
        return DEFAULT_CHAT_TEMPLATE, "the built-in ChatML template"

    def check_chat_template(self, configured: str | None = None) -> None:
        """Compile the template chats will render with now: `configured` (the server's chat_template
        setting: a file or the template itself), else the model's. One that does not compile fails the
        start in one line naming it, instead of answering every chat with an error."""
        import jinja2

        if configured is not None:
            source = load_chat_template(configured)
            origin = configured if "{" not in configured else "the chat_template setting"
        else:
            source, origin = self.chat_template, self.chat_template_origin
        fix = "fix the template" + ("" if configured else ", or serve with --chat-template FILE")
        try:
            compile_chat_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(
                f"the chat template in {origin} does not compile: {e.message} (template line {e.lineno}); {fix}"
            ) from None
        except RecursionError:
            raise ValueError(f"the chat template in {origin} nests too deeply to compile; {fix}") from None

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
    @overload
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: Literal[False] = ...,
        *,
        template: str | None = ...,
        continue_final_message: bool = ...,
        **extra: Any,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tokenize: Literal[True],
        *,
        template: str | None = ...,
        continue_final_message: bool = ...,
        **extra: Any,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = ...,
        *,
        tokenize: Literal[True],
        template: str | None = ...,
        continue_final_message: bool = ...,
        **extra: Any,
    ) -> list[int]: ...

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
        if template is not None:
            compiled = compile_client_template(template)
        else:
            if self._template is None:
                self._template = compile_chat_template(self.chat_template)
            compiled = self._template
        return render_chat(
            compiled,
            messages,
            add_generation_prompt,
            continue_final_message,
            **self.template_variables(),
            **extra,
        )

    def template_variables(self) -> dict[str, str]:
        """The special-token names every chat template sees, as transformers passes them."""
        return {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
        }

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
        prepared = self.prepare_chat(messages, tools, allow_special_in_content)
        rendered = self.apply_chat_template(
            prepared.messages,
            add_generation_prompt,
            tools=prepared.tools,
            template=template,
            continue_final_message=continue_final_message,
            **extra,
        )
        return self.encode_rendered(rendered, prepared)

    def prepare_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        allow_special_in_content: bool = False,
    ) -> PreparedChat:
        """The chat as the template should see it: normalized (`normalize_chat`), and with each
        special-token string in client text swapped for a random placeholder, so the template sees no
        marker it did not write (unless allow_special_in_content: trusted clients). Render
        `prepared.messages` and `prepared.tools`, then `encode_rendered`."""
        messages = normalize_chat(messages)
        if allow_special_in_content or not any(self.has_special_text(t) for t in _strings((messages, tools))):
            return PreparedChat(messages, tools)
        tag = str(secrets.randbelow(10**18))
        originals: list[str] = []

        def placeholder(match: re.Match) -> str:
            originals.append(match.group(0))
            return f"\U000f0000{tag}.{len(originals) - 1}\U000f0001"

        special_re = self._special_re
        assert special_re is not None  # has_special_text found a special-token string with it

        def mask(text: str) -> str:
            return special_re.sub(placeholder, text)

        return PreparedChat(_map_strings(messages, mask), _map_strings(tools, mask), tag, originals)

    def encode_rendered(self, rendered: str, prepared: PreparedChat) -> list[int]:
        """The ids of a chat rendered from `prepared`: the template's markers are special tokens, the
        special-token strings of client text are plain text."""
        if prepared.tag is None:
            return self.encode(rendered, add_special_tokens=False)
        # Put the special strings back, remembering where client text put them.
        parts: list[str] = []
        content_spans: list[tuple[int, int]] = []
        pos = length = 0
        for match in re.finditer(f"\U000f0000{prepared.tag}\\.(\\d+)\U000f0001", rendered):
            parts.append(rendered[pos : match.start()])
            length += match.start() - pos
            original = prepared.originals[int(match.group(1))]
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
