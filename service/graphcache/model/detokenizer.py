"""Streaming detokenization: output ids -> the text that is safe to send, one sequence at a time.

`IncrementalDetokenizer` is what a sequence holds: it turns each step's ids into new text and handles
stop strings (holding back what may start one, cutting the text before one). Under it, the ids -> text
stream: `TokenTextStream` through tokenizers' DecodeStream (>= 0.22: prefilled with the prompt's last
ids) for a real `Tokenizer` (its `text_stream`), `WindowTextStream` (a sliding-window decode) for any
object with only `decode(ids, skip_special_tokens)` (test doubles).

Kept apart from model/tokenizer.py because it is per-sequence streaming state, not the vocabulary:
the Tokenizer hands out these objects (`Tokenizer.detokenizer`, `Tokenizer.text_stream`), and the
detokenizer tells a real tokenizer by its `text_stream` method, so this file needs no Tokenizer.
No torch: the API process imports it.
"""

from __future__ import annotations

import re
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["PROMPT_CONTEXT_IDS", "IncrementalDetokenizer", "TokenTextStream", "WindowTextStream"]

# Prompt ids decoded as left context of the first output token: sentencepiece-style decoders drop a
# word's leading space when it comes first in a decode, and byte-level tokens need their neighbours.
PROMPT_CONTEXT_IDS = 5
# A text stream trims the ids it keeps (for finish() and restarts) back to the context past this many.
_MAX_KEPT_IDS = 256


class IncrementalDetokenizer:
    """Streaming text for one sequence: add(new_ids) -> the new text that is safe to emit.

    Never emits broken UTF-8: a character split across tokens comes out once its last token arrives
    (`TokenTextStream` below). With stop strings it also holds back the last len(longest stop) - 1
    characters (they may start a stop string), and once a stop string appears it truncates the text
    before it and sets `stopped` to that string (the earliest one in the text; of those starting at
    the same place, the shortest). Any number of stop strings cost one regex search per step over the
    new characters plus the held-back tail. add(ids, find_stop=False) (before min_tokens) decodes
    without looking for stops; a stop string found later must end in text decoded after that. Call
    finish() at the end of the sequence for whatever was held back. `text` is everything emitted so
    far. Without stop strings, the concatenation of add()s and finish() is exactly the text a
    whole decode gives the output ids (after the prompt's context: see `TokenTextStream`).

    `tokenizer` is a `Tokenizer` or anything with its `text_stream(prompt_ids, skip_special_tokens)`
    (ids -> text through tokenizers' DecodeStream), or any object with only
    `decode(ids, skip_special_tokens)` (test doubles; a sliding-window decode, `WindowTextStream`).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int] | None = None,
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        text_stream = getattr(tokenizer, "text_stream", None)
        self._ids_to_text = (
            text_stream(prompt_ids, skip_special_tokens)
            if text_stream is not None
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
        new: int | list[int]  # DecodeStream.step takes either
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
