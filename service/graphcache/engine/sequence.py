"""Per-request state: what a request asked for, what it has produced, and where its KV lives.

A `Sequence` is the scheduler's state of a request, owned by the engine thread; nothing else mutates
it. The scheduler moves it between WAITING and RUNNING, the block manager fills `block_table`, the engine
appends sampled tokens and Scheduler.postprocess runs the stop rules (stopping.py) that finish it. The
worker never sees it: a step plan (engine/plan.py) carries what the worker needs, and the worker keeps its
own state of each request (engine/worker/request_table.py; the sampler's, engine/sample/state.py).

Token accounting (the one invariant everything relies on):
  all_token_ids = prompt_token_ids + output_token_ids
  num_computed_tokens = how many of all_token_ids already have their K/V written in the cache.
A step feeds all_token_ids[num_computed_tokens : num_computed_tokens + n]; when that slice reaches
the end, the step also yields logits and a new token is sampled. Preemption by recompute simply
resets num_computed_tokens to 0 and drops the blocks: the outputs are kept, so the sequence
resumes by re-prefilling prompt + outputs and continues where it stopped.
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from graphcache.engine.errors import InvalidRequest
from graphcache.engine.pooling import PoolingSpec
from graphcache.metrics import FINISH_REASONS


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on the output, compiled by the grammar engine (engine/sample/structured.py).

    kind: "json" (any JSON object), "json_schema" (value: the schema as a JSON string), "regex"
    (value: the pattern), "choice" (value: a tuple of allowed strings), "grammar" (value: a
    Lark/EBNF grammar), "structural_tag" is not supported. compact: JSON without whitespace outside
    strings (vLLM's disable_any_whitespace; json and json_schema kinds only)."""

    kind: str
    value: Any = None
    compact: bool = False


class TokenIds(tuple):
    """Token ids checked once to be integers in [0, vocab_size) (any integer >= 0 when the vocabulary
    is unknown), as an immutable tuple. An API request checks its token-id lists once and hands every
    choice the same TokenIds: validate() and validate_token_ids() trust it in O(1) where they walk a
    plain list per choice (with a 152k vocabulary, every id allowed and n = 128, that walk is seconds
    of event-loop work). A plain list from a direct engine caller is still checked in full."""

    vocab_size: int | None

    def __new__(cls, ids: Iterable[int], vocab_size: int | None, param: str = "token ids") -> TokenIds:
        try:  # operator.index: C speed, refuses floats and strings (a bool becomes its int)
            values = tuple(map(operator.index, ids))
        except TypeError:
            raise InvalidRequest(f"{param} must hold integer token ids", param=param) from None
        if values and (min(values) < 0 or (vocab_size is not None and max(values) >= vocab_size)):
            bound = "" if vocab_size is None else f" and < {vocab_size}"
            raise InvalidRequest(f"{param} must hold token ids >= 0{bound}", param=param)
        checked = super().__new__(cls, values)
        checked.vocab_size = vocab_size
        return checked

    def checked_for(self, vocab_size: int | None) -> bool:
        """Were these ids checked against a vocabulary no larger than `vocab_size`?"""
        return vocab_size is None or (self.vocab_size is not None and self.vocab_size <= vocab_size)

    def __reduce__(self):  # pickled to the engine process with its bound, not checked again there
        return (_unpickle_token_ids, (tuple(self), self.vocab_size))


def _unpickle_token_ids(values: tuple[int, ...], vocab_size: int | None) -> TokenIds:
    checked = tuple.__new__(TokenIds, values)
    checked.vocab_size = vocab_size
    return checked


@dataclass
class TokenLogprob:
    """One position's log probabilities: the chosen token's, its rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


@dataclass
class SamplingParams:
    """OpenAI-style sampling knobs. temperature 0 means greedy."""

    # Stop strings per request: the detokenizer searches them all each token (one regex, over the
    # last few characters only), so many are cheap; the bound keeps a request from making it costly.
    MAX_STOP_STRINGS: ClassVar[int] = 64

    max_tokens: int | None = 16  # None: the rest of the context window (the engine resolves it at submit)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # --- sampling controls (applied on the device, batched: controls.py) ------------------
    presence_penalty: float = 0.0  # OpenAI: -2..2, subtracted once per token present in the output
    frequency_penalty: float = 0.0  # OpenAI: -2..2, subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # vLLM/HF: > 0; prompt + output tokens, logit / p if > 0 else * p
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many outputs
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob (0 = off)
    # Only these may be sampled (None = all); a TokenIds (checked once, shared by a request's choices) or a list.
    allowed_token_ids: list[int] | TokenIds | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # token sequences never completed
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # False: special tokens' text stays in the output text
    # --- log probabilities (raw: log_softmax of the model's logits, before any processing) --
    logprobs: int | None = None  # None = off; k >= 0: the sampled token's logprob + the top k
    prompt_logprobs: int | None = None  # None = off; k >= 0: each prompt token's logprob + the top k (echo)
    # --- structured output (structured.py): None, or what the output must match ------------
    structured: StructuredSpec | None = None
    # --- embeddings (pooling.py): set, the request returns its pooled hidden state, not tokens -
    pooling: PoolingSpec | None = None
    # --- scheduling: lower runs first under the priority policy (vLLM's `priority`); fcfs ignores it
    priority: int = 0
    # --- the LoRA adapter the request runs through (its name; None: the base model) -------
    lora_name: str | None = None

    def validate(self) -> None:
        """Raise InvalidRequest naming the bad field (the API maps it to 400)."""
        if self.pooling is not None:
            self.pooling.validate()
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequest(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens"
            )
        if self.temperature < 0:
            raise InvalidRequest(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}", param="temperature"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {self.top_k}", param="top_k")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty", param="stop")
        if len(self.stop) > self.MAX_STOP_STRINGS:
            raise InvalidRequest(
                f"at most {self.MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}",
                param="stop",
            )
        self._check_ids(self.stop_token_ids, "stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value}", param=name)
        if not 0 < self.repetition_penalty < math.inf:
            raise InvalidRequest(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}",
                param="repetition_penalty",
            )
        self._check_ids(list(self.logit_bias), "logit_bias")
        for token, bias in self.logit_bias.items():
            if not -100 <= bias <= 100:
                raise InvalidRequest(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token}",
                    param="logit_bias",
                )
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest(
                f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", param="min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1] (0 = off), got {self.min_p}", param="min_p")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequest(
                    "allowed_token_ids must not be empty (leave it out to allow every token)",
                    param="allowed_token_ids",
                )
            if not isinstance(self.allowed_token_ids, TokenIds):
                self._check_ids(self.allowed_token_ids, "allowed_token_ids")
        for word in self.bad_words_token_ids:
            if not word:
                raise InvalidRequest(
                    "each bad word must be a non-empty list of token ids", param="bad_words_token_ids"
                )
            self._check_ids(word, "bad_words_token_ids")

    def validate_token_ids(self, vocab_size: int) -> None:
        """Raise InvalidRequest when a token-id control names an id outside [0, vocab_size) (the core
        calls this: validate() does not know the vocabulary)."""
        allowed = self.allowed_token_ids or ()
        if isinstance(allowed, TokenIds) and allowed.checked_for(vocab_size):
            allowed = ()
        for name, ids in (
            ("logit_bias", self.logit_bias),
            ("allowed_token_ids", allowed),
            ("stop_token_ids", self.stop_token_ids),
            ("bad_words_token_ids", [t for word in self.bad_words_token_ids for t in word]),
        ):
            bad = sorted({t for t in ids if not 0 <= t < vocab_size})
            if bad:
                raise InvalidRequest(
                    f"{name} has token ids outside the vocabulary [0, {vocab_size}): "
                    f"{bad[:5]}{' ...' if len(bad) > 5 else ''}",
                    param=name,
                )

    @staticmethod
    def _check_ids(ids, param: str) -> None:
        """Token ids must be integers >= 0 (the upper bound is the vocabulary: validate_token_ids)."""
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidRequest(f"{param} must hold token ids (integers >= 0), got {t!r}", param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def has_controls(p: SamplingParams) -> bool:
    """Logits controls that act every step (min_tokens acts only until that many tokens are out)."""
    return (
        has_penalty(p) or bool(p.logit_bias) or p.allowed_token_ids is not None or bool(p.bad_words_token_ids)
    )


def needs_history(params: SamplingParams) -> bool:
    """Does this request's sampling read tokens it already generated (penalties, min_tokens, bad
    words of more than one token)? Then a step must not sample it before the previous step's token
    is on the host (no async overlap). Single-token bad words, logit_bias, allowed_token_ids and
    min_p do not."""
    return (
        has_penalty(params)
        or params.min_tokens > 0
        or any(len(word) > 1 for word in params.bad_words_token_ids)
    )


@dataclass
class RequestOutput:
    """One streamed delta of a request. The last one has finished=True and a finish_reason."""

    request_id: str
    text: str  # new text since the previous output
    token_ids: list[int]  # new token ids since the previous output
    finished: bool
    finish_reason: str | None  # stop | length | abort | error (None until finished)
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # message when finish_reason == "error" (safe to show a client)
    error_code: str | None = (
        None  # set when the request caused its error (engine/errors.py CLIENT_ERROR_CODES)
    )
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids (params.logprobs set)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only; None for prompt token 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # Final output only: it ended on a stop token or EOS, whose text a consumer that detokenizes leaves out.
    stopped_on_token: bool = False
    # Final output only: the stop string or stop token id that ended it (None for EOS, length, ...).
    stop_reason: int | str | None = None
    embedding: list[float] | None = None  # final output of a pooling request only: its vector


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity equality: two requests with equal fields are still two requests
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None  # why, when finish_reason == "error"
    error_code: str | None = None  # engine/errors.py CLIENT_ERROR_CODES: the request caused its error
    num_preemptions: int = 0
    num_freed_computed: int = 0  # tokens whose KV the last preemption freed (computed again on return)
    num_inflight: int = 0  # sampled tokens of scheduled steps not appended yet (async scheduling)
    stream: bool = True  # False: only the final output (carrying everything) is delivered
    # Detokenizer state: the tokenizer's IncrementalDetokenizer (None once flushed at finish) and the
    # text it released so far (stop strings already cut).
    detokenizer: Any = None
    # Non-streaming and no stop strings: nobody reads text before the end, so the detokenizer
    # runs once over all output ids at finish instead of twice per token on the engine thread.
    defer_text: bool = False
    stop_reason: int | str | None = None  # the stop string or stop token id that finished it
    stopped_on_token: bool = False  # finished by a stop token / EOS (its text is left out), not a grammar
    output_text: str = ""
    num_text_sent: int = 0  # chars of output_text already streamed to the client
    num_tokens_sent: int = 0  # output tokens already streamed to the client
    first_scheduled_time: float | None = None  # monotonic time of its first admission (queue time ends)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # params.logprobs: one per output token
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # params.prompt_logprobs
    cumulative_logprob: float = 0.0  # sum of the sampled tokens' raw logprobs (best_of ranks by it)
    embedding: list[float] | None = None  # a pooling request's vector, set by the step that ends it
    grammar: Any = None  # structured.py's matcher for params.structured (engine thread only)
    compiled_grammar: Any = None  # its compiled grammar, from the submit-time check (copied into grammar)
    # Unique for the process's lifetime (id() is not: a freed object's id comes back): the step plans name
    # the request by it, and the worker's request table holds its state under it (engine/plan.py).
    key: int = field(default_factory=itertools.count().__next__, init=False, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the concatenation for decode steps."""
        n_prompt = len(self.prompt_token_ids)
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.all_token_ids[start:end]

    def finish(self, reason: str, error: str | None = None, error_code: str | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.error_code = error_code

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)})"
        )
