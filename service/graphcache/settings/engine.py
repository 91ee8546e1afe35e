"""EngineSettings (`settings.engine`): batch limits, the KV cache and the step loop."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from graphcache.choices import AsyncScheduling, SchedulingPolicy
from graphcache.kv_events.config import parse_kv_events_config
from graphcache.settings.section import BlankIsUnset, SettingsSection

__all__ = ["EngineSettings"]


class EngineSettings(SettingsSection):
    """Batch limits, the KV cache and the step loop: the scheduler, the block manager and the engine."""

    max_num_seqs: int = Field(
        64,
        ge=1,
        le=4096,
        description="Requests running at once (decode batch size); the default follows the device "
        "(config.py's GPU defaults).",
    )
    max_num_batched_tokens: int = Field(
        1024,
        ge=16,
        description="Tokens in one step (prefill chunks + decodes); the default follows the device "
        "(config.py's GPU defaults).",
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Prompt + output tokens; default: the model's."
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV cache block.")
    num_kv_blocks: int | None = Field(
        None,
        ge=2,
        description="KV blocks (vLLM's --num-gpu-blocks-override); default: from gpu_memory_utilization "
        "or kv_cache_memory_fraction on CUDA, enough for max_num_seqs full sequences on CPU.",
    )
    kv_cache_memory_fraction: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="Share of the GPU memory free after the weights that the KV cache takes "
        "(unless gpu_memory_utilization is set).",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM's --gpu-memory-utilization: the share of the GPU's total memory this server may "
        "use (weights, activations, graph pools and KV cache together); the KV cache gets what is left of it. "
        "Set instead of kv_cache_memory_fraction, not with it; num_kv_blocks overrides both. "
        "Unset: kv_cache_memory_fraction sizes the KV cache. No effect on the CPU.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Share the KV of full blocks between requests with the same prefix (automatic prefix "
        "caching): a new request computes only what is not cached. Off: every prompt is computed in full.",
    )
    max_queue: int = Field(1024, ge=1, description="Waiting requests before new ones get 429.")
    scheduling_policy: SchedulingPolicy = Field(
        "fcfs",
        description="fcfs: first come, first served. priority: by the request's `priority` (lower first, "
        "ties by arrival), and a preemption evicts the lowest-priority running request (vLLM's meaning).",
    )
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
    bf16_small_gemm: bool = Field(
        True,
        description="Decode-sized steps (1-64 rows) of a 16-bit model run their linear layers through "
        "model/bf16_gemv.py's Triton kernel (W read once for all rows, silu * up in the gate_up GEMM) where "
        "it measured faster than cuBLAS (its TILES table); CUDA, tensor_parallel_size 1. false: cuBLAS only.",
    )
    speculative_config: Annotated[str | None, BlankIsUnset] = Field(
        None,
        description="Speculative decoding, as vLLM's --speculative-config: one JSON object, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
        '\'{"method": "draft_model", "model": "DIR or org/name", "num_speculative_tokens": 4}\' '
        "(keys: method, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, "
        "disable_by_batch_size; engine/spec/config.py). Unset: off.",
    )
    speculative_token_cost: float | None = Field(
        None,
        ge=0,
        description="Speculative decoding's turn-off rule (engine/spec/acceptance.py): what one draft token "
        "costs (verifying it, and drafting it with a draft model), as a share of a plain decode step. A "
        "request whose measured acceptance rate (accepted / draft tokens) is at or below it stops drafting; "
        "0: never (the rule is off). Unset: 0.1 for ngram, 0.3 for draft_model (docs/DEPLOY.md has the measured costs).",
    )
    speculative_step_payoff: bool = Field(
        True,
        description="Speculative decoding: a step speculates only where steps that speculate have been "
        "measured on this server to emit more tokens per second than plain steps at the same batch size "
        "(engine/spec/payoff.py: a few plain steps in a row now and then keep the measure fresh); false: "
        "every step that may speculate does.",
    )
    speculative_judge_drafts: int = Field(
        8,
        ge=1,
        description="Speculative decoding: verify steps with drafts before a request's acceptance is judged "
        "(its judgment follows about this many of its latest drafts).",
    )
    speculative_reprobe_steps: int = Field(
        64,
        ge=0,
        description="Speculative decoding: decode steps a request turned off by its acceptance waits before "
        "it drafts again to be judged anew (doubling after each failed probe, up to 8x); 0: it stays off.",
    )

    kv_events_config: Annotated[str | None, BlankIsUnset] = Field(
        None,
        description="KV cache events for a KV-aware router, as vLLM's --kv-events-config: one JSON object, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (keys: enable_kv_cache_events, publisher, endpoint, '
        "replay_endpoint, buffer_steps, hwm, max_queue_size, topic; kv_events/config.py). Unset: off.",
    )

    @model_validator(mode="after")
    def _one_kv_budget(self) -> EngineSettings:
        # Two ways to size the same cache: the one the user set is the one meant, so both is a mistake.
        if self.gpu_memory_utilization is not None and "kv_cache_memory_fraction" in self.model_fields_set:
            raise ValueError(
                "gpu_memory_utilization and kv_cache_memory_fraction both size the KV cache: set one "
                "(gpu_memory_utilization is vLLM's share of the whole GPU, kv_cache_memory_fraction the "
                "share of the memory left after the weights)"
            )
        return self

    @field_validator("kv_events_config")
    @classmethod
    def _kv_events_json(cls, v: str | None) -> str | None:
        parse_kv_events_config(v)  # ValueError names the key and the fix
        return v

    @field_validator("speculative_config")
    @classmethod
    def _one_json_object(cls, v: str | None) -> str | None:
        # Only the JSON's shape here: its keys are checked by engine/spec/config.py, on the engine's floor.
        if v is None:
            return None
        try:
            value = json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"not JSON ({e.msg} at character {e.pos}); pass one JSON object, e.g. "
                '\'{"method": "ngram", "num_speculative_tokens": 4}\''
            ) from None
        if not isinstance(value, dict):
            raise ValueError(f"a JSON {type(value).__name__}, not an object; pass one JSON object ({{...}})")
        return v
