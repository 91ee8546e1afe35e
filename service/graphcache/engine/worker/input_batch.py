"""The step's input layout: the static buffers the model reads, and the one function that fills them.

`InputBatch` owns every buffer a step's inputs go through (a static device buffer with a pinned host mirror
each, staging.py) and which of their host rows hold which block table. `prepare(table, plan)` lays any step
out (decode, mixed, prompt logits) from the plan and the worker's request table
(engine/worker/request_table.py), and says what the step needs to know of it as a `StepLayout`:

- a steady decode (every row fed the token the step in flight samples for it, on the decode layout)
  whose rows follow from the rows the table knows on the device is advanced there (`ResidentRows.apply`:
  a few small kernels, whatever the row count), how "rows";
- anything else is written from the host in numpy passes over the rows: decodes first (the attention op's
  contract), then the others, each in plan order; logits rows the need_logits rows in plan order, then the
  others. On the decode layout (a uniform decode, decode kernels, no prompt logits: how "full_decode") row i
  is request i is logits row i, and a block-table row is rewritten on the host only when its table changed
  since the last such layout; otherwise (how "mixed") every row is rewritten.

Pads are written in one place (`_write_pads`): token 0 at position 0 writing the scratch slot, length 0,
logits rows reading token 0 (a decode's read their own row: the decode layout's logits rows are its rows).

What the device rows hold after a step (the table's `ResidentRows.remember`): every row after a decode
laid out either way; after a mixed step, its decode prefix (laid out and sampled first); nothing after
anything else (a capture outside a step, a failed step, prompt logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Literal

import numpy as np
import torch

from graphcache.engine.plan import StepPlan
from graphcache.engine.worker.request_table import RequestTable, ResidentRows
from graphcache.engine.worker.staging import StagingBuffer
from graphcache.model.attention_metadata import AttentionMetadata, AttentionPlanner, DecodeMetadata

# Input of a row fed the token the step in flight samples: written, then replaced on the device by that
# step's sampled id (async scheduling).
PLACEHOLDER_TOKEN = -1


@dataclass(frozen=True, slots=True)
class StepLayout:
    """What one step's layout wrote, for the runner to run it (valid until the next layout)."""

    how: Literal["rows", "full_decode", "mixed"]
    metadata: AttentionMetadata | DecodeMetadata  # the forward context of the step
    num_tokens: int  # real tokens (rows of input_ids before the pads)
    num_reqs: int  # real requests (rows of seq_lens / block_tables before the pads)
    num_logits: int  # logits rows that matter: the need_logits rows, plan order
    decode_prefix: int  # rows 0..d-1 are decodes of the plan's first d rows, logits rows 0..d-1
    prompt_rows: tuple[int, ...] = ()  # token rows fed by the plan's PromptLogits rows, plan order
    verify_rows: tuple[int, ...] = ()  # token rows fed by the plan's verify rows, plan.verify order
    # all_logits layouts (a verify step replayed from a graph): logits row t is token row t, and the
    # need_logits rows' logits are these token rows, plan order
    sample_rows: tuple[int, ...] = ()
    # (first token row, tokens fed) of each of the plan's pooling rows, plan.pooling order
    pool_rows: tuple[tuple[int, int], ...] = ()


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
        # Rows fed the token in flight (async scheduling): token rows to fill, and the previous step's row
        # each takes its sampled id from.
        self.fill_rows = StagingBuffer((max_reqs,), i64, device)  # [R_max]
        self.fill_src = StagingBuffer((max_reqs,), i64, device)  # [R_max]
        # Which block table (the request's list in the table, and its length) each row of block_tables.np
        # holds, so a decode layout rewrites only rows that changed; stale once a mixed layout wrote the rows.
        self._table_rows: list = [None] * max_reqs
        self._table_lens: list[int] = [0] * max_reqs
        self._host_tables_stale = False
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def resident_rows(self) -> ResidentRows:
        """The device rows over these buffers (the request table's device part)."""
        return ResidentRows(
            input_ids=self.input_ids.dev,
            positions=self.positions.dev,
            slot_mapping=self.slot_mapping.dev,
            seq_lens=self.seq_lens.dev,
            block_tables=self.block_tables.dev,
            logits_indices=self.logits_indices.dev,
            block_size=self.block_size,
        )

    # --- validity ------------------------------------------------------------------------
    def invalidate(self, table: RequestTable) -> None:
        """The buffers may hold half a step (a failed step): the next step lays its rows out anew."""
        if table.rows is not None:
            table.rows.invalidate()
        self._host_tables_stale = True

    def point_at_scratch(self, table: RequestTable) -> None:
        """Before a capture outside a step: every token writes the scratch slot, every logits row reads
        token 0 and every decode row attends to nothing, so no stale row reaches a real slot."""
        self.invalidate(table)
        self.slot_mapping.dev.fill_(self.scratch_slot)
        self.logits_indices.dev.zero_()
        self.seq_lens.dev.zero_()
        self.cu_seqlens.dev.zero_()  # every request empty: a mixed graph's attention does no work
        if table.rows is not None:
            table.rows.arange_rows = 0

    @staticmethod
    def takes_rows(table: RequestTable, plan: StepPlan, *, decode: bool, num_prev: int) -> bool:
        """Whether prepare() advances the device rows for this plan (num_prev: ids the step in flight samples)."""
        return (
            decode and num_prev > 0 and table.rows is not None and table.rows.follows(plan, table, num_prev)
        )

    # --- laying a step out -------------------------------------------------------------------
    def prepare(
        self,
        table: RequestTable,
        plan: StepPlan,
        *,
        decode: bool,
        pad_tokens: int,
        pad_reqs: int,
        prev_tokens: torch.Tensor | None = None,
        all_logits: bool = False,
    ) -> StepLayout:
        """Lay the plan's step out (the table holds the plan's requests: RequestTable.update). all_logits: a
        logits row per fed token (a verify step's graph: pad_reqs >= the step's tokens). decode: the
        step runs on the decode layout (a uniform decode, decode kernels, no prompt logits); pad_tokens /
        pad_reqs: its padded sizes (the descriptor's, or the real ones); prev_tokens: the ids the step in
        flight samples (None: no step in flight)."""
        if decode and plan.tokens is None and prev_tokens is not None and table.rows is not None:
            layout = self._advance(table, table.rows, plan, pad_reqs, prev_tokens)
            if layout is not None:
                return layout
        return self._lay_out(table, plan, decode, pad_tokens, pad_reqs, prev_tokens, all_logits)

    def _advance(
        self,
        table: RequestTable,
        rows: ResidentRows,
        plan: StepPlan,
        pad_reqs: int,
        prev_tokens: torch.Tensor,
    ) -> StepLayout | None:
        """A steady decode from the device rows; None (nothing touched) when they do not follow."""
        after_mixed = pad_reqs > rows.arange_rows  # the rows past the decodes may hold a prefill's tokens
        rp = rows.apply(plan, table, prev_tokens, self._wait_uploads)
        if rp is None:
            return None
        n = len(plan.keys)
        # The pads: rewritten when the rows changed, or after a mixed step (its rows past the decodes held
        # prefill tokens writing real slots); after a decode step of these rows they are as they were.
        if (rp.src is not None or after_mixed) and n < pad_reqs:
            self._wait_uploads()
            self._write_pads(n, pad_reqs, n, pad_reqs, decode=True)
            for buf in (self.input_ids, self.positions, self.slot_mapping, self.seq_lens):
                buf.upload_range(n, pad_reqs)
        rows.set_arange(pad_reqs)
        self._record_uploads()
        return StepLayout("rows", self._decode_metadata(pad_reqs), n, n, n, n)

    def _write_pads(
        self, num_tokens: int, pad_tokens: int, num_reqs: int, pad_reqs: int, *, decode: bool
    ) -> None:
        """The pads of every layout, in the host mirrors: token 0 at position 0 (valid embedding and rotary
        rows) writing the scratch slot; a padded request has length 0 (attention writes zeros) and an empty
        query range; its logits row reads token 0, or on the decode layout its own row."""
        self.input_ids.np[num_tokens:pad_tokens] = 0
        self.positions.np[num_tokens:pad_tokens] = 0
        self.slot_mapping.np[num_tokens:pad_tokens] = self.scratch_slot
        self.seq_lens.np[num_reqs:pad_reqs] = 0
        self.logits_indices.np[num_reqs:pad_reqs] = np.arange(num_reqs, pad_reqs) if decode else 0
        if self._pad_requests and not decode:
            self.cu_seqlens.np[num_reqs + 1 : pad_reqs + 1] = num_tokens  # empty query ranges at the end

    def _lay_out(
        self,
        table: RequestTable,
        plan: StepPlan,
        decode: bool,
        pad_tokens: int,
        pad_reqs: int,
        prev_tokens: torch.Tensor | None,
        all_logits: bool = False,
    ) -> StepLayout:
        """Any step from the host, in numpy passes over the rows' lengths. On the decode layout (a uniform
        decode) row i is plan row i, token i and logits row i, and the general reorderings are skipped."""
        self._wait_uploads()
        keys, tokens, n, bs = plan.keys, plan.tokens, len(plan.keys), self.block_size
        tables = table.block_tables(keys)  # [R] each row's whole block table
        start = np.asarray(plan.starts, np.int64)  # [R]
        if decode or tokens is None:
            fed = np.ones(n, np.int64)  # [R] tokens fed, plan order
        else:
            fed = np.fromiter((1 if t is None else len(t) for t in tokens), np.int64, n)
        if decode:
            self._write_tables_cached(tables)
            blocks = np.asarray(self._table_lens[:n], np.int64)
        else:
            blocks = np.fromiter(map(len, tables), np.int64, n)  # [R]
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
        ids, pos, bt = self.input_ids.np, self.positions.np, self.block_tables.np
        need = plan.need_logits
        need_logits = np.ones(n, bool) if need is None else np.asarray(need, bool)  # [R]
        num_logits = int(need_logits.sum())
        if decode:
            num_tokens = num_decodes = n
            first_row = np.arange(n)  # [R] by plan row: row i is token i
            if tokens is None:
                ids[:n] = PLACEHOLDER_TOKEN
            else:
                ids[:n] = [PLACEHOLDER_TOKEN if t is None else t[0] for t in tokens]
            pos[:n] = start
            self.slot_mapping.np[:n] = bt[first_row, start // bs] * bs + start % bs
            self.logits_indices.np[:n] = first_row  # with the pads: 0, 1, 2, ... (the rows' invariant)
            seq_lens = end
        else:
            is_decode = fed == 1
            num_decodes = int(is_decode.sum())
            if num_decodes == n:
                order = np.arange(n)  # [R] row -> plan row
            else:
                order = np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])
            query_start = np.zeros(n + 1, np.int64)  # [R + 1] by row
            np.cumsum(fed[order], out=query_start[1:])
            num_tokens = int(query_start[-1])
            first_row = np.empty(n, np.int64)  # [R] by plan row
            first_row[order] = query_start[:-1]
            order_list = order.tolist()
            if tokens is None:
                ids[:num_tokens] = PLACEHOLDER_TOKEN
            else:
                ids[:num_tokens] = np.fromiter(
                    chain.from_iterable(
                        (PLACEHOLDER_TOKEN,) if t is None else t for t in map(tokens.__getitem__, order_list)
                    ),
                    np.int64,
                    num_tokens,
                )
            pos[:num_tokens] = np.arange(num_tokens) + np.repeat(start[order] - query_start[:-1], fed[order])
            self._write_tables(tables, order_list)
            token_row = np.repeat(np.arange(n), fed[order])  # [T] each token's row
            p = pos[:num_tokens]
            self.slot_mapping.np[:num_tokens] = bt[token_row, p // bs] * bs + p % bs
            if num_logits == n:
                logits_rows = first_row + fed - 1  # each one's last token
            else:
                logits_seqs = np.concatenate([np.flatnonzero(need_logits), np.flatnonzero(~need_logits)])
                logits_rows = first_row[logits_seqs] + fed[logits_seqs] - 1
            self.logits_indices.np[:n] = logits_rows
            seq_lens = end[order]  # [R] by row
        self.seq_lens.np[:n] = seq_lens
        self._write_pads(num_tokens, pad_tokens, n, pad_reqs, decode=decode)
        sample_rows: tuple[int, ...] = ()
        if all_logits:
            if decode or pad_reqs < num_tokens:
                raise ValueError(
                    f"an all-logits layout needs a mixed step of {num_tokens} <= {pad_reqs} rows"
                )
            li = self.logits_indices.np
            sample_rows = tuple(li[:num_logits].tolist())
            li[:num_tokens] = np.arange(num_tokens)
            li[num_tokens:pad_reqs] = 0
        if decode:
            uploads = [
                (self.input_ids, pad_reqs),
                (self.positions, pad_reqs),
                (self.slot_mapping, pad_reqs),
                (self.logits_indices, pad_reqs),
                (self.seq_lens, pad_reqs),
                (self.block_tables, pad_reqs),
            ]
        else:
            uploads = [
                (self.input_ids, pad_tokens),
                (self.positions, pad_tokens),
                (self.slot_mapping, pad_tokens),
                (self.logits_indices, pad_reqs),
                (self.seq_lens, pad_reqs if self._pad_requests else n),
                (self.block_tables, n),
            ]
            if self._pad_requests:
                self.cu_seqlens.np[: n + 1] = query_start
                uploads.append((self.cu_seqlens, pad_reqs + 1))
            elif self._flash:
                cu = self.cu_seqlens.np
                cu[: n + 1] = query_start
                cu[n + 1] = 0
                np.cumsum(seq_lens, out=cu[n + 2 : 2 * n + 2])
                uploads.append((self.cu_seqlens, 2 * n + 2))
        for buf, count in uploads:
            buf.upload(count)
        if tokens is None or None in tokens:
            self._fill_in_flight(table, plan, first_row, prev_tokens)
        self._record_uploads()
        prompt_rows = tuple(
            r
            for span in plan.prompt_logits
            for r in range(int(first_row[span.row]), int(first_row[span.row] + fed[span.row]))
        )
        verify_rows = tuple(
            r for row, _ in plan.verify for r in range(int(first_row[row]), int(first_row[row] + fed[row]))
        )
        pool_rows = tuple((int(first_row[row]), int(fed[row])) for row in plan.pooling)
        rows = table.rows
        if decode:
            if rows is not None:
                rows.remember(keys, self._table_lens[:n], pad_reqs)
            return StepLayout(
                "full_decode", self._decode_metadata(pad_reqs), n, n, n, n, prompt_rows, pool_rows=pool_rows
            )
        md = self._planner.plan(
            num_real_tokens=num_tokens,
            num_decodes=num_decodes,
            query_start_loc=query_start.tolist(),
            seq_lens=seq_lens.tolist(),
            seq_lens_dev=self.seq_lens.dev[:n],
            block_tables=self.block_tables.dev[:n],
            cu_seqlens=self.cu_seqlens.dev,
        )
        # The decodes can be the next step's device rows when they are the plan's first d rows and all
        # sample (the scheduler's order: decodes first): then they are rows and logits rows 0..d-1.
        d = num_decodes
        prefix = d if d and is_decode[:d].all() and need_logits[:d].all() else 0
        if rows is not None:
            if prefix == 0 or plan.prompt_logits or plan.verify or plan.pooling:
                rows.invalidate()
            else:
                rows.remember(keys[:prefix], blocks[:prefix], 0)
        return StepLayout(
            "mixed", md, num_tokens, n, num_logits, prefix, prompt_rows, verify_rows, sample_rows, pool_rows
        )

    def _write_tables_cached(self, tables: list[list[int]]) -> None:
        """Row i = tables[i]; a row is rewritten only when its table changed since the last decode layout
        (a new request in the row, or a new block)."""
        if self._host_tables_stale:
            self._table_rows[:] = [None] * len(self._table_rows)
            self._host_tables_stale = False
        bt, rows, lens = self.block_tables.np, self._table_rows, self._table_lens
        for row, t in enumerate(tables):
            if rows[row] is not t or lens[row] != len(t):
                bt[row, : len(t)] = t
                rows[row], lens[row] = t, len(t)

    def _write_tables(self, tables: list[list[int]], order: list[int]) -> None:
        """Row r = tables[order[r]], the rest of each row block 0; the decode layout's row cache is stale."""
        self._host_tables_stale = True
        bt = self.block_tables.np
        bt[: len(tables)] = 0
        for row, i in enumerate(order):
            t = tables[i]
            bt[row, : len(t)] = t

    # --- uploads -------------------------------------------------------------------------
    def _wait_uploads(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's async copies have read the host mirrors

    def _record_uploads(self) -> None:
        if self._uploaded is not None:
            self._uploaded.record()

    def _fill_in_flight(
        self, table: RequestTable, plan: StepPlan, first_row: np.ndarray, prev_tokens: torch.Tensor | None
    ) -> None:
        """Async scheduling: a row fed the token the step in flight samples gets it on the device,
        input_ids[row] = prev_tokens[its row of them], after the upload (stream order), no sync."""
        if prev_tokens is None:
            raise ValueError("rows fed the token in flight need the ids the step in flight sampled")
        tokens, keys = plan.tokens, plan.keys
        rows = range(len(keys)) if tokens is None else [i for i, t in enumerate(tokens) if t is None]
        src_of = table.in_flight_rows()
        try:
            src = [src_of[keys[i]] for i in rows]
        except KeyError as missing:
            table.in_flight_row_of(missing.args[0])  # raises, naming the row
            raise
        k = len(src)
        self.fill_rows.np[:k] = first_row[rows] if tokens is not None else first_row
        self.fill_src.np[:k] = src
        self.fill_rows.upload(k)
        self.fill_src.upload(k)
        self.input_ids.dev.index_copy_(
            0, self.fill_rows.dev[:k], prev_tokens.index_select(0, self.fill_src.dev[:k])
        )
