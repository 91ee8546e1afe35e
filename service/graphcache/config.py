"""Settings shared by every floor: env `GRAPHCACHE_*`, CLI flags and defaults in one place.

Settings is grouped by who owns the values: `model` (what runs, where, which kernels), `engine` (batch
limits, KV cache, the step loop), `graph_cache` (capture and cache policy), `http` (the server and what it
accepts) and `logging`. Each section goes whole to its owner. Users see one flat namespace: every section
field is a `GRAPHCACHE_<NAME>` env var, a `graphcache serve --name` flag (cli.py) and a Helm `config` key,
under its flat name (the field's alias where it has one, e.g. `cache_max_entries` for
`graph_cache.max_entries`). A new setting goes into the section of the code that reads it; flat names are
unique across sections (checked when this module is imported).

Defaults run the embedded tiny model on whatever device is there.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from graphcache.choices import (
    AdmissionRule,
    AsyncScheduling,
    AttentionBackend,
    CaptureMode,
    CaptureWarmup,
    DecodeAttentionBackend,
    Device,
    Dtype,
    EvictionPolicy,
    FusedOps,
    LazyPool,
    LogFormat,
    LogLevel,
    Quantization,
    ReasoningParserName,
    ToolCallParserName,
)

__all__ = [
    "GPU_BATCH_DEFAULTS",
    "EngineSettings",
    "GraphCacheSettings",
    "HttpSettings",
    "LoggingSettings",
    "ModelSettings",
    "Settings",
    "SettingsSection",
    "default_capture_sizes",
]

# Batch limits for CUDA devices when the user sets none: the offline benchmark's (BENCHMARKS.md: 33k output
# tok/s for a 0.5B model on the H200 at 256 / 8192; the CPU defaults 64 / 1024 leave it idle).
GPU_BATCH_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default shape: 1, 2, 4, then every 8 up to 256, then every 16 up to max_size."""
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, max_size + 1, 16)]
    return [s for s in sizes if s <= max_size]


# --------------------------------------------------------------------------- value parsing


def _list_text(v: object) -> object:
    """A list from env or a flag as text: `1,2,4` (comma-separated) or JSON (`[1,2,4]`, `null`); "" = []."""
    if not isinstance(v, str):
        return v
    text = v.strip()
    if text.startswith("[") or text == "null":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ValueError("a list is comma-separated (1,2,4) or a JSON list ([1,2,4])") from None
    return [item.strip() for item in text.split(",") if item.strip()]


def _blank_is_unset(v: object) -> object:
    # GRAPHCACHE_MODEL="" (a blank Helm or compose value) means "not set", never Path(".").
    return None if isinstance(v, str) and not v.strip() else v


def _is_ascii_token(v: str) -> bool:
    # HTTP header values are Latin-1 on the wire; curl and most clients send a non-ASCII token as UTF-8
    # bytes, so such a token would match only clients that happen to encode it as the server decodes it.
    return v.isascii() and v.isprintable() and v == v.strip()


def _path_text(v: object) -> object:
    # A directory given as a Path (tests, Settings(model=tmp_path)) is kept as its text; a hub id is text.
    return os.fspath(v) if isinstance(v, os.PathLike) else v


CommaList = BeforeValidator(_list_text)
BlankIsUnset = BeforeValidator(_blank_is_unset)
PathText = BeforeValidator(_path_text)


# --------------------------------------------------------------------------- sections


class SettingsSection(BaseModel):
    """One owner's settings. populate_by_name: a section can be built by field name as well as by flat name;
    hide_input_in_errors: a refused secret is never printed by a ValidationError's str()."""

    model_config = ConfigDict(populate_by_name=True, hide_input_in_errors=True, extra="forbid")


class ModelSettings(SettingsSection):
    """What model runs, where, and which kernels run it: the runner and the model loader read these."""

    path: Annotated[str | None, BlankIsUnset, PathText] = Field(
        None,
        alias="model",
        description="The model: a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) "
        "or a hub id (org/name, fetched into the Hugging Face cache at start: HF_HOME, HF_TOKEN, "
        "HF_HUB_OFFLINE apply). Also `graphcache serve MODEL`. Unset: the embedded tiny model, created on "
        "first use under cache_dir.",
    )
    revision: Annotated[str | None, BlankIsUnset] = Field(
        None,
        description="Branch, tag or commit of a hub model (a commit makes restarts reproducible); "
        "default: the repository's default branch. Not used for a local directory.",
    )
    served_model_name: Annotated[str | None, BlankIsUnset] = Field(
        None, description="Model id in the API; default: the hub id, or the directory's name."
    )
    generation_config: str = Field(
        "auto",
        description="Sampling defaults for requests that leave a field out: auto = the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), vllm = "
        "none (the API's own defaults), or a directory holding a generation_config.json (docs/API.md).",
    )
    dtype: Dtype = Field("auto", description="auto = bfloat16 on CUDA, float32 on CPU.")
    quantization: Quantization = Field(
        "auto",
        description="auto = as the checkpoint is (FP8 checkpoints in the fp8 or compressed-tensors format "
        "serve in FP8); fp8 = quantize a bf16/fp16 checkpoint's linear layers to FP8 on load (per-channel "
        "weight scales, per-token activation scales; CUDA needs compute capability 8.9+).",
    )
    device: Device = Field("auto", description="auto = cuda when available.")
    cache_dir: Path = Field(
        Path.home() / ".cache" / "graphcache", description="Where the tiny model is written."
    )
    seed: int = Field(0, description="Seed for random weights of the tiny model and the default sampler.")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="GPUs one model is split over (tensor parallelism: heads, MLP and vocabulary "
        "sharded, one process per GPU, started by the server itself; gloo processes on the CPU). Must divide the "
        "model's attention heads, KV heads and intermediate size (docs/TENSOR_PARALLEL.md).",
    )
    attention_backend: AttentionBackend = Field(
        "auto",
        description="Attention kernel: auto picks the fastest that runs here; the others force one "
        "(A/B runs) and fail at start if it cannot run.",
    )
    decode_attention_backend: DecodeAttentionBackend = Field(
        "auto",
        description="Kernel of uniform-decode steps: auto = triton on CUDA (paged split-KV), torch on CPU; "
        "varlen = the general attention kernel, as for mixed batches.",
    )
    fused_ops: FusedOps = Field(
        "auto",
        description="auto = on CUDA, one Triton kernel each for residual add + RMSNorm, rotary and "
        "SiLU*mul (a decode step is mostly tiny kernels); off = the PyTorch ops (A/B runs).",
    )

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, v: str) -> str:
        # A directory is checked at start, not on the first request.
        v = v.strip()
        if v in ("auto", "vllm") or (Path(v).expanduser() / "generation_config.json").is_file():
            return v
        raise ValueError(
            f"{v!r} is neither auto, vllm nor a directory holding a generation_config.json; fix the path"
        )


class EngineSettings(SettingsSection):
    """Batch limits, the KV cache and the step loop: the scheduler, the block manager and the engine."""

    max_num_seqs: int = Field(
        64,
        ge=1,
        le=4096,
        description="Requests running at once (decode batch size). "
        "Default 64 on the CPU, 256 on CUDA (GPU_BATCH_DEFAULTS).",
    )
    max_num_batched_tokens: int = Field(
        1024,
        ge=16,
        description="Tokens in one step (prefill chunks + decodes). "
        "Default 1024 on the CPU, 8192 on CUDA (GPU_BATCH_DEFAULTS).",
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Prompt + output tokens; default: the model's."
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV cache block.")
    num_kv_blocks: int | None = Field(
        None,
        ge=2,
        description="KV blocks; default: from kv_cache_memory_fraction "
        "on CUDA, enough for max_num_seqs full sequences on CPU.",
    )
    kv_cache_memory_fraction: float = Field(
        0.5, gt=0, lt=1, description="Share of free GPU memory for the KV cache."
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Share the KV of full blocks between requests with the same prefix (automatic prefix "
        "caching): a new request computes only what is not cached. Off: every prompt is computed in full.",
    )
    max_queue: int = Field(1024, ge=1, description="Waiting requests before new ones get 429.")
    engine_process: bool = Field(
        False,
        description="Run the engine's step loop in a child process (HTTP, tokenizing and detokenizing stay "
        "in the server process), so the two do not share one interpreter lock. Default: on with CUDA at "
        "tensor_parallel_size 1 (H200, 64 streaming clients: +24% tok/s, BENCHMARKS.md §8.5), off on the CPU. "
        "Not with tensor_parallel_size > 1 yet (docs/ARCHITECTURE.md).",
    )
    step_trace: Path | None = Field(
        None,
        description="Benchmarks: keep a timing record of the last 100,000 steps and write it to this "
        "file (JSON lines) when the engine stops (benchmarks/step_trace.py reads it).",
    )
    stream_interval_ms: float = Field(
        20.0,
        ge=0,
        description="Streams get new tokens at most this often (first and last tokens at once); "
        "0 = every step. Fewer, larger chunks keep the event loop ahead of a large batch.",
    )
    async_scheduling: AsyncScheduling = Field(
        "auto",
        description="Schedule and prepare step n+1 while the GPU runs step n (auto = on with CUDA). "
        "Greedy outputs are the same either way; a request that stops at step n wastes one step of work.",
    )


class GraphCacheSettings(SettingsSection):
    """What is captured and how the cache keeps it: the runner and GraphCache. The policy fields are named as
    CachePolicyConfig's (graphs/policy_config.py), which is built from this section by name."""

    enforce_eager: bool = Field(False, description="Never capture; every step runs eagerly.")
    decode_capture_mode: CaptureMode = Field(
        "full",
        description="Uniform-decode captures: full = one CUDA graph with attention inside (needs a "
        "triton/torch decode kernel); breakable = attention as an eager break. Mixed batches are always breakable.",
    )
    capture_sizes: Annotated[list[int] | None, CommaList] = Field(
        None,
        description="Padded batch sizes (tokens) that may be captured; "
        "default: 1,2,4,8..256 by 8, then by 16 up to max_capture_size.",
    )
    max_capture_size: int = Field(256, ge=1, description="Largest capture size; bigger batches run eagerly.")
    # --- mixed steps above max_capture_size: coarse buckets (graphs/descriptor.py mixed_buckets,
    # engine/worker/capture_sizes.py for the default rule, benchmarks/big_steps.py for its measurements) ---
    mixed_capture_sizes: Annotated[list[int] | None, CommaList] = Field(
        None,
        description="Sizes above max_capture_size that mixed (prefill + decode) steps pad to (sizes up to "
        "max_capture_size or past max_num_batched_tokens are ignored). Default: 384, 512, 768, 1024, 1536, ... "
        "(x1.5 / x1.33 apart) up to max_num_batched_tokens, only with CUDA graphs, and "
        "only the buckets whose padded GEMM time stays below an eager step's launch time at this model's size "
        "(larger steps are GPU-bound: a graph saves nothing and padding costs). [] = none.",
    )
    mixed_capture_mode: CaptureMode = Field(
        "full",
        description="Mixed captures: full = one CUDA graph with the unified attention kernel inside "
        "(grid fixed by the descriptor, needs attention kernel triton; others fall back to breakable); "
        "breakable = attention as an eager break, one Python launch per layer.",
    )
    warmup_mixed_sizes: Annotated[list[int] | None, CommaList] = Field(
        None,
        description="Mixed bucket sizes above max_capture_size captured at start (pinned). Default: every "
        "mixed bucket in use. [] = capture them lazily, on misses.",
    )
    warmup_decode_sizes: Annotated[list[int] | None, CommaList] = Field(
        None,
        description="Uniform-decode sizes captured at start (pinned). Default: capture sizes <= max_num_seqs. "
        "[] = none.",
    )
    warmup_descriptors: Annotated[list[str], CommaList] = Field(
        default_factory=list,
        description='Extra descriptors to capture at start, "TOKENS:REQS" (mixed) or "TOKENS:REQS:decode".',
    )
    warmup_profile: Path | None = Field(
        None,
        description="A profile exported by GET /admin/cache/profile (JSON file): warm exactly its "
        "descriptors at start, largest first, within the budgets (instead of warmup_decode_sizes and "
        "warmup_descriptors). An entry the server cannot capture is a startup error.",
    )
    max_entries: int = Field(
        128,
        ge=0,
        alias="cache_max_entries",
        description="Captured graphs kept; evicted beyond (eviction_policy).",
    )
    max_bytes: int = Field(
        4 << 30,
        ge=0,
        alias="cache_max_bytes",
        description="Graph-pool bytes kept (allocator-measured); evicted beyond (eviction_policy).",
    )
    admission: AdmissionRule = Field(
        "auto",
        description="On a miss while serving: auto = capture a uniform-decode descriptor at once and a "
        "mixed one at its N-th miss; always = at once; after_n = at the N-th miss; never = warmup/admin only.",
    )
    admission_min_misses: int = Field(
        2, ge=1, description="N for admission=after_n and for mixed batches under auto."
    )
    capture_time_share: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Lazy captures (misses while serving; each stalls its step) may take at most "
        "this share of serving time; a miss past it is served eagerly and captured later. 1 = no limit.",
    )
    capture_burst_seconds: float = Field(
        0.25,
        ge=0,
        description="Capture seconds lazy captures may spend at once before capture_time_share applies.",
    )
    pin_share: float = Field(
        0.5,
        gt=0,
        le=1,
        alias="cache_pin_share",
        description="Warmup pins at most this share of cache_max_entries and cache_max_bytes; "
        "beyond it warmed graphs stay evictable, so lazy captures always keep room.",
    )
    lazy_pool: LazyPool = Field(
        "shared",
        alias="cache_lazy_pool",
        description="Graph pool of lazily captured (unpinned) graphs: shared = "
        "one pool for all of them, about the size of the largest (graphs never run at once), freed only with its "
        "last graph; private = one pool each, so evicting one frees exactly its bytes, at the sum of their sizes "
        "(docs/graph-pools.md).",
    )
    eviction_policy: EvictionPolicy = Field(
        "lru",
        description="Which unpinned graph the budgets evict: lru = least recently used; gdsf = lowest "
        "(hits + 1) x capture seconds / MiB, aged (docs/graph-pools.md).",
    )
    graph_debug: bool = Field(False, description="Assert input addresses at replay equal those at capture.")
    capture_warmup: CaptureWarmup = Field(
        "per_kernel",
        description="When a capture first runs its step eagerly (so kernels' first-call setup and "
        "Triton compiles stay out of the graph): per_kernel = before the first capture of each kernel family "
        "(uniform decode per split-KV count, mixed), always = before every capture (about twice the capture "
        "time: BENCHMARKS.md §8). A capture that fails without one is retried with one.",
    )

    @field_validator("capture_sizes", "mixed_capture_sizes", "warmup_mixed_sizes")
    @classmethod
    def _sorted_unique(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if v is None:
            return v
        if any(s < 1 for s in v):
            raise ValueError(f"{info.field_name} must be positive integers")
        return sorted(set(v))

    def resolved_capture_sizes(self) -> list[int]:
        return (
            self.capture_sizes
            if self.capture_sizes is not None
            else default_capture_sizes(self.max_capture_size)
        )


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


class HttpSettings(SettingsSection):
    """The HTTP server and what it accepts: the api floor and `graphcache serve`."""

    host: str = Field("127.0.0.1", description="Bind address; 0.0.0.0 in containers.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = any free port).")
    admin_token: Annotated[str | None, BlankIsUnset] = Field(
        None,
        description="Bearer token for /admin/* (printable ASCII, e.g. from `openssl rand -hex 32`). Unset: "
        "admin is off, unless admin_allow_loopback lets loopback clients in.",
    )
    api_key: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="API keys for /v1/*, /tokenize and /detokenize (clients send 'Authorization: Bearer "
        "<key>'): one, or several comma-separated; printable ASCII, e.g. from `openssl rand -hex 32`. "
        "Unset: that API is open. /health, /ready, /ping, /version and /metrics are always open.",
    )
    admin_allow_loopback: bool = Field(
        False, description="Without a token, allow /admin/* from 127.0.0.1/::1."
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long in-flight requests may finish."
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body; bigger gets 413.")
    max_header_bytes: int = Field(
        64 << 10,
        ge=1024,
        alias="http_max_header_bytes",
        description="Largest request head (request line + "
        "headers); a bigger one is answered 431 (httptools) or 400 (h11) and the connection closed.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        alias="http_header_timeout_s",
        description="Seconds a connection may take to send a complete "
        "request head (and an idle keep-alive connection stays open); slower ones are closed, so half-open "
        "connections cannot pile up.",
    )
    max_connections: int = Field(
        1000,
        ge=1,
        alias="http_max_connections",
        description="Open connections at most; past it new requests get "
        "503 at once. Keep it below the process's file-descriptor limit (`ulimit -n`).",
    )
    cors_origins: Annotated[list[str], CommaList] = Field(
        default_factory=list, description="CORS allowed origins; empty = CORS off."
    )
    allow_special_tokens_in_chat: bool = Field(
        False,
        description="Encode special-token strings inside chat message content as control tokens. Off: "
        "content is always plain text, so a user cannot open a fake system turn (set only for trusted clients).",
    )
    tool_call_parser: ToolCallParserName = Field(
        "hermes",
        description='How chat answers are read back into tool_calls (and what tool_choice "required" or a '
        "named function forces): hermes (<tool_call> blocks: Qwen, Hermes), llama3_json (JSON calls, "
        "optionally after <|python_tag|>: Llama 3.1-3.3), mistral ([TOOL_CALLS] [...]). Match the model's chat template.",
    )
    reasoning_parser: ReasoningParserName = Field(
        "none",
        description="Split a chat answer's <think>...</think> into reasoning_content: deepseek_r1 (the "
        "template opens <think>, so text before </think> is reasoning) or qwen3 (reasoning only inside "
        "<think>...</think>); none keeps all text in content.",
    )

    chat_template: Annotated[str | None, BlankIsUnset] = Field(
        None,
        description="The chat template for every chat request without its own: a file path (.jinja) "
        "or the jinja template itself. Unset: the model's (chat_template.jinja or tokenizer_config.json, "
        "else ChatML).",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_or_file(cls, v: str | None) -> str | None:
        # A value without jinja markers names a file: a typo is refused at start, not on the first chat.
        if v is not None and "{" not in v and not Path(v).expanduser().is_file():
            raise ValueError(f"{v!r} is not a readable file (nor a jinja template); fix the path")
        return v

    @field_validator("admin_token")
    @classmethod
    def _ascii_token(cls, v: str | None) -> str | None:
        # Refused at start, without echoing the secret.
        if v is not None and not _is_ascii_token(v):
            raise ValueError(
                "admin_token must be printable ASCII without leading or trailing spaces (HTTP "
                "header values are Latin-1 on the wire, and clients send other characters "
                "differently): use ASCII characters, e.g. a hex token from `openssl rand -hex 32`"
            )
        return v

    @field_validator("api_key", mode="before")
    @classmethod
    def _api_keys(cls, v: object) -> list[str] | None:
        # GRAPHCACHE_API_KEY=k1,k2 or --api-key k1,k2: one key or several, comma-separated. NoDecode and no
        # JSON here: any ASCII key (even "null" or "[1]") is taken as written.
        if isinstance(v, str):
            v = v.split(",")
        if v is None:
            return None
        if not isinstance(v, list | tuple) or not all(isinstance(k, str) for k in v):
            raise ValueError(
                "api_key must be one key or several comma-separated keys of printable ASCII text"
            )
        keys = [k.strip() for k in v if k.strip()]
        if not keys:
            # Set, but blank (GRAPHCACHE_API_KEY="", " " or ","): an open API nobody asked for. Refused at
            # start rather than served open without a word.
            raise ValueError(
                "api_key is set but holds no key (blank, or only commas and spaces): set a key, "
                "e.g. from `openssl rand -hex 32`, or unset GRAPHCACHE_API_KEY (--api-key) to leave "
                "the API open"
            )
        if not all(_is_ascii_token(key) for key in keys):
            raise ValueError(
                "api_key must be printable ASCII (HTTP header values are Latin-1 on the wire, "
                "and clients send other characters differently): use ASCII characters, e.g. "
                "a hex key from `openssl rand -hex 32`"
            )
        return keys


class LoggingSettings(SettingsSection):
    """How the server logs: set up once per process (server, engine process, tensor-parallel ranks)."""

    log_format: LogFormat = Field("text", description="text for people, json for log pipelines.")
    log_level: LogLevel = Field("info", description="Root log level.")


SECTIONS: dict[str, type[SettingsSection]] = {
    "model": ModelSettings,
    "engine": EngineSettings,
    "graph_cache": GraphCacheSettings,
    "grammar": GrammarSettings,
    "http": HttpSettings,
    "logging": LoggingSettings,
}


@cache
def _flat_names() -> dict[str, tuple[str, str, FieldInfo]]:
    """flat name -> (section, field name, field), in declaration order."""
    names: dict[str, tuple[str, str, FieldInfo]] = {}
    for section, model in SECTIONS.items():
        for field_name, field in model.model_fields.items():
            flat = field.alias or field_name
            if flat in names:
                raise TypeError(
                    f"setting {flat!r} is declared in both {names[flat][0]} and {section}: flat "
                    "names are env vars and flags, so each must be unique"
                )
            names[flat] = (section, field_name, field)
    return names


_flat_names()  # a duplicate flat name fails at import, not at the first Settings()


# --------------------------------------------------------------------------- flat env


class FlatEnvSource(PydanticBaseSettingsSource):
    """GRAPHCACHE_<FLAT NAME> for every section field, as text (case-insensitive, as pydantic-settings reads
    env): each field's own validators parse it, so lists take `1,2,4` as well as JSON."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads every flat name at once

    def __call__(self) -> dict[str, Any]:
        prefix = self.config.get("env_prefix", "").lower()
        env = {k.lower(): v for k, v in os.environ.items()}
        return {flat: env[prefix + flat] for flat in _flat_names() if prefix + flat in env}


# --------------------------------------------------------------------------- Settings


class Settings(BaseSettings):
    """Built from flat names (`Settings(max_num_seqs=8)`, env, flags) or whole sections
    (`Settings(http=HttpSettings(port=0))`); read by section (`settings.engine.max_num_seqs`).
    Precedence: keyword arguments (the CLI's flags) > env > defaults."""

    # hide_input_in_errors: a refused admin_token must not be printed by a ValidationError's str().
    model_config = SettingsConfigDict(env_prefix="GRAPHCACHE_", extra="ignore", hide_input_in_errors=True)

    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    graph_cache: GraphCacheSettings = Field(default_factory=GraphCacheSettings)
    grammar: GrammarSettings = Field(default_factory=GrammarSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, FlatEnvSource(settings_cls)

    @classmethod
    def flat_fields(cls) -> dict[str, FieldInfo]:
        """Every setting by its flat name (env var without the prefix, flag, Helm key), in declaration order."""
        return {flat: field for flat, (_, _, field) in _flat_names().items()}

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        """Flat names into their sections; a whole section (a dict or a section) is taken as given."""
        if not isinstance(data, dict):
            return data
        flat = _flat_names()
        nested: dict[str, Any] = {name: {} for name in SECTIONS}
        for key, value in data.items():
            if key in SECTIONS and isinstance(value, dict | SettingsSection):
                section = (
                    value.model_dump(exclude_unset=True) if isinstance(value, SettingsSection) else value
                )
                nested[key].update(section)
            elif key in flat:
                section, field_name, _ = flat[key]
                nested[section][field_name] = value
        return nested

    @model_validator(mode="after")
    def _check(self) -> Settings:
        # The rules that span sections, once: the device decides the engine's defaults, which the batch
        # limits are checked against.
        self._gpu_defaults()
        engine = self.engine
        if engine.max_num_batched_tokens < engine.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per sequence)")
        if engine.engine_process and self.model.tensor_parallel_size > 1:
            raise ValueError(
                "engine_process does not support tensor_parallel_size > 1 yet: set "
                "GRAPHCACHE_ENGINE_PROCESS=false (--no-engine-process) to split the model, or "
                "GRAPHCACHE_TENSOR_PARALLEL_SIZE=1 to run the engine in its own process"
            )
        return self

    def _gpu_defaults(self) -> None:
        """On CUDA, engine settings not set by the user take their GPU defaults: the batch limits
        GPU_BATCH_DEFAULTS (measured on the H200; the CPU defaults would leave a GPU mostly idle), and
        engine_process on at tensor parallel size 1 (the step loop outruns one interpreter shared with the
        HTTP server). The device is probed only when it matters: device=auto and at least one of these left
        to its default."""
        engine, given = self.engine, self.engine.model_fields_set
        unset = [f for f in GPU_BATCH_DEFAULTS if f not in given]
        process = "engine_process" not in given and self.model.tensor_parallel_size == 1
        if (not unset and not process) or self.model.device == "cpu":
            return
        if self.model.device == "auto":
            import torch  # config floor: only the probe needs it, and only here

            if not torch.cuda.is_available():
                return
        for name in unset:
            value = GPU_BATCH_DEFAULTS[name]
            if name == "max_num_seqs":  # never more rows than an explicit token budget allows
                value = min(value, engine.max_num_batched_tokens)
            object.__setattr__(engine, name, value)
        if process:
            object.__setattr__(engine, "engine_process", True)

    def updated(self, **flat: Any) -> Settings:
        """A copy with some settings replaced by flat name, unvalidated (as model_copy(update=...)): for
        values the server itself fills in (the bound port, the written tiny model) and for benchmarks."""
        names = _flat_names()
        unknown = sorted(set(flat) - set(names))
        if unknown:
            raise TypeError(f"unknown settings {unknown}; the settings are {', '.join(names)}")
        sections: dict[str, dict[str, Any]] = {}
        for key, value in flat.items():
            section, field_name, _ = names[key]
            sections.setdefault(section, {})[field_name] = value
        return self.model_copy(
            update={name: getattr(self, name).model_copy(update=update) for name, update in sections.items()}
        )
