"""The checks every paged-attention kernel (decode_attention, unified_attention) makes on its inputs before a
launch: a Triton kernel given a wrong shape or stride reads the wrong memory instead of raising."""

from __future__ import annotations

import torch


def paged_cache_dims(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[int, int]:
    """(block_size, num_kv_heads) of k_cache [num_blocks, block_size, K, D], after checking it against
    q / out [T, H, D] (H a multiple of K), v_cache (k_cache's shape) and block_tables [R, B]: head_dim
    contiguous everywhere, the tables' rows contiguous, block_size a power of two. Raises ValueError."""
    head_dim = q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.shape[1] % num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q {tuple(q.shape)} vs k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)}"
        )
    if (
        q.stride(2) != 1
        or out.stride(2) != 1
        or k_cache.stride(3) != 1
        or v_cache.stride(3) != 1
        or block_tables.stride(1) != 1
    ):
        raise ValueError("q, out, k_cache, v_cache need a contiguous head_dim, block_tables contiguous rows")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two")
    return block_size, num_kv_heads
