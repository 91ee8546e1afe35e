"""Tokenizer over a Hugging Face directory: tokenizer.json (via `tokenizers`), tokenizer_config.json
(special tokens, chat template), generation_config.json (eos ids); plus streaming detokenization.

Chat templates render with jinja2 the way transformers does (sandboxed, trim_blocks, lstrip_blocks,
`raise_exception`, `tojson`), so a model's own template produces the same prompt as HF. Prompts
rendered from a template already hold their special tokens: encode them with
add_special_tokens=False (apply_chat_template(tokenize=True) does).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

# Used when tokenizer_config.json has no chat_template: ChatML, the most common plain format.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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
            raise FileNotFoundError(f"{tok_file} is missing; graphcache needs a fast tokenizer file "
                                    "(save one with transformers' tokenizer.save_pretrained)")
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
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- chat ---
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **extra: Any) -> str | list[int]:
        """Render messages ([{"role", "content"}]) to the model's prompt text (or its ids)."""
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     pad_token=self.pad_token or "", **extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def detokenizer(self, prompt_ids: list[int] | None = None, stop: list[str] | None = None,
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, stop, skip_special_tokens)


def _compile_template(source: str):
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 ships with transformers and the server deps
        raise RuntimeError("chat templates need jinja2: pip install jinja2") from e

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Streaming text for one sequence: add(new_ids) -> the new text that is safe to emit.

    Never emits broken UTF-8: while the decoded tail ends in U+FFFD (a multi-byte character split
    across tokens) it holds the text back. With stop strings it also holds back the last
    len(longest stop) - 1 characters (they may start a stop string), and once a stop string
    appears it truncates the text before it and sets `stopped` to that string. Call finish() at
    the end of the sequence for whatever was held back. `text` is everything emitted so far.
    Decoding uses a sliding window of ids (prefix/read offsets) so each step costs O(window),
    not O(sequence length), while keeping the spacing a whole-sequence decode would produce.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 stop: list[str] | None = None, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])
        # Decode a few prompt tokens as left context (sentencepiece drops a word's leading space
        # when it is decoded first), but emit only what comes after the prompt.
        self._prefix = max(len(self.ids) - 5, 0)
        self._read = len(self.ids)
        self._decoded = ""           # all decoded completion text (may run ahead of `text`)
        self.text = ""               # emitted text
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped: str | None = None

    def _decode_new(self, final: bool) -> None:
        prefix_text = self._tok.decode(self.ids[self._prefix:self._read], self._skip)
        full = self._tok.decode(self.ids[self._prefix:], self._skip)
        if len(full) > len(prefix_text) and (final or not full.endswith("\ufffd")):
            self._decoded += full[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        if self.stopped is not None:
            return ""
        self.ids.extend(token_ids)
        self._decode_new(final=False)
        return self._emit(final=False)

    def finish(self) -> str:
        """End of sequence: flush held-back text (a trailing broken character decodes as U+FFFD)."""
        if self.stopped is None:
            self._decode_new(final=True)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.stopped is None and self.stop:
            # A new stop string can only start within the last (hold) chars already emitted.
            search_from = max(len(self.text) - self._hold, 0)
            hits = [(i, s) for s in self.stop if (i := self._decoded.find(s, search_from)) >= 0]
            if hits:
                cut, self.stopped = min(hits)
                self._decoded = self._decoded[:cut]
        end = len(self._decoded)
        if not final and self.stopped is None and self.stop:
            end = max(end - self._hold, len(self.text))
        delta = self._decoded[len(self.text):end]
        self.text += delta
        return delta
