"""SpeculativeConfig: `--speculative-config` (GRAPHCACHE_SPECULATIVE_CONFIG) read as vLLM reads it.

The setting is one JSON object (settings.engine.speculative_config keeps its text: the settings floor
cannot import the engine, so only here are its keys checked). vLLM's rules (vllm/config/speculative.py):
  - method "ngram" (vLLM's legacy spelling "[ngram]" too) or "draft_model"; left out, it is "ngram" when
    model is "ngram" / "[ngram]" and "draft_model" when another model is named;
  - num_speculative_tokens (k): tokens proposed per request per step, required, >= 1;
  - ngram: prompt_lookup_min / prompt_lookup_max, the n-gram lengths matched; neither given: both 5;
    one given: the other takes its value; min > max is an error;
  - draft_model: model, a local directory or a hub id (org/name) of a model with the target's tokenizer;
  - disable_by_batch_size: speculation is off for a step that runs this many requests or more (vLLM's
    `running_queue_size >= disable_by_batch_size`); vLLM requires > 1.
Anything else is refused with the key named and the fix: vLLM keys graphcache does not implement (EAGLE's,
MTP's, draft tensor parallelism, ...) and unknown keys (with the nearest known one). Bounds vLLM does not
have: k <= MAX_SPECULATIVE_TOKENS and prompt_lookup_max <= MAX_PROMPT_LOOKUP (the reasons are at each).
No torch: the CLI's preflight and the scheduler may read it.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from graphcache.model.source import ModelSourceError, model_source

__all__ = [
    "DEFAULT_PROMPT_LOOKUP",
    "MAX_PROMPT_LOOKUP",
    "MAX_SPECULATIVE_TOKENS",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "SpeculativeMethod",
    "parse_speculative_config",
]

SpeculativeMethod = Literal["ngram", "draft_model"]
METHODS: tuple[str, ...] = ("ngram", "draft_model")
NGRAM_MODELS = ("ngram", "[ngram]")  # vLLM's names for "no model: prompt lookup"
# Each verify step scores k + 1 tokens per row and is a captured graph per (rows, k): past ~16 the chance
# that position k is still accepted is small even at 90% per-token acceptance (0.9^16 = 0.19) while the
# verify cost grows linearly. 32 leaves room to measure that; vLLM's rejection kernel stops at 128.
MAX_SPECULATIVE_TOKENS = 32
# The n-gram index holds (max - min + 1) entries per context token (ngram.py: 18 bytes each) and hashes
# that many n-grams per appended token; matches longer than a few tokens rarely change the proposal.
MAX_PROMPT_LOOKUP = 32
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both bounds when neither is given
KEYS = (
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
)
# vLLM methods graphcache does not implement yet (EAGLE needs the target's hidden states: proposer.py's seam).
VLLM_METHODS = (
    "eagle",
    "eagle3",
    "medusa",
    "mlp_speculator",
    "mtp",
    "deepseek_mtp",
    "ngram_gpu",
    "suffix",
    "custom_class",
    "extract_hidden_states",
)
# vLLM SpeculativeConfig keys with no effect here: named as such rather than as unknown.
VLLM_KEYS = (
    "draft_tensor_parallel_size",
    "tensor_parallel_size",
    "quantization",
    "max_model_len",
    "revision",
    "code_revision",
    "enforce_eager",
    "kv_cache_dtype",
    "attention_backend",
    "moe_backend",
    "draft_sample_method",
    "rejection_sample_method",
    "speculative_token_tree",
    "parallel_drafting",
    "disable_padded_drafter_batch",
    "disable_logprobs",
    "disable_log_stats",
    "acceptance_method",
    "posterior_threshold",
    "posterior_alpha",
    "num_speculative_tokens_per_batch_size",
    "use_heterogeneous_vocab",
    "draft_load_config",
)
EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


class SpeculativeConfigError(ValueError):
    """The speculative config is refused; the message is one line, "<field>: <what is wrong>; <the fix>"."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative config. prompt_lookup_* are set (ngram) or None (draft_model); model is the
    draft's local directory or hub id (draft_model) or None (ngram)."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def speculates(self, num_running: int, default_limit: int | None = None) -> bool:
        """Whether a step running `num_running` requests speculates: under disable_by_batch_size (as vLLM),
        or when the config sets none, under `default_limit` (verify_batch_limit's; None: no limit)."""
        limit = self.disable_by_batch_size if self.disable_by_batch_size is not None else default_limit
        return limit is None or num_running < limit

    def verify_batch_limit(self, verify_graph_tokens: int | None) -> int | None:
        """The default disable_by_batch_size on CUDA: speculate only while every running request's verify
        row (k + 1 tokens) fits the largest captured verify graph. A bigger verify step runs eagerly as a
        mixed step, which on the H200 made the realistic 0.5B workload 0.55x as fast as without speculation
        (34.7 ms steps of ~2,100 tokens against 3.6 ms decode steps, BENCHMARKS.md); past that size a step is
        compute-bound anyway, where verifying k more tokens a row costs about k more decode steps' work.
        None (no verify graphs, e.g. eager or the CPU): no limit."""
        if verify_graph_tokens is None:
            return None
        return verify_graph_tokens // (self.num_speculative_tokens + 1) + 1  # speculates below it

    def as_dict(self) -> dict[str, Any]:
        """The config as JSON-ready values, the unset keys left out (for /admin and logs)."""
        return {k: v for k in KEYS if (v := getattr(self, k)) is not None}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """Check a parsed JSON object. Raises SpeculativeConfigError naming the first wrong field."""
        _check_keys(raw)
        method = _method(raw)
        k = _whole(raw, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, required=True)
        assert k is not None
        disable = _whole(raw, "disable_by_batch_size", 2, None)
        if method == "draft_model":
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if raw.get(key) is not None:
                    _fail(key, "is for method ngram only", "remove it, or set method to ngram")
            return cls("draft_model", k, model=_draft_model(raw), disable_by_batch_size=disable)
        model = raw.get("model")
        if model is not None and model not in NGRAM_MODELS:
            _fail(
                "model",
                f"names a draft model ({model!r}) but method is ngram",
                'remove model, or set method to "draft_model" to draft with that model',
            )
        low = _whole(raw, "prompt_lookup_min", 1, MAX_PROMPT_LOOKUP)
        high = _whole(raw, "prompt_lookup_max", 1, MAX_PROMPT_LOOKUP)
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        assert low is not None and high is not None
        if low > high:
            _fail(
                "prompt_lookup_min",
                f"{low} is above prompt_lookup_max {high}",
                "set prompt_lookup_min <= prompt_lookup_max (the shortest and the longest n-gram matched)",
            )
        return cls("ngram", k, prompt_lookup_min=low, prompt_lookup_max=high, disable_by_batch_size=disable)


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """settings.engine.speculative_config's text -> SpeculativeConfig; None or blank: speculation is off."""
    if text is None or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpeculativeConfigError(
            f"speculative_config: not JSON ({e.msg} at character {e.pos}); pass one JSON object, "
            f"e.g. '{EXAMPLE}'"
        ) from None
    if not isinstance(raw, dict):
        raise SpeculativeConfigError(
            f"speculative_config: a JSON {type(raw).__name__}, not an object; pass one JSON object, "
            f"e.g. '{EXAMPLE}'"
        )
    return SpeculativeConfig.from_dict(raw)


# --------------------------------------------------------------------------- the checks


def _fail(key: str, what: str, fix: str) -> NoReturn:
    raise SpeculativeConfigError(f"speculative_config.{key}: {what}; {fix}")


def _check_keys(raw: dict[str, Any]) -> None:
    for key in raw:
        if key in KEYS:
            continue
        if key in VLLM_KEYS or key.startswith("suffix_decoding_"):
            _fail(key, "is a vLLM setting graphcache does not implement", "remove it")
        near = difflib.get_close_matches(key, KEYS, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        _fail(key, "is not a speculative_config key", f"{hint}the keys are {', '.join(KEYS)}")


def _method(raw: dict[str, Any]) -> SpeculativeMethod:
    method = raw.get("method")
    if method is None:  # vLLM: the model decides
        model = raw.get("model")
        if model is None:
            _fail(
                "method",
                "is missing",
                'set "method": "ngram" (prompt lookup) or "draft_model" (with "model")',
            )
        return "ngram" if model in NGRAM_MODELS else "draft_model"
    if method in NGRAM_MODELS:
        return "ngram"
    if method == "draft_model":
        return "draft_model"
    if method in VLLM_METHODS:
        _fail("method", f"{method!r} is not implemented in graphcache yet", 'use "ngram" or "draft_model"')
    _fail("method", f"{method!r} is not a method", 'use "ngram" or "draft_model"')


def _whole(raw: dict[str, Any], key: str, low: int, high: int | None, required: bool = False) -> int | None:
    value = raw.get(key)
    bounds = f"{low} to {high}" if high is not None else f"{low} or more"
    if value is None:
        if required:
            _fail(key, "is missing", f"set the number of tokens to propose per step ({bounds})")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(key, f"{value!r} is not a whole number", f"set a whole number, {bounds}")
    if value < low or (high is not None and value > high):
        _fail(key, f"{value} is out of range", f"set it to {bounds}")
    return value


def _draft_model(raw: dict[str, Any]) -> str:
    model = raw.get("model")
    if model is None or (isinstance(model, str) and not model.strip()):
        _fail(
            "model",
            "is missing (method draft_model)",
            "name the draft: a local model directory or a hub id (org/name) with the target's tokenizer",
        )
    if not isinstance(model, str):
        _fail("model", f"{model!r} is not a string", "name a local model directory or a hub id (org/name)")
    if model in NGRAM_MODELS:
        _fail("model", f"{model!r} means prompt lookup", 'set "method": "ngram" and leave model out')
    try:  # a path that does not exist is refused now; a hub id is fetched when the engine loads it
        model_source(model)
    except ModelSourceError as e:
        _fail("model", str(e).split(";")[0], "name an existing model directory or a hub id (org/name)")
    return model
