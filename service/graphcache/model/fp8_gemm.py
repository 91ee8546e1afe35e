"""FP8 GEMMs in Triton: block-scaled weights (any batch), and row-scaled weights for small batches.

Both take xq [T, K] FP8 (quantized per token, or per token and bk columns) and W [N, K] FP8 row-major,
and scale the fp32 accumulator:

  row scales    y[t, n] = sa[t] * sw[n] * (xq[t] . W[n])
                The decode path (T <= ROW_SCALED_MAX_ROWS): narrow N tiles give every SM its share of W
                to stream, where _scaled_mm's large-tile kernels leave most SMs idle at T = 1. The
                decode kernel also quantizes x itself (`fused_row_scaled_mm`: each program reads x's rows
                once for their amax, then scales each tile by the reciprocal, fp8_quant.py's rule), which
                saves a quantization launch per layer and step: 4 of a layer's ~12 decode kernels.
  block scales  y[t, n] = sum over k-blocks j of sa[t, j] * sw[n // bn, j] * (xq[t, j] . W[n, j])
                DeepSeek-style `weight_block_size` [bn, bk] checkpoints: the K tile is bk wide, so every
                tile product has one scale pair, applied before it is accumulated.

On the CPU the dequantized operands are multiplied in fp32 (`emulated`: the same sums up to fp32
rounding order); tests/test_fp8.py checks the kernels against it under Triton's interpreter and
tests/gpu/test_fp8_cuda.py on the GPU.
"""

from __future__ import annotations

import torch

from graphcache.model.fp8_quant import MIN_SCALE
from graphcache.model.triton_support import tl, triton

__all__ = ["ROW_SCALED_MAX_ROWS", "block_scaled_mm", "emulated_mm", "fused_row_scaled_mm", "row_scaled_mm"]

# Batches up to this many rows take the Triton row-scaled kernel on CUDA, larger ones torch._scaled_mm
# (fp8_linear.fp8_mm). 0 = always _scaled_mm; benchmarks/fp8_bench.py measures both.
ROW_SCALED_MAX_ROWS = 16


def _fp8_mm_kernel(
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
    min_scale,
    QUANT_A: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # a [M, K] fp8 row-major, b [N, K] fp8 row-major (read as [K, N] tiles), c [M, N] written.
    # BLOCK_SCALES: sa [M, K / BLOCK_K] (strides stride_sa_m, stride_sa_g), sb [ceil(N / GROUP_N), K / BLOCK_K];
    # else sa [M] (stride_sa_m), sb [N] (stride_sb_n). QUANT_A (row scales only): a is the 16-bit x [M, K],
    # quantized here per row (sa_ptr unused).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
    if QUANT_A:  # the rows' amax -> scale (amax / 448, floored) and its reciprocal, as fp8_quant.py
        running = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for j in range(0, tl.cdiv(K, BLOCK_K)):
            k_mask = offs_k < K - j * BLOCK_K
            x = tl.load(a_ptrs + j * BLOCK_K, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            running = tl.maximum(running, tl.abs(x.to(tl.float32)))
        sa = tl.maximum(tl.math.div_rn(tl.max(running, axis=1), 448.0), min_scale)  # [BLOCK_M]
        inv = tl.math.div_rn(1.0, sa)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - j * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if QUANT_A:
            a = tl.clamp(a.to(tl.float32) * inv[:, None], -448.0, 448.0).to(b_ptr.dtype.element_ty)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if BLOCK_SCALES:
            sa = tl.load(sa_ptr + offs_m * stride_sa_m + j * stride_sa_g, mask=m_mask, other=0.0)
            sb = tl.load(sb_ptr + (offs_n // GROUP_N) * stride_sb_n + j, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        if not QUANT_A:
            sa = tl.load(sa_ptr + offs_m * stride_sa_m, mask=m_mask, other=0.0)
        sb = tl.load(sb_ptr + offs_n * stride_sb_n, mask=n_mask, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        # The batch rows (and the block scales' stride, = rows) vary per step: not specialized on, so a new
        # batch size never compiles (nor compiles inside a graph capture).
        _KERNEL = triton.jit(_fp8_mm_kernel, do_not_specialize=["M", "stride_sa_g"])
    return _KERNEL


# (BLOCK_N, BLOCK_K, num_warps, num_stages) of row-scaled steps of at most 16 rows, bound by streaming W:
# N tiles narrow enough that the grid covers the H200's 132 SMs (N = 4096: 128 tiles), K tiles wide enough
# to keep loads in flight. benchmarks/fp8_bench.py --sweep times alternatives on the 8B shapes.
DECODE_TILE = (32, 256, 4, 4)


def _tiles(m: int, block_k: int | None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); block_k: the weight's scale block (block scales)."""
    if m <= 16:
        block_n, k, warps, stages = DECODE_TILE
        return 16, block_n, block_k or k, warps, stages
    if m <= 64:
        return 64, 64, block_k or 128, 4, 3
    return 128, 128, block_k or 128, 8, 3


def _launch_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_w: torch.Tensor,
    block: tuple[int, int] | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The one GEMM kernel on a [T, K] x w [N, K] -> [T, N]. scale_a None: a is the 16-bit x, quantized per
    row inside the kernel (QUANT_A); block None: row scales, else [bn, bk] block scales (BLOCK_SCALES)."""
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    block_m, block_n, block_k, warps, stages = _tiles(m, None if block is None else block[1])
    if scale_a is None:  # the kernel computes a's scales: sa_ptr is unused, its strides 0
        sa, stride_sa_g, stride_sa_m = scale_w, 0, 0
    elif block is None:  # scale_a [T, 1]
        sa, stride_sa_g, stride_sa_m = scale_a, 0, scale_a.stride(0)
    else:  # scale_a [T, K / bk]
        sa, stride_sa_g, stride_sa_m = scale_a, scale_a.stride(1), scale_a.stride(0)
    _kernel()[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a,
        w,
        out,
        sa,
        scale_w,
        m,
        n,
        k,
        a.stride(0),
        w.stride(0),
        out.stride(0),
        stride_sa_g,
        stride_sa_m,
        scale_w.stride(0),
        MIN_SCALE,
        QUANT_A=scale_a is None,
        BLOCK_SCALES=block is not None,
        GROUP_N=1 if block is None else block[0],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def row_scaled_mm(
    xq: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_w: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """xq [T, K] fp8 with scale_a [T, 1], w [N, K] fp8 with scale_w [N, 1] -> [T, N] (Triton, CUDA)."""
    return _launch_gemm(xq, w, scale_a, scale_w, None, out_dtype)


def fused_row_scaled_mm(
    x: torch.Tensor, w: torch.Tensor, scale_w: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """x [T, K] 16-bit (T <= 16), w [N, K] fp8 with scale_w [N, 1] -> [T, N]: x quantized per token inside
    the GEMM (Triton, CUDA); the same numbers as quantize_rows then row_scaled_mm."""
    if x.shape[0] > 16 or x.stride(1) != 1:
        raise ValueError(
            f"fused_row_scaled_mm takes at most 16 rows with contiguous columns, got {tuple(x.shape)}"
        )
    return _launch_gemm(x, w, None, scale_w, None, out_dtype)


def block_scaled_mm(
    xq: torch.Tensor,
    w: torch.Tensor,
    scale_a: torch.Tensor,
    scale_w: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq [T, K] fp8 with scale_a [T, K / bk], w [N, K] fp8 with scale_w [ceil(N / bn), K / bk] -> [T, N]:
    the Triton kernel on CUDA, the fp32 emulation elsewhere."""
    if not xq.is_cuda:
        return emulated_mm(xq, w, scale_a, scale_w, out_dtype, block)
    return _launch_gemm(xq, w, scale_a, scale_w, block, out_dtype)


def emulated_mm(
    xq: torch.Tensor,
    w: torch.Tensor,
    scale_a: torch.Tensor,
    scale_w: torch.Tensor,
    out_dtype: torch.dtype,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The product any of the kernels computes, from the dequantized operands in fp32 (the CPU path)."""
    if block is None:
        return ((xq.float() @ w.float().t()) * scale_a * scale_w.view(1, -1)).to(out_dtype)
    bn, bk = block
    n, k = w.shape
    x = xq.float() * scale_a.repeat_interleave(bk, 1)[:, :k]  # [T, K]
    wd = w.float() * scale_w.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]  # [N, K]
    return (x @ wd.t()).to(out_dtype)
