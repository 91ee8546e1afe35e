"""FP8 GEMMs in Triton: block-scaled weights (any batch), and row-scaled weights at decode batch sizes.

W [N, K] is FP8 row-major. One kernel, two modes:

  block scales  xq [T, K] FP8 (quantized per token and bk columns):
                y[t, n] = sum over k-blocks j of sa[t, j] * sw[n // bn, j] * (xq[t, j] . W[n, j])
                DeepSeek-style `weight_block_size` [bn, bk] checkpoints: the K tile is bk wide, so every
                tile product has one scale pair, applied before it is accumulated.
  weight only   (`weight_only_mm`, T <= 16 rows, row-scaled W) x stays in 16 bits:
                y[t, n] = sw[n] * (x[t] . W[n]), W's tiles widened to x's dtype in registers (exact:
                every E4M3 value is a bf16 and an fp16 value), multiplied on the 16-bit tensor cores;
                at one row (ONE_ROW) multiply-adds in fp32 instead, with no 16-row MMA tile to fill.
                `weight_only_silu_mul`: the same on a [gate | up] weight, silu(gate) * up applied to the
                accumulators (the MLP's activation without a launch of its own).
                `weight_only_qkv_rope` (one token): the qkv GEMM with rotary and the KV cache write in
                its epilogue (fp8_rope.py; the attention's rotary kernel without a launch of its own).
Larger row-scaled batches go to torch._scaled_mm (fp8_linear.fp8_mm). Why weight only at <= 16 rows:
the GEMM is bound by reading W there, so FP8 tensor cores buy nothing, while quantizing x first costs a
pass over x before the first product (every program needs the row's amax). The narrow N tiles give
every SM its share of W to stream, where _scaled_mm's large-tile kernels leave most SMs idle at T = 1.
Loads are masked along K only where K is not a multiple of the K tile (no served shape): the mask kept
the one-row kernel's loads from streaming W at full speed (BENCHMARKS.md §14). benchmarks/fp8_gemv_sweep.py
times the designs (§13, §14).

On the CPU the dequantized operands are multiplied in fp32 (`emulated_mm`, and weight_only_mm's own
fallback: the same sums up to fp32 rounding order); tests/model/test_fp8.py checks the kernels against it
under Triton's interpreter and tests/gpu/test_fp8_cuda.py on the GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from graphcache.model import fp8_rope
from graphcache.model.fp8_rope import RopeArgs
from graphcache.model.fused_ops import silu_mul
from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = [
    "WEIGHT_ONLY_MAX_ROWS",
    "block_m",
    "RopeArgs",
    "folds_rope",
    "weight_only_qkv_rope",
    "block_scaled_mm",
    "emulated_mm",
    "weight_only_mm",
    "weight_only_silu_mul",
]

WEIGHT_ONLY_MAX_ROWS = 16  # the decode kernel's one BLOCK_M tile: steps of up to 16 rows leave x unquantized


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
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    stride_cos,
    stride_cs,
    stride_ch,
    rope_heads,
    q_heads,
    BLOCK_SCALES: tl.constexpr,
    ONE_ROW: tl.constexpr,
    GATED: tl.constexpr,
    ROPE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # b [N, K] fp8 row-major (read as [K, N] tiles), c [M, N] written. BLOCK_SCALES: a [M, K] fp8 with
    # sa [M, K / BLOCK_K] (strides stride_sa_m, stride_sa_g), sb [ceil(N / GROUP_N), K / BLOCK_K]. Else
    # (weight only): a is the 16-bit x [M, K], b's tiles are widened to its dtype, sb [N]; sa_ptr unused.
    # GATED (weight only): b is [2N, K] = [gate | up] and c [M, N] = silu(x . gate) * (x . up), each
    # factor rounded to c's dtype first as silu_mul does (the [M, 2N] GEMM output is never written).
    # ONE_ROW (weight only, M = 1): no tensor cores, a multiply-add per weight into fp32 accumulators
    # summed across threads once after the loop (at one row a 16-row MMA tile is 15/16 padding and its
    # shared-memory round trip the cost; a sum per K tile would put a cross-warp reduction in the loop).
    # ROPE (ONE_ROW, GATED off): b is the qkv weight [(H + 2K) * D, K] and c its [1, N] output with q and k
    # rotated and k, v also written to their cache slots (what fused_ops.rotary_cache_ does after the GEMM).
    # Each program streams 2 x BLOCK_N rows, like GATED: in a q or k head the dims d and d + D/2 that rotary
    # pairs, in a v head 2 x BLOCK_N consecutive rows (rope_heads = H + K, q_heads = H, D = HEAD_DIM).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROPE:
        offs_n, up, is_rope, head, dim = _rope_rows(pid_n, rope_heads, HEAD_DIM, BLOCK_N)
        up_rows = up * stride_bn
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        up_rows = N * stride_bn  # GATED: the up half starts N rows down
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if USE_PDL:  # launched before the previous kernel ended: wait for its writes (x), let the next one in
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if ONE_ROW:
        # Accumulators [BLOCK_N, BLOCK_K / 8]: each thread adds up the products of its 8 consecutive K
        # values before they go in, so it holds one fp32 per row where a [BLOCK_N, BLOCK_K] accumulator
        # held eight. That took the kernel from 65 registers a thread to 40 at (4, 1024, 4): 12 programs
        # an SM instead of 7, so every N tile of a 4096-row weight is resident at once and more of W is
        # in flight (BENCHMARKS.md §17: the 8B layer's four one-row GEMMs 94.6 -> 61.6 us).
        acc_g = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        # W and x in one register layout: 8 K values a thread for both (8 bytes of W, 16 of x), so x [1,
        # BLOCK_K] broadcasts over W's rows in registers and the sum over a thread's 8 is in registers too.
        # Left to itself the compiler gives W 16 a thread and x 8, and converts x through shared memory with
        # two barriers every K tile. The layouts only agree where every warp lies along K, BLOCK_K a multiple
        # of 8 x 32 x num_warps (1024 at 4 warps; at 512 / 4 or 1024 / 8 the conversion is back:
        # scripts/fp8_one_row_sass.py prints the K loop's instructions and the registers).
        offs_k8 = tl.max_contiguous(offs_k, 8)
        w_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k8[None, :]  # [BLOCK_N, BLOCK_K], K contiguous
        x_ptrs = a_ptr + offs_k8[None, :]  # [1, BLOCK_K]
        for j in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:  # no mask along K (every real shape): nothing keeps the loads from full vectors
                w_mask = n_mask[:, None]
                x = tl.load(x_ptrs).to(tl.float32)
            else:
                k_mask = offs_k < K - j * BLOCK_K
                w_mask = n_mask[:, None] & k_mask[None, :]
                x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
            prod_g = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x  # [BLOCK_N, BLOCK_K]
            acc_g += tl.sum(tl.reshape(prod_g, (BLOCK_N, BLOCK_K // 8, 8)), axis=2)
            if GATED or ROPE:
                prod_u = tl.load(w_ptrs + up_rows, mask=w_mask, other=0.0).to(tl.float32) * x
                acc_u += tl.sum(tl.reshape(prod_u, (BLOCK_N, BLOCK_K // 8, 8)), axis=2)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        row = tl.sum(acc_g, axis=1)[None, :]  # [1, BLOCK_N]
        row_u = tl.sum(acc_u, axis=1)[None, :]
    else:
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a_mask = m_mask[:, None]
                b_mask = n_mask[None, :]
            else:
                k_mask = offs_k < K - j * BLOCK_K
                a_mask = m_mask[:, None] & k_mask[None, :]
                b_mask = k_mask[:, None] & n_mask[None, :]
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            if BLOCK_SCALES:
                sa = tl.load(sa_ptr + offs_m * stride_sa_m + j * stride_sa_g, mask=m_mask, other=0.0)
                sb = tl.load(sb_ptr + (offs_n // GROUP_N) * stride_sb_n + j, mask=n_mask, other=0.0)
                acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
            else:
                acc = tl.dot(a, b.to(a.dtype), acc)
                if GATED:
                    b_up = tl.load(b_ptrs + up_rows, mask=b_mask, other=0.0)
                    acc_up = tl.dot(a, b_up.to(a.dtype), acc_up)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        row, row_u = acc, acc_up
    if not BLOCK_SCALES:
        row = row * tl.load(sb_ptr + offs_n * stride_sb_n, mask=n_mask, other=0.0)[None, :]
    if ROPE:
        row_u = row_u * tl.load(sb_ptr + (offs_n + up) * stride_sb_n)[None, :]
        _rope_store(
            c_ptr, row, row_u, offs_n, up, is_rope, head, dim, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr,
            vc_ptr, stride_cos, stride_cs, stride_ch, rope_heads, q_heads, HEAD_DIM,
        )  # fmt: skip
    else:
        if GATED:
            row_u = row_u * tl.load(sb_ptr + (offs_n + N) * stride_sb_n, mask=n_mask, other=0.0)[None, :]
            g = row.to(c_ptr.dtype.element_ty).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(c_ptr.dtype.element_ty).to(tl.float32)  # F.silu, rounded
            row = act * row_u.to(c_ptr.dtype.element_ty).to(tl.float32)
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, row.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


_KERNEL = None
# fp8_rope's helpers, jitted with the kernel (JITFunctions: Any, triton has no types).
_rope_rows: Any = None
_rope_store: Any = None


def _kernel():
    global _KERNEL, _rope_rows, _rope_store
    if _KERNEL is None:
        _rope_rows = triton.jit(fp8_rope.rope_rows)  # the kernel finds its helpers as this module's globals
        _rope_store = triton.jit(fp8_rope.rope_store)
        # The batch rows (and the block scales' stride, = rows) vary per step: not specialized on, so a new
        # batch size never compiles (nor compiles inside a graph capture).
        _KERNEL = triton.jit(_fp8_mm_kernel, do_not_specialize=["M", "stride_sa_g"])
    return _KERNEL


# (BLOCK_N, BLOCK_K, num_warps, num_stages) of GEMMs of at most 16 rows, bound by streaming W:
# N tiles narrow enough that the grid covers the H200's 132 SMs (N = 4096: 128 tiles), K tiles wide enough
# to keep loads in flight. benchmarks/fp8_gemv_sweep.py times alternatives on the 8B shapes.
DECODE_TILE = (32, 256, 4, 4)
# The same for one row (ONE_ROW): narrower N tiles, longer K tiles. BENCHMARKS.md §17, us on the H200: o_proj
# 6.6 and down_proj 16.1 at this tile, 7.9 and 21.3 at (4, 1024, 4, 2); (2, 2048, 4, 2) and (8, 1024, 4, 2)
# in between.
ONE_ROW_TILE = (2, 1024, 4, 2)
# One row of the gated gate_up GEMM: each program streams BLOCK_N rows of gate and as many of up (§17: 30.2
# us at this tile, 30.7-32.1 at (2, 2048), (4, 2048), (8, 1024), 37.5 at (2, 1024)).
GATED_ONE_ROW_TILE = (4, 1024, 4, 2)
# One row of the qkv GEMM with rotary and the KV write in its epilogue (ROPE): BLOCK_N rows a half, so a
# program streams 4 rows (the plain kernel at 4 rows: qkv_proj 9.0 us in §17, 9.2 at 2, 8.7 at (2, 2048)).
ROPE_ONE_ROW_TILE = (2, 1024, 4, 2)
# Programmatic dependent launch of the weight-only kernels (a kernel is launched while the one before it
# drains, and waits in griddepcontrol.wait for its writes): None = on where the GPU has it (compute
# capability 9.0+; the instructions do not exist before Hopper). The 8B FP8 decode at batch 1 took 3.30-3.45
# ms with it against 3.54-3.57 without (BENCHMARKS.md §15). True / False force it (benchmarks' A/B).
PDL: bool | None = None
# Rotary and the KV write in the one-token qkv GEMM's epilogue (weight_only_qkv_rope); False runs the GEMM,
# then fused_ops.rotary_cache_ (an A/B switch for benchmarks and tests, read when a forward runs or is captured).
ROPE_IN_GEMM = True


def _tiles(
    m: int, block_k: int | None, gated: bool = False, rope: bool = False
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); block_k: the weight's scale block (block scales)."""
    if m == 1 and block_k is None:
        tile = ROPE_ONE_ROW_TILE if rope else GATED_ONE_ROW_TILE if gated else ONE_ROW_TILE
        block_n, k, warps, stages = tile
        return 1, block_n, k, warps, stages
    if m <= 16:
        block_n, k, warps, stages = DECODE_TILE
        return 16, block_n, block_k or k, warps, stages
    if m <= 64:
        return 64, 64, block_k or 128, 4, 3
    return 128, 128, block_k or 128, 8, 3


def block_m(m: int, block_k: int | None) -> int:
    """The GEMM kernel's BLOCK_M for `m` rows (a constexpr: each value compiles once)."""
    return _tiles(m, block_k)[0]


def _launch_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_w: torch.Tensor,
    block: tuple[int, int] | None,
    out_dtype: torch.dtype,
    gated: bool = False,
    rope: RopeArgs | None = None,
) -> torch.Tensor:
    """The one GEMM kernel on a [T, K] x w [N, K] -> [T, N]. block None: weight only (a is the 16-bit x,
    scale_a None, scale_w [N, 1]); else [bn, bk] block scales (a fp8, scale_a [T, K / bk]). gated (weight
    only): w is [gate | up], [2N, K], and the result silu(gate) * up, [T, N]. rope (weight only, one token):
    w is the qkv weight and the result its output with q, k rotated, k and v written to the cache."""
    m, k = a.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    block_m, block_n, block_k, warps, stages = _tiles(
        m, None if block is None else block[1], gated, rope is not None
    )
    if rope is None:  # the rotary operands are unread without ROPE: any tensor (a), any ints
        pos, cos, sin, slots, kc, vc, heads, q_heads, head_dim = a, a, a, a, a, a, 0, 0, 2
    else:
        pos, cos, sin, slots, kc, vc, heads, q_heads, head_dim = rope.operands()
    if block is None:  # weight only: sa_ptr is unused, its strides 0
        sa, stride_sa_g, stride_sa_m = scale_w, 0, 0
    else:  # scale_a [T, K / bk]
        assert scale_a is not None  # block scales come with the activation's scales
        sa, stride_sa_g, stride_sa_m = scale_a, scale_a.stride(1), scale_a.stride(0)
    rows_a_program = 2 * block_n if rope is not None else block_n  # ROPE: two halves of BLOCK_N rows
    use_pdl = block is None and _pdl_on(a.device)
    _kernel()[(triton.cdiv(m, block_m), triton.cdiv(n, rows_a_program))](
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
        pos,
        cos,
        sin,
        slots,
        kc,
        vc,
        cos.stride(0),
        kc.stride(0),
        kc.stride(1) if kc.dim() > 1 else 0,
        heads,
        q_heads,
        BLOCK_SCALES=block is not None,
        ONE_ROW=block_m == 1,  # _tiles' one-row tile: weight only at M = 1
        GATED=gated,
        ROPE=rope is not None,
        HEAD_DIM=head_dim,
        EVEN_K=k % block_k == 0,
        USE_PDL=use_pdl,
        launch_pdl=use_pdl,
        GROUP_N=1 if block is None else block[0],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _pdl_on(device: torch.device) -> bool:
    """PDL, or where it is None, whether the device has programmatic dependent launch."""
    return _has_pdl(device) if PDL is None else PDL


def weight_only_mm(
    x: torch.Tensor, w: torch.Tensor, scale_w: torch.Tensor, out_dtype: torch.dtype, kernel: bool = True
) -> torch.Tensor:
    """x [T, K] (T <= WEIGHT_ONLY_MAX_ROWS), w [N, K] fp8 with scale_w [N, 1] -> [T, N] = x @ (w * scale_w).T,
    x not quantized. kernel: the Triton kernel where it applies (CUDA, bf16 or fp16 x with contiguous
    columns: W widened in registers, 16-bit products, fp32 sums); otherwise the fp32 product of the
    dequantized W (the CPU path and the reference; on CUDA with the fused kernels off, a slow debug path)."""
    if x.shape[0] > WEIGHT_ONLY_MAX_ROWS:
        raise ValueError(f"weight_only_mm takes at most {WEIGHT_ONLY_MAX_ROWS} rows, got {tuple(x.shape)}")
    if _runs_kernel(x, kernel):
        return _launch_gemm(x, w, None, scale_w, None, out_dtype)
    return ((x.float() @ w.float().t()) * scale_w.view(1, -1)).to(out_dtype)


def weight_only_silu_mul(
    x: torch.Tensor, w: torch.Tensor, scale_w: torch.Tensor, out_dtype: torch.dtype, kernel: bool = True
) -> torch.Tensor:
    """silu_mul of weight_only_mm(x, w, ...): w [2I, K] fp8 = [gate | up] -> [T, I] = silu(gate) * up, each
    factor rounded to out_dtype as fused_ops.silu_mul rounds it. The kernel applies the activation to its
    accumulators (one launch less a layer, and the [T, 2I] product is never written)."""
    if x.shape[0] > WEIGHT_ONLY_MAX_ROWS:
        raise ValueError(
            f"weight_only_silu_mul takes at most {WEIGHT_ONLY_MAX_ROWS} rows, got {tuple(x.shape)}"
        )
    if _runs_kernel(x, kernel):
        return _launch_gemm(x, w, None, scale_w, None, out_dtype, gated=True)
    return silu_mul(weight_only_mm(x, w, scale_w, out_dtype, kernel=False), w.shape[0] // 2, fused=False)


def weight_only_qkv_rope(
    x: torch.Tensor, w: torch.Tensor, scale_w: torch.Tensor, out_dtype: torch.dtype, rope: RopeArgs
) -> torch.Tensor:
    """weight_only_mm of one token's qkv (x [1, K], w [(H + 2K) * D, K]), then fused_ops.rotary_cache_ on
    its q, k, v, in one kernel (folds_rope must hold): the [1, N] result holds q and k rotated, and k, v are
    in their cache slots, as the two steps leave them (the same roundings: bit for bit, given the GEMM's
    sums). One launch a layer less at batch 1."""
    return _launch_gemm(x, w, None, scale_w, None, out_dtype, rope=rope)


def folds_rope(x: torch.Tensor, w: torch.Tensor, rope: RopeArgs, kernel: bool = True) -> bool:
    """Whether weight_only_qkv_rope takes these operands: one token on the kernel path, w's rows the heads'
    and the caches and tables in the rotary kernel's layout, in x's dtype (an FP8 KV cache takes the GEMM,
    then fused_ops.rotary_cache_, which rounds to E4M3)."""
    d, kc, vc = rope.head_dim, rope.k_slots, rope.v_slots
    rows = (rope.num_heads + 2 * rope.num_kv_heads) * d
    layout = kc.stride() == vc.stride() and kc.dim() == 3 and kc.stride(2) == 1 and rope.cos.stride(1) == 1
    layout = layout and kc.dtype == vc.dtype == x.dtype
    halves = d % (2 * ROPE_ONE_ROW_TILE[0]) == 0
    one_token = ROPE_IN_GEMM and x.shape[0] == 1
    return one_token and _runs_kernel(x, kernel) and w.shape[0] == rows and layout and halves


def _runs_kernel(x: torch.Tensor, kernel: bool) -> bool:
    """Whether the weight-only Triton kernel takes x (CUDA, 16-bit, contiguous columns)."""
    sixteen_bits = x.dtype in (torch.bfloat16, torch.float16)
    return kernel and x.is_cuda and HAVE_TRITON and sixteen_bits and x.stride(1) == 1


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
    """What the W8A8 GEMMs compute (_scaled_mm, the block-scaled kernel), from the dequantized operands in
    fp32 (the CPU path)."""
    if block is None:
        return ((xq.float() @ w.float().t()) * scale_a * scale_w.view(1, -1)).to(out_dtype)
    bn, bk = block
    n, k = w.shape
    x = xq.float() * scale_a.repeat_interleave(bk, 1)[:, :k]  # [T, K]
    wd = w.float() * scale_w.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]  # [N, K]
    return (x @ wd.t()).to(out_dtype)
