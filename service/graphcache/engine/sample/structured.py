"""Structured output: constrain sampling to a JSON schema, a regex, a list of choices or a grammar.

The grammar engine is llguidance (Microsoft's, also a vLLM backend). It was picked over xgrammar
because `llguidance.LLTokenizer` builds straight from the tokenizer.json text we already load
(model/tokenizer.py, the `tokenizers` library): no transformers tokenizer object, no hub access, no
vocabulary re-derivation; its wheel is abi3 (one build for every Python), computes a mask in tens of
microseconds with an Earley parser over a lazily built lexer (no per-grammar precompile of the
whole vocabulary), and it accepts JSON schema, regex, Lark and GBNF, plus `%json {schema}` inside a
Lark rule, which is how tool calls force Hermes markup around schema-checked arguments
(api/tool_calls.py).

Life of a constrained request (the lead wires these calls; none of them is made here):
  1. submit (API side, off the event loop: compiling a large schema can take ~100 ms):
     `structured.check(spec)` compiles it through the cache, InvalidRequest(param=...) when it is
     invalid; the engine's check() may call it again (a cache hit).
  2. EngineCore.add_request: `seq.grammar = structured.new_matcher(spec)` (a copy of the cached
     compiled matcher: cheap).
  3. EngineCore._launch, after runner.execute and BEFORE sampling, on the need_logits rows:
     `structured.apply(result.logits[:len(sample_seqs)], sample_seqs)`: every row whose seq has a
     grammar gets its disallowed ids set to -inf, in place (raw logprobs, if requested, must be
     taken before this call).
  4. Scheduler.postprocess, right after a token is appended: `accept(seq, token)` (False: the token
     broke the grammar: finish "error"); when the stop rules found no reason,
     `is_done(seq)` -> finish "stop" (the grammar is complete: nothing but EOS could follow).
  5. Async scheduling: a mask needs the previous token accepted, so a step is never launched while
     a step holding one of its grammar sequences is in flight (complete the pending step first).

Vocabulary: the model's logits may be wider than the tokenizer (embedding padded to a multiple of
64/128): the matcher is built over max(model, tokenizer) ids, and ids without a token string are
never allowed, so padding ids are masked too. EOS is allowed exactly when the grammar accepts.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from graphcache.engine.errors import InvalidRequest
from graphcache.engine.sequence import Sequence, StructuredSpec
from graphcache.engine.stopping import grammar_accepts, grammar_done

__all__ = ["KINDS", "StructuredOutput", "accept", "is_done"]

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
# Compiled grammars kept (LRU). A compiled matcher holds its lexer/parser tables: a few hundred KB for
# a typical schema; clients usually reuse a handful of schemas, so hits dominate.
DEFAULT_CACHE_SIZE = 128
# The param an invalid spec is blamed on, by kind, when the caller names none.
DEFAULT_PARAMS = {"json": "response_format", "json_schema": "response_format", "regex": "structured_outputs",
                  "choice": "structured_outputs", "grammar": "structured_outputs"}


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise RuntimeError("structured output needs llguidance: pip install llguidance") from e
    return llguidance


def grammar_source(spec: StructuredSpec, param: str) -> str:
    """The llguidance grammar text of `spec` (not yet checked). Raises InvalidRequest for a spec whose
    shape is wrong before any compiling (unknown kind, choice not a list of strings, ...)."""
    llg = _llguidance()
    kind, value = spec.kind, spec.value
    if kind == "json":
        # Any JSON object; a schema given with kind "json" (vLLM's guided_json) constrains it further.
        schema = '{"type": "object"}' if value is None else _schema_text(value, param)
        return llg.LLMatcher.grammar_from_json_schema(schema)
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(_schema_text(value, param))
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise InvalidRequest("a regex constraint needs a non-empty pattern string", param=param)
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest("choice needs a non-empty list of non-empty strings", param=param)
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise InvalidRequest("a grammar constraint needs the grammar text (Lark or GBNF/EBNF)", param=param)
        try:
            return llg.grammar_from("grammar", value)   # GBNF is converted to Lark; Lark passes through
        except ValueError as e:
            raise InvalidRequest(f"invalid grammar: {e}", param=param) from None
    raise InvalidRequest(f"unknown structured output kind {kind!r}; use one of {', '.join(KINDS)}", param=param)


def _schema_text(value: Any, param: str) -> str:
    """A schema as JSON text: a dict is serialized as given (property order kept: it is the output's)."""
    if isinstance(value, dict):
        return json.dumps(value)
    if not isinstance(value, str):
        raise InvalidRequest("json_schema needs the schema as a JSON object", param=param)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the JSON schema is not valid JSON: {e}", param=param) from None
    if not isinstance(parsed, (dict, bool)):
        raise InvalidRequest("a JSON schema must be a JSON object", param=param)
    return value


def _cache_key(spec: StructuredSpec) -> tuple:
    value = spec.value
    if isinstance(value, dict):
        value = json.dumps(value)
    elif isinstance(value, list):
        value = tuple(value)
    return spec.kind, value


class StructuredOutput:
    """Compiles specs (cached), makes per-sequence matchers, masks logits. One per engine.

    tokenizer: model/tokenizer.py's Tokenizer; vocab_size: the model's logits width (>= or <= the
    tokenizer's). Thread-safe for check() from API threads while the engine thread masks."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        llg = _llguidance()
        self.vocab_size = vocab_size or tokenizer.vocab_size
        # Ids past the tokenizer have no bytes: llguidance never allows them (the padding ids).
        self._mask_vocab = max(self.vocab_size, tokenizer.vocab_size)
        self._words = -(-self._mask_vocab // 32)   # [words] int32 per row: llguidance's exact mask size
        self.eos_token_ids = list(tokenizer.eos_token_ids)
        self.ll_tokenizer = llg.LLTokenizer(tokenizer._tok.to_str(), n_vocab=self._mask_vocab,
                                            eos_token=self.eos_token_ids or None)
        self._executor = llg.LLExecutor()
        self._cache: OrderedDict[tuple, Any] = OrderedDict()   # key -> compiled matcher (never advanced)
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._shifts: dict[torch.device, torch.Tensor] = {}

    # --- compiling -------------------------------------------------------------------------
    def compiled(self, spec: StructuredSpec, param: str | None = None) -> Any:
        """The compiled matcher of `spec` in its start state (from the LRU cache, compiled on a miss).
        Raises InvalidRequest(param) when the spec is invalid; invalid specs are not cached."""
        param = param or DEFAULT_PARAMS.get(spec.kind, "structured_outputs")
        key = _cache_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        source = grammar_source(spec, param)
        try:
            # Compiling drops the interpreter lock: other threads run meanwhile.
            matcher = _llguidance().LLMatcher(self.ll_tokenizer, source, log_level=0)
        except Exception as e:   # misuse-level errors; grammar errors put the matcher in its error state
            raise InvalidRequest(f"invalid {spec.kind} constraint: {e}", param=param) from None
        if matcher.is_error():
            raise InvalidRequest(f"invalid {spec.kind} constraint: {_one_line(matcher.get_error())}", param=param)
        with self._lock:
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def check(self, spec: StructuredSpec, param: str | None = None) -> None:
        """Submit-time validation: InvalidRequest(param=...) naming the problem, else None (and the
        compiled grammar is cached for new_matcher)."""
        self.compiled(spec, param)

    def new_matcher(self, spec: StructuredSpec) -> Any:
        """A fresh matcher for one sequence (store it in seq.grammar)."""
        return self.compiled(spec).deep_copy()

    @property
    def cache_len(self) -> int:
        return len(self._cache)

    # --- masking ---------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask logits [R, V] in place (row i belongs to seqs[i]): in each row whose seq has a grammar,
        ids the grammar does not allow next become -inf. Masks are filled on the host (all rows in one
        parallel llguidance call), copied once, and applied by one batched op on logits' device."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return
        pin = logits.is_cuda
        bitmask = torch.empty((len(rows), self._words), dtype=torch.int32, pin_memory=pin)   # [G, words]
        jobs = []
        for k, i in enumerate(rows):
            matcher = seqs[i].grammar
            if matcher.is_error():
                # A broken grammar (postprocess ends the request): allow EOS only so the row still samples.
                bitmask[k].zero_()
                for eos in self.eos_token_ids:
                    bitmask[k, eos // 32] |= _bit(eos % 32)
            else:
                jobs.append((matcher, k))
        if jobs:
            self._executor.unsafe_compute_mask_ptr(jobs, bitmask.data_ptr(), self._words * 4, len(rows))
        mask = bitmask.to(logits.device, non_blocking=pin)
        shifts = self._shifts.get(logits.device)
        if shifts is None:
            shifts = self._shifts[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
        vocab = logits.shape[-1]
        allowed = ((mask.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()   # [G, V]
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))

    def allowed_token_ids(self, seq: Sequence) -> list[int]:
        """The ids seq's grammar allows next (tests and debugging; apply() is the fast path)."""
        logits = torch.zeros(1, self.vocab_size)
        self.apply(logits, [seq])
        return torch.nonzero(logits[0] == 0).flatten().tolist()


# Advancing a matcher and asking if it is complete are stop rules the scheduler runs after every token:
# they live in the torch-free stopping.py; these names keep this module's interface whole.
accept = grammar_accepts
is_done = grammar_done


def _bit(position: int) -> int:
    """Bit `position` of an int32 word, as the signed value torch stores."""
    return (1 << position) - (1 << 32 if position == 31 else 0)


def _one_line(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit - 3] + "..."


# Methods too, so the engine holds one object: structured.accept(seq, t) / structured.is_done(seq).
StructuredOutput.accept = staticmethod(accept)
StructuredOutput.is_done = staticmethod(is_done)
