"""Per-request state: what a request asked for, what it has produced, and where its KV lives.

A `Sequence` is owned by the engine thread; nothing else mutates it. The scheduler moves it
between WAITING and RUNNING, the block manager fills `block_table`, the engine appends sampled
tokens and Scheduler.postprocess runs the stop rules (stopping.py) that finish it.

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
import time
from dataclasses import dataclass, field
from typing import Any

from graphcache.engine.errors import InvalidRequest
from graphcache.metrics import FINISH_REASONS


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on the output, compiled by the grammar engine (engine/structured.py).

    kind: "json" (any JSON object), "json_schema" (value: the schema as a JSON string), "regex"
    (value: the pattern), "choice" (value: a tuple of allowed strings), "grammar" (value: a
    Lark/EBNF grammar), "structural_tag" is not supported."""

    kind: str
    value: Any = None


@dataclass
class TokenLogprob:
    """One position's log probabilities: the chosen token's, its rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int                                   # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)   # (token id, logprob), most likely first


@dataclass
class SamplingParams:
    """OpenAI-style sampling knobs. temperature 0 means greedy."""

    max_tokens: int | None = 16   # None: the rest of the context window (the engine resolves it at submit)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0          # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # --- sampling controls (applied on the device, batched: sampler.py) -------------------
    presence_penalty: float = 0.0       # OpenAI: -2..2, subtracted once per token present in the output
    frequency_penalty: float = 0.0      # OpenAI: -2..2, subtracted per occurrence in the output
    repetition_penalty: float = 1.0     # vLLM/HF: > 0; prompt + output tokens, logit / p if > 0 else * p
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit (-100..100)
    min_tokens: int = 0                 # EOS and stop_token_ids are masked until this many outputs
    min_p: float = 0.0                  # drop tokens with prob < min_p * max prob (0 = off)
    allowed_token_ids: list[int] | None = None   # only these may be sampled (None = all)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)   # token sequences never completed
    include_stop_str_in_output: bool = False
    # --- log probabilities (raw: log_softmax of the model's logits, before any processing) --
    logprobs: int | None = None         # None = off; k >= 0: the sampled token's logprob + the top k
    prompt_logprobs: int | None = None  # None = off; k >= 0: each prompt token's logprob + the top k (echo)
    # --- structured output (structured.py): None, or what the output must match ------------
    structured: StructuredSpec | None = None

    def validate(self) -> None:
        """Raise InvalidRequest naming the bad field (the API maps it to 400)."""
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0 (0 = greedy), got {self.temperature}",
                                 param="temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {self.top_k}", param="top_k")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty", param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestOutput:
    """One streamed delta of a request. The last one has finished=True and a finish_reason."""

    request_id: str
    text: str                      # new text since the previous output
    token_ids: list[int]           # new token ids since the previous output
    finished: bool
    finish_reason: str | None      # stop | length | abort | error (None until finished)
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None       # message when finish_reason == "error" (safe to show a client)
    logprobs: list[TokenLogprob] | None = None         # one per token in token_ids (params.logprobs set)
    prompt_logprobs: list[TokenLogprob | None] | None = None   # first output only; None for prompt token 0
    num_cached_tokens: int = 0     # prompt tokens whose KV came from the prefix cache


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
    error: str | None = None            # why, when finish_reason == "error"
    num_preemptions: int = 0
    num_inflight: int = 0               # sampled tokens of scheduled steps not appended yet (async scheduling)
    stream: bool = True                 # False: only the final output (carrying everything) is delivered
    # Detokenizer state: the tokenizer's IncrementalDetokenizer (None once flushed at finish) and the
    # text it released so far (stop strings already cut).
    detokenizer: Any = None
    # Non-streaming and no stop strings: nobody reads text before the end, so the detokenizer
    # runs once over all output ids at finish instead of twice per token on the engine thread.
    defer_text: bool = False
    output_text: str = ""
    num_text_sent: int = 0              # chars of output_text already streamed to the client
    num_tokens_sent: int = 0            # output tokens already streamed to the client
    generator: Any = None               # torch.Generator for seeded sampling (created lazily by the sampler)
    first_scheduled_time: float | None = None   # monotonic time of its first admission (queue time ends)
    num_cached_tokens: int = 0          # prompt tokens found in the prefix cache at admission
    output_logprobs: list[TokenLogprob] = field(default_factory=list)   # params.logprobs: one per output token
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)   # params.prompt_logprobs
    cumulative_logprob: float = 0.0     # sum of the sampled tokens' raw logprobs (best_of ranks by it)
    grammar: Any = None                 # structured.py's matcher for params.structured (engine thread only)

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
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.all_token_ids[start:end]

    def finish(self, reason: str, error: str | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)})")
