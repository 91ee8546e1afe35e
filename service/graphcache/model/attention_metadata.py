"""A step's attention metadata and the planner that builds it: what every layer's attention reads.

`AttentionPlanner.plan` runs ONCE per step for all layers (the runner calls it), on the device and
without host syncs: every size comes from host ints, every index from device tensors the runner
uploaded. What it builds depends on the kernel (model/attention.py chose it and runs it):
- "triton": a few views of the runner's uploads (cumulative query lengths, block tables, context
  lengths) and the tile shape of the step's launch; nothing gathered;
- "flash_paged": the same views as int32, for FlashAttention's paged varlen call;
- "flash": the flat slot of every request's context, for one gather + the varlen call;
- "sdpa": decodes as one batch ([num_decodes, L] slots + additive mask), each prefill its own plan.
`DecodeMetadata` is the uniform-decode counterpart, made by the runner once per padded batch size:
static buffers only, so it serves every step of that size and can be captured in the graph.
`AttentionPlanner.plan_in_graph` gives a mixed graph with attention inside its (static) metadata.

Kept apart from the attention ops: the runner and its input batch build and hold these objects
without running attention, and the ops only read them (through the forward context).
Token layout of a step: decodes first (token i is request i's), then each multi-token request as a
contiguous run; see model/attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphcache.model.prefill_attention import DensePrefill, plan_dense_suffix
from graphcache.model.unified_attention import UnifiedConfig, choose_config

__all__ = ["AttentionMetadata", "AttentionPlanner", "DecodeMetadata", "PrefillPlan"]

# The mem-efficient SDPA kernel wants the mask's key dim a multiple of 16; otherwise it pads the
# mask with extra ops on every call. The decode context length is rounded up to this.
_MASK_ALIGN = 16


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
    # "flash": [sum(seq_lens)] int64 slots of every request's context
    context_slots: torch.Tensor | None = None
    block_table: torch.Tensor | None = None  # "flash_paged": [R, B] int32 block ids; "triton": int64
    seqused_k: torch.Tensor | None = None  # "flash_paged": [R] int32 context lengths; "triton": int64
    num_reqs: int = 0  # "triton": R
    unified_config: UnifiedConfig | None = None  # "triton": the tile shape of this step's launch
    # "triton": the fresh prompts at the end of the step, run by a dense kernel (model/prefill_attention.py);
    # the unified launch then covers requests [0, dense.first_req) only. None: every row on the unified kernel.
    dense: DensePrefill | None = None
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
        prefill_kernel: str = "",
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """prefill_kernel: the dense kernel of fresh prompts on the triton kernel ("": none;
        model/prefill_attention.py select_prefill_kernel). kv_dtype: the cache's (default: dtype)."""
        self.kernel, self.block_size, self.dtype, self.device = kernel, block_size, dtype, device
        self.kv_bytes = (kv_dtype or dtype).itemsize  # the unified kernel's tiles follow it (choose_config)
        self.prefill_kernel = prefill_kernel
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
            return self._plan_triton(
                num_real_tokens, query_start_loc, seq_lens, seq_lens_dev, block_tables, cu_seqlens
            )
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
        config = choose_config(self.num_heads // self.num_kv_heads, self.head_dim, 2, self.kv_bytes)
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

    def _plan_triton(
        self, num_real_tokens, query_start_loc, seq_lens, seq_lens_dev, block_tables, cu_seqlens
    ):
        # Views of what the runner uploaded: no device work at all (no gather metadata), except the dense
        # prefill's rebased lengths when a dense kernel takes the step's trailing fresh prompts.
        num_reqs = len(query_start_loc) - 1
        dense = plan_dense_suffix(self.prefill_kernel, query_start_loc, seq_lens, cu_seqlens)
        unified_reqs = dense.first_req if dense is not None else num_reqs
        q_lens = [end - start for start, end in zip(query_start_loc, query_start_loc[1:], strict=False)]
        max_q = max(q_lens)
        # The tile shape of the rows the unified launch still runs (decode-sized when only decodes are left).
        config = choose_config(
            self.num_heads // self.num_kv_heads,
            self.head_dim,
            max(q_lens[:unified_reqs], default=1),
            self.kv_bytes,
        )
        return AttentionMetadata(
            num_real_tokens=num_real_tokens,
            kernel="triton",
            cu_seqlens_q=cu_seqlens[: num_reqs + 1],
            block_table=block_tables,
            seqused_k=seq_lens_dev,
            num_reqs=num_reqs,
            unified_config=config,
            max_q=max_q,
            dense=dense,
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
