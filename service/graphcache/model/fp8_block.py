"""The block-scaled FP8 GEMM of DeepSeek-style checkpoints (`weight_block_size` [128, 128]).

W [N, K] FP8 has one fp32 scale per bn x bk block; x is quantized per token and bk columns (scales
[T, K / bk]). Each bk-wide slice of K is one FP8 tensor-core product whose fp32 partial sum is scaled
by the token's and the block's scales before it is accumulated:

  y[t, n] = sum over k-blocks j of  sa[t, j] * sw[n // bn, j] * (xq[t, j-block] . W[n, j-block])

A Triton kernel on CUDA (bk must equal its K tile, so every tile has a single scale pair); on the CPU
the dequantized operands are multiplied in fp32 (the same sum up to fp32 rounding order). The CUDA
tests compare the two (tests/gpu/test_fp8_cuda.py).
"""

from __future__ import annotations

import torch

from graphcache.model.triton_support import tl, triton

__all__ = ["block_fp8_mm"]


def _block_mm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_sa_g,
    stride_sa_m,
    stride_sb_n,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # a [M, K] fp8 row-major, b [N, K] fp8 row-major (read as [K, N] tiles), sa [M, K / BLOCK_K] with
    # strides (stride_sa_m, stride_sa_g), sb [ceil(N / GROUP_N), K / BLOCK_K]; c [M, N] written.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
    sb_ptrs = sb_ptr + (offs_n // GROUP_N) * stride_sb_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - j * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        sa = tl.load(sa_ptr + offs_m * stride_sa_m + j * stride_sa_g, mask=m_mask, other=0.0)
        sb = tl.load(sb_ptrs + j, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


_KERNEL = None


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): small-M steps (decode) take narrow N tiles so more SMs stream W."""
    if m <= 16:
        return 16, 64, 4
    if m <= 64:
        return 64, 64, 4
    return 128, 128, 8


def _block_mm_triton(
    xq: torch.Tensor, w: torch.Tensor, sa: torch.Tensor, sw: torch.Tensor, block: tuple[int, int], dtype
) -> torch.Tensor:
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = triton.jit(_block_mm_kernel)
    m, k = xq.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=dtype, device=xq.device)
    block_m, block_n, warps = _tiles(m)
    _KERNEL[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        xq,
        w,
        out,
        sa,
        sw,
        m,
        n,
        k,
        xq.stride(0),
        w.stride(0),
        out.stride(0),
        sa.stride(1),
        sa.stride(0),
        sw.stride(0),
        GROUP_N=block[0],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block[1],
        num_warps=warps,
        num_stages=3,
    )
    return out


def _block_mm_emulated(
    xq: torch.Tensor, w: torch.Tensor, sa: torch.Tensor, sw: torch.Tensor, block: tuple[int, int], dtype
) -> torch.Tensor:
    bn, bk = block
    n, k = w.shape
    x = xq.float() * sa.repeat_interleave(bk, 1)[:, :k]  # [T, K]
    wd = w.float() * sw.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]  # [N, K]
    return (x @ wd.t()).to(dtype)


def block_fp8_mm(
    xq: torch.Tensor,
    w: torch.Tensor,
    scale_a: torch.Tensor,
    scale_w: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq [T, K] fp8 with scale_a [T, K / bk], w [N, K] fp8 with scale_w [ceil(N / bn), K / bk] -> [T, N]."""
    if xq.is_cuda:
        return _block_mm_triton(xq, w, scale_a, scale_w, block, out_dtype)
    return _block_mm_emulated(xq, w, scale_a, scale_w, block, out_dtype)
