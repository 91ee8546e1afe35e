"""Small-batch 16-bit GEMMs in Triton: y [M, N] = x [M, K] @ W [N, K]^T for M = 1..64 rows (decode steps).

At these row counts a GEMM is bound by reading W once (N * K * 2 bytes over ~4.8 TB/s on the H200), and
cuBLAS runs them as GEMVs at ~73% of that (BENCHMARKS.md §13: qkv 3.2 TB/s, o 2.6). Every design here reads
each W tile once for all of a program's rows (the M tile), and narrow N tiles give every SM its share of W:

  fma  (M tile of 1, 2, 4 or 8 rows) no tensor cores: each thread multiplies its 8 consecutive K values of W
       (one 16-byte load) by each x row's and adds the 8 products up before they go into that row's fp32
       accumulator [BLOCK_N, BLOCK_K / 8], summed across threads once after the loop (no cross-warp reduction
       in the loop). The FP8 one-row kernel's design (fp8_gemm.py, BENCHMARKS.md §14 and §17) on 16-bit W.
  dot  (M tile of 16, 32 or 64 rows) W as the MMA's A operand: [BLOCK_N, BLOCK_K] tiles of W times x^T
       [BLOCK_K, BLOCK_M] on the tensor cores, fp32 accumulators [BLOCK_N, BLOCK_M]; x's padding rows cost
       nothing but MMA work, which is far from the bound at these sizes.

The K loop has no mask (all full tiles); a K that is not a multiple of BLOCK_K gets one masked tail tile after
it (Qwen2.5-0.5B's K = 896). The last N tile's rows and the M tile's padding rows are clamped to the last
real row instead of masked, so the loads stay unmasked 16-byte vectors; only the stores are masked.
`small_silu_mul` is the gate_up GEMM with silu(gate) * up on its accumulators ([gate | up] weight, [M, I] out:
the [M, 2I] product is never written, one launch less a layer).

Tiles per (M bucket, N, K): TILES, from benchmarks/bf16_gemv_sweep.py (which also prints the table to paste;
measured on an H100); DEFAULT_TILES per bucket for other shapes. No split-K: it needs a zeroed fp32 buffer or a
second pass, and the narrow N tiles already fill the grid (N = 4096 at BLOCK_N 2: 2,048 programs).

Graph-capturable: no host sync, one allocation (the output); M is not specialized on, so a new row count in
a bucket compiles nothing (`precompile` compiles every bucket before any capture). On the CPU, for other
dtypes, non-contiguous x or more than MAX_ROWS rows, `small_mm` is x @ W.T (torch), the same function.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from graphcache.model.fused_ops import silu_mul
from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = [
    "BUCKETS",
    "DEFAULT_TILES",
    "MAX_ROWS",
    "TILES",
    "Tile",
    "bucket_of",
    "linear",
    "precompile",
    "runs_kernel",
    "small_mm",
    "small_silu_mul",
    "takes",
    "tile_for",
]

MAX_ROWS = 64  # past this the GEMM is no longer bound by W alone: cuBLAS's large tiles win
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a step's rows round up to one of these (one compiled tile each)


class Tile(NamedTuple):
    """One launch setting: design "fma" (block_m 1..8) or "dot" (block_m 16..64), the M, N and K tiles."""

    design: str
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


# Per M bucket, for shapes TILES does not name. fma: BLOCK_K = 8 x 32 x warps, every warp along K, so each
# thread's 8 K values of W and of x share one register layout (fp8_gemm's ONE_ROW note). dot: BLOCK_N 16 for
# the grid (N = 4096: 256 programs), K tiles deep enough to keep several loads in flight per SM.
DEFAULT_TILES: dict[int, Tile] = {
    1: Tile("fma", 1, 2, 1024, 4, 2),
    2: Tile("fma", 2, 2, 1024, 4, 2),
    4: Tile("fma", 4, 2, 1024, 4, 2),
    8: Tile("dot", 16, 16, 256, 4, 4),
    16: Tile("dot", 16, 16, 256, 4, 4),
    32: Tile("dot", 32, 32, 256, 4, 4),
    64: Tile("dot", 64, 64, 128, 4, 4),
}

# (bucket, N, K) -> Tile for the served shapes, measured: benchmarks/bf16_gemv_sweep.py prints this table
# (N: the weight's rows, gate_up's [gate | up] both). None: cuBLAS measured faster than every tile there, so
# small_mm is torch's product at that bucket and shape. Measured on an H100 (the H200 did not come;
# BENCHMARKS.md §25). Both have 132 SMs, so a tile's grid fills them alike; the H200's faster HBM may
# move the best tile where two are close.
TILES: dict[tuple[int, int, int], Tile | None] = {
    (1, 896, 896): Tile("fma", 1, 2, 1024, 4, 2),
    (1, 896, 4864): Tile("fma", 1, 2, 1024, 4, 2),
    (1, 1152, 896): Tile("fma", 1, 2, 1024, 4, 2),
    (1, 4096, 4096): Tile("fma", 1, 4, 1024, 4, 2),
    (1, 4096, 14336): Tile("fma", 1, 4, 1024, 4, 2),
    (1, 6144, 4096): Tile("fma", 1, 2, 1024, 4, 2),
    (1, 9728, 896): Tile("fma", 1, 2, 1024, 4, 2),
    (1, 28672, 4096): Tile("fma", 1, 2, 1024, 4, 2),
    (1, 128256, 4096): Tile("fma", 1, 2, 1024, 4, 2),
    (1, 151936, 896): Tile("fma", 1, 2, 1024, 4, 2),
    (2, 896, 896): Tile("fma", 2, 2, 1024, 4, 2),
    (2, 896, 4864): Tile("fma", 2, 2, 1024, 4, 2),
    (2, 1152, 896): Tile("fma", 2, 2, 1024, 4, 2),
    (2, 4096, 4096): Tile("fma", 2, 4, 512, 2, 2),
    (2, 4096, 14336): Tile("fma", 2, 4, 512, 2, 2),
    (2, 6144, 4096): Tile("fma", 2, 4, 512, 2, 2),
    (2, 9728, 896): Tile("fma", 2, 4, 512, 2, 2),
    (2, 28672, 4096): Tile("fma", 2, 4, 512, 2, 2),
    (2, 128256, 4096): Tile("fma", 2, 2, 1024, 4, 2),
    (2, 151936, 896): Tile("fma", 2, 4, 512, 2, 2),
    (4, 896, 896): Tile("fma", 4, 2, 1024, 4, 2),
    (4, 896, 4864): Tile("fma", 4, 2, 1024, 4, 2),
    (4, 1152, 896): Tile("fma", 4, 2, 1024, 4, 2),
    (4, 4096, 4096): Tile("fma", 4, 2, 512, 2, 2),
    (4, 4096, 14336): None,
    (4, 6144, 4096): None,
    (4, 9728, 896): None,
    (4, 28672, 4096): Tile("fma", 4, 2, 512, 2, 2),
    (4, 128256, 4096): Tile("fma", 4, 2, 512, 2, 2),
    (4, 151936, 896): None,
    (8, 896, 896): None,
    (8, 896, 4864): None,
    (8, 1152, 896): None,
    (8, 4096, 4096): Tile("dot", 16, 32, 256, 4, 4),
    (8, 4096, 14336): None,
    (8, 6144, 4096): None,
    (8, 9728, 896): None,
    (8, 28672, 4096): None,
    (8, 128256, 4096): Tile("dot", 16, 32, 256, 4, 4),
    (8, 151936, 896): None,
    (16, 896, 896): Tile("dot", 16, 64, 128, 4, 4),
    (16, 896, 4864): None,
    (16, 1152, 896): Tile("dot", 16, 64, 128, 4, 4),
    (16, 4096, 4096): Tile("dot", 16, 32, 256, 4, 4),
    (16, 4096, 14336): Tile("dot", 16, 32, 256, 4, 4),
    (16, 6144, 4096): Tile("dot", 16, 64, 128, 4, 4),
    (16, 9728, 896): Tile("dot", 16, 64, 128, 4, 4),
    (16, 28672, 4096): Tile("dot", 16, 64, 128, 4, 4),
    (16, 128256, 4096): Tile("dot", 16, 64, 128, 4, 4),
    (16, 151936, 896): Tile("dot", 16, 64, 128, 4, 4),
    (32, 896, 896): Tile("dot", 32, 64, 128, 4, 4),
    (32, 896, 4864): None,
    (32, 1152, 896): Tile("dot", 32, 64, 128, 4, 4),
    (32, 4096, 4096): None,
    (32, 4096, 14336): Tile("dot", 32, 16, 256, 4, 4),
    (32, 6144, 4096): Tile("dot", 32, 64, 128, 4, 4),
    (32, 9728, 896): None,
    (32, 28672, 4096): Tile("dot", 32, 64, 128, 4, 4),
    (32, 128256, 4096): Tile("dot", 32, 64, 128, 4, 4),
    (32, 151936, 896): Tile("dot", 32, 64, 128, 4, 4),
    (64, 896, 896): None,
    (64, 896, 4864): None,
    (64, 1152, 896): None,
    (64, 4096, 4096): None,
    (64, 4096, 14336): None,
    (64, 6144, 4096): None,
    (64, 9728, 896): None,
    (64, 28672, 4096): None,
    (64, 128256, 4096): Tile("dot", 64, 64, 128, 4, 4),
    (64, 151936, 896): None,
}
# Programmatic dependent launch (the kernel is launched while the one before it drains and waits in
# griddepcontrol.wait for its writes; sm_90+): off, since the sweep's pdl rows measured it no faster on the H100
# (the 8B layer at one row 151.5 against 148.9 us, BENCHMARKS.md §25). True / False: benchmarks' A/B.
PDL = False


def bucket_of(rows: int) -> int:
    """The M bucket of a step of `rows` rows (1 <= rows <= MAX_ROWS): the next power of two."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the small GEMM takes 1 to {MAX_ROWS} rows, got {rows}")
    return next(b for b in BUCKETS if b >= rows)


def tile_for(rows: int, n: int, k: int) -> Tile | None:
    """The tile of `rows` rows of a weight [n, k]; None: torch's product (TILES says cuBLAS is faster there)."""
    b = bucket_of(rows)
    return TILES.get((b, n, k), DEFAULT_TILES[b])


def runs_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the Triton kernel takes x [M, K] and w [N, K]: CUDA, both bf16 or both fp16, contiguous rows of
    16-byte aligned length, 1..MAX_ROWS rows. Otherwise small_mm is torch's x @ w.T."""
    sixteen = x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
    rows = x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
    layout = rows and x.stride(1) == 1 and w.stride(1) == 1 and x.shape[1] % 8 == 0 and w.stride(0) % 8 == 0
    return HAVE_TRITON and x.is_cuda and sixteen and layout


def _small_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    DOT: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # x [M, K], w [N, K] (GATED: [2N, K] = [gate | up]), y [M, N]; all K-contiguous. Program (pid_n, pid_m)
    # writes y[pid_m * BLOCK_M :, pid_n * BLOCK_N :] (BLOCK_M x BLOCK_N, masked at the edges).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if USE_PDL:  # launched before the previous kernel ended: wait for its writes (x), let the next one in
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m0 = pid_m * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows_n = tl.minimum(offs_n, N - 1)  # clamped, not masked: the last tile's extra rows re-read row N - 1
    offs_k = tl.max_contiguous(tl.arange(0, BLOCK_K), 8)
    up_rows = N * stride_wn  # GATED: the up half starts N rows down
    full_tiles = K // BLOCK_K
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    if DOT:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        rows_m = tl.minimum(offs_m, M - 1)  # the padding rows re-read row M - 1
        x_ptrs = x_ptr + rows_m[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M] = x^T
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in range(0, full_tiles):
            xt = tl.load(x_ptrs)
            acc = tl.dot(tl.load(w_ptrs), xt, acc)
            if GATED:
                acc_u = tl.dot(tl.load(w_ptrs + up_rows), xt, acc_u)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if not EVEN_K:  # the one partial K tile
            k_mask = offs_k < K - full_tiles * BLOCK_K
            xt = tl.load(x_ptrs, mask=k_mask[:, None], other=0.0)
            acc = tl.dot(tl.load(w_ptrs, mask=k_mask[None, :], other=0.0), xt, acc)
            if GATED:
                acc_u = tl.dot(tl.load(w_ptrs + up_rows, mask=k_mask[None, :], other=0.0), xt, acc_u)
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]  # [BLOCK_N, BLOCK_M] = y^T
        _store(y_ptrs, acc, acc_u, (offs_m[None, :] < M) & n_mask[:, None], GATED)
    else:
        # One accumulator [BLOCK_N, BLOCK_K / 8] per row of x (up to 8, each used only where BLOCK_M has
        # it): each thread's 8 consecutive K values of W (one 16-byte load) and of the x row share one
        # register layout, so the products' sum over those 8 stays in the thread, and the sum across threads
        # happens once after the loop. A 3-D [BLOCK_M, BLOCK_N, BLOCK_K] product put shuffles, shared-memory
        # stores and barriers inside the K loop (SASS of Triton 3.6 for sm_90).
        x0 = x_ptr + offs_k[None, :] + tl.minimum(m0, M - 1) * stride_xm  # [1, BLOCK_K]
        x1 = x_ptr + offs_k[None, :] + tl.minimum(m0 + 1, M - 1) * stride_xm
        x2 = x_ptr + offs_k[None, :] + tl.minimum(m0 + 2, M - 1) * stride_xm
        x3 = x_ptr + offs_k[None, :] + tl.minimum(m0 + 3, M - 1) * stride_xm
        x4 = x_ptr + offs_k[None, :] + tl.minimum(m0 + 4, M - 1) * stride_xm
        x5 = x_ptr + offs_k[None, :] + tl.minimum(m0 + 5, M - 1) * stride_xm
        x6 = x_ptr + offs_k[None, :] + tl.minimum(m0 + 6, M - 1) * stride_xm
        x7 = x_ptr + offs_k[None, :] + tl.minimum(m0 + 7, M - 1) * stride_xm
        a0 = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
        u0, u1, u2, u3, u4, u5, u6, u7 = a0, a0, a0, a0, a0, a0, a0, a0
        k_mask = offs_k[None, :] < K  # read only where not EVEN_K: no mask on a full tile's loads
        for j in range(0, full_tiles + (0 if EVEN_K else 1)):
            if EVEN_K:
                w = tl.load(w_ptrs).to(tl.float32)  # [BLOCK_N, BLOCK_K]
                wu = tl.load(w_ptrs + up_rows).to(tl.float32) if GATED else w
            else:
                k_mask = offs_k[None, :] < K - j * BLOCK_K
                w = tl.load(w_ptrs, mask=k_mask, other=0.0).to(tl.float32)
                wu = tl.load(w_ptrs + up_rows, mask=k_mask, other=0.0).to(tl.float32) if GATED else w
            a0, u0 = _fma_row(a0, u0, w, wu, x0, k_mask, EVEN_K, GATED, BLOCK_N, BLOCK_K)
            if BLOCK_M > 1:
                a1, u1 = _fma_row(a1, u1, w, wu, x1, k_mask, EVEN_K, GATED, BLOCK_N, BLOCK_K)
            if BLOCK_M > 2:
                a2, u2 = _fma_row(a2, u2, w, wu, x2, k_mask, EVEN_K, GATED, BLOCK_N, BLOCK_K)
                a3, u3 = _fma_row(a3, u3, w, wu, x3, k_mask, EVEN_K, GATED, BLOCK_N, BLOCK_K)
            if BLOCK_M > 4:
                a4, u4 = _fma_row(a4, u4, w, wu, x4, k_mask, EVEN_K, GATED, BLOCK_N, BLOCK_K)
                a5, u5 = _fma_row(a5, u5, w, wu, x5, k_mask, EVEN_K, GATED, BLOCK_N, BLOCK_K)
                a6, u6 = _fma_row(a6, u6, w, wu, x6, k_mask, EVEN_K, GATED, BLOCK_N, BLOCK_K)
                a7, u7 = _fma_row(a7, u7, w, wu, x7, k_mask, EVEN_K, GATED, BLOCK_N, BLOCK_K)
            w_ptrs += BLOCK_K
            x0 += BLOCK_K
            x1 += BLOCK_K
            x2 += BLOCK_K
            x3 += BLOCK_K
            x4 += BLOCK_K
            x5 += BLOCK_K
            x6 += BLOCK_K
            x7 += BLOCK_K
        y0 = y_ptr + offs_n + m0 * stride_ym  # [BLOCK_N], row m0
        _store_row(y0, 0, a0, u0, n_mask, m0, M, stride_ym, GATED)
        if BLOCK_M > 1:
            _store_row(y0, 1, a1, u1, n_mask, m0, M, stride_ym, GATED)
        if BLOCK_M > 2:
            _store_row(y0, 2, a2, u2, n_mask, m0, M, stride_ym, GATED)
            _store_row(y0, 3, a3, u3, n_mask, m0, M, stride_ym, GATED)
        if BLOCK_M > 4:
            _store_row(y0, 4, a4, u4, n_mask, m0, M, stride_ym, GATED)
            _store_row(y0, 5, a5, u5, n_mask, m0, M, stride_ym, GATED)
            _store_row(y0, 6, a6, u6, n_mask, m0, M, stride_ym, GATED)
            _store_row(y0, 7, a7, u7, n_mask, m0, M, stride_ym, GATED)


def fma_row(
    acc, acc_u, w, wu, x_ptrs, k_mask, EVEN_K: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One x row's products with the W tile(s) [BLOCK_N, BLOCK_K], each thread's 8 along K summed first:
    (acc, acc_u) [BLOCK_N, BLOCK_K / 8] updated."""
    if EVEN_K:
        x = tl.load(x_ptrs).to(tl.float32)  # [1, BLOCK_K]
    else:
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    acc += tl.sum(tl.reshape(w * x, (BLOCK_N, BLOCK_K // 8, 8)), axis=2)
    if GATED:
        acc_u += tl.sum(tl.reshape(wu * x, (BLOCK_N, BLOCK_K // 8, 8)), axis=2)
    return acc, acc_u


def store(y_ptrs, out, out_u, mask, GATED: tl.constexpr):
    """out (GATED: silu(out) * out_u, each factor rounded to y's dtype first as fused_ops.silu_mul does) into y."""
    if GATED:
        g = out.to(y_ptrs.dtype.element_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(y_ptrs.dtype.element_ty).to(tl.float32)
        out = act * out_u.to(y_ptrs.dtype.element_ty).to(tl.float32)
    tl.store(y_ptrs, out.to(y_ptrs.dtype.element_ty), mask=mask)


def store_row(y0, i: tl.constexpr, acc, acc_u, n_mask, m0, M, stride_ym, GATED: tl.constexpr):
    """Row m0 + i of y (if it is one of the M) from an fma accumulator pair [BLOCK_N, BLOCK_K / 8]."""
    row_ok = (n_mask.to(tl.int32) * 0 + m0 + i) < M  # a [BLOCK_N] mask (the interpreter wants a tensor)
    _store(y0 + i * stride_ym, tl.sum(acc, axis=1), tl.sum(acc_u, axis=1), n_mask & row_ok, GATED)


_KERNEL = None
# The kernel's helpers, jitted with it (JITFunctions: Any, triton has no types).
_fma_row: Any = None
_store: Any = None
_store_row: Any = None


def _kernel():
    global _KERNEL, _fma_row, _store, _store_row
    if _KERNEL is None:
        _fma_row = triton.jit(fma_row)  # the kernel finds its helpers as this module's globals
        _store = triton.jit(store)
        _store_row = triton.jit(store_row)
        # The rows vary per step: not specialized on (Triton would make M = 1 a constant), so a new row count
        # inside a bucket never compiles, nor compiles inside a graph capture.
        _KERNEL = triton.jit(_small_gemm_kernel, do_not_specialize=["M"])
    return _KERNEL


def launch(
    x: torch.Tensor,
    w: torch.Tensor,
    tile: Tile,
    gated: bool = False,
    out: torch.Tensor | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """The kernel at an explicit tile (the sweep's entry; small_mm picks the tile). x [M, K], w [N, K]
    (gated: [2N, K]) -> [M, N], into out where given (x's dtype, unit column stride). pdl: None = PDL."""
    if tile.design == "fma" and tile.block_m not in (1, 2, 4, 8):
        raise ValueError(f"the fma design holds 1, 2, 4 or 8 rows a program, not {tile.block_m}")
    m, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m))
    use_pdl = (PDL if pdl is None else pdl) and _has_pdl(x.device)
    _kernel()[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        DOT=tile.design == "dot", GATED=gated, EVEN_K=k % tile.block_k == 0, USE_PDL=use_pdl, launch_pdl=use_pdl,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.warps, num_stages=tile.stages,
    )  # fmt: skip
    return out


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def small_mm(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N] in x's dtype (into out where given, bias None): the kernel
    where runs_kernel holds, else torch (the CPU path, and the reference)."""
    if out is not None and bias is not None:
        raise ValueError("small_mm writes into out only without a bias")
    tile = tile_for(x.shape[0], w.shape[0], x.shape[1]) if runs_kernel(x, w) else None
    if tile is None or (out is not None and (out.dtype != x.dtype or out.stride(1) != 1)):
        return F.linear(x, w, bias) if out is None else torch.mm(x, w.t(), out=out)
    y = launch(x, w, tile, out=out)
    return y if bias is None else y + bias


def takes(layer: nn.Module, x: torch.Tensor, on: bool) -> bool:
    """Whether `linear` runs the kernel: on, a plain nn.Linear (not FP8, not tensor-parallel) the kernel takes.
    Depends on shapes, dtypes and flags only, so it is fixed for a captured graph (its row count is static)."""
    return on and type(layer) is nn.Linear and runs_kernel(x, layer.weight)


def linear(layer: nn.Module, x: torch.Tensor, on: bool) -> torch.Tensor:
    """layer(x) [M, N], through small_mm where `takes` holds."""
    if takes(layer, x, on):
        assert isinstance(layer, nn.Linear)  # takes checked it
        return small_mm(x, layer.weight, layer.bias)
    return layer(x)


def small_silu_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for w [2I, K] = [gate | up] -> [M, I], each factor rounded to x's dtype
    (fused_ops.silu_mul's roundings). One kernel where a tile takes it; else torch's product, then silu_mul
    (its Triton kernel on the kernel path, where TILES names cuBLAS)."""
    kernel = runs_kernel(x, w)
    tile = tile_for(x.shape[0], w.shape[0], x.shape[1]) if kernel else None
    if tile is None:
        return silu_mul(F.linear(x, w), w.shape[0] // 2, fused=kernel)
    return launch(x, w, tile, gated=True)


def precompile(weights: list[tuple[torch.Tensor, bool]]) -> int:
    """Runs every bucket's tile once on each (weight [N, K], gated) so that Triton compiles before any graph
    capture (a compile inside a capture fails). Returns the launches made (0 where the kernel does not run)."""
    runs = 0
    for w, gated in weights:
        for b in BUCKETS:
            x = torch.ones((b, w.shape[1]), dtype=w.dtype, device=w.device)
            if runs_kernel(x, w):
                small_silu_mul(x, w) if gated else small_mm(x, w)
                runs += 1
    return runs
