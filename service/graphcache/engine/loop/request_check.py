"""Can this request ever be served? One check, built from a snapshot of the engine's limits.

The limits of a loaded engine never change (vocabulary, context window, KV cache size), so the
check needs no engine state: the EngineCore holds one `RequestChecker`, and so does the API
process's EngineClient when the core runs in a child process (engine/loop/process.py), built from the
`EngineLimits` the child sends when it is ready. Both refuse the same requests with the same
InvalidRequest, before a request is queued.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from graphcache.engine.errors import InvalidRequest
from graphcache.engine.sample.grammar_cache import GrammarCache
from graphcache.engine.sample.grammar_compiler import GrammarLimits
from graphcache.engine.sequence import Sequence

__all__ = ["EngineLimits", "RequestChecker"]


@dataclass(frozen=True)
class EngineLimits:
    """What a request is checked against; plain values, so it crosses a process boundary."""

    vocab_size: int | None  # the model's logits width (None: unknown, ids are not range-checked)
    max_model_len: int
    block_size: int
    num_usable_blocks: int  # the KV cache: what one sequence could hold at most

    @property
    def max_tokens_capacity(self) -> int:
        return self.num_usable_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class RequestChecker:
    """check(seq): InvalidRequest naming the fix, or the sequence's max_tokens resolved. Grammars
    compile through `structured` (built on first use, ~1 s for a 150k vocabulary; thread-safe): a
    `grammar_cache` (GrammarCache, torch-free, where only checking happens: the API process) or a subclass
    that also masks (the engine's StructuredOutput)."""

    def __init__(
        self,
        limits: EngineLimits,
        tokenizer: Any,
        grammar_limits: GrammarLimits | None = None,
        metrics: Any = None,
        grammar_cache: type[GrammarCache] = GrammarCache,
    ) -> None:
        self.limits = limits
        self.grammar_cache = grammar_cache
        self.tokenizer = tokenizer
        self.grammar_limits = grammar_limits
        self.metrics = metrics
        self._structured: GrammarCache | None = None
        self._structured_lock = threading.Lock()

    @property
    def structured(self) -> GrammarCache:
        """The grammar engine over this model's tokenizer (built lazily)."""
        with (
            self._structured_lock
        ):  # the API compiles off the event loop while the engine thread may build it
            if self._structured is None:
                self._structured = self.grammar_cache(
                    self.tokenizer, self.limits.vocab_size, limits=self.grammar_limits, metrics=self.metrics
                )
        return self._structured

    @property
    def built_structured(self) -> GrammarCache | None:
        """The grammar engine if a constrained request built it already, else None (costs nothing)."""
        return self._structured

    def resolve_max_tokens(
        self, num_prompt_tokens: int, max_tokens: int | None, param: str = "max_tokens"
    ) -> int:
        """The tokens a request may generate: its own max_tokens checked against the context window,
        or (None) the rest of the window, capped by what the whole KV cache can hold."""
        limit, n = self.limits.max_model_len, num_prompt_tokens
        if n == 0:
            raise InvalidRequest("the prompt is empty; send at least one token", param="prompt")
        if n >= limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{n} tokens; shorten the prompt.",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return max(1, min(limit, self.limits.max_tokens_capacity) - n)
        if n + max_tokens > limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens; the prompt has {n} "
                f"and {param}={max_tokens} asks for more. Lower {param} to at most {limit - n}.",
                param=param,
                code="context_length_exceeded",
            )
        return max_tokens

    def check(self, seq: Sequence, param: str = "max_tokens", prompt_checked: bool = False) -> None:
        """Raise InvalidRequest naming the fix when `seq` can never be served; resolves max_tokens.
        prompt_checked: its prompt came as a TokenIds checked against this vocabulary (once per request,
        not once per choice), so its ids are not walked again."""
        limits = self.limits
        seq.params.validate()
        if limits.vocab_size is not None:
            seq.params.validate_token_ids(limits.vocab_size)
        if seq.params.structured is not None:  # an invalid schema, regex or grammar is the client's 400
            # Kept on the sequence: the engine thread copies it and never compiles (nor waits for a compile).
            seq.compiled_grammar = self.structured.check(seq.params.structured)
        pooling = seq.params.pooling is not None
        if pooling:  # prefill only: the whole window is its prompt's; its one sampled row is never fed
            n, limit = seq.num_prompt_tokens, limits.max_model_len
            if n == 0:
                raise InvalidRequest("the input is empty; send at least one token", param="input")
            if n > limit:
                raise InvalidRequest(
                    f"This model's maximum context length is {limit} tokens, but the input has {n} tokens; "
                    "shorten it, or set truncate_prompt_tokens.",
                    param="input",
                    code="context_length_exceeded",
                )
            seq.params.max_tokens = 1
        else:
            seq.params.max_tokens = self.resolve_max_tokens(
                seq.num_prompt_tokens, seq.params.max_tokens, param
            )
        vocab = limits.vocab_size
        if vocab is not None and not prompt_checked and any(not 0 <= t < vocab for t in seq.prompt_token_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        total = seq.num_prompt_tokens + (0 if pooling else seq.params.max_tokens)
        if limits.blocks_for(total) > limits.num_usable_blocks:
            raise InvalidRequest(
                f"prompt + {param} = {total} tokens needs more KV cache than the server has "
                f"({limits.max_tokens_capacity} tokens); lower {param}",
                param=param,
            )
