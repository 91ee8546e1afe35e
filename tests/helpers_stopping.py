"""Drive the real stop rules and IncrementalDetokenizer one token at a time over a letter vocabulary
(token id i is the letter chr(ord("a") + i); id 25 is EOS), as the scheduler's postprocess does."""

from __future__ import annotations

from graphcache.engine.sequence import Sequence
from graphcache.engine.stopping import check_stop, sendable_text
from graphcache.model.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """Token id -> one letter (0 -> a); drives the real IncrementalDetokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def feed(s: Sequence, tokens: list[int]) -> tuple[str, str | None]:
    """Append `tokens` to `s` one by one until a stop rule ends it: (text streamed, finish reason)."""
    s.detokenizer = IncrementalDetokenizer(CharTokenizer(), s.prompt_token_ids, s.params.stop)
    streamed, reason = "", None
    for t in tokens:
        s.output_token_ids.append(t)
        reason = check_stop(s, t, eos_token_ids={25}, max_model_len=1000)
        streamed += sendable_text(s, reason is not None)
        if reason:
            break
    return streamed, reason


def letters(text: str) -> list[int]:
    """The token ids of `text` in the letter vocabulary."""
    return [ord(ch) - ord("a") for ch in text]
