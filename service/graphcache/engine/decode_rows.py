"""Persistent decode rows: a steady decode step applied to the runner's device buffers as a change.

In a steady decode (async scheduling, every running sequence fed the token the step in flight is
sampling for it) a row changes only thus: its position and length advance by one, its input is the id
just sampled in the same row, and now and then its block table grows by a block. So row i stays the
same sequence across steps and these buffers advance on the device: the host compares the row keys
(one C-level list comparison), writes the new blocks, and launches a dozen small kernels, however many
rows there are, instead of building, filling and uploading every row (the aim of vLLM's persistent
input batch; the shape here is our own).

Rows may leave (a finished or preempted sequence, or one whose in-flight token ends it): the rows that
stay are gathered to the front on the device, in the scheduler's order. Anything else (a sequence the
previous step did not decode, a mixed step, prompt logprobs, a capture outside a step, a failed step)
makes the runner lay every row out from the StepSeqs again (ModelRunner._prepare_decode), which tells
this class the rows anew (`remember`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from graphcache.engine.batch import DecodeRows
from graphcache.engine.staging import StagingBuffer


class _Plan(NamedTuple):
    index: list[int] | None        # [n] the previous row of each row; None: the same rows in place
    row_of: dict[int, int]         # key -> its row this step
    num_blocks: np.ndarray         # [n] blocks of each row's table on the device after this step
    added_rows: list[int]          # row, column and block id of each block added this step
    added_cols: list[int]
    added_ids: list[int]


class PersistentRows:
    def __init__(self, *, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, scratch_slot: int) -> None:
        """The runner's static device buffers: input_ids, positions, slot_mapping [T_max] int64,
        seq_lens [R_max] int64, block_tables [R_max, B] int64."""
        self.input_ids, self.positions, self.slot_mapping = input_ids, positions, slot_mapping
        self.seq_lens, self.block_tables = seq_lens, block_tables
        self.block_size, self.scratch_slot = block_size, scratch_slot
        max_reqs, device = block_tables.shape[0], block_tables.device
        self.keys: list[int] | None = None       # row i's Sequence.key after the last decode step; None: unknown
        self._row_of: dict[int, int] | None = None   # key -> row of `keys`, built on first need
        self._num_blocks = np.zeros(max_reqs, dtype=np.int64)   # [R_max] blocks of row i's table on the device
        self._src = StagingBuffer((max_reqs,), torch.int64, device)          # [R_max] old row of each row
        # [3, 2 * R_max]: row, column and block id of each block added this step (a decode adds at most one).
        self._added = StagingBuffer((3, 2 * max_reqs), torch.int64, device)
        self._view_cache: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_applied = 0   # steps that went this way (tests, benchmarks)

    def _views(self, n: int) -> tuple[torch.Tensor, ...]:
        """The first n rows of input_ids, positions, seq_lens, slot_mapping, block_tables and the gather
        index, made once per n: slicing costs as much host time as a small kernel launch."""
        views = self._view_cache.get(n)
        if views is None:
            views = self._view_cache[n] = (self.input_ids[:n], self.positions[:n], self.seq_lens[:n],
                                           self.slot_mapping[:n], self.block_tables[:n], self._src.dev[:n])
        return views

    def invalidate(self) -> None:
        """The device buffers no longer hold the rows (another layout was written, or a step failed)."""
        self.keys = self._row_of = None

    def remember(self, keys: list[int] | None, num_blocks: Sequence[int]) -> None:
        """A decode step laid every row out from its StepSeqs: row i is keys[i] (None: not known) with
        num_blocks[i] blocks in the device block table."""
        self.keys, self._row_of = keys, None
        if keys is not None:
            self._num_blocks[:len(keys)] = num_blocks

    def _rows_of_old(self) -> dict[int, int]:
        if self._row_of is None:
            self._row_of = {k: i for i, k in enumerate(self.keys)}
        return self._row_of

    def _plan(self, rows: DecodeRows, num_prev_tokens: int) -> _Plan | None:
        """How this step's rows follow from the last step's, computed without touching anything; None
        when they do not (unknown rows, a sequence the last step did not decode, ids that do not match
        the rows, a table that shrank)."""
        if self.keys is None or num_prev_tokens != len(self.keys):
            return None
        n = len(rows.keys)
        if rows.keys == self.keys:   # the usual step: the same rows in place
            index, row_of, num_blocks = None, self._rows_of_old(), self._num_blocks[:n].copy()
        else:                        # rows left: the previous row of each row that stays
            old = self._rows_of_old()
            try:
                index = [old[k] for k in rows.keys]
            except KeyError:
                return None
            row_of, num_blocks = {k: i for i, k in enumerate(rows.keys)}, self._num_blocks[index]
        added_rows, added_cols, added_ids = [], [], []
        for key, table in rows.grown:   # new blocks: one per decode that crossed a block boundary
            r = row_of[key]
            have = int(num_blocks[r])
            if len(table) < have:
                return None
            added_rows += [r] * (len(table) - have)
            added_cols += range(have, len(table))
            added_ids += table[have:]
            num_blocks[r] = len(table)
        if len(added_ids) > self._added.np.shape[1]:
            return None
        return _Plan(index, row_of, num_blocks, added_rows, added_cols, added_ids)

    def applicable(self, rows: DecodeRows, num_prev_tokens: int) -> bool:
        return self._plan(rows, num_prev_tokens) is not None

    def apply(self, rows: DecodeRows, pad_reqs: int, prev_tokens: torch.Tensor,
              wait_uploads: Callable[[], None]) -> bool:
        """Advance the device buffers to this step's rows; False (nothing touched) when not applicable.
        prev_tokens: [rows of the previous step] int64, the ids it sampled (row i's next input).
        wait_uploads: blocks until the previous step's uploads have read the host mirrors."""
        plan = self._plan(rows, prev_tokens.shape[0])
        if plan is None:
            return False
        n, bs, index, k = len(rows.keys), self.block_size, plan.index, len(plan.added_ids)
        if index is not None or k:
            wait_uploads()
        ids, pos, lens, slots, table, src = self._views(n)   # [n] each, table [n, B]
        if index is not None:
            self._src.np[:n] = index
            self._src.upload(n)
            pos.copy_(self.positions.index_select(0, src))
            table.copy_(self.block_tables.index_select(0, src))
            torch.index_select(prev_tokens, 0, src, out=ids)
        else:
            ids.copy_(prev_tokens)
        if k:
            added = self._added
            added.np[0, :k], added.np[1, :k], added.np[2, :k] = plan.added_rows, plan.added_cols, plan.added_ids
            added.dev[:, :k].copy_(added.host[:, :k], non_blocking=True)
            self.block_tables.index_put_((added.dev[0, :k], added.dev[1, :k]), added.dev[2, :k])
        pos.add_(1)
        torch.add(pos, 1, out=lens)   # a decode row's length is its position + 1
        block = table.gather(1, pos.div(bs, rounding_mode="floor").unsqueeze(1)).squeeze(1)   # [n]
        torch.add(pos.remainder(bs), block, alpha=bs, out=slots)
        if index is not None and n < pad_reqs:   # rows left: pad rows (token 0 at position 0, scratch slot, length 0)
            self.input_ids[n:pad_reqs] = 0
            self.positions[n:pad_reqs] = 0
            self.slot_mapping[n:pad_reqs] = self.scratch_slot
            self.seq_lens[n:pad_reqs] = 0
        self._num_blocks[:n] = plan.num_blocks
        self.keys, self._row_of = rows.keys, plan.row_of
        self.num_applied += 1
        return True
