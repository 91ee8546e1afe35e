"""The worker's requests: per-request state keyed by request, and the rows resident on the device.

`RequestTable` is what the worker holds between steps, changed by each StepPlan (`update`): a request is
added when a plan brings it (`NewRequest`), grows when a plan sends it blocks, and is removed when a plan
lists it as finished (or preempted: it comes back as new). Per request: its block table and its sampling
state (engine/sample/state.py: parameters, prompt, the outputs its sampling reads, and the sampler's caches
of them), which the sampler reads as the table's rows (`sampled`).

`ResidentRows`, the table's device part: the rows of the last decode layout, resident in the input
batch's static buffers (positions, lengths, block tables, ids, slots), advanced there by a steady decode
step. In a steady decode (async scheduling, every row fed the token the step in flight is sampling for
it) a row changes only thus: its position and length advance by one, its input is the id just sampled
in the same row, and now and then its block table grows by a block. So row i stays the same request across
steps and the buffers advance on the device: the host compares the row keys (one C-level list comparison),
writes the new blocks, and launches about ten small kernels, however many rows there are, instead of
building, filling and uploading every row (the aim of vLLM's persistent input batch; the shape here is our
own).

Which rows are known (`remember`): every row of a decode step; after a mixed step, its decode rows (laid out
first, and sampled first). A steady step's rows then follow from the last step's: rows that stay are
gathered on the device in the scheduler's order (condensed: rows left when their request finished or was
preempted); rows it did not hold (a prefill that ended in the mixed step before) are written from the
table's host state, with the id the last step sampled for them. Anything else (no rows known: a capture
outside a step, a failed step, prompt logprobs) makes engine/worker/input_batch.py lay every row out from the
host (`InputBatch.prepare` decides).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from graphcache.engine.plan import NewRequest, StepPlan
from graphcache.engine.sample.sampler import Sampler
from graphcache.engine.sample.state import SamplingState
from graphcache.engine.worker.staging import StagingBuffer

__all__ = ["RequestState", "RequestTable", "ResidentRows", "SampledRows"]


class RequestState:
    """One request the worker holds."""

    __slots__ = ("block_table", "key", "pool_count", "pool_sum", "sampling", "source")

    def __init__(self, new: NewRequest) -> None:
        self.key = new.key
        self.source = new  # the NewRequest it came from
        self.block_table = list(new.block_table)  # ours: later plans append the blocks it gets
        self.sampling = SamplingState(new.request_id, new.params, new.prompt_ids, list(new.output_ids))
        # A pooling request's chunks so far (engine/worker/pooler.py): [hidden] float32 on the device (the
        # sum of its rows' final hidden states for mean pooling, the first row's for cls) and the rows summed.
        # A preempted request comes back as a new state and pools its recomputed prompt from the start.
        self.pool_sum: torch.Tensor | None = None
        self.pool_count = 0


@dataclass(frozen=True, slots=True)
class SampledRows:
    """The sampling states of a step's need_logits rows, in row order, with what the sampler asks of all of
    them (worked out once per set of rows: a steady decode reuses it)."""

    keys: list[int]
    states: list[SamplingState]
    plain_greedy: bool  # every row takes the argmax of its raw logits (Sampler.plain_greedy)
    counted: tuple[int, ...]  # rows whose sampling reads how many tokens they generated (seeded, min_tokens)
    logprob_rows: list[int]  # rows whose request asked for logprobs
    logprob_k: int  # the most alternatives any of them asked for


class RequestTable:
    def __init__(self, rows: ResidentRows | None = None) -> None:
        """rows: the device rows (a runner without static buffers has none)."""
        self.reqs: dict[int, RequestState] = {}
        self.rows = rows
        # Requests whose sampling reads their outputs (penalties, bad words of several tokens): their fed
        # tokens are appended to their outputs. Never fed a token in flight (the core's overlap rule).
        self._history: dict[int, RequestState] = {}
        self._sampled: SampledRows | None = None
        self._in_flight: list[int] = []  # the keys the last step sampled, in the order of its sampled ids
        self._in_flight_row: dict[int, int] | None = None  # key -> its row of those ids, built on first need

    def __len__(self) -> int:
        return len(self.reqs)

    # --- the plan's changes --------------------------------------------------------------------
    def update(self, plan: StepPlan) -> None:
        """Drop the finished, add the new, append the blocks that came (before the step is laid out)."""
        reqs = self.reqs
        if plan.finished or plan.new:
            self._sampled = None  # a key may now name another state (a preempted request came back)
            for key in plan.finished:
                reqs.pop(key, None)
                self._history.pop(key, None)
            for new in plan.new:
                held = reqs.get(new.key)
                if held is not None and held.source is new:
                    continue  # the same plan run again (a hand-built step, StepPlan.standalone): as it was
                state = reqs[new.key] = RequestState(new)
                if state.sampling.history:
                    self._history[new.key] = state
                else:
                    self._history.pop(new.key, None)
                if self.rows is not None:
                    self.rows.forget(new.key)  # its rows (before a preemption) are no longer what it holds
        try:
            for key, length in plan.trimmed:  # speculation rolled back: a new list, so no cached row matches
                state = reqs[key]
                state.block_table = state.block_table[:length]
            if plan.trimmed and self.rows is not None:
                self.rows.invalidate()
            for key, blocks in plan.grown:
                reqs[key].block_table += blocks
        except KeyError as missing:
            self.get(missing.args[0])  # raises, naming the split
            raise
        if self._history:
            self._append_outputs(plan)

    def get(self, key: int) -> RequestState:
        state = self.reqs.get(key)
        if state is None:
            raise RuntimeError(
                f"the step names request key {key}, which the worker does not hold: the scheduler's plans and "
                "the worker's table have split"
            )
        return state

    def block_tables(self, keys: list[int]) -> list[list[int]]:
        """The block tables of these requests, in order."""
        try:
            return [self.reqs[k].block_table for k in keys]
        except KeyError as missing:
            self.get(missing.args[0])  # raises, naming the split
            raise

    def _append_outputs(self, plan: StepPlan) -> None:
        """The history requests' fed tokens past their prompt and known outputs are outputs they sampled."""
        rows = {k: i for i, k in enumerate(plan.keys) if k in self._history}
        for key, row in rows.items():
            fed = plan.fed(row)
            if fed is None:
                raise RuntimeError(
                    f"request key {key} reads its outputs to sample but was fed a token still in flight; "
                    "such a request's step must wait for the step before it"
                )
            s = self._history[key].sampling
            out, first = s.output_token_ids, plan.starts[row] - len(s.prompt_token_ids)
            for i, token in enumerate(fed, start=first):
                if i == len(out):
                    out.append(token)

    # --- the rows the sampler reads -------------------------------------------------------------
    def sampled(self, plan: StepPlan) -> SampledRows:
        """The plan's need_logits rows' sampling states, their num_generated set for this step."""
        keys = plan.sampled_keys()
        rows = self._sampled
        if rows is None or rows.keys != keys:
            rows = self._sampled = self._sampled_rows(keys)
        if rows.counted:
            self._count(plan, rows)
        return rows

    def _sampled_rows(self, keys: list[int]) -> SampledRows:
        states = [self.get(k).sampling for k in keys]
        logprob_rows = [j for j, s in enumerate(states) if s.params.logprobs is not None]
        return SampledRows(
            keys=list(keys),
            states=states,
            plain_greedy=all(map(Sampler.plain_greedy, states)),
            counted=tuple(j for j, s in enumerate(states) if s.counted),
            logprob_rows=logprob_rows,
            logprob_k=max((states[j].params.logprobs or 0 for j in logprob_rows), default=0),
        )

    @staticmethod
    def _count(plan: StepPlan, rows: SampledRows) -> None:
        """num_generated of the counted rows: the sampled token's position minus the prompt's length."""
        need, tokens = plan.need_logits, plan.tokens
        plan_row = list(range(len(plan.keys))) if need is None else [i for i, w in enumerate(need) if w]
        for j in rows.counted:
            i = plan_row[j]
            fed = None if tokens is None else tokens[i]
            s = rows.states[j]
            s.num_generated = plan.starts[i] + (1 if fed is None else len(fed)) - len(s.prompt_token_ids)

    # --- the step in flight ---------------------------------------------------------------------
    def sampled_by_step(self, keys: list[int]) -> None:
        """The step just run sampled these keys' tokens, in this order: the next plan's in-flight rows
        read theirs (async scheduling)."""
        self._in_flight, self._in_flight_row = keys, None

    def in_flight_keys(self) -> list[int]:
        return self._in_flight

    def in_flight_rows(self) -> dict[int, int]:
        """key -> its row of the ids the step in flight samples."""
        if self._in_flight_row is None:
            self._in_flight_row = {k: i for i, k in enumerate(self._in_flight)}
        return self._in_flight_row

    def in_flight_row(self, key: int) -> int | None:
        """key's row of the ids the step in flight samples (None: that step did not sample it)."""
        return self.in_flight_rows().get(key)

    def in_flight_row_of(self, key: int) -> int:
        """in_flight_row, for a row that is fed the token in flight: it must have one."""
        row = self.in_flight_row(key)
        if row is None:
            raise RuntimeError(
                f"request key {key} is fed the token in flight, but the step before did not sample it"
            )
        return row


class _RowPlan(NamedTuple):
    """How one step's rows follow from the last step's (computed without touching anything)."""

    src: list[int] | None  # [n] the last step's row of each row (0 for new rows); None: same rows
    prev: list[int] | None  # [n] each row's row of the last step's sampled ids; None: same rows
    row_of: dict[int, int]  # key -> its row this step
    num_blocks: np.ndarray  # [n] blocks of each row's table on the device after this step
    added: list[list[int]]  # [rows, columns, block ids] of the blocks held rows got this step
    new: list[
        tuple[int, int, list[int]]
    ]  # (row, position, whole block table) of rows the last step did not hold


class ResidentRows:
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
    ) -> None:
        """The input batch's static device buffers: input_ids, positions, slot_mapping [T_max] int64,
        seq_lens, logits_indices [R_max] int64, block_tables [R_max, B] int64."""
        self.input_ids, self.positions, self.slot_mapping = input_ids, positions, slot_mapping
        self.seq_lens, self.block_tables, self.logits_indices = seq_lens, block_tables, logits_indices
        self.block_size = block_size
        max_reqs, device = block_tables.shape[0], block_tables.device
        self.keys: list[int] | None = None  # the rows known after the last step; None: none
        self._row_of: dict[int, int] | None = None  # key -> row of `keys`, built on first need
        self._num_blocks = np.zeros(max_reqs, dtype=np.int64)  # [R_max] blocks of row i's table on the device
        self.arange_rows = 0  # logits_indices[:this] holds 0, 1, 2, ... (a decode's layout)
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

    def forget(self, key: int) -> None:
        """key's request was added anew: a row it held is not its state now."""
        if self.keys is not None and key in self._old_row_of():
            self.invalidate()

    def remember(self, keys: list[int], num_blocks: np.ndarray | list[int], arange_rows: int) -> None:
        """A layout from the host wrote rows 0..len(keys)-1 as decodes of those requests, with
        num_blocks[i] blocks in the device block table, and row i's sampled id is row i of the step's
        sampled ids. logits_indices[:arange_rows] is 0, 1, 2, ..."""
        self.keys, self._row_of, self.arange_rows = keys, None, arange_rows
        self._num_blocks[: len(keys)] = num_blocks

    def _old_row_of(self) -> dict[int, int]:
        if self._row_of is None:
            assert self.keys is not None  # asked only while rows are known
            self._row_of = {k: i for i, k in enumerate(self.keys)}
        return self._row_of

    def _plan(self, plan: StepPlan, table: RequestTable, num_prev: int) -> _RowPlan | None:
        """How this step's rows follow from the last step's; None when they do not."""
        if self.keys is None or num_prev < len(self.keys):
            return None
        keys, n = plan.keys, len(plan.keys)
        new: list[tuple[int, int, list[int]]] = []
        if keys == self.keys:  # the usual step: the same rows in place
            src = prev = None
            row_of, num_blocks = self._old_row_of(), self._num_blocks[:n].copy()
        else:
            old = self._old_row_of()
            src = [old.get(k, -1) for k in keys]
            prev = list(src)
            for i, j in enumerate(src):
                if j < 0:  # not held: written from the table, fed what the last step sampled for it
                    key = keys[i]
                    p = table.in_flight_row(key)
                    if p is None or not 0 <= p < num_prev:
                        return None
                    new.append((i, plan.starts[i], table.get(key).block_table))
                    src[i], prev[i] = 0, p
            row_of, num_blocks = {k: i for i, k in enumerate(keys)}, self._num_blocks[src]
            for i, _, blocks in new:
                num_blocks[i] = len(blocks)
        added: list[list[int]] = [[], [], []]
        new_rows = {i for i, _, _ in new}
        for key, _ in plan.grown:  # one block per decode that crossed a block boundary
            r = row_of[key]
            if r in new_rows:  # its whole table is written anyway
                continue
            table_now, have = table.reqs[key].block_table, int(num_blocks[r])  # held: update() checked
            if len(table_now) < have:
                return None
            added[0] += [r] * (len(table_now) - have)
            added[1] += range(have, len(table_now))
            added[2] += table_now[have:]
            num_blocks[r] = len(table_now)
        if 3 * len(added[2]) > self._added.np.shape[0]:
            return None
        return _RowPlan(src, prev, row_of, num_blocks, added, new)

    def follows(self, plan: StepPlan, table: RequestTable, num_prev: int) -> bool:
        """Whether apply() would take this plan's rows (tests)."""
        return plan.tokens is None and self._plan(plan, table, num_prev) is not None

    def apply(
        self,
        plan: StepPlan,
        table: RequestTable,
        prev_tokens: torch.Tensor,
        wait_uploads: Callable[[], None],
    ) -> _RowPlan | None:
        """Advance the device rows to this steady step's rows; None (nothing touched) when they do not
        follow from the last step's. prev_tokens: [rows of the previous step] int64, the ids it sampled
        (row i's next input). wait_uploads: blocks until the previous step's uploads have read the host
        mirrors. The caller writes the pads (InputBatch: one place) and the logits rows."""
        rp = self._plan(plan, table, prev_tokens.shape[0])
        if rp is None:
            return None
        n, bs, k = len(plan.keys), self.block_size, len(rp.added[2])
        if rp.src is not None or k:
            wait_uploads()
        ids, pos, lens, slots, tbl, src, prev = self._views(n)  # [n] each, tbl [n, B]
        if rp.src is not None:
            assert rp.prev is not None  # set together
            self._index.np[:n], self._index.np[n : 2 * n] = rp.src, rp.prev
            self._index.upload(2 * n)
            pos.copy_(self.positions.index_select(0, src))
            tbl.copy_(self.block_tables.index_select(0, src))
            torch.index_select(prev_tokens, 0, prev, out=ids)
        else:  # the same rows; the last step may have sampled more (a prefill that ended and left)
            ids.copy_(prev_tokens if prev_tokens.shape[0] == n else prev_tokens[:n])
        if k:
            added = self._added
            added.np[:k], added.np[k : 2 * k], added.np[2 * k : 3 * k] = rp.added
            added.upload(3 * k)
            self.block_tables.index_put_((added.dev[:k], added.dev[k : 2 * k]), added.dev[2 * k : 3 * k])
        pos.add_(1)
        if rp.new:
            self._write_new_rows(rp.new)
        torch.add(pos, 1, out=lens)  # a decode row's length is its position + 1
        block = tbl.gather(1, pos.div(bs, rounding_mode="floor").unsqueeze(1)).squeeze(1)  # [n]
        torch.add(pos.remainder(bs), block, alpha=bs, out=slots)
        self._num_blocks[:n] = rp.num_blocks
        self.keys, self._row_of = plan.keys, rp.row_of
        self.num_applied += 1
        return rp

    def set_arange(self, pad_reqs: int) -> None:
        """logits_indices[:pad_reqs] = 0, 1, 2, ... (a decode's logits rows are its rows)."""
        if pad_reqs > self.arange_rows:
            self.logits_indices[:pad_reqs] = self._arange[:pad_reqs]
            self.arange_rows = pad_reqs

    def _write_new_rows(self, new: list[tuple[int, int, list[int]]]) -> None:
        """Positions and whole block tables of the rows the last step did not hold (after the += 1)."""
        m, tables = len(new), self._new_tables.np
        for j, (_, _, blocks) in enumerate(new):
            tables[j, : len(blocks)] = blocks
        self._new.np[:m] = [i for i, _, _ in new]
        self._new.np[m : 2 * m] = [position for _, position, _ in new]
        self._new.upload(2 * m)
        self._new_tables.upload(m)
        rows = self._new.dev[:m]
        self.positions.index_copy_(0, rows, self._new.dev[m : 2 * m])
        self.block_tables.index_copy_(0, rows, self._new_tables.dev[:m])
