"""Batched LoRA on CUDA in Triton: y [T, out] += B[s] (A[s] x[t]) for each token t with a slot s = index[t]
>= 0, over any mix of slots and base tokens, with fixed grids and no host sync (capturable: one graph serves
any mix). Three kernels:

- plan (once a forward, one program): groups the step's tokens by slot into tiles of BLOCK_M tokens of one
  slot (tile_slot, tile_count, tile_rows: slot 0's tokens in token order, then slot 1's, ...; a slot's last
  tile partly filled). The grid bound is min(T, T / BLOCK_M + S) tiles; tiles past the real ones have count
  0, and base tokens (-1) are in no tile.
- shrink: one program a (tile, 16 of its rows, rank block, and up to 256 tokens 1,024 input columns): the
  rows of x (gathered) x A[slot]^T -> the tile's rows of the fp32 scratch [splits, rows, W] (W = P R: every
  piece's ranks; split_k).
- expand: one program a (tile, BLOCK_N output columns): the tile's scratch rows (the splits summed in a
  fixed order) x B[slot, cols]^T, added into y's rows of the tile (gathered, in fp32, rounded once). Rows of
  base tokens are never written.

Every output element comes from fixed programs in a fixed order (no atomics), so a token's result does not
depend on which other tokens share the step, only on the step size (which picks the tiles and splits).
model/lora_layers.py launches the shrink on a side stream forked before the base GEMM while a graph of up to
128 tokens is captured, so for qkv the expand is the one kernel added to the critical path, and for o, down
and gate_up (whose deltas go into the residual or the activation's input) the expand runs there too and
nothing is; above 128 tokens the GEMM fills the SMs and the fork measured slower than running in order.

Why, in numbers (H100: ~3.3 TB/s HBM, ~700 TFLOP/s bf16, a small kernel in a graph ~2.5 us from its launch
to the next one's; Llama-3-8B: hidden 4096, intermediate 14336; rank 16, 4 slots: W = 48 for qkv, 32 for
gate_up, 16 for o and down):

- What the kernels replaced gave each program a tile of any tokens and looped over the slots (one masked dot
  a slot present), and split the shrink's K at every size with the expand re-reading every split for every
  output tile and slot. At T = 512, 4 slots, the gate_up expand read [16 splits, 64, 32] fp32 x 4 slots in
  each of its 3,584 programs: 1.8 GB from L2, ~2.9 GB a layer, ~90 GB a step, ~10 ms at ~9 TB/s, the order
  of the measured loss (5,242 against 8,482 tok/s).
- Large steps (T = 512..8192). With one-slot tiles and one split what is left is what the method must move:
  x read once by the shrink (T in 2 bytes; A [W, in] comes again from L2 for each 16 rows) and y read and
  written once by the expand (T out 4 bytes), against the base GEMM's 2 T in out FLOPs: the x read is ~5%
  of the o and down GEMMs' time (700 / 3.3 / 4096) and ~1-3% of the others', the y read-modify-write ~10%
  of the qkv, o and gate_up GEMMs' (2 x 700 / 3.3 / 4096) and 3% of down's: ~11% of the layer's GEMM time at
  T = 8192 (~0.57 of 5.4 ms a layer), less where y is still in L2 from its GEMM (T out 2 bytes under ~40 MB:
  T <= 512 for gate_up). Forking the shrink does not help here: at T = 192-512 the 8B step measured 4-49%
  more LoRA time forked than in order (the GEMM's tiles already fill the SMs). The MMA work (2 T W out) is
  under 1% of the base's. Tiles feed the tensor cores (16-64 tokens, tl.dot); the expand's output tiles are
  128 wide past 16 tokens (gate_up: 224 of them a tile).
- Decode (T = 1..16). Latency, not bytes: one slot's A and B are ~1.2 and ~2.7 MB a layer (~126 MB a step,
  ~38 us of HBM time), while the old two kernels a projection cost ~4.8 us each (1.23 ms a step: TPOT x1.196).
  Two dependent kernels cost >= 2 x 2.5 us + their loads: 128 projections x ~6.5 us = 0.83 ms (x1.13). A
  single fused kernel needs all of A x before any B column: either each program reads all of A (0.13-0.46
  MB from L2 at ~0.1 TB/s a program: 1.3-4.6 us, so ~6 us a projection again) or a grid barrier (spinning
  programs that must all be resident, ~1 us; untestable under the interpreter). So the shrink overlaps the
  base GEMM instead: it depends on x only, runs on the side stream beside the GEMM (qkv ~15 us, o ~10,
  gate_up ~70, down ~35 at T = 1) and the expand waits for both: one kernel a projection on the critical
  path, ~2.5 us + two dependent loads (the tile's slot and rows, then B's, y's and the splits' tiles),
  ~3.5 us x 128 = 0.45 ms a step (x1.07). Where the delta need not wait for the GEMM's output (o and down
  add into the residual, gate_up into the activation's input), the expand joins the shrink beside the GEMM:
  32 expands (qkv's) remain, measured 0.26 ms a step at one slot on the H100 (BENCHMARKS §23). The shrink
  itself is W / 16 x in / 1,024 programs (qkv 12, down 14) of 32 KB of A each, ~1.5 us of loads: a lone
  program streams only ~20 GB/s (a few 16 KB loads in flight), so 16 ranks x 14,336 columns in one program
  would take ~22 us, past the o GEMM and near down's.
  Summing 4-14 splits costs the expand 1-14 KB of L2 loads a program, beside its B tile. The plan (one
  program, ~3 us up to 512 tokens) is forked with the first shrink of the forward.
"""

from __future__ import annotations

import torch

from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = [
    "HAVE_TRITON",
    "LoraWorkspace",
    "block_m",
    "lora_expand",
    "lora_kernel_variant",
    "lora_plan",
    "lora_shrink",
    "lora_shrink_expand",
]

SUB_M = 16  # tokens a shrink program (a tile's rows are spread over BLOCK_M / SUB_M programs)
SPLIT_K = 1024  # in-columns a shrink program streams at up to 256 tokens (the expand sums the splits)
MAX_SPLITS = 16


def block_m(num_tokens: int) -> int:
    """Tokens a tile at this step size; every other block size follows from it (one compiled variant of
    each kernel per BLOCK_M and projection shape)."""
    return 16 if num_tokens <= 16 else 32 if num_tokens <= 256 else 64


def split_k(num_tokens: int, k: int) -> tuple[int, int]:
    """(splits, in-columns a split) of the shrink at this step size: past 256 tokens one split (the tiles
    fill the GPU); up to it ceil(in / 1024), so a decode's A[slot] (W x in) is streamed by W / 16 x in / 1024
    programs of 32 KB each, not by W / 16 programs of 128-460 KB (~20 GB/s a lone program: 6-22 us)."""
    if block_m(num_tokens) > 32:
        return 1, k
    bk = _block_k(num_tokens)
    splits = min(MAX_SPLITS, _cdiv(k, SPLIT_K))
    k_split = _cdiv(_cdiv(k, splits), bk) * bk
    return _cdiv(k, k_split), k_split


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_k(num_tokens: int) -> int:
    return 256 if block_m(num_tokens) <= 32 else 128


def max_tiles(num_tokens: int, slots: int) -> int:
    """An upper bound of the tiles of any mix over `slots` slots (sum over slots of ceil(count / BLOCK_M):
    at most one partly filled tile a slot, and a tile holds at least one token): the kernels' fixed grid;
    programs past the real tiles find count 0. One tile at one token."""
    return min(num_tokens, _cdiv(num_tokens, block_m(num_tokens)) + slots)


def _plan_kernel(
    idx_ptr, tile_slot_ptr, tile_count_ptr, tile_rows_ptr,
    T, S, MAX_TILES,
    BLOCK_M: tl.constexpr, S_P2: tl.constexpr, CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr,
):  # fmt: skip
    slots = tl.arange(0, S_P2)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([S_P2], dtype=tl.int32)  # tokens a slot
    for c0 in range(0, T, CHUNK):
        idx = tl.load(idx_ptr + c0 + lanes, mask=c0 + lanes < T, other=-1).to(tl.int32)
        counts += tl.sum((idx[:, None] == slots[None, :]).to(tl.int32), axis=0)
    counts = tl.where(slots < S, counts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)  # slot s owns tiles [tile_end[s] - tiles[s], tile_end[s])
    tile_start = tile_end - tiles
    total = tl.sum(tiles, axis=0)
    # The tile table: tile p belongs to the first slot whose tiles end past p.
    tile_lanes = tl.arange(0, TILE_CHUNK)
    for p0 in range(0, MAX_TILES, TILE_CHUNK):
        p = p0 + tile_lanes
        slot = tl.sum((tile_end[None, :] <= p[:, None]).to(tl.int32), axis=1)
        mine = slot[:, None] == slots[None, :]
        first = tl.sum(tl.where(mine, tile_start[None, :], 0), axis=1)
        count = tl.sum(tl.where(mine, counts[None, :], 0), axis=1)
        n = tl.minimum(count - (p - first) * BLOCK_M, BLOCK_M)
        real = p < total
        tl.store(tile_slot_ptr + p, tl.where(real, slot, -1), mask=p < MAX_TILES)
        tl.store(tile_count_ptr + p, tl.where(real, n, 0), mask=p < MAX_TILES)
    # Each token's place: its slot's first tile x BLOCK_M + its rank among the slot's tokens.
    running = tl.zeros([S_P2], dtype=tl.int32)
    for c0 in range(0, T, CHUNK):
        tok = c0 + lanes
        idx = tl.load(idx_ptr + tok, mask=tok < T, other=-1).to(tl.int32)
        hit = ((idx[:, None] == slots[None, :]) & (slots[None, :] < S)).to(tl.int32)
        rank = running[None, :] + tl.cumsum(hit, axis=0) - 1
        place = tl.sum(tl.where(hit > 0, tile_start[None, :] * BLOCK_M + rank, 0), axis=1)
        tl.store(tile_rows_ptr + place, tok, mask=(idx >= 0) & (idx < S) & (tok < T))
        running += tl.sum(hit, axis=0)


def _shrink_kernel(
    x_ptr, a_ptr, tile_slot_ptr, tile_count_ptr, tile_rows_ptr, out_ptr,
    K, W, K_SPLIT, stride_xt, stride_as, stride_ar, stride_ok, stride_ot,
    BLOCK_M: tl.constexpr, SUB_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    # out [SPLITS, tiles x BLOCK_M, W] fp32: row p BLOCK_M + m of split z = the tile's m-th token's A[slot] x
    # over the in-columns [z K_SPLIT, (z + 1) K_SPLIT) (0 past its count; the expand sums the splits).
    # A program: SUB_M rows of tile p (program_id 1), BLOCK_R ranks and one split (program_id 2).
    p, sub, pid_rz = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_r, z = pid_rz // SPLITS, pid_rz % SPLITS
    count = tl.load(tile_count_ptr + p)
    if count > sub * SUB_M:
        slot = tl.load(tile_slot_ptr + p).to(tl.int64)
        lanes = sub * SUB_M + tl.arange(0, SUB_M)
        live = lanes < count
        rows = tl.where(live, tl.load(tile_rows_ptr + p * BLOCK_M + lanes), 0).to(tl.int64)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        k_first = z * K_SPLIT
        offs_k = k_first + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_xt + offs_k[None, :]
        a_ptrs = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :]
        acc = tl.zeros((SUB_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_first, tl.minimum(K, k_first + K_SPLIT), BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs, mask=live[:, None], other=0.0)
                at = tl.load(a_ptrs, mask=offs_r[:, None] < W, other=0.0)
            else:
                in_k = (k0 + tl.arange(0, BLOCK_K))[None, :] < K
                xt = tl.load(x_ptrs, mask=live[:, None] & in_k, other=0.0)
                at = tl.load(a_ptrs, mask=(offs_r[:, None] < W) & in_k, other=0.0)
            acc += tl.dot(xt, tl.trans(at))
            x_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
        out_rows = p * BLOCK_M + lanes
        out_ptrs = out_ptr + z * stride_ok + out_rows[:, None] * stride_ot + offs_r[None, :]
        tl.store(out_ptrs, acc, mask=offs_r[None, :] < W)


def _expand_kernel(
    s_ptr, b_ptr, tile_slot_ptr, tile_count_ptr, tile_rows_ptr, y_ptr,
    N, W, stride_sk, stride_st, stride_bs, stride_bn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, R_BLOCKS: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    # Straight-line and masked (no branch on the tile's count): the tile's count, slot and rows are loaded
    # at once, then B, y and the shrink's splits (its live rows only): two dependent loads before the dot.
    # An empty tile (count 0) loads nothing past its metadata and stores nothing.
    p, pid_n = tl.program_id(0), tl.program_id(1)
    lanes = tl.arange(0, BLOCK_M)
    count = tl.load(tile_count_ptr + p)
    slot = tl.load(tile_slot_ptr + p).to(tl.int64)
    live = lanes < count
    rows = tl.where(live, tl.load(tile_rows_ptr + p * BLOCK_M + lanes), 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < tl.where(count > 0, N, 0)  # an empty tile's program loads no B and stores nothing
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    out_mask = live[:, None] & in_n[None, :]
    y = tl.load(y_ptrs, mask=out_mask, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for rb in tl.static_range(R_BLOCKS):
        offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        s_ptrs = s_ptr + (p * BLOCK_M + lanes)[:, None] * stride_st + offs_r[None, :]
        s_mask = live[:, None] & (offs_r[None, :] < W)
        st = tl.load(s_ptrs, mask=s_mask, other=0.0)
        for z in tl.static_range(1, SPLITS):  # the splits in a fixed order
            st += tl.load(s_ptrs + z * stride_sk, mask=s_mask, other=0.0)
        bt = tl.load(
            b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
            mask=in_n[:, None] & (offs_r[None, :] < W), other=0.0,
        )  # fmt: skip
        acc += tl.dot(st.to(bt.dtype), tl.trans(bt))
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=out_mask)


_KERNELS = None


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        if not HAVE_TRITON:
            raise RuntimeError("the LoRA kernels need triton (pip install triton)")
        # The arguments that vary with the step size (the plan's T and tile count, the splits' stride) are
        # not specialized on (divisibility by 16, == 1), so a new step size in a BLOCK_M bucket compiles
        # nothing (a compile inside a graph capture fails).
        _KERNELS = (
            triton.jit(_plan_kernel, do_not_specialize=["T", "MAX_TILES"]),
            triton.jit(_shrink_kernel, do_not_specialize=["stride_ok"]),
            triton.jit(_expand_kernel, do_not_specialize=["stride_sk"]),
        )
    return _KERNELS


class LoraWorkspace:
    """One model's static buffers for the kernels (allocated once, outside every graph pool; a captured graph
    reads and writes them at replay): the step's plan and the shrink's output. Shared by every projection:
    a projection's shrink is ordered after the previous projection's expand (model/lora_layers.py)."""

    def __init__(self, max_tokens: int, slots: int, width: int, device: torch.device) -> None:
        self.max_tokens, self.slots, self.width = max_tokens, slots, width
        edges = _size_edges(max_tokens)
        tiles = max(max_tiles(t, slots) for t in edges)
        rows = max(max_tiles(t, slots) * block_m(t) for t in edges)
        split_rows = max(MAX_SPLITS * max_tiles(t, slots) * block_m(t) for t in edges if block_m(t) <= 32)
        self.tile_slot = torch.full((tiles,), -1, dtype=torch.int32, device=device)
        self.tile_count = torch.zeros(tiles, dtype=torch.int32, device=device)
        self.tile_rows = torch.zeros(rows, dtype=torch.int32, device=device)  # token ids
        # [splits x rows, W] A x: split z of a step's plan at rows [z R, (z + 1) R), R = its tiles x BLOCK_M
        self.shrunk = torch.zeros(max(rows, split_rows), width, dtype=torch.float32, device=device)
        self.planned: int | None = None  # the step size of the plan last launched (host side)

    def fits(self, num_tokens: int, slots: int, width: int) -> bool:
        return num_tokens <= self.max_tokens and slots <= self.slots and width <= self.width


def _size_edges(max_tokens: int) -> list[int]:
    """The step sizes where max_tiles x block_m peaks: each BLOCK_M bucket's largest size up to max_tokens."""
    return sorted({min(max_tokens, edge) for edge in (16, 256, max_tokens)})


def lora_kernel_variant(num_tokens: int) -> tuple[str, int]:
    """What the kernels compile per step size (the token tile, which sets every other block size): a capture
    of a LoRA graph whose variant has not run yet warms it up outside the capture first (the graph cache's
    kernel families)."""
    return ("lora", block_m(num_tokens))


def lora_plan(index: torch.Tensor, slots: int, ws: LoraWorkspace) -> None:
    """Group this step's tokens by slot into ws's tile table. index [T] int64 (-1: base)."""
    plan, _, _ = _kernels()
    t = index.shape[0]
    if not ws.fits(t, slots, 0):
        raise ValueError(
            f"LoRA workspace for {ws.max_tokens} tokens / {ws.slots} slots, step has {t} / {slots}"
        )
    s_p2 = max(2, triton.next_power_of_2(slots))
    chunk = max(64, min(1024, 4096 // s_p2))
    plan[(1,)](
        index, ws.tile_slot, ws.tile_count, ws.tile_rows,
        t, slots, max_tiles(t, slots),
        BLOCK_M=block_m(t), S_P2=s_p2, CHUNK=chunk, TILE_CHUNK=64, num_warps=4,
    )  # fmt: skip
    ws.planned = t


def _checked(ws: LoraWorkspace, t: int, slots: int, width: int) -> None:
    if ws.planned != t:
        raise RuntimeError(
            f"the LoRA plan was made for {ws.planned} tokens, this projection has {t}: plan each forward "
            "before its first projection (LoraIndex.planner)"
        )
    if not ws.fits(t, slots, width):
        raise ValueError(f"LoRA workspace for {ws.slots} slots of width {ws.width}, got {slots} of {width}")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, ws: LoraWorkspace) -> int:
    """ws.shrunk's tile rows = A[slot] x of each planned token, in `splits` partial sums over the
    in-dimension; returns splits (lora_expand's). x [T, in] (unit stride in its last dim); a [S, W, in]
    contiguous."""
    _, shrink, _ = _kernels()
    t, k = x.shape
    slots, w, _ = a.shape
    _checked(ws, t, slots, w)
    if x.stride(1) != 1:
        x = x.contiguous()
    bm = block_m(t)
    # A program streams its rows of x and its ranks of A[slot] (K long each) once: 16 rows a program, so a
    # tile's x is spread over BLOCK_M / 16 programs (A read again by each, from L2); up to 256 tokens 16
    # ranks too, so a decode's A (W x in, 0.13-0.46 MB) is read by W / 16 programs; past it every rank in one
    # program, so x is read once (at 8,192 tokens x is 64-235 MB, A 0.13-0.46 MB a slot).
    block_r = 16 if bm <= 32 else min(128, max(16, triton.next_power_of_2(w)))
    block_k = _block_k(t)
    splits, k_split = split_k(t, k)
    tiles = max_tiles(t, slots)
    shrink[(tiles, bm // SUB_M, triton.cdiv(w, block_r) * splits)](
        x, a, ws.tile_slot, ws.tile_count, ws.tile_rows, ws.shrunk,
        k, w, k_split, x.stride(0), a.stride(0), a.stride(1), tiles * bm * ws.shrunk.stride(0),
        ws.shrunk.stride(0),
        BLOCK_M=bm, SUB_M=SUB_M, BLOCK_R=block_r, BLOCK_K=block_k, SPLITS=splits, EVEN_K=k % block_k == 0,
        num_warps=4, num_stages=4 if block_r <= 32 else 3,
    )  # fmt: skip
    return splits


def lora_expand(y: torch.Tensor, b: torch.Tensor, ws: LoraWorkspace, splits: int) -> None:
    """y [T, out] += B[slot] (the shrink's rows, its `splits` partial sums added) for each planned token, in
    place; rows of base tokens are not touched. b [S, out, W] contiguous; y unit stride in its last dim."""
    _, _, expand = _kernels()
    t, n = y.shape
    slots, _, w = b.shape
    _checked(ws, t, slots, w)
    block_r = min(64, max(16, triton.next_power_of_2(w)))
    bm = block_m(t)
    block_n = 64 if bm == 16 else 128
    tiles = max_tiles(t, slots)
    expand[(tiles, triton.cdiv(n, block_n))](
        ws.shrunk, b, ws.tile_slot, ws.tile_count, ws.tile_rows, y,
        n, w, tiles * bm * ws.shrunk.stride(0), ws.shrunk.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_R=block_r, R_BLOCKS=triton.cdiv(w, block_r), SPLITS=splits,
        num_warps=4,
    )  # fmt: skip


def lora_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    index: torch.Tensor,
    ws: LoraWorkspace | None = None,
) -> None:
    """y [T, out] += B[s] @ A[s] @ x[t] per token t with slot s = index[t] >= 0, in place, on the current
    stream: plan, shrink, expand. x [T, in]; a [S, W, in]; b [S, out, W] (contiguous); index [T] int64.
    ws: a workspace to use (else one made for this call)."""
    t = x.shape[0]
    if t == 0:
        return
    slots, w, _ = a.shape
    if ws is None:
        ws = LoraWorkspace(t, slots, w, x.device)
    lora_plan(index, slots, ws)
    lora_expand(y, b, ws, lora_shrink(x, a, ws))
