"""Paged decode attention in Triton: one query token per request against its paged KV context.

What it computes: for request r (context length L = seq_lens[r], the current token included and
already written to the cache) and query head h, attending to KV head h // G (G = H // K):
    out[r, h] = softmax(scale * q[r, h] . k[r, 0..L-1, h // G]) @ v[r, 0..L-1, h // G]
where position p of request r lives at cache[block_tables[r, p // block_size], p % block_size].
seq_lens[r] == 0 marks a padded row: its out row is written as zeros and its table row is not read.

Why (what it replaces): decode at batch 256 spent 59% of its GPU time in a prefill-shaped varlen
FlashAttention kernel that does not pack the query heads of a KV head (so each K/V tile is read
G times and a one-token query fills a 128-row tile), plus 20% gathering every request's context into
a contiguous copy first (index_select of the context slots: a full extra read + write of K/V).
Here each K/V tile is read once, in place through the block tables, for all G heads that share it.

Split-KV ("flash-decoding"), two kernels:
- stage 1, grid (R, K, num_splits): program (r, kv_head, s) takes the G query heads of kv_head
  (padded to a power of two >= 16 for tl.dot, masked) and the tokens [s * chunk, min(L, (s+1) * chunk))
  with chunk = ceil(L / num_splits) rounded up to the tile BLOCK_N; it loops over BLOCK_N-token tiles
  (a tile may span several cache blocks or lie inside one: the block id is looked up per token),
  runs an online softmax in fp32 (exp2, scale * log2(e) folded in) and writes its partial
  (running max m, sum of exp l, unnormalised acc[D]) per head to the fp32 workspace. A split with an
  empty range (short context, padded row) writes m = -inf, l = 0, acc = 0.
  With num_splits == 1 there is nothing to combine: stage 1 normalises and writes `out` itself
  (zeros where l == 0) and stage 2 is not launched.
- stage 2, grid (R, H): combines the splits of one (request, head) with the log-sum-exp rescaling
  (weights exp2(m_s - max_s m_s)) and writes out[r, h] in q's dtype (zeros when every split is empty).

CUDA graphs: the grid and every constexpr depend only on host ints (R, K, H, D, num_splits, block
size, dtype), never on seq_lens or block_tables contents; each program reads its own length from
device memory. No host syncs, no allocations (the caller allocates the workspace once, outside any
graph pool, with decode_workspace). So a captured call replays correctly with new lengths/tables.

Workspace layout (fp32, flat): per request a block of REQ_STRIDE floats (rounded up to 16 floats so
every block starts 64-byte aligned), holding acc [H, num_splits, D] then (m, l) [H, num_splits, 2].

triton is imported guarded (HAVE_TRITON) and the kernels are jitted on first use, so importing this
module needs no triton, and TRITON_INTERPRET (the CPU tests) is honoured whenever it is set before the
first call.
"""

from __future__ import annotations

import math

import torch

from graphcache.model.paged_inputs import paged_cache_dims
from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = [
    "HAVE_TRITON",
    "choose_num_splits",
    "decode_workspace",
    "paged_decode_attention",
    "reference_decode_attention",
]

BLOCK_N = 64  # tokens per K/V tile (head_dim > 128 uses 32: see _block_n)
# On a one-byte (FP8) cache: the bytes of a bf16 tile. H100, 8B shape (BENCHMARKS §27): 64 rows at 512 and
# 2,048 tokens 56 -> 44 and 182 -> 126 us, 256 at 512 146 -> 133, 134 at 700 107 -> 112.
FP8_BLOCK_N = 128
MAX_SPLITS = 32  # choose_num_splits never goes past this
NUM_WARPS = 4
NUM_STAGES = 2  # software pipelining of the tile loop's loads (GPU only)
_LOG2E = math.log2(math.e)


def _block_n(head_dim: int, cache_dtype: torch.dtype) -> int:
    if head_dim > 128:
        return 32
    return FP8_BLOCK_N if cache_dtype.itemsize == 1 else BLOCK_N


def _req_stride(num_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 floats of workspace per request: acc [H, S, D] + (m, l) [H, S, 2], rounded up to 16."""
    return -(-num_heads * num_splits * (head_dim + 2) // 16) * 16


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_model_len: int, num_sms: int = 132) -> int:
    """How many KV splits a call site with this batch should use (a host int, fixed per call site, so a
    CUDA graph captured for num_reqs keeps it).

    Stage 1 runs num_reqs * num_kv_heads * num_splits programs. Pick the fewest splits that give about
    two waves of programs over the SMs (2 * num_sms): small batches split the context to fill the GPU,
    large ones (num_reqs * num_kv_heads >= 2 * num_sms) use 1 split, which also skips stage 2. Clamped
    to [1, MAX_SPLITS] and to ceil(max_model_len / BLOCK_N): more splits than tiles in the longest
    possible context would only add empty programs. Splits past a short request's context are empty
    programs (they write m = -inf, l = 0 and exit): cheap, but not free, so do not oversize
    max_model_len."""
    programs = max(1, num_reqs * num_kv_heads)
    want = -(-2 * num_sms // programs)
    cap = max(1, min(MAX_SPLITS, -(-max_model_len // BLOCK_N)))
    return max(1, min(want, cap))


def decode_workspace(max_reqs: int, num_heads: int, head_dim: int, num_splits: int, device) -> torch.Tensor:
    """fp32 scratch for the split partials of up to max_reqs requests with num_splits splits. Allocate it
    once, outside any CUDA graph pool. Flat [max_reqs * REQ_STRIDE] (module docstring: layout). One
    buffer sized for the largest batch and split count serves every call with fewer of both (a call
    checks only numel >= R * REQ_STRIDE of its own num_splits), and all layers can share it: each call's
    stage 2 consumes the partials before the next call on the stream overwrites them. Not written at
    all when num_splits == 1."""
    return torch.empty(
        max_reqs * _req_stride(num_heads, head_dim, num_splits), dtype=torch.float32, device=device
    )


# ---------------------------------------------------------------------------------------------
# Kernels. Plain functions here, wrapped with triton.jit on first use (see _kernels).


def _decode_stage1(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    ws_ptr,
    qk_scale,
    stride_qr,
    stride_qh,  # q [R, H, D] (D contiguous)
    stride_kb,
    stride_ks,
    stride_kh,  # k_cache [num_blocks, block_size, K, D] (D contiguous)
    stride_vb,
    stride_vs,
    stride_vh,  # v_cache, same shape
    stride_btr,  # block_tables [R_max, B] (B contiguous)
    stride_or,
    stride_oh,  # out [R, H, D] (D contiguous)
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    REQ_STRIDE: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    r = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(seq_len, lo + chunk)  # hi <= lo: empty (short context or padded row)

    g = tl.arange(0, GROUP_PAD)  # [GP] query head within the group
    d = tl.arange(0, HEAD_DIM_PAD)  # [DP]
    n = tl.arange(0, BLOCK_N)  # [BN] token within the tile
    head = kv_head * GROUP + g  # [GP] query head (h = kv_head * G + g, as HF's repeat_kv)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM

    q = tl.load(
        q_ptr + r * stride_qr + head[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [GP, DP] q dtype
    # An FP8 cache: the dots in fp16. E4M3 widens to fp16 in one packed op (two values), but to bf16 only through
    # fp16 and one more op per value, which tripled the kernel's conversions (SASS, sm_90). fp16 holds every E4M3
    # value exactly, every probability more precisely than bf16, and q's bf16 values exactly from 6.1e-5 to
    # 65,504 in magnitude (smaller ones, which add nothing to the dot products, lose bits).
    if k_ptr.dtype.element_ty == tl.float8e4nv:
        q = q.to(tl.float16)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # [GP] running max (log2)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # [GP] sum of exp2
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)  # [GP, DP]

    bt_row = bt_ptr + r.to(tl.int64) * stride_btr
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for start in range(lo, hi, BLOCK_N):
        pos = start + n  # [BN] positions
        valid = pos < hi
        # Block id per token (a tile may span several blocks or sit inside one; repeats hit L1).
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # [BN]
        off = pos % BLOCK_SIZE  # [BN]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_head + blk[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0
        ).to(q.dtype)  # [BN, DP]; an FP8 cache's values widened to q's 16 bits (a no-op for a 16-bit one)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [GP, BN] fp32, log2
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every tile holds >= 1 valid token
        alpha = tl.exp2(m_i - m_new)  # first tile: exp2(-inf) = 0
        p = tl.exp2(qk - m_new[:, None])  # [GP, BN], 0 at masked tokens
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + blk[:, None] * stride_vb + off[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0
        ).to(q.dtype)  # [BN, DP]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    gd_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT_OUT:
        # One split: normalise here. Empty (padded row): acc = 0, l = 0 -> zeros.
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + r * stride_or + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=gd_mask,
        )
    else:
        # Partials: acc [H, S, D] then (m, l) [H, S, 2] in this request's workspace block.
        ws = ws_ptr + r.to(tl.int64) * REQ_STRIDE
        row = head * NUM_SPLITS + split  # [GP]
        tl.store(ws + row[:, None] * HEAD_DIM + d[None, :], acc, mask=gd_mask)
        ml = ws + NUM_HEADS * NUM_SPLITS * HEAD_DIM + row * 2
        tl.store(ml, m_i, mask=g_mask)
        tl.store(ml + 1, l_i, mask=g_mask)


def _decode_stage2(
    ws_ptr,
    out_ptr,
    stride_or,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    REQ_STRIDE: tl.constexpr,
):
    r = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)  # [SP]
    d = tl.arange(0, HEAD_DIM_PAD)  # [DP]
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM

    ws = ws_ptr + r.to(tl.int64) * REQ_STRIDE
    row = head * NUM_SPLITS + s  # [SP]
    ml = ws + NUM_HEADS * NUM_SPLITS * HEAD_DIM + row * 2
    m_s = tl.load(ml, mask=s_mask, other=float("-inf"))  # [SP] log2 units
    l_s = tl.load(ml + 1, mask=s_mask, other=0.0)  # [SP]
    m_max = tl.max(m_s, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: avoid -inf - -inf
    w = tl.where(l_s > 0.0, tl.exp2(m_s - m_max), 0.0)  # [SP]
    l_tot = tl.sum(l_s * w, 0)
    acc = tl.load(
        ws + row[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )  # [SP, DP]
    o = tl.sum(acc * w[:, None], 0) / tl.where(l_tot > 0.0, l_tot, 1.0)  # [DP]
    tl.store(out_ptr + r * stride_or + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


_KERNELS = None


def _kernels():
    """(stage1, stage2) jitted once, on first use: TRITON_INTERPRET is read by triton.jit, so this
    honours it whenever it was set before the first call rather than before this module's import."""
    global _KERNELS
    if _KERNELS is None:
        if not HAVE_TRITON:
            raise RuntimeError("paged_decode_attention needs triton (pip install triton)")
        _KERNELS = (triton.jit(_decode_stage1), triton.jit(_decode_stage2))
    return _KERNELS


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    workspace: torch.Tensor,
    num_splits: int,
) -> None:
    """q [R, H, D]; k_cache, v_cache [num_blocks, block_size, K, D] (q's dtype or FP8 E4M3, widened on
    load; D contiguous); block_tables [R_max, B] int32/int64 (row-contiguous; rows >= R ignored);
    seq_lens [R_max] int32/int64 on q's device (context length including the current token; 0 = padded
    row -> zeros); out [R, H, D] q's dtype, every row written; workspace from decode_workspace(max_reqs
    >= R, H, D, num_splits). Launches 1 kernel (num_splits == 1) or 2. No host syncs: graph-capturable."""
    num_reqs, num_heads, head_dim = q.shape
    if num_reqs == 0:
        return
    block_size, num_kv_heads = paged_cache_dims(q, out, k_cache, v_cache, block_tables)
    req_stride = _req_stride(num_heads, head_dim, num_splits)
    if num_splits > 1 and workspace.numel() < num_reqs * req_stride:
        raise ValueError(
            f"workspace holds {workspace.numel() // req_stride} requests, need {num_reqs} "
            f"(decode_workspace(..., num_splits={num_splits}))"
        )
    stage1, stage2 = _kernels()
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, _next_pow2(head_dim))
    stage1[(num_reqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        workspace,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=max(16, _next_pow2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=_block_n(head_dim, k_cache.dtype),
        NUM_SPLITS=num_splits,
        REQ_STRIDE=req_stride,
        DIRECT_OUT=num_splits == 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if num_splits == 1:
        return
    stage2[(num_reqs, num_heads)](
        workspace,
        out,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=_next_pow2(num_splits),
        REQ_STRIDE=req_stride,
        num_warps=NUM_WARPS,
    )


def reference_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch, fp32 math, one request at a time (tests and benchmarks only: it syncs).
    Same arguments as paged_decode_attention; returns [R, H, D] fp32 (zeros for seq_len 0 rows)."""
    num_reqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_reqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for r, length in enumerate(seq_lens[:num_reqs].tolist()):
        if length == 0:
            continue
        pos = torch.arange(length, device=q.device)
        blocks = block_tables[r].long()[pos // block_size]  # [L]
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)  # [L, H, D]
        scores = torch.einsum("hd,lhd->hl", q[r].float(), k) * scale  # [H, L]
        out[r] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out
