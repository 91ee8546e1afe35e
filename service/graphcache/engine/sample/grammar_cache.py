"""The compiled-grammar cache: a constraint (JSON schema, regex, choices, Lark/GBNF grammar) compiled by
llguidance into a matcher in its start state, bounded in depth before compiling, compiled on a big-stack
thread under the library's limits and a time budget, and cached by entries and bytes. No torch: the API
process (engine in its own process) checks constraints here; masking logits is structured.py's.
See structured.py for the life of a constrained request and docs/RELIABILITY.md for the limits.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from graphcache.engine.errors import InvalidRequest
from graphcache.engine.sample.grammar_bounds import grammar_depth, json_nesting_depth, ref_chain_depth
from graphcache.engine.sample.grammar_compiler import CompileExecutor, GrammarLimits, heap_bytes
from graphcache.engine.sample.grammar_matcher import SequenceMatcher
from graphcache.engine.sequence import StructuredSpec

__all__ = ["KINDS", "CompiledGrammar", "GrammarCache", "grammar_source"]

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
# Compiled grammars kept (LRU, also bounded by bytes: GrammarLimits.cache_bytes). A compiled matcher holds
# its lexer/parser tables: a few hundred KB for a typical schema; clients usually reuse a handful of
# schemas, so hits dominate.
DEFAULT_CACHE_SIZE = GrammarLimits.cache_entries
# The param an invalid spec is blamed on, by kind, when the caller names none.
DEFAULT_PARAMS = {
    "json": "response_format",
    "json_schema": "response_format",
    "regex": "structured_outputs",
    "choice": "structured_outputs",
    "grammar": "structured_outputs",
}


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise RuntimeError("structured output needs llguidance: pip install llguidance") from e
    return llguidance


def grammar_source(spec: StructuredSpec, param: str, max_depth: int = GrammarLimits.max_depth) -> str:
    """The llguidance grammar text of `spec` (not yet compiled). Raises InvalidRequest for a spec whose
    shape is wrong or that is deeper than `max_depth` (grammar_bounds.py), before any compiling.
    Converting a schema recurses in native code: call this on a compile thread."""
    llg = _llguidance()
    kind, value = spec.kind, spec.value
    # compact: no whitespace between JSON tokens (strings keep theirs); over the schema's own x-guidance.
    options = {"whitespace_flexible": False} if spec.compact else None
    if kind == "json":
        # Any JSON object; a schema given with kind "json" (vLLM's guided_json) constrains it further.
        schema = '{"type": "object"}' if value is None else _schema_text(value, param, max_depth)
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(
            _schema_text(value, param, max_depth), overrides=options
        )
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise InvalidRequest("a regex constraint needs a non-empty pattern string", param=param)
        _bounded("regex group nesting", _group_depth(value), max_depth, param)
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidRequest("choice needs a non-empty list of non-empty strings", param=param)
        # One regex lexeme, not one grammar alternative per choice: the parser allows at most 2,000
        # items in a row (llguidance's max_items_in_row), the lexer's alternation has no such bound.
        return llg.LLMatcher.grammar_from_regex("(?:" + "|".join(re.escape(c) for c in value) + ")")
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise InvalidRequest(
                "a grammar constraint needs the grammar text (Lark or GBNF/EBNF)", param=param
            )
        _bounded("grammar rule chain", grammar_depth(value, max_depth), max_depth, param)
        for schema in _embedded_schemas(value):  # `%json {...}` rules (tool calls): bounded as schemas
            _check_schema_depth(schema, param, max_depth)
        try:
            return llg.grammar_from("grammar", value)  # GBNF is converted to Lark; Lark passes through
        except ValueError as e:
            raise InvalidRequest(f"invalid grammar: {_one_line(str(e))}", param=param) from None
    raise InvalidRequest(
        f"unknown structured output kind {kind!r}; use one of {', '.join(KINDS)}", param=param
    )


def _bounded(what: str, depth: int, max_depth: int, param: str) -> None:
    if depth > max_depth:
        raise InvalidRequest(
            f"the output constraint is too deep: its {what} is at least {depth} levels, over the server's "
            f"limit of {max_depth} (grammar_max_depth); flatten it",
            param=param,
        )


def _check_schema_depth(schema: Any, param: str, max_depth: int) -> None:
    _bounded("JSON nesting", json_nesting_depth(schema), max_depth, param)
    _bounded("$ref chain", ref_chain_depth(schema, max_depth), max_depth, param)


def _group_depth(pattern: str) -> int:
    """The deepest nesting of ( ) groups in a regex (escapes and character classes skipped)."""
    depth = deepest = 0
    escaped = in_class = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(0, depth - 1)
    return deepest


def _embedded_schemas(grammar: str) -> list[Any]:
    """The JSON schemas of a Lark grammar's `%json {...}` rules."""
    found, decoder = [], json.JSONDecoder()
    for match in re.finditer(r"%json\s*", grammar):
        try:
            found.append(decoder.raw_decode(grammar, match.end())[0])
        except (ValueError, RecursionError):
            continue  # not JSON: the grammar library reports it
    return found


def _schema_text(value: Any, param: str, max_depth: int) -> str:
    """A schema as JSON text, checked for depth: a dict is serialized as given (property order kept: it is
    the output's)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"the JSON schema is not valid JSON: {e}", param=param) from None
        except RecursionError:
            raise InvalidRequest(
                f"the JSON schema is nested too deeply (the server's limit is {max_depth} "
                "levels, grammar_max_depth)",
                param=param,
            ) from None
        if not isinstance(parsed, (dict, bool)):
            raise InvalidRequest("a JSON schema must be a JSON object", param=param)
        _check_schema_depth(parsed, param, max_depth)
        return value
    if not isinstance(value, dict):
        raise InvalidRequest("json_schema needs the schema as a JSON object", param=param)
    _check_schema_depth(value, param, max_depth)
    return json.dumps(value)


def _cache_key(spec: StructuredSpec) -> tuple:
    value = spec.value
    if isinstance(value, dict):
        value = json.dumps(value)
    elif isinstance(value, list):
        value = tuple(value)
    return spec.kind, value, spec.compact


@dataclass
class CompiledGrammar:
    """A cache entry: the compiled matcher in its start state (never advanced; sequences get deep copies,
    which share its lexer), what it is estimated to hold, and its key."""

    matcher: Any
    nbytes: int
    key: tuple


class GrammarCache:
    """Compiles specs (cached, bounded by entries and bytes) and makes per-sequence matchers. Torch-free:
    the API process validates constraints with it; structured.py's StructuredOutput adds the masks.

    tokenizer: model/tokenizer.py's Tokenizer; vocab_size: the model's logits width (>= or <= the
    tokenizer's); limits: GrammarLimits (settings/grammar.py's grammar_* settings); metrics: the Metrics whose
    grammar_cache_bytes gauge follows the cache. Thread-safe for check() from API threads while the
    engine thread makes matchers."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        cache_size: int | None = None,
        limits: GrammarLimits | None = None,
        metrics: Any = None,
    ) -> None:
        llg = _llguidance()
        self.limits = limits = limits or GrammarLimits()
        self.vocab_size = vocab_size or tokenizer.vocab_size
        # Ids past the tokenizer have no bytes: llguidance never allows them (the padding ids).
        self._mask_vocab = max(self.vocab_size, tokenizer.vocab_size)
        self._words = -(-self._mask_vocab // 32)  # [words] int32 per row: llguidance's exact mask size
        self.eos_token_ids = list(tokenizer.eos_token_ids)
        self.ll_tokenizer = llg.LLTokenizer(
            tokenizer._tok.to_str(), n_vocab=self._mask_vocab, eos_token=self.eos_token_ids or None
        )
        # Short errors (no parser state or grammar text echoed back to the client), lexer fuel bounded:
        # a counted-repetition bomb (a{1000}{1000}) fails in milliseconds instead of seconds of lexing.
        self._ll_limits = llg.LLParserLimits(initial_lexer_fuel=limits.lexer_fuel, verbose_errors=False)
        self._executor = llg.LLExecutor()
        self._compiler = CompileExecutor(
            limits.compile_threads, limits.compile_queue, limits.compile_stack_mib
        )
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._cache_size = limits.cache_entries if cache_size is None else cache_size
        self._cache_bytes = 0
        self._compiling: dict[tuple, Future] = {}  # one compile per key at a time; the others wait on it
        self._lock = threading.Lock()
        self._metrics = metrics

    # --- compiling -------------------------------------------------------------------------
    def compiled(self, spec: StructuredSpec, param: str | None = None) -> Any:
        """The compiled matcher of `spec` in its start state (from the cache, compiled on a miss).
        Raises InvalidRequest(param) when the spec is invalid, too deep, unsatisfiable, past the grammar
        library's limits or too slow to compile; QueueFull when too many compiles wait. Failures are not cached."""
        return self._entry(spec, param).matcher

    def _entry(self, spec: StructuredSpec, param: str | None) -> CompiledGrammar:
        param = param or DEFAULT_PARAMS.get(spec.kind, "structured_outputs")
        key = _cache_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and not hit.matcher.is_error():
                self._cache.move_to_end(key)
                return hit
            if hit is not None:  # poisoned (a shared lexer went past its limits): compile afresh
                self._drop_locked(key)
            waiting = self._compiling.get(key)
            if waiting is None:
                mine = self._compiling[key] = Future()
        if waiting is not None:  # the same spec is compiling now: share its result (or its refusal)
            try:
                return waiting.result()
            except InvalidRequest as e:
                raise InvalidRequest(e.message, param=param, code=e.code) from None
        try:
            entry = self._compiler.run(self._compile, spec, param, key)
        except BaseException as e:
            mine.set_exception(e)
            raise
        finally:
            with self._lock:
                self._compiling.pop(key, None)
        with self._lock:
            if entry.nbytes <= self.limits.cache_bytes:  # a larger one serves its own request, uncached
                self._cache[key] = entry
                self._cache_bytes += entry.nbytes
            while self._cache and (
                len(self._cache) > self._cache_size or self._cache_bytes > self.limits.cache_bytes
            ):
                self._drop_locked(next(iter(self._cache)))
            self._publish_locked()
        mine.set_result(entry)
        return entry

    def _compile(self, spec: StructuredSpec, param: str, key: tuple) -> CompiledGrammar:
        """On a compile thread: bounds, compile, the first mask and one step past it, all timed."""
        llg = _llguidance()
        heap_before = heap_bytes()
        start = time.perf_counter()
        source = grammar_source(spec, param, self.limits.max_depth)
        try:
            matcher = llg.LLMatcher(self.ll_tokenizer, source, log_level=0, limits=self._ll_limits)
        except Exception as e:  # misuse-level errors; grammar errors put the matcher in its error state
            raise InvalidRequest(
                f"invalid {spec.kind} constraint: {_one_line(str(e))}", param=param
            ) from None
        if matcher.is_error():
            raise InvalidRequest(
                f"invalid {spec.kind} constraint: {_one_line(matcher.get_error())}", param=param
            )
        first = (
            matcher.compute_bitmask()
        )  # builds the shared lexer's first states: never on the engine thread
        if matcher.is_error():
            raise InvalidRequest(_refusal(spec.kind, matcher), param=param)
        self._probe_one_step(matcher, first, spec.kind, param)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        if elapsed_ms > self.limits.compile_budget_ms:
            raise InvalidRequest(
                f"the {spec.kind} constraint is too costly: compiling it and its first masks "
                f"took {elapsed_ms:.0f} ms, over the server's budget of "
                f"{self.limits.compile_budget_ms:g} ms (grammar_compile_budget_ms); simplify it",
                param=param,
            )
        heap_after = heap_bytes()
        grown = heap_after - heap_before if heap_before is not None and heap_after is not None else 0
        return CompiledGrammar(matcher, max(grown, len(source)), key)

    def _probe_one_step(self, matcher: Any, first: bytes, kind: str, param: str) -> None:
        """Take the first token the grammar allows (not EOS) and compute the next mask, on a copy: grammars
        past the library's limits (a lexer blow-up, a row of over 2,000 items) mostly fail there."""
        token = _first_allowed(first, set(self.eos_token_ids))
        if token is None:
            return
        probe = matcher.deep_copy()
        if probe.consume_token(token):
            probe.compute_bitmask()
        if probe.is_error():
            raise InvalidRequest(_refusal(kind, probe), param=param)

    def _drop_locked(self, key: tuple) -> None:
        entry = self._cache.pop(key, None)
        if entry is not None:
            self._cache_bytes -= entry.nbytes

    def _publish_locked(self) -> None:
        if self._metrics is not None:
            self._metrics.grammar_cache_bytes.set(self._cache_bytes)

    def discard(self, key: tuple) -> None:
        """Drop a cache entry (its shared lexer went past its limits while a sequence used it)."""
        with self._lock:
            self._drop_locked(key)
            self._publish_locked()

    def check(self, spec: StructuredSpec, param: str | None = None) -> CompiledGrammar:
        """Submit-time validation: InvalidRequest(param=...) naming the problem; else the compiled entry
        (cached too), which new_matcher takes so the engine thread never compiles."""
        return self._entry(spec, param)

    def new_matcher(self, spec: StructuredSpec, compiled: CompiledGrammar | None = None) -> SequenceMatcher:
        """A fresh matcher for one sequence (store it in seq.grammar): a copy of `compiled` (check()'s
        result), else of the cached grammar (compiled on a compile thread on a miss)."""
        entry = compiled if compiled is not None else self._entry(spec, None)
        key = entry.key
        return SequenceMatcher(entry.matcher.deep_copy(), on_error=lambda: self.discard(key))

    @property
    def cache_len(self) -> int:
        return len(self._cache)

    @property
    def cache_bytes(self) -> int:
        """The cache's estimated bytes (see the module docstring for how an entry is measured)."""
        return self._cache_bytes


def _first_allowed(mask: bytes, skip: set[int]) -> int | None:
    """The lowest token id set in a compute_bitmask() result (little-endian bits) that is not in `skip`."""
    for index, byte in enumerate(mask):
        if byte:
            for bit in range(8):
                if byte >> bit & 1 and index * 8 + bit not in skip:
                    return index * 8 + bit
    return None


def _refusal(kind: str, matcher: Any) -> str:
    """Why a compiled constraint is refused after its first masks: unsatisfiable, or past the library's limits."""
    if "NoExtension" in matcher.stop_reason() or "NoExtension" in matcher.get_error():
        return (
            f"the {kind} constraint can never be satisfied: no output matches it (a rule that only refers "
            "to itself, a $ref loop, ...); fix the constraint"
        )
    return (
        f"the {kind} constraint is past the grammar engine's limits ({_one_line(matcher.get_error())}); "
        "simplify it (large counted repetitions, thousands of alternatives in one rule, ...)"
    )


def _one_line(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."
