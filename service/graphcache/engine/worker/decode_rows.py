"""Persistent decode rows: a steady decode step applied to the input batch's device buffers as a change.

In a steady decode (async scheduling, every running sequence fed the token the step in flight is
sampling for it) a row changes only thus: its position and length advance by one, its input is the id
just sampled in the same row, and now and then its block table grows by a block. So row i stays the
same sequence across steps and these buffers advance on the device: the host compares the row keys
(one C-level list comparison), writes the new blocks, and launches about ten small kernels, however
many rows there are, instead of building, filling and uploading every row (the aim of vLLM's
persistent input batch; the shape here is our own).

What the input batch knows after a step (`remember`): every row of a decode step; after a mixed step, its
decode rows (laid out first, and sampled first). A step's rows then follow from the last step's: rows
that stay are gathered on the device in the scheduler's order (rows left: finished, aborted,
preempted); rows it did not hold (a prefill that ended in the mixed step before) are written from
their own StepSeq alone (`StepBatch.seq_at`), with the id the last step sampled for
them. Anything else (no rows known: a capture outside a step, a failed step, prompt logprobs, a row fed
a token that is not in flight) makes the input batch lay every row out from the StepSeqs
(InputBatch.full_decode). The InputBatch (input_batch.py) owns this object and decides when it is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from graphcache.engine.batch import DecodeRows, StepSeq
from graphcache.engine.worker.staging import StagingBuffer


class _Plan(NamedTuple):
    """How one step's rows follow from the last step's (computed without touching anything)."""

    src: list[int] | None  # [n] the last step's row of each row (0 for new rows); None: same rows
    prev: list[int] | None  # [n] each row's row of the last step's sampled ids; None: same rows
    row_of: dict[int, int]  # key -> its row this step
    num_blocks: np.ndarray  # [n] blocks of each row's table on the device after this step
    added: list[list[int]]  # [rows, columns, block ids] of the blocks held rows got this step
    new: list[tuple[int, StepSeq]]  # (row, its StepSeq) of the rows the last step did not hold


class PersistentRows:
    def __init__(
        self,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        logits_indices: torch.Tensor,
        block_size: int,
        scratch_slot: int,
    ) -> None:
        """The input batch's static device buffers: input_ids, positions, slot_mapping [T_max] int64,
        seq_lens, logits_indices [R_max] int64, block_tables [R_max, B] int64."""
        self.input_ids, self.positions, self.slot_mapping = input_ids, positions, slot_mapping
        self.seq_lens, self.block_tables, self.logits_indices = seq_lens, block_tables, logits_indices
        self.block_size, self.scratch_slot = block_size, scratch_slot
        max_reqs, device = block_tables.shape[0], block_tables.device
        self.keys: list[int] | None = None  # the rows known after the last step; None: none
        self._row_of: dict[int, int] | None = None  # key -> row of `keys`, built on first need
        self._num_blocks = np.zeros(max_reqs, dtype=np.int64)  # [R_max] blocks of row i's table on the device
        self._arange_rows = 0  # logits_indices[:this] holds 0, 1, 2, ... (a decode's layout)
        self._arange = torch.arange(max_reqs, device=device)
        self._index = StagingBuffer((2 * max_reqs,), torch.int64, device)  # src, then prev, of each row
        # Flat, so one contiguous upload: rows, then columns, then ids of the blocks added (one per decode
        # at most), and of the new rows: rows, then positions.
        self._added = StagingBuffer((3 * max_reqs,), torch.int64, device)
        self._new = StagingBuffer((2 * max_reqs,), torch.int64, device)
        self._new_tables = StagingBuffer(tuple(block_tables.shape), torch.int64, device)  # [R_max, B]
        self._view_cache: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_applied = 0  # steps that went this way (tests, benchmarks)

    def _views(self, n: int) -> tuple[torch.Tensor, ...]:
        """The first n rows of input_ids, positions, seq_lens, slot_mapping, block_tables and the two
        gather indices, made once per n: slicing costs as much host time as a small kernel launch."""
        views = self._view_cache.get(n)
        if views is None:
            views = self._view_cache[n] = (
                self.input_ids[:n],
                self.positions[:n],
                self.seq_lens[:n],
                self.slot_mapping[:n],
                self.block_tables[:n],
                self._index.dev[:n],
                self._index.dev[n : 2 * n],
            )
        return views

    def invalidate(self) -> None:
        """The device buffers no longer hold known rows (another layout was written, or a step failed)."""
        self.keys = self._row_of = None

    def remember(
        self, keys: list[int] | None, num_blocks: Sequence[int] | np.ndarray, arange_rows: int
    ) -> None:
        """A step laid rows out from its StepSeqs: rows 0..len(keys)-1 are decodes of those sequences
        (None: not known), with num_blocks[i] blocks in the device block table, and row i's sampled id
        is row i of the step's sampled ids. logits_indices[:arange_rows] is 0, 1, 2, ..."""
        self.keys, self._row_of, self._arange_rows = keys, None, arange_rows
        if keys is not None:
            self._num_blocks[: len(keys)] = num_blocks

    def _old_row_of(self) -> dict[int, int]:
        if self._row_of is None:
            assert self.keys is not None  # asked only while rows are known (_plan checks)
            self._row_of = {k: i for i, k in enumerate(self.keys)}
        return self._row_of

    def _plan(self, rows: DecodeRows, num_prev_tokens: int, seq_at: Callable[[int], StepSeq]) -> _Plan | None:
        """How this step's rows follow from the last step's; None when they do not."""
        if self.keys is None or num_prev_tokens < len(self.keys):
            return None
        n, new = len(rows.keys), []
        if rows.keys == self.keys:  # the usual step: the same rows in place
            src = prev = None
            row_of, num_blocks = self._old_row_of(), self._num_blocks[:n].copy()
        else:
            old = self._old_row_of()
            src = [old.get(k, -1) for k in rows.keys]
            prev = list(src)
            for i, j in enumerate(src):
                if j < 0:  # not held: written from its StepSeq, fed what the last step sampled for it
                    s = seq_at(i)
                    if s.prev_row is None or len(s.token_ids) != 1 or not 0 <= s.prev_row < num_prev_tokens:
                        return None
                    new.append((i, s))
                    src[i], prev[i] = 0, s.prev_row
            row_of, num_blocks = {k: i for i, k in enumerate(rows.keys)}, self._num_blocks[src]
            for i, s in new:
                num_blocks[i] = len(s.block_table)
        added: list[list[int]] = [[], [], []]
        new_rows = {i for i, _ in new}
        for key, table in rows.grown:  # one block per decode that crossed a block boundary
            r = row_of[key]
            if r in new_rows:  # its whole table is written anyway
                continue
            have = int(num_blocks[r])
            if len(table) < have:
                return None
            added[0] += [r] * (len(table) - have)
            added[1] += range(have, len(table))
            added[2] += table[have:]
            num_blocks[r] = len(table)
        if 3 * len(added[2]) > self._added.np.shape[0]:
            return None
        return _Plan(src, prev, row_of, num_blocks, added, new)

    def applicable(self, rows: DecodeRows, num_prev_tokens: int) -> bool:
        """Whether apply() would take these rows with no rows new to it (so no StepSeq is needed)."""
        try:
            return self._plan(rows, num_prev_tokens, _no_seq) is not None
        except _NoSeq:
            return False

    def apply(
        self,
        rows: DecodeRows,
        pad_reqs: int,
        prev_tokens: torch.Tensor,
        seq_at: Callable[[int], StepSeq],
        wait_uploads: Callable[[], None],
    ) -> bool:
        """Advance the device buffers to this step's rows; False (nothing touched) when not applicable.
        prev_tokens: [rows of the previous step] int64, the ids it sampled (row i's next input).
        seq_at(i): row i's StepSeq (asked only for rows the last step did not hold).
        wait_uploads: blocks until the previous step's uploads have read the host mirrors."""
        plan = self._plan(rows, prev_tokens.shape[0], seq_at)
        if plan is None:
            return False
        n, bs, k = len(rows.keys), self.block_size, len(plan.added[2])
        if plan.src is not None or k:
            wait_uploads()
        ids, pos, lens, slots, table, src, prev = self._views(n)  # [n] each, table [n, B]
        if plan.src is not None:
            self._index.np[:n], self._index.np[n : 2 * n] = plan.src, plan.prev
            self._index.upload(2 * n)
            pos.copy_(self.positions.index_select(0, src))
            table.copy_(self.block_tables.index_select(0, src))
            torch.index_select(prev_tokens, 0, prev, out=ids)
        else:  # the same rows; the last step may have sampled more (a prefill that ended and left)
            ids.copy_(prev_tokens if prev_tokens.shape[0] == n else prev_tokens[:n])
        if k:
            added = self._added
            added.np[:k], added.np[k : 2 * k], added.np[2 * k : 3 * k] = plan.added
            added.upload(3 * k)
            self.block_tables.index_put_((added.dev[:k], added.dev[k : 2 * k]), added.dev[2 * k : 3 * k])
        pos.add_(1)
        if plan.new:
            self._write_new_rows(plan.new)
        torch.add(pos, 1, out=lens)  # a decode row's length is its position + 1
        block = table.gather(1, pos.div(bs, rounding_mode="floor").unsqueeze(1)).squeeze(1)  # [n]
        torch.add(pos.remainder(bs), block, alpha=bs, out=slots)
        # After a mixed step the rows past the decodes hold prefill tokens (real slots!) and the logits
        # rows another order: both are written; after a decode step only when the row count changed.
        after_mixed = pad_reqs > self._arange_rows
        if (
            plan.src is not None or after_mixed
        ) and n < pad_reqs:  # pads: token 0, position 0, scratch slot, length 0
            self.input_ids[n:pad_reqs] = 0
            self.positions[n:pad_reqs] = 0
            self.slot_mapping[n:pad_reqs] = self.scratch_slot
            self.seq_lens[n:pad_reqs] = 0
        if after_mixed:
            self.logits_indices[:pad_reqs] = self._arange[:pad_reqs]
            self._arange_rows = pad_reqs
        self._num_blocks[:n] = plan.num_blocks
        self.keys, self._row_of = rows.keys, plan.row_of
        self.num_applied += 1
        return True

    def _write_new_rows(self, new: list[tuple[int, StepSeq]]) -> None:
        """Positions and whole block tables of the rows the last step did not hold (after the += 1)."""
        m, tables = len(new), self._new_tables.np
        for j, (_, s) in enumerate(new):
            tables[j, : len(s.block_table)] = s.block_table
        self._new.np[:m] = [i for i, _ in new]
        self._new.np[m : 2 * m] = [s.start_pos for _, s in new]
        self._new.upload(2 * m)
        self._new_tables.upload(m)
        rows = self._new.dev[:m]
        self.positions.index_copy_(0, rows, self._new.dev[m : 2 * m])
        self.block_tables.index_copy_(0, rows, self._new_tables.dev[:m])


class _NoSeq(Exception):
    pass


def _no_seq(i: int) -> StepSeq:
    raise _NoSeq(i)
