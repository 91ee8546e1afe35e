"""The KV cache's storage dtype (settings.model.kv_cache_dtype, vLLM's --kv-cache-dtype): the model's dtype
(auto), or FP8 E4M3 (fp8, fp8_e4m3), which halves a bf16 cache's bytes: twice the tokens in the same memory,
and half the bytes a decode step's attention reads.

FP8 values are the model's K and V rounded to E4M3 with a scale of 1 (what vLLM stores for a checkpoint
without calibrated KV scales), saturated at +-448: torch's cast would make an out-of-range value NaN.
Everything that writes the cache (the rotary + cache-write kernel and its torch fallback; the FP8 one-token
qkv epilogue, which writes 16 bits, is not used with an FP8 cache: fp8_gemm.folds_rope) rounds through
`to_cache` or the same clamp; everything that reads it widens the values before any arithmetic: the torch
gathers to the model's dtype, the Triton decode and unified kernels to fp16 (with q: one op per two values
on sm_90, where bf16 takes a second op per value; fp16 holds every E4M3 value exactly). The
FlashAttention backends take 16-bit K/V only, so FP8 caches need the triton (CUDA) or sdpa attention.

torch has no index_copy_ / index_select for float8 on every device, so the fp8 writes and gathers go
through uint8 views of the same bytes (`write_slots_`, `gather_slots`).
"""

from __future__ import annotations

import torch

from graphcache.choices import KV_CACHE_DTYPES

__all__ = ["FP8_KV", "FP8_KV_MAX", "cache_dtype", "gather_slots", "is_fp8", "to_cache", "write_slots_"]

FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # E4M3's largest finite value


def cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for a kv_cache_dtype setting: auto = the model's."""
    if setting not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={setting!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
    return model_dtype if setting == "auto" else FP8_KV


def is_fp8(t: torch.Tensor | torch.dtype) -> bool:
    return (t if isinstance(t, torch.dtype) else t.dtype) == FP8_KV


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (the model's dtype) as the cache stores it: saturated at +-448 for FP8."""
    if dtype != FP8_KV:
        return x.to(dtype)
    return x.float().clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV)


def write_slots_(slots: torch.Tensor, index: torch.Tensor, x: torch.Tensor) -> None:
    """slots[index[t]] = x[t] in the cache's dtype: slots [S, K, D], index [T] int64, x [T, K, D]."""
    if not is_fp8(slots):
        slots.index_copy_(0, index, x.to(slots.dtype))
        return
    slots.view(torch.uint8).index_copy_(0, index, to_cache(x, FP8_KV).view(torch.uint8))


def gather_slots(cache: torch.Tensor, dim: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache.index_select(dim, index) widened to dtype (the model's), for the torch attention paths."""
    if not is_fp8(cache):
        return cache.index_select(dim, index)
    return cache.view(torch.uint8).index_select(dim, index).view(FP8_KV).to(dtype)
