"""Settings shared by every floor: env `GRAPHCACHE_*`, CLI flags and defaults in one place.

Every field here is also a `graphcache serve --flag` (see cli.py) and a Helm value.
Defaults run the embedded tiny model on whatever device is there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# Batch limits for CUDA devices when the user sets none: the offline benchmark's (BENCHMARKS.md §6:
# 33k output tok/s for a 0.5B model on the H200 at 256 / 8192; the CPU defaults 64 / 1024 leave it idle).
GPU_BATCH_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default shape: 1, 2, 4, then every 8 up to 256, then every 16 up to max_size."""
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, max_size + 1, 16)]
    return [s for s in sizes if s <= max_size]


class Settings(BaseSettings):
    # hide_input_in_errors: a refused admin_token must not be printed by a ValidationError's str().
    model_config = SettingsConfigDict(env_prefix="GRAPHCACHE_", extra="ignore", hide_input_in_errors=True)

    # --- model ---
    model: Path | None = Field(
        None, description="Hugging Face model directory (config.json, *.safetensors, tokenizer.json). "
        "Unset: the embedded tiny model, created on first use under cache_dir.")
    served_model_name: str | None = Field(None, description="Model id in the API; default: the directory name.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="auto = bfloat16 on CUDA, float32 on CPU.")
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="auto = cuda when available.")
    cache_dir: Path = Field(Path.home() / ".cache" / "graphcache", description="Where the tiny model is written.")
    seed: int = Field(0, description="Seed for random weights of the tiny model and the default sampler.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPUs one model is split over (tensor parallelism: heads, MLP and vocabulary "
        "sharded, one process per GPU, started by the server itself; gloo processes on the CPU). Must divide the "
        "model's attention heads, KV heads and intermediate size (docs/TENSOR_PARALLEL.md).")

    # --- engine ---
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Requests running at once (decode batch size). "
                              "Default 64 on the CPU, 256 on CUDA (GPU_BATCH_DEFAULTS).")
    max_num_batched_tokens: int = Field(1024, ge=16, description="Tokens in one step (prefill chunks + decodes). "
                                        "Default 1024 on the CPU, 8192 on CUDA (GPU_BATCH_DEFAULTS).")
    max_model_len: int | None = Field(None, ge=16, description="Prompt + output tokens; default: the model's.")
    block_size: int = Field(16, ge=1, description="Tokens per KV cache block.")
    num_kv_blocks: int | None = Field(None, ge=2, description="KV blocks; default: from kv_cache_memory_fraction "
                                      "on CUDA, enough for max_num_seqs full sequences on CPU.")
    kv_cache_memory_fraction: float = Field(0.5, gt=0, lt=1, description="Share of free GPU memory for the KV cache.")
    enable_prefix_caching: bool = Field(
        True, description="Share the KV of full blocks between requests with the same prefix (automatic prefix "
        "caching): a new request computes only what is not cached. Off: every prompt is computed in full.")
    max_queue: int = Field(1024, ge=1, description="Waiting requests before new ones get 429.")
    engine_process: bool = Field(
        False, description="Run the engine's step loop in a child process (HTTP, tokenizing and detokenizing stay "
        "in the server process), so the two do not share one interpreter lock. Default: on with CUDA at "
        "tensor_parallel_size 1 (H200, 64 streaming clients: +24% tok/s, BENCHMARKS.md §8.5), off on the CPU. "
        "Not with tensor_parallel_size > 1 yet (docs/ARCHITECTURE.md).")
    enforce_eager: bool = Field(False, description="Never capture; every step runs eagerly.")
    step_trace: Path | None = Field(
        None, description="Benchmarks: keep a timing record of the last 100,000 steps and write it to this "
        "file (JSON lines) when the engine stops (benchmarks/step_trace.py reads it).")
    allow_special_tokens_in_chat: bool = Field(
        False, description="Encode special-token strings inside chat message content as control tokens. Off: "
        "content is always plain text, so a user cannot open a fake system turn (set only for trusted clients).")
    attention_backend: Literal["auto", "sdpa", "flash", "flash_paged", "triton"] = Field(
        "auto", description="Attention kernel: auto picks the fastest that runs here; the others force one "
        "(A/B runs) and fail at start if it cannot run.")
    stream_interval_ms: float = Field(
        20.0, ge=0, description="Streams get new tokens at most this often (first and last tokens at once); "
        "0 = every step. Fewer, larger chunks keep the event loop ahead of a large batch.")
    async_scheduling: Literal["auto", "on", "off"] = Field(
        "auto", description="Schedule and prepare step n+1 while the GPU runs step n (auto = on with CUDA). "
        "Greedy outputs are the same either way; a request that stops at step n wastes one step of work.")
    decode_attention_backend: Literal["auto", "triton", "torch", "varlen"] = Field(
        "auto", description="Kernel of uniform-decode steps: auto = triton on CUDA (paged split-KV), torch on CPU; "
        "varlen = the general attention kernel, as for mixed batches.")
    fused_ops: Literal["auto", "off"] = Field(
        "auto", description="auto = on CUDA, one Triton kernel each for residual add + RMSNorm, rotary and "
        "SiLU*mul (a decode step is mostly tiny kernels); off = the PyTorch ops (A/B runs).")
    decode_capture_mode: Literal["full", "breakable"] = Field(
        "full", description="Uniform-decode captures: full = one CUDA graph with attention inside (needs a "
        "triton/torch decode kernel); breakable = attention as an eager break. Mixed batches are always breakable.")

    # --- graph cache ---
    capture_sizes: list[int] | None = Field(None, description="Padded batch sizes (tokens) that may be captured; "
                                            "default: 1,2,4,8..256 by 8, then by 16 up to max_capture_size.")
    max_capture_size: int = Field(256, ge=1, description="Largest capture size; bigger batches run eagerly.")
    # --- mixed steps above max_capture_size: coarse buckets (graphs/descriptor.py mixed_buckets,
    # engine/worker/capture_sizes.py for the default rule, benchmarks/big_steps.py for its measurements) ---
    mixed_capture_sizes: list[int] | None = Field(
        None, description="Sizes above max_capture_size that mixed (prefill + decode) steps pad to (sizes up to "
        "max_capture_size or past max_num_batched_tokens are ignored). Default: 384, 512, 768, 1024, 1536, ... "
        "(x1.5 / x1.33 apart) up to max_num_batched_tokens, only with CUDA graphs, and "
        "only the buckets whose padded GEMM time stays below an eager step's launch time at this model's size "
        "(larger steps are GPU-bound: a graph saves nothing and padding costs). [] = none.")
    mixed_capture_mode: Literal["full", "breakable"] = Field(
        "full", description="Mixed captures: full = one CUDA graph with the unified attention kernel inside "
        "(grid fixed by the descriptor, needs attention kernel triton; others fall back to breakable); "
        "breakable = attention as an eager break, one Python launch per layer.")
    warmup_mixed_sizes: list[int] | None = Field(
        None, description="Mixed bucket sizes above max_capture_size captured at start (pinned). Default: every "
        "mixed bucket in use. [] = capture them lazily, on misses.")
    warmup_decode_sizes: list[int] | None = Field(
        None, description="Uniform-decode sizes captured at start (pinned). Default: capture sizes <= max_num_seqs. "
        "[] = none.")
    warmup_descriptors: list[str] = Field(
        default_factory=list, description='Extra descriptors to capture at start, "TOKENS:REQS" (mixed) '
        'or "TOKENS:REQS:decode".')
    warmup_profile: Path | None = Field(
        None, description="A profile exported by GET /admin/cache/profile (JSON file): warm exactly its "
        "descriptors at start, largest first, within the budgets (instead of warmup_decode_sizes and "
        "warmup_descriptors). An entry the server cannot capture is a startup error.")
    cache_max_entries: int = Field(128, ge=0, description="Captured graphs kept; evicted beyond (eviction_policy).")
    cache_max_bytes: int = Field(4 << 30, ge=0, description="Graph-pool bytes kept (allocator-measured); evicted beyond (eviction_policy).")
    admission: Literal["auto", "always", "after_n", "never"] = Field(
        "auto", description="On a miss while serving: auto = capture a uniform-decode descriptor at once and a "
        "mixed one at its N-th miss; always = at once; after_n = at the N-th miss; never = warmup/admin only.")
    admission_min_misses: int = Field(2, ge=1, description="N for admission=after_n and for mixed batches under auto.")
    capture_time_share: float = Field(
        0.1, gt=0, le=1, description="Lazy captures (misses while serving; each stalls its step) may take at most "
        "this share of serving time; a miss past it is served eagerly and captured later. 1 = no limit.")
    capture_burst_seconds: float = Field(
        0.25, ge=0, description="Capture seconds lazy captures may spend at once before capture_time_share applies.")
    cache_pin_share: float = Field(0.5, gt=0, le=1, description="Warmup pins at most this share of "
                                   "cache_max_entries and cache_max_bytes; beyond it warmed graphs stay evictable, "
                                   "so lazy captures always keep room.")
    cache_lazy_pool: Literal["shared", "private"] = Field(
        "shared", description="Graph pool of lazily captured (unpinned) graphs: shared = one pool for all of them, "
        "about the size of the largest (graphs never run at once), freed only with its last graph; private = one "
        "pool each, so evicting one frees exactly its bytes, at the sum of their sizes (docs/graph-pools.md).")
    eviction_policy: Literal["lru", "gdsf"] = Field(
        "lru", description="Which unpinned graph the budgets evict: lru = least recently used; gdsf = lowest "
        "(hits + 1) x capture seconds / MiB, aged (docs/graph-pools.md).")
    graph_debug: bool = Field(False, description="Assert input addresses at replay equal those at capture.")
    capture_warmup: Literal["per_kernel", "always"] = Field(
        "per_kernel", description="When a capture first runs its step eagerly (so kernels' first-call setup and "
        "Triton compiles stay out of the graph): per_kernel = before the first capture of each kernel family "
        "(uniform decode per split-KV count, mixed), always = before every capture (about twice the capture "
        "time: BENCHMARKS.md §8). A capture that fails without one is retried with one.")

    # --- structured output (grammar compiling and masking; docs/RELIABILITY.md, "Structured output limits") ---
    grammar_compile_threads: int = Field(
        2, ge=1, le=64, description="Threads that compile output constraints (schemas, regexes, grammars) and "
        "their first masks, off the event loop and the engine thread.")
    grammar_compile_queue: int = Field(
        64, ge=0, description="Constraints that may wait for a compile thread; more get 429.")
    grammar_compile_stack_mib: int = Field(
        256, ge=8, le=4096, description="Stack of each compile thread (MiB, reserved, touched only as used): the "
        "grammar library recurses natively, and a deep input on a default 8 MiB stack kills the process.")
    grammar_max_depth: int = Field(
        128, ge=4, description="Deepest constraint compiled: JSON nesting and $ref chain of a schema, rule "
        "chain of a grammar, group nesting of a regex. Deeper: 400.")
    grammar_lexer_fuel: int = Field(
        100_000, ge=1000, description="Lexer fuel of one constraint (llguidance's initial_lexer_fuel, default 1M): "
        "a regex bomb such as a{1000}{1000} or x{100000} runs out of it and is refused (400) after ~0.3 s of "
        "lexing instead of seconds; schemas with long strings, big enums and formats need far less.")
    grammar_compile_budget_ms: float = Field(
        2000.0, gt=0, description="Most time compiling a constraint and its first two masks may take; slower: 400.")
    grammar_mask_ms_per_token: float = Field(
        10.0, gt=0, description="Most mask time per token a constrained request may cost the engine thread (mean "
        "over grammar_mask_window timed tokens, measured once its step's masks took longer than this); past it "
        "the request ends with finish_reason error.")
    grammar_mask_window: int = Field(
        8, ge=1, description="Tokens a request's mask cost is averaged over before it is ended or cleared.")
    grammar_cache_entries: int = Field(128, ge=1, description="Compiled constraints kept for reuse (LRU).")
    grammar_cache_bytes: int = Field(
        512 << 20, ge=0, description="Estimated bytes of compiled constraints kept (LRU beyond; one larger than this "
        "is not kept): the heap growth while each compiled (metric graphcache_grammar_cache_bytes).")

    # --- HTTP ---
    host: str = Field("127.0.0.1", description="Bind address; 0.0.0.0 in containers.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = any free port).")
    admin_token: str | None = Field(None, description="Bearer token for /admin/* (printable ASCII, e.g. from "
                                    "`openssl rand -hex 32`). Unset: admin is off, "
                                    "unless admin_allow_loopback lets loopback clients in.")
    api_key: Annotated[list[str] | None, NoDecode] = Field(
        None, description="API keys for /v1/*, /tokenize and /detokenize (clients send 'Authorization: Bearer "
        "<key>'): one, or several comma-separated; printable ASCII, e.g. from `openssl rand -hex 32`. "
        "Unset: that API is open. /health, /ready, /ping, /version and /metrics are always open.")

    @field_validator("api_key", mode="before")
    @classmethod
    def _api_keys(cls, v: object) -> list[str] | None:
        # GRAPHCACHE_API_KEY=k1,k2 or --api-key k1,k2: one key or several, comma-separated. NoDecode: env
        # text is never read as JSON, so any ASCII key (even "null" or "1.5") is taken as written.
        if isinstance(v, str):
            v = v.split(",")
        if v is None:
            return None
        if not isinstance(v, list | tuple) or not all(isinstance(k, str) for k in v):
            raise ValueError("api_key must be one key or several comma-separated keys of printable ASCII text")
        keys = [k.strip() for k in v if k.strip()]
        if not keys:
            # Set, but blank (GRAPHCACHE_API_KEY="", " " or ","): an open API nobody asked for. Refused at
            # start rather than served open without a word.
            raise ValueError("api_key is set but holds no key (blank, or only commas and spaces): set a key, "
                             "e.g. from `openssl rand -hex 32`, or unset GRAPHCACHE_API_KEY (--api-key) to leave "
                             "the API open")
        for key in keys:
            try:
                cls._ascii_token(key)   # the admin token's rule: printable ASCII, no surrounding spaces
            except ValueError:
                raise ValueError("api_key must be printable ASCII (HTTP header values are Latin-1 on the wire, "
                                 "and clients send other characters differently): use ASCII characters, e.g. "
                                 "a hex key from `openssl rand -hex 32`") from None
        return keys
    admin_allow_loopback: bool = Field(False, description="Without a token, allow /admin/* from 127.0.0.1/::1.")
    log_format: Literal["text", "json"] = Field("text", description="text for people, json for log pipelines.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Root log level.")
    drain_timeout_s: float = Field(30.0, ge=0, description="On SIGTERM, how long in-flight requests may finish.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body; bigger gets 413.")
    http_max_header_bytes: int = Field(
        64 << 10, ge=1024, description="Largest request head (request line + headers); a bigger one is "
        "answered 431 (httptools) or 400 (h11) and the connection closed.")
    http_header_timeout_s: float = Field(
        10.0, gt=0, description="Seconds a connection may take to send a complete request head (and an idle "
        "keep-alive connection stays open); slower ones are closed, so half-open connections cannot pile up.")
    http_max_connections: int = Field(
        1000, ge=1, description="Open connections at most; past it new requests get 503 at once. Keep it "
        "below the process's file-descriptor limit (`ulimit -n`).")
    cors_origins: list[str] = Field(default_factory=list, description="CORS allowed origins; empty = CORS off.")

    @field_validator("model", "admin_token", "served_model_name", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: object) -> object:
        # GRAPHCACHE_MODEL="" (a blank Helm or compose value) means "not set", never Path(".").
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("admin_token")
    @classmethod
    def _ascii_token(cls, v: str | None) -> str | None:
        # HTTP header values are Latin-1 on the wire; curl and most clients send a non-ASCII token as
        # UTF-8 bytes, so such a token would match only clients that happen to encode it as the server
        # decodes it. Refused at start instead, without echoing the secret.
        if v is not None and not (v.isascii() and v.isprintable() and v == v.strip()):
            raise ValueError("admin_token must be printable ASCII without leading or trailing spaces (HTTP "
                             "header values are Latin-1 on the wire, and clients send other characters "
                             "differently): use ASCII characters, e.g. a hex token from `openssl rand -hex 32`")
        return v

    @field_validator("capture_sizes", "mixed_capture_sizes", "warmup_mixed_sizes")
    @classmethod
    def _sorted_unique(cls, v: list[int] | None, info) -> list[int] | None:
        if v is None:
            return v
        if any(s < 1 for s in v):
            raise ValueError(f"{info.field_name} must be positive integers")
        return sorted(set(v))

    @model_validator(mode="after")
    def _check(self) -> Settings:
        self._gpu_defaults()
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per sequence)")
        if self.engine_process and self.tensor_parallel_size > 1:
            raise ValueError("engine_process does not support tensor_parallel_size > 1 yet: set "
                             "GRAPHCACHE_ENGINE_PROCESS=false (--no-engine-process) to split the model, or "
                             "GRAPHCACHE_TENSOR_PARALLEL_SIZE=1 to run the engine in its own process")
        return self

    def _gpu_defaults(self) -> None:
        """On CUDA, settings not set by the user take their GPU defaults: the batch limits
        GPU_BATCH_DEFAULTS (measured on the H200: BENCHMARKS.md §6; the CPU defaults would leave a GPU
        mostly idle), and engine_process on at tensor parallel size 1 (§8.5: the step loop outruns one
        interpreter shared with the HTTP server). The device is probed only when it matters: device=auto
        and at least one of these left to its default."""
        unset = [f for f in GPU_BATCH_DEFAULTS if f not in self.model_fields_set]
        process = "engine_process" not in self.model_fields_set and self.tensor_parallel_size == 1
        if (not unset and not process) or self.device == "cpu":
            return
        if self.device == "auto":
            import torch  # config floor: only the probe needs it, and only here

            if not torch.cuda.is_available():
                return
        for name in unset:
            value = GPU_BATCH_DEFAULTS[name]
            if name == "max_num_seqs":   # never more rows than an explicit token budget allows
                value = min(value, self.max_num_batched_tokens)
            object.__setattr__(self, name, value)
        if process:
            object.__setattr__(self, "engine_process", True)

    def resolved_capture_sizes(self) -> list[int]:
        return self.capture_sizes if self.capture_sizes is not None else default_capture_sizes(self.max_capture_size)
