"""Paged attention: the eager break of every decoder layer, and its per-step plan.

Split of work (why): every graph-mode step replays this break once per layer, and at small batches
the step is host-bound, so each torch call made here costs ~10 us x layers x steps. Hence:
- the KV write is NOT here: llama.Attention writes this step's k/v into the cache inside the graph
  segment (index_copy_ by the runner's static `slot_mapping`; padded rows go to a scratch slot no
  sequence owns), so it costs nothing on the host at replay;
- everything shared by all layers (flat slot indices of each request's context, masks, cumulative
  lengths) is built ONCE per step by `AttentionPlanner.plan` (the runner calls it) and read here;
- the break itself is a handful of torch calls: gather the context slots, one attention kernel,
  (SDPA path) one copy into `out`. No host syncs, no per-layer mask building, no zeroing.

Four kernels, one plan each:
- "triton" (CUDA with triton, power-of-two block_size; model/unified_attention.py): ONE Triton
  launch per layer over ALL requests of the step, decode rows and chunks alike (causal, bottom-right
  aligned), reading K/V in place through the block tables (no gather) with the query heads of each
  KV head packed into one tile, writing straight into `out`. Its plan is a few views of buffers the
  runner already uploaded.
- "flash_paged" (CUDA, fp16/bf16, block_size a multiple of 256, FlashAttention's paged-KV page
  size): FlashAttention varlen over ALL requests of the step at once, decode and prefill alike
  (causal, bottom-right aligned), reading the paged cache through the block tables and writing
  straight into `out`: per layer ONE kernel, nothing gathered.
- "flash" (same, any block_size): the same call over a gathered copy of every request's context:
  per layer one gather + one kernel. Only the real context is gathered (sum of seq_lens).
- "sdpa" (CPU, fp32, or a torch without the varlen op): torch SDPA. Decodes batched as one call over
  [num_decodes, L] gathered slots with an additive mask; prefills one call each.

Token layout of a step (the runner orders it this way): the `num_decodes` requests that feed one
token each come first (token i belongs to request i), then the multi-token (prefill or chunk)
requests, each a contiguous run [query_start_loc[i], query_start_loc[i + 1]). Rows past the real
tokens are padding: the break leaves their `out` rows untouched. That is safe: padded rows only
ever meet their own row (norms, rotary and matmuls are row-wise), they write K/V only to the
scratch slot, the scratch slot is never gathered, and no logits row reads them.

KV cache per layer: [2, num_slots, K, D] (k, v), slot = block * block_size + offset. It is
zero-filled and only real tokens write real slots, so every gathered slot holds finite values:
masked positions get softmax weight 0, and 0 * NaN would still be NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from graphcache.choices import ATTENTION_BACKENDS, DECODE_ATTENTION_BACKENDS, DECODE_KERNELS
from graphcache.graphs.capture import eager_break, is_capturing
from graphcache.model.decode_attention import HAVE_TRITON, paged_decode_attention
from graphcache.model.forward_context import current_attention_metadata
from graphcache.model.unified_attention import UnifiedConfig, choose_config, unified_attention

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "AttentionPlanner",
    "DecodeMetadata",
    "decode_attention",
    "graph_attention",
    "paged_attention",
    "select_attention_kernel",
    "select_decode_kernel",
]

# The mem-efficient SDPA kernel wants the mask's key dim a multiple of 16; otherwise it pads the
# mask with extra ops on every call. The decode context length is rounded up to this.
_MASK_ALIGN = 16
_FLASH_INPLACE = getattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace", None)
# Older torch (2.11 on the H200 box) has only the out-of-place op; it may lack block tables too.
_FLASH = getattr(torch.ops.aten, "_flash_attention_forward", None)
_FLASH_PAGES = any(
    "block_table" in str(op._schema)
    for op in ([_FLASH_INPLACE.default] if _FLASH_INPLACE is not None else [])
    + ([_FLASH.default] if _FLASH is not None else [])
)


def _flash_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_tokens: int,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    **paged,
) -> None:
    """FlashAttention varlen (causal, bottom-right aligned) of the first num_tokens rows into out.
    In place where torch has the in-place op; else one extra copy of the [num_tokens, H, D] result."""
    if _FLASH_INPLACE is not None:
        _FLASH_INPLACE(
            out,
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            True,
            False,
            scale=scale,
            window_size_left=-1,
            window_size_right=0,
            **paged,
        )
        return
    o = _FLASH(
        q[:num_tokens],
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        True,
        False,
        scale=scale,
        window_size_left=-1,
        window_size_right=0,
        **paged,
    )[0]
    out[:num_tokens].copy_(o)


FLASH_PAGE_MULTIPLE = 256  # FlashAttention 2 takes a paged KV cache only in pages of a multiple of 256


def select_attention_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int, backend: str = "auto"
) -> str:
    """ "triton" (the unified paged kernel) where it runs, else "flash_paged" / "flash" where the
    FlashAttention varlen kernel applies, else "sdpa". `backend` (settings.model.attention_backend) other
    than "auto" forces a kernel (A/B runs); a forced kernel that cannot run here raises."""
    triton_ok = (
        device.type == "cuda"
        and HAVE_TRITON
        and dtype in (torch.float16, torch.bfloat16, torch.float32)
        and block_size & (block_size - 1) == 0
        and head_dim % 8 == 0
        and head_dim <= 256
    )
    flash_ok = (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and (_FLASH_INPLACE is not None or _FLASH is not None)
    )
    paged_ok = flash_ok and _FLASH_PAGES and block_size % FLASH_PAGE_MULTIPLE == 0
    if backend == "auto":
        return "triton" if triton_ok else "flash_paged" if paged_ok else "flash" if flash_ok else "sdpa"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "triton" and not triton_ok:
        raise RuntimeError(
            "attention_backend=triton needs CUDA, triton, a power-of-two block_size and "
            "head_dim % 8 == 0 (<= 256); use auto, flash or sdpa"
        )
    if (backend == "flash" and not flash_ok) or (backend == "flash_paged" and not paged_ok):
        pages = f", and block_size a multiple of {FLASH_PAGE_MULTIPLE}" if backend == "flash_paged" else ""
        raise RuntimeError(
            f"attention_backend={backend} needs CUDA, fp16/bf16, head_dim % 8 == 0 and <= 256, "
            f"a torch with aten._flash_attention_forward (with block_table for paged){pages}"
        )
    return backend


def select_decode_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int, backend: str = "auto"
) -> str:
    """The kernel of uniform-decode steps: "triton" (model/decode_attention.py: paged, split-KV,
    query heads packed per KV head; CUDA), "torch" (static-shape masked attention over the
    whole block table: capturable but O(max_model_len), the CPU path), or "varlen" (no decode path:
    decode steps use the general kernel as an eager break, as mixed batches do)."""
    pow2 = block_size & (block_size - 1) == 0
    triton_ok = (
        device.type == "cuda"
        and HAVE_TRITON
        and dtype in (torch.float16, torch.bfloat16, torch.float32)
        and pow2
        and head_dim % 8 == 0
        and head_dim <= 256
    )
    if backend == "auto":
        return "triton" if triton_ok else "torch" if device.type == "cpu" else "varlen"
    if backend == "triton" and not triton_ok:
        raise RuntimeError(
            "decode_attention_backend=triton needs CUDA, triton, a power-of-two "
            "block_size and head_dim % 8 == 0 (<= 256); use auto"
        )
    if backend not in DECODE_KERNELS:
        raise ValueError(
            f"decode_attention_backend={backend!r}: use one of {', '.join(DECODE_ATTENTION_BACKENDS)}"
        )
    return backend


@dataclass(frozen=True)
class DecodeMetadata:
    """Attention of a uniform-decode step, read entirely from static device buffers (no host
    values): the same object serves every step of one padded batch size, and the kernel can be
    captured inside the graph (in_graph=True: "full" capture mode) or run as the eager break."""

    kernel: str  # "triton" | "torch"
    in_graph: bool  # True: the model calls decode_attention inside the graph segment
    block_tables: torch.Tensor  # [R, B] int64 static view; rows of padded requests are never read
    seq_lens: torch.Tensor  # [R] int64 static view: context length incl. this token; 0 = padded row
    num_splits: int = 1  # triton split-KV factor, fixed per R (the grid must not change)
    workspace: torch.Tensor | None = None  # triton split partials, fp32, allocated once
    positions: torch.Tensor | None = None  # torch kernel: [B * block_size] int64 arange


def decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    md: DecodeMetadata,
    scale: float,
) -> None:
    """q, out [R, H, D] (one token per request; R = the padded batch); k_blocks, v_blocks
    [num_blocks, block_size, K, D]. Writes every row of out (padded rows: zeros)."""
    num_reqs = md.seq_lens.shape[0]
    if md.kernel == "triton":
        paged_decode_attention(
            q[:num_reqs],
            k_blocks,
            v_blocks,
            md.block_tables,
            md.seq_lens,
            out[:num_reqs],
            scale,
            md.workspace,
            md.num_splits,
        )
        return
    # torch: every request attends over its whole block table ([R, B * bs] keys), masked past its
    # length. Static shapes, so it captures; the cost grows with max_model_len, not the context.
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_blocks.shape[2]
    length = md.block_tables.shape[1] * k_blocks.shape[1]
    flat = md.block_tables.reshape(-1)
    k = k_blocks.index_select(0, flat).view(num_reqs, length, kv_heads, dim).transpose(1, 2)  # [R, K, L, D]
    v = v_blocks.index_select(0, flat).view(num_reqs, length, kv_heads, dim).transpose(1, 2)
    seq_lens = md.seq_lens.clamp_min(1)  # padded rows attend to slot 0, then are zeroed
    beyond = md.positions[:length] >= seq_lens[:, None]  # [R, L]
    mask = torch.zeros(beyond.shape, dtype=q.dtype, device=q.device).masked_fill_(beyond, float("-inf"))
    qg = q[:num_reqs].view(num_reqs, kv_heads, heads // kv_heads, dim)  # [R, K, G, D]
    o = F.scaled_dot_product_attention(
        qg, k, v, attn_mask=mask[:, None, None, :], scale=scale
    )  # [R, K, G, D]
    real = (md.seq_lens > 0).to(q.dtype).view(num_reqs, 1, 1, 1)
    out[:num_reqs].view(num_reqs, kv_heads, heads // kv_heads, dim).copy_(o * real)


def graph_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    md: DecodeMetadata | AttentionMetadata,
    scale: float,
) -> None:
    """Attention recorded inside the graph ("full" runtime mode): the decode kernel for a uniform
    decode (DecodeMetadata), the unified kernel for a mixed step (AttentionMetadata from
    AttentionPlanner.plan_in_graph: its grid is fixed by the descriptor's padded sizes, and what the
    step really holds is read from the static buffers at replay)."""
    if isinstance(md, DecodeMetadata):
        decode_attention(q, out, k_blocks, v_blocks, md, scale)
        return
    if md.kernel != "triton":
        raise RuntimeError(
            f"attention kernel {md.kernel!r} cannot run inside a graph: mixed_capture_mode=full "
            "needs the triton kernel (the runner falls back to breakable for the others)"
        )
    unified_attention(
        q,
        k_blocks,
        v_blocks,
        out,
        md.cu_seqlens_q,
        md.seqused_k,
        md.block_table,
        scale,
        md.num_reqs,
        md.unified_config,
    )


@dataclass
class PrefillPlan:
    """One multi-token request on the SDPA path."""

    start: int  # its token rows are [start, end) of the step
    end: int
    context_slots: torch.Tensor | None  # [L] int64 slots of its whole context; None: no cached context,
    # it attends to this step's own k/v rows (plain causal)
    mask: torch.Tensor | None  # [n, L] additive (0 / -inf), causal in absolute positions


@dataclass
class AttentionMetadata:
    num_real_tokens: int
    kernel: str = "sdpa"
    # SDPA path: decodes batched (rows 0..num_decodes-1), prefills one call each
    num_decodes: int = 0
    decode_len: int = 0  # L: longest decode context, rounded up to _MASK_ALIGN
    decode_slots: torch.Tensor | None = None  # [num_decodes * L] int64 flat slots (row-major [nd, L])
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, L] additive (0 / -inf), model dtype
    # shapes the decode call views its tensors as (host tuples: no shape reads in the break)
    decode_kv_shape: tuple[int, ...] = ()  # (2, nd, L, K, D): the gathered slots, split per request
    decode_q_shape: tuple[int, ...] = ()  # (nd, K, G, D): query heads grouped by their KV head
    prefills: list[PrefillPlan] = field(default_factory=list)
    # flash and triton paths: every request in one call
    cu_seqlens_q: torch.Tensor | None = None  # [R + 1] int32 token offsets (= query_start_loc)
    cu_seqlens_k: torch.Tensor | None = None  # flash: [R + 1] int32 offsets into the gathered context
    context_slots: torch.Tensor | None = (
        None  # "flash": [sum(seq_lens)] int64 slots of every request's context
    )
    block_table: torch.Tensor | None = None  # "flash_paged": [R, B] int32 block ids; "triton": int64
    seqused_k: torch.Tensor | None = None  # "flash_paged": [R] int32 context lengths; "triton": int64
    num_reqs: int = 0  # "triton": R
    unified_config: UnifiedConfig | None = None  # "triton": the tile shape of this step's launch
    max_q: int = 0
    max_k: int = 0

    @classmethod
    def empty(cls) -> AttentionMetadata:
        """No real tokens: the op does nothing (used for warmup captures)."""
        return cls(num_real_tokens=0)


class AttentionPlanner:
    """Builds a step's AttentionMetadata on the device, once for all layers (no host syncs: every
    size comes from host ints, every index from device tensors the runner uploaded)."""

    def __init__(
        self,
        *,
        kernel: str,
        block_size: int,
        max_blocks_per_seq: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.kernel, self.block_size, self.dtype, self.device = kernel, block_size, dtype, device
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.max_blocks_per_seq = max_blocks_per_seq
        max_len = max_blocks_per_seq * block_size + _MASK_ALIGN  # decode L may round past the table
        pos = torch.arange(max_len, device=device)
        # Static per-position lookups, so building a step's slots is a gather, not arange/div/mod.
        self._pos = pos  # [P] int64
        self._pos_block = (pos // block_size).clamp_(max=max_blocks_per_seq - 1)  # [P] table column
        self._pos_offset = pos % block_size  # [P] offset in block

    def plan(
        self,
        *,
        num_real_tokens: int,
        num_decodes: int,
        query_start_loc: list[int],
        seq_lens: list[int],
        seq_lens_dev: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """seq_lens_dev [R] int64, block_tables [R, B] int64 (uploaded); cu_seqlens [2 * (R + 1)] int32
        = (query_start_loc, cumsum of seq_lens with a leading 0), uploaded, needed by the flash kernels."""
        if self.kernel == "triton":
            return self._plan_triton(num_real_tokens, query_start_loc, seq_lens_dev, block_tables, cu_seqlens)
        if self.kernel == "flash_paged":
            return self._plan_flash_paged(
                num_real_tokens, query_start_loc, seq_lens, seq_lens_dev, block_tables, cu_seqlens
            )
        if self.kernel == "flash":
            return self._plan_flash(
                num_real_tokens, query_start_loc, seq_lens, seq_lens_dev, block_tables, cu_seqlens
            )
        return self._plan_sdpa(
            num_real_tokens, num_decodes, query_start_loc, seq_lens, seq_lens_dev, block_tables
        )

    def plan_in_graph(
        self,
        *,
        num_reqs: int,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> AttentionMetadata:
        """The unified kernel's metadata for a mixed graph with attention inside: views of the static
        buffers over the descriptor's num_reqs (padded) rows, so it depends on the descriptor alone and
        a capture outside a step records what a step would. query_start_loc [R + 1] int32, seq_lens
        [R] int64, block_tables [R, B] int64. The step's layout must give every padded request an
        empty query range (query_start_loc = real tokens from the last real request on): its tiles
        exit at once, and the launch's grid (T // BLOCK_Q + R) covers any real layout that fits T, R.
        The tile shape is the chunked one: a fixed graph cannot pick it per step."""
        if self.kernel != "triton":
            raise RuntimeError(f"plan_in_graph needs the triton attention kernel, not {self.kernel!r}")
        config = choose_config(self.num_heads // self.num_kv_heads, self.head_dim, max_query_len=2)
        return AttentionMetadata(
            num_real_tokens=0,
            kernel="triton",
            cu_seqlens_q=query_start_loc,
            block_table=block_tables,
            seqused_k=seq_lens,
            num_reqs=num_reqs,
            unified_config=config,
        )

    def _slots(self, tables: torch.Tensor, length: int) -> torch.Tensor:
        """tables [N, B] -> [N, length] int64 slot of each position 0..length-1."""
        blocks = tables.index_select(1, self._pos_block[:length])  # [N, L]
        return blocks * self.block_size + self._pos_offset[:length]

    def _plan_sdpa(self, num_real_tokens, num_decodes, query_start_loc, seq_lens, seq_lens_dev, block_tables):
        md = AttentionMetadata(num_real_tokens=num_real_tokens, kernel="sdpa", num_decodes=num_decodes)
        if num_decodes:
            longest = max(seq_lens[:num_decodes])
            length = -(-longest // _MASK_ALIGN) * _MASK_ALIGN
            # Positions past a request's length read whatever its table row points at (unused
            # entries are block 0): finite data, masked out.
            md.decode_len = length
            heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
            md.decode_kv_shape = (2, num_decodes, length, kv_heads, dim)
            md.decode_q_shape = (num_decodes, kv_heads, heads // kv_heads, dim)
            md.decode_slots = self._slots(block_tables[:num_decodes], length).view(-1)  # [nd * L]
            beyond = self._pos[:length] >= seq_lens_dev[:num_decodes, None]  # [nd, L]
            md.decode_mask = (
                torch.zeros(beyond.shape, dtype=self.dtype, device=self.device)
                .masked_fill_(beyond, float("-inf"))
                .view(num_decodes, 1, 1, length)
            )  # [nd, 1, 1, L]
        for i in range(num_decodes, len(seq_lens)):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            n, length = end - start, seq_lens[i]
            if n == length:  # no cached context: its own k/v rows, plain causal
                md.prefills.append(PrefillPlan(start, end, None, None))
                continue
            slots = self._slots(block_tables[i : i + 1], length)[0]  # [L]
            # query j sits at absolute position length - n + j and sees keys 0..length - n + j
            future = self._pos[:length][None, :] > self._pos[length - n : length][:, None]  # [n, L]
            mask = torch.zeros(future.shape, dtype=self.dtype, device=self.device).masked_fill_(
                future, float("-inf")
            )
            md.prefills.append(PrefillPlan(start, end, slots, mask))
        return md

    def _plan_flash(self, num_real_tokens, query_start_loc, seq_lens, seq_lens_dev, block_tables, cu_seqlens):
        num_reqs, total_k = len(seq_lens), sum(seq_lens)
        cu_q, cu_k = cu_seqlens[: num_reqs + 1], cu_seqlens[num_reqs + 1 : 2 * num_reqs + 2]
        # Request of every context position, then the position inside it; output_size keeps
        # repeat_interleave free of a device->host sync.
        req = torch.repeat_interleave(seq_lens_dev, output_size=total_k)  # [total_k]
        pos = torch.arange(total_k, device=self.device) - cu_k[:-1].index_select(0, req)  # [total_k]
        cols = self._pos_block.index_select(0, pos)  # [total_k]
        blocks = block_tables.flatten().index_select(0, req * block_tables.shape[1] + cols)
        slots = blocks * self.block_size + self._pos_offset.index_select(0, pos)  # [total_k]
        max_q = max(end - start for start, end in zip(query_start_loc, query_start_loc[1:], strict=False))
        return AttentionMetadata(
            num_real_tokens=num_real_tokens,
            kernel="flash",
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            context_slots=slots,
            max_q=max_q,
            max_k=max(seq_lens),
        )

    def _plan_triton(self, num_real_tokens, query_start_loc, seq_lens_dev, block_tables, cu_seqlens):
        # Views of what the runner uploaded: no device work at all (no gather metadata).
        num_reqs = len(query_start_loc) - 1
        max_q = max(end - start for start, end in zip(query_start_loc, query_start_loc[1:], strict=False))
        config = choose_config(self.num_heads // self.num_kv_heads, self.head_dim, max_q)
        return AttentionMetadata(
            num_real_tokens=num_real_tokens,
            kernel="triton",
            cu_seqlens_q=cu_seqlens[: num_reqs + 1],
            block_table=block_tables,
            seqused_k=seq_lens_dev,
            num_reqs=num_reqs,
            unified_config=config,
            max_q=max_q,
        )

    def _plan_flash_paged(
        self, num_real_tokens, query_start_loc, seq_lens, seq_lens_dev, block_tables, cu_seqlens
    ):
        num_reqs = len(seq_lens)
        max_q = max(end - start for start, end in zip(query_start_loc, query_start_loc[1:], strict=False))
        return AttentionMetadata(
            num_real_tokens=num_real_tokens,
            kernel="flash_paged",
            cu_seqlens_q=cu_seqlens[: num_reqs + 1],
            cu_seqlens_k=cu_seqlens[num_reqs + 1 : 2 * num_reqs + 2],
            block_table=block_tables.to(torch.int32),
            seqused_k=seq_lens_dev.to(torch.int32),
            max_q=max_q,
            max_k=max(seq_lens),
        )


@eager_break
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    scale: float,
) -> None:
    """q [T, H, D]; k, v [T, K, D] this step's keys/values (T padded; already written to the cache
    by the graph segment); out [T, H, D] written in place (real rows only); kv_cache [2, S, K, D]
    the layer's cache as flat slots; k_blocks, v_blocks [num_blocks, block_size, K, D] the same
    memory as pages (views made once by the model: no view ops here). Returns None: an eager break."""
    if is_capturing() and q.is_cuda:  # thread-local flag first: no tensor attribute read per replay
        # Under CUDA capture the graph segments have not run, so q/k/v hold garbage; the cache
        # replays right after capturing, and that run is real.
        return
    md = current_attention_metadata()
    if isinstance(md, DecodeMetadata):  # decode kernels in breakable mode: read at replay like the rest
        decode_attention(q, out, k_blocks, v_blocks, md, scale)
        return
    if not md.num_real_tokens:
        return
    if md.kernel == "triton":
        # All requests in one launch, straight from the pages; rows past cu_seqlens_q[R] (padding)
        # are neither read nor written.
        unified_attention(
            q,
            k_blocks,
            v_blocks,
            out,
            md.cu_seqlens_q,
            md.seqused_k,
            md.block_table,
            scale,
            md.num_reqs,
            md.unified_config,
        )
        return
    if md.kernel == "flash_paged":
        # All requests at once, straight from the pages. Rows past cu_seqlens_q[-1] (padding) are
        # neither read nor written.
        _flash_into(
            out,
            q,
            k_blocks,
            v_blocks,
            md.num_real_tokens,
            md.cu_seqlens_q,
            md.cu_seqlens_k,
            md.max_q,
            md.max_k,
            scale,
            seqused_k=md.seqused_k,
            block_table=md.block_table,
        )
        return
    if md.kernel == "flash":
        # All requests at once. Rows past cu_seqlens_q[-1] (padding) are neither read nor written.
        kc, vc = kv_cache.index_select(1, md.context_slots).unbind(0)  # [total_k, K, D] each
        _flash_into(
            out, q, kc, vc, md.num_real_tokens, md.cu_seqlens_q, md.cu_seqlens_k, md.max_q, md.max_k, scale
        )
        return
    if md.num_decodes:
        _decode_attention(q, out, kv_cache, scale, md)
    for p in md.prefills:
        _prefill_attention(p, q, k, v, out, kv_cache, scale)


def _decode_attention(q, out, kv_cache, scale, md: AttentionMetadata) -> None:
    """One query per request, all decodes in one SDPA call over their gathered contexts."""
    nd = md.num_decodes
    kc, vc = (
        kv_cache.index_select(1, md.decode_slots)  # [2, nd * L, K, D]
        .view(md.decode_kv_shape)
        .transpose(2, 3)
        .unbind(0)
    )  # [nd, K, L, D] each
    # GQA without copying K/V per head: the G query heads sharing a KV head become that head's
    # query rows (head h = kv_head * G + g, as HF's repeat_kv lays them out).
    qg = q[:nd].view(md.decode_q_shape)  # [nd, K, G, D]
    o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=md.decode_mask, scale=scale)  # [nd, K, G, D]
    # o may be strided ([nd, G, K, D] memory on CUDA kernels): copy through out's own view
    out[:nd].view(md.decode_q_shape).copy_(o)  # [nd, K, G, D]


def _prefill_attention(p: PrefillPlan, q, k, v, out, kv_cache, scale) -> None:
    """Request p's new tokens attend causally to its cached context plus themselves."""
    qi = q[p.start : p.end].transpose(0, 1)[None]  # [1, H, n, D]
    if p.context_slots is None:  # no cached context: this step's own rows; eligible for flash kernels
        ki = k[p.start : p.end].transpose(0, 1)[None]  # [1, K, n, D]
        vi = v[p.start : p.end].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kc, vc = (
            kv_cache.index_select(1, p.context_slots).transpose(1, 2)[:, None].unbind(0)
        )  # [1, K, L, D] each
        o = F.scaled_dot_product_attention(qi, kc, vc, attn_mask=p.mask, scale=scale, enable_gqa=True)
    out[p.start : p.end].copy_(o[0].transpose(0, 1))  # [n, H, D]
