"""The step's input layout: the static buffers the model reads, and what they hold between steps.

`InputBatch` is the one owner of a step's inputs: the host staging buffers (a static device buffer with
a pinned host mirror each, staging.py), the persistent decode rows on the device (decode_rows.py), the
host cache of which block table each host row holds, and whether each of those is valid. It lays a
step out one of three ways, and each returns what the step needs to know of it as a `StepLayout`:

- `decode_from_rows`: a uniform decode said as `DecodeRows` advances the device rows the last step
  left (a few small kernels, whatever the row count);
- `full_decode`: a uniform decode laid out from its StepSeqs: row i = sequence i = logits row i, a
  block-table row rewritten on the host only when its table changed since the last full decode;
- `mixed`: any step (prefill chunks, decodes, prompt logits): decodes first (the attention op's
  contract), logits rows the need_logits seqs in batch order.

`prepare` picks one by one rule (`takes_rows`). Validity, all of it here: the device rows are known
after a decode (either way) whose keys are known and after a mixed step for its decode prefix (laid
out and sampled first); unknown after anything else (a capture outside a step, a failed step, prompt
logits). The host block-table cache holds only after a full decode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Literal

import numpy as np
import torch

from graphcache.engine.batch import StepBatch, StepSeq
from graphcache.engine.worker.decode_rows import PersistentRows
from graphcache.engine.worker.staging import StagingBuffer
from graphcache.model.attention_metadata import AttentionMetadata, AttentionPlanner, DecodeMetadata


@dataclass(frozen=True, slots=True)
class StepLayout:
    """What one step's layout wrote, for the runner to run it (valid until the next layout)."""

    how: Literal["rows", "full_decode", "mixed"]
    metadata: AttentionMetadata | DecodeMetadata  # the forward context of the step
    num_tokens: int  # real tokens (rows of input_ids before the pads)
    num_reqs: int  # real requests (rows of seq_lens / block_tables before the pads)
    num_logits: int  # logits rows that matter: the need_logits seqs, batch order
    decode_prefix: int  # rows 0..d-1 are decodes of the batch's first d seqs, logits rows 0..d-1
    prompt_rows: tuple[int, ...] = ()  # token rows fed by the prompt_logits seqs, batch order


class InputBatch:
    def __init__(
        self,
        *,
        max_tokens: int,
        max_reqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        max_model_len: int,
        scratch_slot: int,
        planner: AttentionPlanner,
        decode_metadata: Callable[[int], DecodeMetadata],
        device: torch.device,
    ) -> None:
        """decode_metadata(padded rows): the decode kernels' metadata over this object's block_tables and
        seq_lens (the runner's, since captures outside a step need it too)."""
        self.block_size, self.max_model_len, self.scratch_slot = block_size, max_model_len, scratch_slot
        self._planner, self._decode_metadata = planner, decode_metadata
        self._flash = planner.kernel != "sdpa"  # the flash kernels take cumulative lengths
        # The unified kernel takes query starts only, and a mixed graph with it inside reads them over the
        # descriptor's padded requests: those get empty ranges (and length 0), see plan_in_graph.
        self._pad_requests = planner.kernel == "triton"
        i64 = torch.int64
        self.input_ids = StagingBuffer((max_tokens,), i64, device)  # [T_max]
        self.positions = StagingBuffer((max_tokens,), i64, device)  # [T_max]
        self.slot_mapping = StagingBuffer((max_tokens,), i64, device)  # [T_max]
        self.logits_indices = StagingBuffer((max_reqs,), i64, device)  # [R_max] token row of each logits row
        self.seq_lens = StagingBuffer((max_reqs,), i64, device)  # [R_max]
        self.block_tables = StagingBuffer((max_reqs, max_blocks_per_seq), i64, device)  # [R_max, B]
        # [2 * (R_max + 1)] int32: cumulative query lengths, then cumulative context lengths (flash
        # kernel); one buffer so it is one upload, each half contiguous as the kernel wants.
        self.cu_seqlens = StagingBuffer((2 * (max_reqs + 1),), torch.int32, device)
        # Placeholder inputs (async scheduling): token rows to fill, and the previous step's row each
        # takes its sampled id from.
        self.fill_rows = StagingBuffer((max_reqs,), i64, device)  # [R_max]
        self.fill_src = StagingBuffer((max_reqs,), i64, device)  # [R_max]
        self.rows = PersistentRows(
            input_ids=self.input_ids.dev,
            positions=self.positions.dev,
            slot_mapping=self.slot_mapping.dev,
            seq_lens=self.seq_lens.dev,
            block_tables=self.block_tables.dev,
            logits_indices=self.logits_indices.dev,
            block_size=block_size,
            scratch_slot=scratch_slot,
        )
        # Which block table (the sequence's own list, and its length) each row of block_tables.np holds,
        # so a full decode rewrites only rows that changed; stale once anything else wrote the rows.
        self._table_rows: list = [None] * max_reqs
        self._table_lens: list[int] = [0] * max_reqs
        self._host_tables_stale = False
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    # --- validity ------------------------------------------------------------------------
    @staticmethod
    def _may_use_rows(batch: StepBatch, decode: bool) -> bool:
        """The one rule for persistent rows: a step on the decode layout, said as DecodeRows over the
        ids the step in flight samples (then the rows themselves say whether they follow)."""
        return decode and batch.rows is not None and batch.prev_tokens is not None

    def takes_rows(self, batch: StepBatch, decode: bool) -> bool:
        """Whether prepare(batch) lays the step out from the persistent rows with no row new to them (no
        StepSeq needed: a tensor-parallel rank then needs the rows alone)."""
        if not self._may_use_rows(batch, decode):
            return False
        assert batch.rows is not None  # _may_use_rows checked it
        return self.rows.applicable(batch.rows, batch.prev_tokens.shape[0])

    def invalidate(self) -> None:
        """The buffers may hold half a step (a failed step): the next step lays its rows out anew."""
        self.rows.invalidate()
        self._host_tables_stale = True

    def point_at_scratch(self) -> None:
        """Before a capture outside a step: every token writes the scratch slot, every logits row reads
        token 0 and every decode row attends to nothing, so no stale row reaches a real slot."""
        self.invalidate()
        self.slot_mapping.dev.fill_(self.scratch_slot)
        self.logits_indices.dev.zero_()
        self.seq_lens.dev.zero_()
        self.cu_seqlens.dev.zero_()  # every request empty: a mixed graph's attention does no work

    # --- laying a step out -------------------------------------------------------------------
    def prepare(self, batch: StepBatch, *, decode: bool, pad_tokens: int, pad_reqs: int) -> StepLayout:
        """Lay `batch` out. decode: the step runs on the decode layout (a uniform decode, decode kernels,
        no prompt logits); pad_tokens / pad_reqs: its padded sizes (the descriptor's, or the real ones)."""
        if self._may_use_rows(batch, decode):
            layout = self.decode_from_rows(batch, pad_reqs)
            if layout is not None:
                return layout
        if decode:
            return self.full_decode(batch.seqs, pad_reqs, batch.prev_tokens, keys=batch.keys)
        return self.mixed(batch.seqs, pad_tokens, pad_reqs, batch.prev_tokens, keys=batch.keys)

    def decode_from_rows(self, batch: StepBatch, pad_reqs: int) -> StepLayout | None:
        """Advance the device rows to batch.rows; None (nothing touched) when they do not follow from the
        rows the last step left."""
        assert batch.rows is not None, "decode_from_rows lays out a batch of DecodeRows"
        if not self.rows.apply(batch.rows, pad_reqs, batch.prev_tokens, batch.seq_at, self._wait_uploads):
            return None
        self._host_tables_stale = True  # the device rows moved; the host mirror no longer matches them
        self._record_uploads()
        n = len(batch.rows.keys)
        return StepLayout("rows", self._decode_metadata(pad_reqs), n, n, n, n)

    def full_decode(
        self,
        seqs: list[StepSeq],
        pad_reqs: int,
        prev_tokens: torch.Tensor | None = None,
        *,
        keys: list[int] | None = None,
    ) -> StepLayout:
        """Uniform decode from its StepSeqs. keys: each seq's Sequence.key (None: unknown), which lets
        the next decode take these rows as they are."""
        self._write_full_decode(seqs, pad_reqs, prev_tokens)
        n = len(seqs)
        self.rows.remember(keys, self._table_lens[:n], pad_reqs)
        return StepLayout("full_decode", self._decode_metadata(pad_reqs), n, n, n, n)

    def _write_full_decode(
        self, seqs: list[StepSeq], pad_reqs: int, prev_tokens: torch.Tensor | None
    ) -> None:
        """Host work is a few list comprehensions and numpy ops; a block-table row is rewritten only when
        its table changed since the last full decode (a new sequence in the row, or a new block)."""
        self._wait_uploads()
        if self._host_tables_stale:
            self._table_rows[:] = [None] * len(self._table_rows)
            self._host_tables_stale = False
        n, bs = len(seqs), self.block_size
        bt, rows, lens = self.block_tables.np, self._table_rows, self._table_lens
        for row, s in enumerate(seqs):
            table = s.block_table
            if rows[row] is not table or lens[row] != len(table):
                bt[row, : len(table)] = table
                rows[row], lens[row] = table, len(table)
        pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)  # [n]
        short = np.flatnonzero((pos >= np.asarray(lens[:n]) * bs) | (pos >= self.max_model_len))
        if short.size:
            i = int(short[0])
            raise ValueError(
                f"sequence {i} reaches position {pos[i] + 1} with {lens[i]} blocks of {bs}; it needs "
                f"ceil({pos[i] + 1}/{bs}) blocks and at most max_model_len {self.max_model_len}"
            )
        self.input_ids.np[:n] = [s.token_ids[0] for s in seqs]
        self.positions.np[:n] = pos
        self.slot_mapping.np[:n] = bt[np.arange(n), pos // bs] * bs + pos % bs
        self.seq_lens.np[:n] = pos + 1
        self.logits_indices.np[:pad_reqs] = np.arange(pad_reqs)
        # Pads: token 0 at position 0 writing the scratch slot, length 0 (attention writes zeros).
        self.input_ids.np[n:pad_reqs] = 0
        self.positions.np[n:pad_reqs] = 0
        self.slot_mapping.np[n:pad_reqs] = self.scratch_slot
        self.seq_lens.np[n:pad_reqs] = 0
        for buf in (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.logits_indices,
            self.seq_lens,
            self.block_tables,
        ):
            buf.upload(pad_reqs)
        self._fill_placeholders(
            [(i, s.prev_row) for i, s in enumerate(seqs) if s.prev_row is not None], prev_tokens
        )
        self._record_uploads()

    def mixed(
        self,
        seqs: list[StepSeq],
        pad_tokens: int,
        pad_reqs: int,
        prev_tokens: torch.Tensor | None = None,
        *,
        keys: list[int] | None = None,
    ) -> StepLayout:
        """Any step, in numpy passes over the sequences' lengths. Rows: decodes first (the attention op's
        contract), then the others, each in batch order; logits rows: the need_logits seqs in batch
        order, then the others. keys: as for full_decode (the decode prefix is remembered)."""
        self._wait_uploads()
        self._host_tables_stale = True  # rows laid out anew
        n, bs = len(seqs), self.block_size
        fed = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)  # [R] tokens fed, batch order
        start = np.fromiter((s.start_pos for s in seqs), np.int64, n)  # [R]
        blocks = np.fromiter((len(s.block_table) for s in seqs), np.int64, n)  # [R]
        end = start + fed  # [R]
        bad = np.flatnonzero((fed == 0) | (end > self.max_model_len) | (blocks * bs < end))
        if bad.size:
            i = int(bad[0])
            if fed[i] == 0:
                raise ValueError(f"sequence {i} of the batch feeds no tokens")
            raise ValueError(
                f"sequence {i} reaches position {end[i]} with {blocks[i]} blocks of {bs}; "
                f"it needs ceil({end[i]}/{bs}) blocks and at most max_model_len {self.max_model_len}"
            )
        is_decode = fed == 1
        order = np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])  # [R] row -> seq
        num_decodes = int(is_decode.sum())
        query_start = np.zeros(n + 1, np.int64)  # [R + 1] by row
        np.cumsum(fed[order], out=query_start[1:])
        num_tokens = int(query_start[-1])
        first_row = np.empty(n, np.int64)  # [R] by seq
        first_row[order] = query_start[:-1]
        ids = self.input_ids.np
        ids[:num_tokens] = np.fromiter(
            chain.from_iterable(seqs[i].token_ids for i in order.tolist()), np.int64, num_tokens
        )
        pos = self.positions.np
        pos[:num_tokens] = np.arange(num_tokens) + np.repeat(start[order] - query_start[:-1], fed[order])
        # Pads: token 0 at position 0 (valid embedding and rotary rows); their K/V go to the scratch slot.
        ids[num_tokens:pad_tokens] = 0
        pos[num_tokens:pad_tokens] = 0
        bt = self.block_tables.np
        bt[:n] = 0
        for row, i in enumerate(order.tolist()):
            table = seqs[i].block_table
            bt[row, : len(table)] = table
        token_row = np.repeat(np.arange(n), fed[order])  # [T] each token's row
        p = pos[:num_tokens]
        self.slot_mapping.np[:num_tokens] = bt[token_row, p // bs] * bs + p % bs
        self.slot_mapping.np[num_tokens:pad_tokens] = self.scratch_slot
        need_logits = np.fromiter((s.need_logits for s in seqs), bool, n)  # [R]
        logits_seqs = np.concatenate([np.flatnonzero(need_logits), np.flatnonzero(~need_logits)])
        self.logits_indices.np[:n] = first_row[logits_seqs] + fed[logits_seqs] - 1  # each one's last token
        self.logits_indices.np[n:pad_reqs] = 0
        seq_lens = end[order]  # [R] by row
        self.seq_lens.np[:n] = seq_lens
        uploads = [
            (self.input_ids, pad_tokens),
            (self.positions, pad_tokens),
            (self.slot_mapping, pad_tokens),
            (self.logits_indices, pad_reqs),
            (self.seq_lens, n),
            (self.block_tables, n),
        ]
        if self._pad_requests:
            cu = self.cu_seqlens.np
            cu[: n + 1] = query_start
            cu[n + 1 : pad_reqs + 1] = num_tokens  # padded requests: empty query ranges at the end
            self.seq_lens.np[n:pad_reqs] = 0
            uploads[4] = (self.seq_lens, pad_reqs)
            uploads.append((self.cu_seqlens, pad_reqs + 1))
        elif self._flash:
            cu = self.cu_seqlens.np
            cu[: n + 1] = query_start
            cu[n + 1] = 0
            np.cumsum(seq_lens, out=cu[n + 2 : 2 * n + 2])
            uploads.append((self.cu_seqlens, 2 * n + 2))
        for buf, count in uploads:
            buf.upload(count)
        self._fill_placeholders(
            [(int(first_row[i]), s.prev_row) for i, s in enumerate(seqs) if s.prev_row is not None],
            prev_tokens,
        )
        self._record_uploads()
        query_list, lens_list = query_start.tolist(), seq_lens.tolist()
        md = self._planner.plan(
            num_real_tokens=num_tokens,
            num_decodes=num_decodes,
            query_start_loc=query_list,
            seq_lens=lens_list,
            seq_lens_dev=self.seq_lens.dev[:n],
            block_tables=self.block_tables.dev[:n],
            cu_seqlens=self.cu_seqlens.dev,
        )
        prompt = [i for i, s in enumerate(seqs) if s.prompt_logits]
        prompt_rows = tuple(r for i in prompt for r in range(int(first_row[i]), int(first_row[i] + fed[i])))
        # The decodes can be the next step's persistent rows when they are the batch's first d seqs and
        # all sample (the scheduler's order: decodes first): then they are rows and logits rows 0..d-1.
        d = num_decodes
        prefix = d if d and is_decode[:d].all() and need_logits[:d].all() else 0
        if keys is None or prefix == 0 or prompt:
            self.rows.invalidate()
        else:
            self.rows.remember(keys[:prefix], blocks[:prefix], 0)
        return StepLayout("mixed", md, num_tokens, n, int(need_logits.sum()), prefix, prompt_rows)

    # --- uploads -------------------------------------------------------------------------
    def _wait_uploads(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's async copies have read the host mirrors

    def _record_uploads(self) -> None:
        if self._uploaded is not None:
            self._uploaded.record()

    def _fill_placeholders(self, fills: list[tuple[int, int]], prev_tokens: torch.Tensor | None) -> None:
        """Async scheduling: a decode fed the token the previous step is still sampling gets it on the
        device, input_ids[row] = prev_tokens[prev_row], after the upload (stream order), no sync."""
        if not fills:
            return
        if prev_tokens is None:
            raise ValueError(
                "placeholder inputs need StepBatch.prev_tokens (the previous step's sampled ids)"
            )
        k = len(fills)
        self.fill_rows.np[:k] = [row for row, _ in fills]
        self.fill_src.np[:k] = [src for _, src in fills]
        self.fill_rows.upload(k)
        self.fill_src.upload(k)
        self.input_ids.dev.index_copy_(
            0, self.fill_rows.dev[:k], prev_tokens.index_select(0, self.fill_src.dev[:k])
        )
