"""The experts of a mixture-of-experts layer on the GPU: a grouped GEMM in Triton, CUDA-graph capturable.

Each of the T tokens goes to its top-k experts: N = T * k (token, slot) assignments, each a row of the
flat [N] routing arrays (assignment a = token a // k, slot a % k). Every step is fixed-shape device work,
with no host sync and no data-dependent size, so the whole layer is recorded inside a CUDA graph:

  1. align    sort the assignments by expert and pad each expert's group to a multiple of BLOCK_M:
              sorted_ids [S] (assignment ids; padding = N), block_expert [MB] (the expert of each block
              of BLOCK_M rows) and num_padded [1] (rows in use). S = N + min(E, N) * (BLOCK_M - 1) is the
              bound for any routing (each active expert wastes at most BLOCK_M - 1 rows), MB = S / BLOCK_M.
              Three small kernels: per-chunk expert counts, one program for the per-expert prefix sums
              and block starts, a scatter into sorted order (order within an expert is the assignment
              order: the same every run).
  2. gate_up  per (block, column tile): x rows of the block's tokens @ the expert's [2I, H] gate and up
              rows, silu(gate) * up fused, written to inter [N, I] at the assignments' rows.
  3. down     per (block, column tile): inter rows @ the expert's [H, I], times the routing weight,
              written to out [N, H] = [T, k, H] at the assignments' rows.
  4. reduce   out.sum over the k slots in fp32: deterministic (no atomics), one cast to the model dtype.

Blocks past num_padded return at once: the grid is the static bound MB, the work the real routing.
Every output row is written by exactly one program, so nothing needs zeroing (the tests poison the
buffers). Rounding follows the PyTorch reference (model/moe.py): each projection's output is rounded
to the model dtype, SiLU before the multiply, the weighted output before the sum.

triton is imported guarded and the kernels are jitted on first use (as in fused_ops.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "MoeBlocks", "align_by_expert", "align_reference", "fused_experts", "pick_blocks"]


class MoeBlocks(NamedTuple):
    """Tile sizes of the grouped GEMMs (chosen per step shape by pick_blocks)."""

    m: int  # rows of one expert's group per program (the alignment unit)
    n: int  # output columns per program
    k: int  # reduction step
    warps: int
    stages: int


def pick_blocks(num_assignments: int, num_experts: int) -> MoeBlocks:
    """Tiles for N assignments over E experts, by the mean rows an expert gets. Decode (a few rows per
    expert) reads each expert's weights once per step and is bandwidth-bound: small BLOCK_M (little
    padding), a long BLOCK_K per load. Prefill has hundreds of rows per expert: H200-sized tensor-core
    tiles."""
    mean = num_assignments / max(1, num_experts)
    if mean <= 16:
        return MoeBlocks(16, 64, 128, 4, 3)
    if mean <= 48:
        return MoeBlocks(32, 64, 64, 4, 3)
    return MoeBlocks(64, 128, 64, 4, 3)


def padded_bound(num_assignments: int, num_experts: int, block_m: int) -> int:
    """S: the most sorted rows any routing of N assignments needs, rounded up to whole blocks."""
    rows = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return -(-rows // block_m) * block_m


# --- kernels ------------------------------------------------------------------------------------------------
def _count_kernel(ids_ptr, counts_ptr, n, num_experts, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[p, e] = assignments of chunk p (BLOCK_N of them) routed to expert e."""
    p = tl.program_id(0)
    offs = p * BLOCK_N + tl.arange(0, BLOCK_N)
    experts = tl.arange(0, BLOCK_E)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32)  # past n: -1, in no expert's column
    one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_N, BLOCK_E]
    tl.store(counts_ptr + p * num_experts + experts, tl.sum(one_hot, axis=0), mask=experts < num_experts)


def _offsets_kernel(
    counts_ptr,
    prefix_ptr,
    start_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_chunks,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program. prefix[p, e]: expert e's assignments in chunks before p; start[e]: the first sorted
    row of expert e (groups padded to BLOCK_M); block_expert[b]: the expert of rows [b*BLOCK_M, ...)."""
    experts = tl.arange(0, BLOCK_E)
    emask = experts < num_experts
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_chunks, BLOCK_P):
        chunks = p0 + tl.arange(0, BLOCK_P)
        where = chunks[:, None] * num_experts + experts[None, :]
        mask = (chunks[:, None] < num_chunks) & emask[None, :]
        tile = tl.load(counts_ptr + where, mask=mask, other=0)  # [BLOCK_P, BLOCK_E]
        tl.store(prefix_ptr + where, tl.cumsum(tile, axis=0) - tile + total[None, :], mask=mask)
        total += tl.sum(tile, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # 0 for an expert no token chose (and for e >= E)
    end = tl.cumsum(padded, axis=0)
    tl.store(start_ptr + experts, end - padded, mask=emask)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    # Block b's expert: how many experts' groups end at or before its first row. Masked experts end at
    # the total, past every row in use; blocks past it are never read (their programs return first).
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        before = (end[None, :] <= blocks[:, None] * BLOCK_M) & emask[None, :]
        expert = tl.minimum(tl.sum(before.to(tl.int32), axis=1), num_experts - 1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)


def _scatter_kernel(
    ids_ptr, prefix_ptr, start_ptr, sorted_ptr, n, num_experts, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr
):
    """sorted[start[e] + prefix[p, e] + rank] = a, rank = a's place among chunk p's assignments to e."""
    p = tl.program_id(0)
    offs = p * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    experts = tl.arange(0, BLOCK_E)
    ids = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int32)
    one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_N, BLOCK_E]
    rank = tl.sum(tl.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1  # [BLOCK_N]
    safe = tl.maximum(ids, 0)
    base = tl.load(start_ptr + safe, mask=mask, other=0) + tl.load(
        prefix_ptr + p * num_experts + safe, mask=mask, other=0
    )
    tl.store(sorted_ptr + base + rank, offs, mask=mask)


def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    n,
    hidden,
    inter,
    stride_x,
    stride_we,
    stride_wn,
    stride_o,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[a, cols] = silu(x[a // k] @ gate[e, cols]) * (x[a // k] @ up[e, cols]) for the block's rows a."""
    b = tl.program_id(0)
    if b * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + b).to(tl.int64)
    rows = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # assignment ids
    valid = rows < n
    tokens = rows // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < inter
    w_gate = w_ptr + expert * stride_we + cols[None, :] * stride_wn  # [1, BLOCK_N] rows of [2I, H]
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < hidden
        a = tl.load(
            x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & kmask[None, :], other=0.0
        )
        wmask = cmask[None, :] & kmask[:, None]
        g = tl.load(w_gate + ks[:, None], mask=wmask, other=0.0)  # [BLOCK_K, BLOCK_N]
        u = tl.load(w_up + ks[:, None], mask=wmask, other=0.0)
        acc_gate = tl.dot(a, g, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, u, acc_up, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)  # each projection rounded, like the two torch matmuls
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # F.silu, rounded
    h = (act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], h, mask=valid[:, None] & cmask[None, :])


def _down_kernel(
    h_ptr,
    w_ptr,
    weights_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    n,
    hidden,
    inter,
    stride_h,
    stride_we,
    stride_wn,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[a, cols] = routing_weight[a] * (h[a] @ down[e, cols]) for the block's rows a."""
    b = tl.program_id(0)
    if b * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + b).to(tl.int64)
    rows = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = rows < n
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    w_down = w_ptr + expert * stride_we + cols[None, :] * stride_wn  # [1, BLOCK_N] rows of [H, I]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < inter
        a = tl.load(
            h_ptr + rows[:, None] * stride_h + ks[None, :], mask=valid[:, None] & kmask[None, :], other=0.0
        )
        w = tl.load(w_down + ks[:, None], mask=cmask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_M]
    y = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y, mask=valid[:, None] & cmask[None, :])


_KERNELS = None


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        if not HAVE_TRITON:
            raise RuntimeError(
                "mixture-of-experts models on CUDA need triton (pip install triton): the experts run as a "
                "Triton grouped GEMM inside the captured graphs"
            )
        # Sizes that follow the step's token count are not specialized on (divisibility by 16 would compile
        # new variants per captured size, inside captures): the variants are the tile choices alone.
        _KERNELS = (
            triton.jit(_count_kernel, do_not_specialize=["n"]),
            triton.jit(_offsets_kernel, do_not_specialize=["num_chunks", "num_blocks"]),
            triton.jit(_scatter_kernel, do_not_specialize=["n"]),
            triton.jit(_gate_up_kernel, do_not_specialize=["n"]),
            triton.jit(_down_kernel, do_not_specialize=["n"]),
        )
    return _KERNELS


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


# The alignment kernels hold [rows, BLOCK_E] one-hot and prefix tiles: this many elements keeps them in
# the registers of 4 warps (64 a thread) at any expert count.
_TILE_ELEMENTS = 8192


def _tile_args(blocks: MoeBlocks, dtype: torch.dtype) -> dict[str, int | str]:
    """The tile constexprs and launch options both grouped GEMMs take."""
    return dict(
        BLOCK_M=blocks.m,
        BLOCK_N=blocks.n,
        BLOCK_K=blocks.k,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",  # fp32 models: exact fp32 products
        num_warps=blocks.warps,
        num_stages=blocks.stages,
    )


# --- the ops --------------------------------------------------------------------------------------------------
def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [N] expert of each assignment (any int dtype) -> (sorted_ids [S] int32, block_expert [S / BLOCK_M]
    int32, num_padded [1] int32): assignments grouped by expert in order, each group padded with N to a
    multiple of block_m. Device-side; sizes depend only on N, E and block_m (see the module doc)."""
    count, offsets, scatter = _kernels()[:3]
    n = ids.numel()
    size = padded_bound(n, num_experts, block_m)
    block_e = _pow2(num_experts)
    block_n = max(16, min(1024, _TILE_ELEMENTS // block_e))  # assignments per chunk
    block_rows = max(1, min(64, _TILE_ELEMENTS // block_e))  # chunks (and blocks) per step of _offsets_kernel
    chunks = triton.cdiv(n, block_n)
    dev = ids.device
    counts = torch.empty((chunks, num_experts), dtype=torch.int32, device=dev)
    prefix = torch.empty_like(counts)
    start = torch.empty(num_experts, dtype=torch.int32, device=dev)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    count[(chunks,)](ids, counts, n, num_experts, BLOCK_N=block_n, BLOCK_E=block_e)
    offsets[(1,)](
        counts,
        prefix,
        start,
        block_expert,
        num_padded,
        chunks,
        num_experts,
        size // block_m,
        BLOCK_M=block_m,
        BLOCK_P=block_rows,
        BLOCK_E=block_e,
        BLOCK_B=block_rows,
        num_warps=4,
    )
    scatter[(chunks,)](ids, prefix, start, sorted_ids, n, num_experts, BLOCK_N=block_n, BLOCK_E=block_e)
    return sorted_ids, block_expert, num_padded


def align_reference(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_by_expert in PyTorch (host-synchronizing; for the tests)."""
    n = ids.numel()
    size = padded_bound(n, num_experts, block_m)
    sorted_ids = torch.full((size,), n, dtype=torch.int32)
    block_expert = torch.full((size // block_m,), num_experts - 1, dtype=torch.int32)
    row = 0
    flat = ids.cpu().long()
    for e in range(num_experts):
        members = (flat == e).nonzero().flatten()
        sorted_ids[row : row + members.numel()] = members.int()
        padded = -(-members.numel() // block_m) * block_m
        block_expert[row // block_m : (row + padded) // block_m] = e
        row += padded
    return sorted_ids, block_expert, torch.tensor([row], dtype=torch.int32)


def fused_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    blocks: MoeBlocks | None = None,
) -> torch.Tensor:
    """x [T, H], w_gate_up [E, 2I, H] (rows gate | up), w_down [E, H, I], weights [T, k] (fp32 or the model
    dtype), ids [T, k] expert ids -> [T, H]: sum over k of weights * down(silu(gate(x)) * up(x)).
    Fixed-shape device work only (CUDA-graph capturable); blocks: tiles (default pick_blocks)."""
    t, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter, top_k = two_inter // 2, ids.shape[1]
    n = t * top_k
    if n == 0:
        return torch.zeros_like(x)
    if x.stride(1) != 1 or w_gate_up.stride(2) != 1 or w_down.stride(2) != 1:
        raise ValueError("fused_experts needs x and the expert weights contiguous along the hidden/inter dim")
    blocks = blocks or pick_blocks(n, num_experts)
    kernels = _kernels()
    sorted_ids, block_expert, num_padded = align_by_expert(ids.reshape(-1), num_experts, blocks.m)
    num_blocks = block_expert.numel()
    tiles = _tile_args(blocks, x.dtype)
    h = torch.empty((n, inter), dtype=x.dtype, device=x.device)  # [N, I], row a = assignment a
    kernels[3][(num_blocks, triton.cdiv(inter, blocks.n))](
        x,
        w_gate_up,
        h,
        sorted_ids,
        block_expert,
        num_padded,
        n,
        hidden,
        inter,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        h.stride(0),
        TOP_K=top_k,
        **tiles,
    )
    out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)  # [T * k, H]
    kernels[4][(num_blocks, triton.cdiv(hidden, blocks.n))](
        h,
        w_down,
        weights.reshape(-1),
        out,
        sorted_ids,
        block_expert,
        num_padded,
        n,
        hidden,
        inter,
        h.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        out.stride(0),
        **tiles,
    )
    return out.view(t, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
