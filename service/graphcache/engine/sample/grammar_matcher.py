"""One sequence's grammar matcher: why it failed, and what its masks cost the engine thread.

`seq.grammar` holds a SequenceMatcher. It passes every llguidance call through to the matcher (the
stop rules of engine/stopping.py call consume_token / is_stopped on it) and adds two things:

- `failure`: the message the request ends with when its grammar cannot go on, and `failure_code`:
  CONSTRAINT_TOO_COMPLEX when the constraint itself is at fault (the API's 400), None otherwise. A matcher that hits the
  grammar library's limits mid-output (lexer or parser "too complex") is in an error state; the message
  says so and names the fix, instead of a generic "broke the grammar" or, worse, an empty "stop".
  Its compiled grammar is dropped from the cache too: the lexer state it shares may be spent.
- mask cost: masks are computed for all grammar rows of a step in one parallel call. When that call
  takes longer than `mask_ms_per_token`, its rows are *watched*: over their next `mask_window` tokens
  each one's mask is computed and timed on its own. A watched row whose mean exceeds the bound fails
  ("its masks cost N ms per token"), which bounds what one request can take from everybody's steps;
  one that stays under is unwatched and goes back to the parallel call.
"""

from __future__ import annotations

from typing import Any

from graphcache.engine.errors import CONSTRAINT_TOO_COMPLEX
from graphcache.engine.stopping import GRAMMAR_BROKEN

__all__ = ["SequenceMatcher"]

# llguidance's error text for a token the grammar does not allow (its stop reason is InternalError for
# this and for its limits alike, so the text tells them apart).
_REJECTED = "doesn't satisfy the grammar"


class SequenceMatcher:
    __slots__ = ("matcher", "failure", "failure_code", "watched", "_timed_s", "_timed_n", "_on_error")

    def __init__(self, matcher: Any, on_error: Any = None) -> None:
        self.matcher = matcher
        self.failure: str | None = None
        self.failure_code: str | None = None  # CONSTRAINT_TOO_COMPLEX: the client's constraint is at fault
        self.watched = False
        self._timed_s = 0.0
        self._timed_n = 0
        self._on_error = on_error  # called once when the matcher errors (drops the cache entry)

    def __getattr__(self, name: str) -> Any:  # is_stopped, is_accepting, get_error, ... of the matcher
        return getattr(self.matcher, name)

    def consume_token(self, token_id: int) -> bool:
        """Advance past the sampled token; False (the request ends, with `failure`) when it cannot."""
        if self.failure is not None:
            return False
        if self.matcher.consume_token(token_id) and not self.matcher.is_error():
            return True
        if _REJECTED in self.matcher.get_error():  # a token outside the mask: not the grammar's limits
            self.failure = GRAMMAR_BROKEN
        else:
            self.note_error()
        return False

    def is_error(self) -> bool:
        return self.failure is not None or self.matcher.is_error()

    def note_error(self) -> None:
        """If the matcher is in its error state, record why (once)."""
        if self.failure is not None or not self.matcher.is_error():
            return
        self.failure = (
            "the output constraint went past the grammar engine's limits while generating ("
            + _short(self.matcher.get_error())
            + "); simplify the schema, regex or grammar"
        )
        self.failure_code = CONSTRAINT_TOO_COMPLEX
        if self._on_error is not None:
            self._on_error()

    def charge(self, seconds: float, limit_ms: float, window: int) -> None:
        """One timed mask of a watched row: fail it, or unwatch it, once `window` masks are timed."""
        self._timed_s += seconds
        self._timed_n += 1
        if self._timed_n < window:
            return
        mean_ms = self._timed_s / self._timed_n * 1e3
        self._timed_s, self._timed_n, self.watched = 0.0, 0, False
        if mean_ms > limit_ms and self.failure is None:
            self.failure = (
                f"the output constraint's masks cost {mean_ms:.1f} ms per token, over the server's "
                f"bound of {limit_ms:g} ms (grammar_mask_ms_per_token); simplify the schema, regex "
                "or grammar (large counted repetitions like x{{100000}} are the usual cause)"
            )
            self.failure_code = CONSTRAINT_TOO_COMPLEX


def _short(message: str, limit: int = 200) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."
