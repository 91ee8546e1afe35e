"""A request's sampling state, as the worker holds it: what the sampler reads of a row, and its caches.

The worker's request table (engine/worker/request_table.py) keeps one per request for the request's
lifetime in the worker; the sampler (sampler.py, controls.py) reads a step's rows as a list of them. The
scheduler's Sequence holds none of this.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

# The predicates on params live beside SamplingParams (the scheduler reads them too); re-exported here.
from graphcache.engine.sequence import SamplingParams, Sequence, has_controls, has_penalty, needs_history

__all__ = ["SamplingState", "has_controls", "has_penalty", "needs_history"]


class SamplingState:
    """One request's sampling inputs. `num_generated` (its outputs before the token being sampled) is set by
    the worker each step for the rows that read it (`counted`: seeded draws, min_tokens); `output_token_ids`
    is kept by the worker for the rows whose controls read it (`history`: penalties, bad words of several
    tokens). The rest are the sampler's caches of values fixed by the parameters (None until first asked)."""

    __slots__ = (
        "controls",
        "counted",
        "draw_row",
        "history",
        "num_generated",
        "output_token_ids",
        "params",
        "plain_greedy",
        "prompt_token_ids",
        "request_id",
        "steady_controls",
    )

    def __init__(
        self,
        request_id: str,
        params: SamplingParams,
        prompt_token_ids: Seq[int] = (),
        output_token_ids: list[int] | None = None,
        num_generated: int = 0,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = [] if output_token_ids is None else output_token_ids
        self.num_generated = num_generated
        self.history = has_penalty(params) or any(len(w) > 1 for w in params.bad_words_token_ids)
        self.counted = params.seed is not None or params.min_tokens > 0
        # The sampler's caches (sampler.py, controls.py), set on first use.
        self.plain_greedy: bool | None = None
        self.steady_controls: bool | None = None
        self.draw_row: Any = None
        self.controls: Any = None

    @classmethod
    def of(cls, seq: Sequence) -> SamplingState:
        """A sequence's state as the scheduler sees it now (tests, tools): its outputs so far, and
        num_generated counting a token of an earlier step still in flight (num_inflight - 1)."""
        return cls(
            seq.request_id,
            seq.params,
            seq.prompt_token_ids,
            list(seq.output_token_ids),
            seq.num_output_tokens + max(seq.num_inflight - 1, 0),
        )

    def __repr__(self) -> str:
        return f"SamplingState({self.request_id!r}, generated={self.num_generated})"
