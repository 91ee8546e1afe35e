"""Dense causal attention in Triton over packed fresh prompts: the "triton" dense prefill kernel
(model/prefill_attention.py) and a candidate of benchmarks/prefill_attention_bench.py.

What it computes: requests laid out back to back in q [T, H, D] and k, v [T, K, D], request r owning rows
[cu[r], cu[r + 1]); each query row attends causally to the rows of its own request up to itself (a fresh
prompt: its whole context is in these rows). out[t, h] = softmax(scale * q[t, h] . k[r, 0..t, h // G]) @ v[..].

Why a kernel of its own next to the unified one: the unified kernel reads K/V through the block tables one
token at a time and packs the G heads of a KV head into tall thin tiles, which suits decode rows and
chunks over a cached prefix; a fresh prompt wants the FlashAttention layout instead, BLOCK_M query rows of
ONE head against contiguous BLOCK_N-row K/V tiles (tl.dot on Hopper lowers to wgmma at these shapes), with
the off-diagonal tiles run without any mask and only the diagonal ones masked.

Design: grid (tiles, H). Tiles are numbered request by request, request r's starting at cu[r] // BLOCK_M + r
(room for ceil(n_r / BLOCK_M) tiles, sometimes one to spare), so the grid (T // BLOCK_M + R) comes from host
ints; a program finds its request by binary search over cu and exits on a spare index. Programs run the
last tiles first (they loop longest). Online softmax in fp32 with exp2 (scale * log2(e) folded in). No host
syncs, no allocations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = ["DenseConfig", "dense_causal_attention"]

_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class DenseConfig:
    """block_m query rows per program, block_n K/V rows per inner tile (block_m % block_n == 0)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


def _dense_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_ptr,
    qk_scale,
    num_reqs,
    stride_qt,
    stride_qh,  # q [T, H, D] (D contiguous)
    stride_kt,
    stride_kh,  # k [T, K, D]
    stride_vt,
    stride_vh,  # v [T, K, D]
    stride_ot,
    stride_oh,  # out [T, H, D]
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    lo = 0
    hi = num_reqs
    while lo < hi:  # the last r with cu[r] // BLOCK_M + r <= tile
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) // BLOCK_M + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    req = lo - 1
    start = tl.load(cu_ptr + req)
    length = tl.load(cu_ptr + req + 1) - start
    first = (tile - (start // BLOCK_M + req)) * BLOCK_M  # this tile's first row inside the request
    if first >= length:
        return

    m = first + tl.arange(0, BLOCK_M)  # [BM] row (= position) inside the request
    n = tl.arange(0, BLOCK_N)  # [BN]
    d = tl.arange(0, HEAD_DIM_PAD)  # [DP]
    d_ok = d < HEAD_DIM
    row_ok = m < length
    rows = (start + m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BM, DP]
    k_base = k_ptr + start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = v_ptr + start.to(tl.int64) * stride_vt + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    # Off-diagonal: keys [0, first) are before every row of the tile and inside the request: no masks.
    for kv in range(0, first, BLOCK_N):
        pos = kv + n
        k_ptrs = k_base + pos[:, None].to(tl.int64) * stride_kt + d[None, :]
        if HEAD_DIM == HEAD_DIM_PAD:  # no mask at all on the hot loads (keeps them wide)
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_base + pos[:, None].to(tl.int64) * stride_vt + d[None, :]
        if HEAD_DIM == HEAD_DIM_PAD:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    # Diagonal: keys [first, first + BLOCK_M), masked causally and at the request's end.
    end = tl.minimum(first + BLOCK_M, length)
    for kv in range(first, end, BLOCK_N):
        pos = kv + n
        ok = pos < length
        k = tl.load(
            k_base + pos[:, None].to(tl.int64) * stride_kt + d[None, :],
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(ok[None, :] & (pos[None, :] <= m[:, None]), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: key `first` is seen by every row
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + pos[:, None].to(tl.int64) * stride_vt + d[None, :],
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        if not HAVE_TRITON:
            raise RuntimeError(
                "dense_causal_attention needs triton; set prefill_attention=unified / flash / sdpa"
            )
        _KERNEL = triton.jit(_dense_kernel, do_not_specialize=["num_reqs"])
    return _KERNEL


def default_config(head_dim: int) -> DenseConfig:
    """Tiles that spill nothing at D <= 128 with 8 warps (two warpgroups over 128 rows); D > 128 halves M.
    Compiled offline for sm_90 (Triton 3.9, bf16): D 128 at M 128 / N 64 / 3 stages takes 236 registers,
    128 KiB of shared memory, no stack, and its dots are HGMMA (wgmma); D 64 (G 7): 116 registers, 64 KiB.
    Not yet timed on the GPU: benchmarks/prefill_attention_bench.py times it and two other tile shapes."""
    return (
        DenseConfig() if head_dim <= 128 else DenseConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    )


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu: torch.Tensor,
    num_reqs: int,
    scale: float,
    config: DenseConfig | None = None,
) -> None:
    """q, out [T, H, D]; k, v [T, K, D] (D contiguous; any row stride); cu [>= R + 1] int32 cumulative
    lengths from 0 on q's device. Writes out[0:cu[R]]; rows past it are neither read nor written."""
    num_tokens, num_heads, head_dim = q.shape
    if num_reqs == 0 or num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads or k.shape[2] != head_dim or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} vs k {tuple(k.shape)} / v {tuple(v.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q, k, v and out need a contiguous head_dim")
    cfg = config or default_config(head_dim)
    if cfg.block_m % cfg.block_n:
        raise ValueError(f"block_m {cfg.block_m} must be a multiple of block_n {cfg.block_n}")
    grid = (num_tokens // cfg.block_m + num_reqs, num_heads)
    _kernel()[grid](
        q,
        k,
        v,
        out,
        cu,
        scale * _LOG2E,
        num_reqs,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, 1 << (head_dim - 1).bit_length()),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
