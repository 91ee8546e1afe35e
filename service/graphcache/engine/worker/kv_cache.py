"""KV cache sizing and allocation: how many blocks fit, agreed over the ranks, and the storage itself.

On CUDA the cache takes kv_cache_memory_fraction of the memory free after the weights, or, with
gpu_memory_utilization (vLLM's), what is left of that share of the GPU's total memory once what the server
took since it started and a reserve for what comes after the cache (graph pools, activations) are counted
(`utilization_kv_bytes`). On the CPU it holds max_num_seqs full sequences, capped at CPU_KV_CACHE_MAX_BYTES
(CPU RAM is shared with everything); settings.engine.num_kv_blocks overrides both. Tensor-parallel ranks take the smallest
count of any rank, since rank 0's block manager hands out blocks for all of them. The storage has one
block past the usable ones: the scratch block padded tokens write (runner.py).

Free memory is read at the driver (`torch.cuda.mem_get_info`), where blocks PyTorch's caching allocator holds
but no tensor uses (what an engine shut down earlier in this process, or the loader's temporaries, left
cached) count as used. `device_free_bytes` hands those back first, so they count as free: otherwise a second
engine in one process (benchmarks, tests) sizes its cache from what the first left cached, a fraction of the
first's.
"""

from __future__ import annotations

import gc

import torch

from graphcache.config import Settings
from graphcache.model.config import ModelConfig
from graphcache.model.parallel import TensorParallel

__all__ = [
    "CPU_KV_CACHE_MAX_BYTES",
    "activation_reserve_bytes",
    "agree_min_blocks",
    "alloc_kv_storage",
    "device_free_bytes",
    "kv_block_bytes",
    "num_kv_blocks",
    "utilization_kv_bytes",
]

CPU_KV_CACHE_MAX_BYTES = 1 << 30  # default CPU KV cache stops here: CPU RAM is shared with everything


def device_free_bytes(device: torch.device, *, collect: bool = False) -> tuple[int, int]:
    """(free, total) bytes of the CUDA device, read after the caching allocator gave back its unused blocks
    (module docstring). collect: first a garbage collection, so tensors only cycles still reach are freed and
    their blocks given back too (at start-up, where a collection is cheap). Blocks left partly used stay
    counted as used: their free parts cannot hold the cache's one large allocation."""
    if collect:
        gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return free, total


def kv_block_bytes(config: ModelConfig, block_size: int, num_kv_heads: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over every layer, K and V, for this rank's num_kv_heads."""
    return config.num_layers * 2 * block_size * num_kv_heads * config.head_dim * dtype.itemsize


def utilization_kv_bytes(utilization: float, *, total: int, start_free: int, free: int, reserve: int) -> int:
    """The KV cache's bytes under vLLM's gpu_memory_utilization: the server may hold utilization x total of
    the GPU; what it took since it started (start_free - free: weights, buffers, kernels' workspaces) and what
    it allocates after the cache (reserve) come off. Memory other processes held at the start is not
    counted, as vLLM counts only its own instance (two servers at 0.45 share a GPU)."""
    return int(utilization * total) - max(start_free - free, 0) - reserve


def activation_reserve_bytes(
    config: ModelConfig, *, max_tokens: int, max_reqs: int, tp_size: int, itemsize: int
) -> int:
    """A bound on what one step allocates beyond the KV cache and the weights: the largest layer's
    intermediates for max_tokens tokens (residual, norm, q/k/v, attention output, the MLP's gate/up, its
    activation and output; the routed experts' rows for a mixture of experts) in the model dtype, and the
    sampler's float32 copies of max_reqs rows of logits (three)."""
    mlp = max(config.intermediate_size, config.num_experts_per_tok * config.moe_intermediate_size) // tp_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim // tp_size
    per_token = (3 * mlp + qkv + 6 * config.hidden_size) * itemsize
    return max_tokens * per_token + 3 * max_reqs * config.vocab_size * 4


def num_kv_blocks(
    settings: Settings,
    *,
    block_bytes: int,
    max_blocks_per_seq: int,
    max_model_len: int,
    device: torch.device,
    start_free: int | None = None,
    reserve: int = 0,
    late_bytes: int = 0,
) -> int:
    """This rank's KV block count (settings.engine.num_kv_blocks, or what fits); raises naming the fix
    when it cannot hold one sequence of max_model_len (max_blocks_per_seq blocks). start_free: the GPU's free
    bytes when this process started using it (before the weights), reserve: what it allocates after the
    cache; both for gpu_memory_utilization. late_bytes: what else loads after the cache on CUDA (a draft
    model's weights, activations and graphs: engine/worker/draft_memory.py), counted by either rule."""
    s = settings
    if s.engine.num_kv_blocks is not None:
        return s.engine.num_kv_blocks
    one_seq = max_blocks_per_seq
    utilization = s.engine.gpu_memory_utilization
    if device.type == "cuda":
        free, total = device_free_bytes(device)
        if utilization is None:
            blocks = int(max(free - late_bytes, 0) * s.engine.kv_cache_memory_fraction) // block_bytes
        else:
            start = free if start_free is None else start_free
            if start < utilization * total:
                raise RuntimeError(
                    f"gpu_memory_utilization {utilization} asks for {utilization * total / 2**30:.1f} GiB of this "
                    f"GPU's {total / 2**30:.1f} GiB, but only {start / 2**30:.1f} GiB were free at start (other "
                    "processes hold the rest); lower --gpu-memory-utilization or free the GPU"
                )
            kv = utilization_kv_bytes(
                utilization, total=total, start_free=start, free=free, reserve=reserve + late_bytes
            )
            blocks = max(kv, 0) // block_bytes
    else:
        blocks = min(s.engine.max_num_seqs * one_seq, CPU_KV_CACHE_MAX_BYTES // block_bytes)
    if blocks < one_seq:
        by_share = utilization is not None and device.type == "cuda"
        knob = "raise gpu_memory_utilization" if by_share else "raise kv_cache_memory_fraction"
        raise RuntimeError(
            f"KV cache of {blocks} blocks cannot hold one sequence of max_model_len "
            f"{max_model_len} ({one_seq} blocks); lower max_model_len, {knob}, or set num_kv_blocks"
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
