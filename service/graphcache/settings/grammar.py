"""GrammarSettings (`settings.grammar`): the limits of structured output, compiling and masking."""

from __future__ import annotations

from pydantic import Field

from graphcache.settings.section import SettingsSection

__all__ = ["GrammarSettings"]


class GrammarSettings(SettingsSection):
    """Structured output: compiling constraints and masking with them (engine/sample/grammar_*.py); field
    names are GrammarLimits' (docs/RELIABILITY.md, "Structured output limits")."""

    compile_threads: int = Field(
        2,
        alias="grammar_compile_threads",
        ge=1,
        le=64,
        description="Threads that compile output constraints (schemas, regexes, grammars) and "
        "their first masks, off the event loop and the engine thread.",
    )
    compile_queue: int = Field(
        64,
        alias="grammar_compile_queue",
        ge=0,
        description="Constraints that may wait for a compile thread; more get 429.",
    )
    compile_stack_mib: int = Field(
        256,
        alias="grammar_compile_stack_mib",
        ge=8,
        le=4096,
        description="Stack of each compile thread (MiB, reserved, touched only as used): the "
        "grammar library recurses natively, and a deep input on a default 8 MiB stack kills the process.",
    )
    max_depth: int = Field(
        128,
        alias="grammar_max_depth",
        ge=4,
        description="Deepest constraint compiled: JSON nesting and $ref chain of a schema, rule "
        "chain of a grammar, group nesting of a regex. Deeper: 400.",
    )
    lexer_fuel: int = Field(
        100_000,
        alias="grammar_lexer_fuel",
        ge=1000,
        description="Lexer fuel of one constraint (llguidance's initial_lexer_fuel, default 1M): "
        "a regex bomb such as a{1000}{1000} or x{100000} runs out of it and is refused (400) after ~0.3 s of "
        "lexing instead of seconds; schemas with long strings, big enums and formats need far less.",
    )
    compile_budget_ms: float = Field(
        2000.0,
        alias="grammar_compile_budget_ms",
        gt=0,
        description="Most time compiling a constraint and its first two masks may take; slower: 400.",
    )
    mask_ms_per_token: float = Field(
        10.0,
        alias="grammar_mask_ms_per_token",
        gt=0,
        description="Most mask time per token a constrained request may cost the engine thread (mean "
        "over grammar_mask_window timed tokens, measured once its step's masks took longer than this); past it "
        "the request ends with finish_reason error.",
    )
    mask_window: int = Field(
        8,
        alias="grammar_mask_window",
        ge=1,
        description="Tokens a request's mask cost is averaged over before it is ended or cleared.",
    )
    cache_entries: int = Field(
        128, alias="grammar_cache_entries", ge=1, description="Compiled constraints kept for reuse (LRU)."
    )
    cache_bytes: int = Field(
        512 << 20,
        alias="grammar_cache_bytes",
        ge=0,
        description="Estimated bytes of compiled constraints kept (LRU beyond; one larger than this "
        "is not kept): the heap growth while each compiled (metric graphcache_grammar_cache_bytes).",
    )
