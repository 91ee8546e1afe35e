"""GraphCacheSettings (`settings.graph_cache`): what is captured and how the cache keeps it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator

from graphcache.choices import (
    AdmissionRule,
    CaptureMode,
    CaptureWarmup,
    EvictionPolicy,
    LazyPool,
)
from graphcache.settings.section import CommaList, SettingsSection

__all__ = ["GraphCacheSettings", "default_capture_sizes"]


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default shape: 1, 2, 4, then every 8 up to 256, then every 16 up to max_size."""
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, max_size + 1, 16)]
    return [s for s in sizes if s <= max_size]


class GraphCacheSettings(SettingsSection):
    """What is captured and how the cache keeps it: the runner and GraphCache. The policy fields are named as
    CachePolicyConfig's (graphs/policy/config.py), which is built from this section by name."""

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
    max_capture_size: int = Field(
        256,
        ge=1,
        description="Largest capture size; bigger batches run eagerly. The default follows the device "
        "(config.py's GPU defaults); on GPUs of 70 GiB or more it is max_num_seqs, up to 512.",
    )
    # --- mixed steps above max_capture_size: coarse buckets (graphs/descriptor.py mixed_buckets,
    # engine/worker/capture_sizes.py for the default rule, benchmarks/big_steps.py for its measurements) ---
    mixed_capture_sizes: Annotated[list[int] | None, CommaList] = Field(
        None,
        description="Sizes above max_capture_size that mixed (prefill + decode) steps pad to (sizes up to "
        "max_capture_size or past max_num_batched_tokens are ignored). Default: 384, 512, 768, 1024, 1536, ... "
        "(x1.5 / x1.33 apart) up to max_num_batched_tokens, only with CUDA graphs, and "
        "only the buckets whose padded GEMM time stays below an eager step's launch time at this model's size "
        "(larger steps are GPU-bound: a graph saves nothing and padding costs); per-row FP8 weights take every "
        "bucket (their eager steps stay host-bound). [] = none.",
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
        "mixed bucket in use; with CUDA graphs and none in use, one mixed graph of max_capture_size tokens (its "
        "capture compiles the mixed step's kernels before serving). [] = capture them lazily, on misses.",
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
