"""A draft model's share of memory, counted when the target sizes its KV cache, and the draft's settings.

With `"method": "draft_model"` the draft runs beside the target on the same device with its own weights,
its own paged KV cache (block for block with the target's: as many blocks of the same size, so a
request the target can hold the draft can hold too), its own step activations and its own graph pools.
The target sizes its cache first (engine/worker/kv_cache.py), so it must leave room for all of it:

- each KV block costs the target's bytes plus the draft's (`DraftFootprint.block_bytes`), on CUDA and on
  the CPU alike (the CPU's default cache is capped in bytes: the draft's blocks count against the cap);
- the draft's weights (from its safetensors headers: element counts x the served dtype's size, no tensor
  data read), its activation bound and its graph budget (cache_max_bytes) are allocated after the
  target's cache: with gpu_memory_utilization they join the reserve; with kv_cache_memory_fraction
  they come off the free memory before the fraction is taken.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from graphcache.config import Settings
from graphcache.engine.spec.config import SpeculativeConfig, parse_speculative_config
from graphcache.engine.worker.kv_cache import activation_reserve_bytes, kv_block_bytes
from graphcache.model.config import ModelConfig, ModelLoadError, read_config
from graphcache.model.loader import weight_files

__all__ = ["DraftFootprint", "draft_footprint", "draft_settings", "weight_elements"]


@dataclass(frozen=True)
class DraftFootprint:
    """What a draft model adds to the target's memory: per KV block, and once (weights + after-cache)."""

    block_bytes: int  # one KV block of the draft, every layer, K and V
    weight_bytes: int  # its weights in the served dtype
    reserve_bytes: int  # its step activations and graph budget (allocated after the target's cache)

    @property
    def fixed_bytes(self) -> int:
        return self.weight_bytes + self.reserve_bytes


def draft_settings(
    settings: Settings, config: SpeculativeConfig, *, num_kv_blocks: int, max_model_len: int
) -> Settings:
    """The settings the draft's ModelRunner loads with: the target's, but the draft's checkpoint (a local
    directory), the target's block count and max_model_len, one process, no speculation of its own, no
    chat template (the draft never renders one), no warmup profile of the target's descriptors."""
    assert config.model is not None
    return settings.updated(
        model=str(config.model),
        num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len,
        speculative_config=None,
        chat_template=None,
        quantization="auto",  # as its checkpoint is (--quantization fp8 is the target's)
        tensor_parallel_size=1,
        warmup_profile=None,
        warmup_descriptors=[],
    )


def draft_footprint(
    settings: Settings,
    *,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    max_tokens: int,
    max_reqs: int,
    max_model_len: int,
) -> DraftFootprint | None:
    """The draft model's footprint when the settings configure one (None: no draft model). Raises
    ModelLoadError naming the fix when the draft's config cannot be read or its positions are too few."""
    spec = parse_speculative_config(settings.engine.speculative_config)
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return None
    path = Path(spec.model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"speculative_config.model {spec.model!r} is not a model directory (no config.json); name a "
            "local checkpoint directory or a hub id (org/name), which the engine fetches before loading"
        )
    config = read_config(path)
    limit = config.max_position_embeddings
    if config.sliding_window:
        limit = min(limit, config.sliding_window)
    if limit < max_model_len:
        raise ModelLoadError(
            f"speculative_config.model {spec.model!r} handles {limit} positions but the target's "
            f"max_model_len is {max_model_len}; lower --max-model-len to {limit} or pick a draft with "
            "a longer context"
        )
    return DraftFootprint(
        # in the target's cache dtype (the draft runner takes the target's kv_cache_dtype)
        block_bytes=kv_block_bytes(config, block_size, config.num_kv_heads, kv_dtype),
        weight_bytes=weight_elements(path) * dtype.itemsize,
        reserve_bytes=settings.graph_cache.max_bytes + _activations(config, max_tokens, max_reqs, dtype),
    )


def _activations(config: ModelConfig, max_tokens: int, max_reqs: int, dtype: torch.dtype) -> int:
    return activation_reserve_bytes(
        config, max_tokens=max_tokens, max_reqs=max_reqs, tp_size=1, itemsize=dtype.itemsize
    )


def weight_elements(path: Path) -> int:
    """The number of weight elements in the checkpoint at `path`, from its safetensors headers alone."""
    total = 0
    for file in weight_files(path):
        try:
            with file.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error) as e:
            raise ModelLoadError(
                f"{file} is not a readable safetensors file ({type(e).__name__}: {e}); download it again"
            ) from None
        total += sum(
            math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
        )
    return total
