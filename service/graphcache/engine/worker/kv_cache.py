"""KV cache sizing and allocation: how many blocks fit, agreed over the ranks, and the storage itself.

On CUDA the cache takes kv_cache_memory_fraction of the memory free after the weights; on the CPU it
holds max_num_seqs full sequences, capped at CPU_KV_CACHE_MAX_BYTES (CPU RAM is shared with
everything); settings.engine.num_kv_blocks overrides both. Tensor-parallel ranks take the smallest
count of any rank, since rank 0's block manager hands out blocks for all of them. The storage has one
block past the usable ones: the scratch block padded tokens write (runner.py).
"""

from __future__ import annotations

import torch

from graphcache.config import Settings
from graphcache.model.config import ModelConfig
from graphcache.model.parallel import TensorParallel

__all__ = [
    "CPU_KV_CACHE_MAX_BYTES",
    "agree_min_blocks",
    "alloc_kv_storage",
    "kv_block_bytes",
    "num_kv_blocks",
]

CPU_KV_CACHE_MAX_BYTES = 1 << 30  # default CPU KV cache stops here: CPU RAM is shared with everything


def kv_block_bytes(config: ModelConfig, block_size: int, num_kv_heads: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over every layer, K and V, for this rank's num_kv_heads."""
    return config.num_layers * 2 * block_size * num_kv_heads * config.head_dim * dtype.itemsize


def num_kv_blocks(
    settings: Settings, *, block_bytes: int, max_blocks_per_seq: int, max_model_len: int, device: torch.device
) -> int:
    """This rank's KV block count (settings.engine.num_kv_blocks, or what fits); raises naming the fix
    when it cannot hold one sequence of max_model_len (max_blocks_per_seq blocks)."""
    s = settings
    if s.engine.num_kv_blocks is not None:
        return s.engine.num_kv_blocks
    one_seq = max_blocks_per_seq
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        blocks = int(free * s.engine.kv_cache_memory_fraction) // block_bytes
    else:
        blocks = min(s.engine.max_num_seqs * one_seq, CPU_KV_CACHE_MAX_BYTES // block_bytes)
    if blocks < one_seq:
        raise RuntimeError(
            f"KV cache of {blocks} blocks cannot hold one sequence of max_model_len "
            f"{max_model_len} ({one_seq} blocks); lower max_model_len or raise "
            "kv_cache_memory_fraction / num_kv_blocks"
        )
    return blocks


def agree_min_blocks(blocks: int, tp: TensorParallel, device: torch.device) -> int:
    """The smallest KV cache over the ranks: rank 0's block manager hands out blocks for all of them
    (each rank sized its own from its free memory). Every rank calls this at the same point of start-up."""
    if not tp.enabled:
        return blocks
    t = torch.tensor([blocks], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=tp.group)
    return int(t.item())


def alloc_kv_storage(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """[layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim]: block num_blocks is the scratch
    block that padded tokens write (their K/V may be garbage; nothing ever reads it). Zero-filled, not
    empty: masked positions get softmax weight 0, and 0 * NaN would still be NaN."""
    return torch.zeros(
        config.num_layers,
        2,
        num_blocks + 1,
        block_size,
        num_kv_heads,
        config.head_dim,
        dtype=dtype,
        device=device,
    )
