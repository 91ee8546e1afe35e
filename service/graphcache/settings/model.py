"""ModelSettings (`settings.model`): what model runs, where, and which kernels run it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator

from graphcache.choices import (
    AttentionBackend,
    DecodeAttentionBackend,
    Device,
    Dtype,
    FusedOps,
    KvCacheDtype,
    PrefillAttention,
    Quantization,
    RunnerKind,
)
from graphcache.settings.section import BlankIsUnset, PathText, SettingsSection

__all__ = ["POOLER_TYPES", "ModelSettings"]

POOLER_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's pooling_type names graphcache serves (choices.PoolingMode)


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
    runner: RunnerKind = Field(
        "auto",
        description="What the model serves, as vLLM's --runner: generate = text (/v1/completions, chat), pooling "
        "= embeddings (/v1/embeddings; vLLM's --convert embed and --task embed mean the same); auto = pooling "
        "for an embedding checkpoint (sentence-transformers' modules.json with a Pooling module, an "
        "architecture *Model / *ForEmbedding, or a name with Embedding in it), else generate.",
    )
    pooler_config: Annotated[str | None, BlankIsUnset] = Field(
        None,
        description='vLLM\'s --pooler-config for an embedding model: JSON {"pooling_type": "LAST" | "MEAN" | "CLS", '
        '"normalize": true | false}, over what the checkpoint says (sentence-transformers files, else LAST, '
        "normalized).",
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
    prefill_attention: PrefillAttention = Field(
        "unified",
        description="Attention of fresh prompt chunks (no cached prefix) on the triton kernel: unified = "
        "the paged unified kernel, as every other row; triton / flash = a dense varlen kernel over "
        "the step's own rows (model/prefill_triton.py, FlashAttention 2); sdpa = torch SDPA per prompt (the CPU runs sdpa for "
        "every value but unified). Other attention backends ignore it (model/prefill_attention.py).",
    )
    kv_cache_dtype: KvCacheDtype = Field(
        "auto",
        description="The KV cache's storage, as vLLM's --kv-cache-dtype: auto = the model's dtype; fp8 / fp8_e4m3 "
        "= FP8 E4M3 with a scale of 1 (half a bf16 cache's bytes: twice the tokens, half the bytes a decode "
        "step's attention reads). Needs the triton attention (CUDA) or sdpa (model/kv_dtype.py).",
    )
    fused_ops: FusedOps = Field(
        "auto",
        description="auto = on CUDA, one Triton kernel each for residual add + RMSNorm, rotary and "
        "SiLU*mul (a decode step is mostly tiny kernels); off = the PyTorch ops (A/B runs).",
    )

    @field_validator("pooler_config")
    @classmethod
    def _pooler_config(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            config = json.loads(v)
        except ValueError as e:
            raise ValueError(f"pooler_config is not JSON ({e})") from None
        if not isinstance(config, dict):
            raise ValueError('pooler_config must be a JSON object, e.g. {"pooling_type": "MEAN"}')
        unknown = sorted(set(config) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(
                f"pooler_config keys {unknown} are not served; give pooling_type and/or normalize"
            )
        kind = config.get("pooling_type")
        if kind is not None and str(kind).upper() not in POOLER_TYPES:
            raise ValueError(
                f"pooler_config pooling_type must be one of {', '.join(POOLER_TYPES)}, got {kind!r}"
            )
        if not isinstance(config.get("normalize", True), bool):
            raise ValueError("pooler_config normalize must be true or false")
        return v

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
