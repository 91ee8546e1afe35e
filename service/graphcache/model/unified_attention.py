"""Paged attention in Triton for any mix of rows: decode rows and prefill chunks in ONE launch.

What it computes: the step's tokens are laid out request after request, request r owning the query
rows [query_start_loc[r], query_start_loc[r + 1]) (n_r rows) with a context of L_r = seq_lens[r]
positions, this step's keys/values included (already written to the cache). Query row j of request
r sits at absolute position L_r - n_r + j (bottom-right aligned causal) and, for query head h,
    out[t, h] = softmax(scale * q[t, h] . k[r, 0..pos, h // G]) @ v[r, 0..pos, h // G]
where position p of request r lives at cache[block_tables[r, p // block_size], p % block_size].
A decode row is n_r = 1; a chunk over a cached prefix has L_r > n_r. Rows past
query_start_loc[num_reqs] (padding) are neither read nor written.

Why (what it replaces): a mixed step gathered every request's whole context out of the pages and ran
FlashAttention varlen over the copy, which puts a one-token decode row into a 128-row tile and reads
each K/V tile once per query head. Here K/V are read in place through the block tables and the G query
heads of a KV head share each K/V tile.

Design (the layout of vLLM's Triton unified attention, written anew here):
- grid (num_q_tiles, K). A program takes BLOCK_Q consecutive query tokens of ONE request and the G
  query heads of one KV head, packed into the M dimension of its tiles: row m is token m // G, head
  kv_head * G + m % G (BLOCK_Q = BLOCK_M // G, rows >= BLOCK_Q * G are masked). So a decode row fills
  G rows of its tile and a chunk fills BLOCK_Q * G.
- Tiles are numbered request by request: request r's tiles start at query_start_loc[r] // BLOCK_Q + r
  (room for ceil(n_r / BLOCK_Q) tiles, sometimes one to spare), so num_q_tiles = T // BLOCK_Q + R
  is an upper bound from host ints alone; a program finds its request by binary search over
  query_start_loc and exits when its tile index lies past that request's rows. Programs take the
  tiles in reverse order, so the long chunk tiles (last in the step) start first.
- It loops over BLOCK_N-token K/V tiles from position 0 up to the last causal position of its
  tile's rows (the block id looked up per token, so any power-of-two block size works, smaller or
  larger than BLOCK_N), with an online softmax in fp32 (exp2, scale * log2(e) folded in). Position 0
  is visible to every row, so each row's running max is finite after the first tile.
- No split-KV: a mixed step has enough (tile, KV head) programs to fill the GPU; uniform-decode steps
  keep model/decode_attention.py, which splits the context for small batches.

CUDA graphs: the grid and every constexpr depend on host ints only (T, R, H, K, D, block size, the
tile sizes); lengths, starts and tables are read from device memory. No host syncs, no allocations.

triton is imported guarded and the kernel is jitted on first use (TRITON_INTERPRET honoured for the
CPU tests whenever it is set before the first call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphcache.model.paged_inputs import paged_cache_dims
from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = [
    "HAVE_TRITON",
    "UnifiedConfig",
    "choose_config",
    "reference_unified_attention",
    "unified_attention",
]

_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class UnifiedConfig:
    """Tile shape of one launch. block_m: query rows (tokens x packed heads) per program, a power of
    two >= 16; block_n: K/V tokens per inner tile; num_warps / num_stages: Triton's launch knobs."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def choose_config(group: int, head_dim: int, max_query_len: int, kv_bytes: int = 2) -> UnifiedConfig:
    """The tile shape for a step whose longest request feeds max_query_len tokens (a host int).
    Decode-only steps want the smallest M that holds the G packed heads (16: tl.dot's minimum);
    steps with chunks want a taller M so each K/V tile is reused by more query rows. Not yet tuned
    on the H200: benchmarks/mixed_attention_bench.py overrides every field from its command line.
    What ptxas reports for sm_90a (bf16, compiled offline): these defaults spill nothing (D 64, M 64:
    ~135 registers; D 128, M 64: ~180 with wgmma; D 256, M 32: ~190); D 128 at M 128 needs 8 warps,
    and fp32 (ieee dots, a correctness path) spills at M 64, D 128. kv_bytes: the cache's element size; an
    FP8 cache (1) takes 128-token K/V tiles up to D 128: half the bytes a token, so twice the tokens in the
    same shared memory. At the 8B shape (H100) that is 5-6% faster on decode-only and mixed steps and 2%
    slower on an 8 x 1,024 prefill (BENCHMARKS §30; its sweep in §28: 7-11% in 3 of 4 steps)."""
    group_rows = max(16, _next_pow2(group))
    block_n = (128 if kv_bytes == 1 else 64) if head_dim <= 128 else 32
    if max_query_len <= 1:
        return UnifiedConfig(block_m=group_rows, block_n=block_n)
    block_m = max(group_rows, 64 if head_dim <= 128 else 32)
    return UnifiedConfig(block_m=block_m, block_n=block_n, num_warps=4)


def _unified_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    qk_scale,
    num_reqs,
    stride_qt,
    stride_qh,  # q [T, H, D] (D contiguous)
    stride_kb,
    stride_ks,
    stride_kh,  # k_cache [num_blocks, block_size, K, D] (D contiguous)
    stride_vb,
    stride_vs,
    stride_vh,  # v_cache, same shape
    stride_btr,  # block_tables [R_max, B] (B contiguous)
    stride_ot,
    stride_oh,  # out [T, H, D] (D contiguous)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Tiles run last request first: the runner puts decode rows first and chunks last, and a chunk's
    # tiles loop over the longest contexts, so starting them first shortens the launch's tail.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    # The request of this tile: the last r with query_start_loc[r] // BLOCK_Q + r <= tile.
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    req = lo - 1
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    local = tile - (q_start // BLOCK_Q + req)  # this tile's index inside its request
    if local * BLOCK_Q >= q_len:  # a spare tile index: nothing to do
        return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    context = seq_len - q_len  # positions before this step's first token

    m = tl.arange(0, BLOCK_M)  # [BM] row: token m // G, head m % G
    d = tl.arange(0, HEAD_DIM_PAD)  # [DP]
    n = tl.arange(0, BLOCK_N)  # [BN] token within a K/V tile
    tok = local * BLOCK_Q + m // GROUP  # [BM] token index inside the request
    head = kv_head * GROUP + m % GROUP  # [BM] query head (h = kv_head * G + g)
    row_ok = (m < BLOCK_Q * GROUP) & (tok < q_len)  # [BM]
    d_ok = d < HEAD_DIM
    # Masked rows take the tile's last real position, so they see keys like a real row (no -inf rows).
    last_tok = tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len) - 1
    q_pos = context + tl.where(row_ok, tok, last_tok)  # [BM] absolute position of each row
    kv_end = context + last_tok + 1  # keys [0, kv_end) cover every row of the tile
    diag = context + local * BLOCK_Q + 1  # keys [0, diag) are seen by every row of the tile

    row_off = (q_start + tok).to(tl.int64)  # [BM] token row in q / out
    q = tl.load(
        q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BM, DP] q dtype
    # An FP8 cache: the dots in fp16 (decode_attention.py's stage 1 says why).
    if k_ptr.dtype.element_ty == tl.float8e4nv:
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BM] running max (log2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BM] sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)  # [BM, DP]

    # In the JIT `req` is a triton scalar (the loop made `lo` one); mypy sees `lo = 0`, an int.
    bt_row = bt_ptr + req.to(tl.int64) * stride_btr  # type: ignore[attr-defined]
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for start in range(0, kv_end, BLOCK_N):
        pos = start + n  # [BN]
        valid = pos < kv_end
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # [BN]
        off = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(
            k_head + blk[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0
        ).to(q.dtype)  # [BN, DP]; an FP8 cache's values widened to q's 16 bits (a no-op for a 16-bit one)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN] fp32, log2
        if start + BLOCK_N > diag:  # only tiles that reach the tile's first row's position need masks
            seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])  # causal, bottom-right
            qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: position 0 is in the first tile of every row
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])  # [BM, BN], 0 where not seen
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + blk[:, None] * stride_vb + off[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0
        ).to(q.dtype)  # [BN, DP]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(
        out_ptr + row_off[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        if not HAVE_TRITON:
            raise RuntimeError(
                "unified_attention needs triton (pip install triton); "
                "or set GRAPHCACHE_ATTENTION_BACKEND=flash / sdpa"
            )
        # num_reqs changes every step: one compiled variant for all values, not extra ones for
        # num_reqs == 1 or a multiple of 16 (Triton's default integer specialisation).
        _KERNEL = triton.jit(_unified_kernel, do_not_specialize=["num_reqs"])
    return _KERNEL


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_reqs: int,
    config: UnifiedConfig | None = None,
    max_query_len: int | None = None,
) -> None:
    """q, out [T, H, D] (T may include padded rows past query_start_loc[num_reqs]: untouched);
    k_cache, v_cache [num_blocks, block_size, K, D] in q's dtype or FP8 E4M3 (widened on load;
    model/kv_dtype.py); query_start_loc [>= R + 1] int32/int64, seq_lens [>= R] and block_tables
    [>= R, B] (row-contiguous) on q's device. `config` fixes the tiles (a CUDA graph must keep one);
    else choose_config from max_query_len (default: a chunked step). One launch; no host syncs:
    graph-capturable."""
    num_tokens, num_heads, head_dim = q.shape
    if num_reqs == 0 or num_tokens == 0:
        return
    block_size, num_kv_heads = paged_cache_dims(q, out, k_cache, v_cache, block_tables)
    group = num_heads // num_kv_heads
    cfg = config or choose_config(
        group, head_dim, num_tokens if max_query_len is None else max_query_len, k_cache.element_size()
    )
    if cfg.block_m < group or cfg.block_m < 16 or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(
            f"block_m {cfg.block_m} must be a power of two >= max(16, heads per KV head {group})"
        )
    block_q = cfg.block_m // group
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _kernel()[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * _LOG2E,
        num_reqs,
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
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, _next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=block_q,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def reference_unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_reqs: int,
) -> torch.Tensor:
    """Plain torch, fp32 masked attention over each request's gathered context, one request at a time
    (tests and benchmarks only: it syncs). Same arguments as unified_attention; returns
    [query_start_loc[num_reqs], H, D] fp32."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc[: num_reqs + 1].tolist()
    out = torch.empty(starts[-1], num_heads, head_dim, dtype=torch.float32, device=q.device)
    for r, length in enumerate(seq_lens[:num_reqs].tolist()):
        s, e = starts[r], starts[r + 1]
        pos = torch.arange(length, device=q.device)
        blocks = block_tables[r].long()[pos // block_size]  # [L]
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(length - (e - s), length, device=q.device)  # [n]
        scores = torch.einsum("nhd,lhd->hnl", q[s:e].float(), k) * scale  # [H, n, L]
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[s:e] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out
