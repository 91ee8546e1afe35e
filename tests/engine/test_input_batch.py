"""The step's input layout (engine/worker/input_batch.py): the mixed layout against a per-token reference
written here, the facts each layout returns, and the one rule for when the persistent rows are used."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from graphcache.engine.plan import NewRequest, PromptLogits, StepPlan
from graphcache.engine.sequence import SamplingParams
from graphcache.engine.worker.input_batch import PLACEHOLDER_TOKEN
from graphcache.engine.worker.request_table import RequestTable
from graphcache.engine.worker.runner import ModelRunner
from helpers_model import cpu_settings, tiny_checkpoint


@dataclass
class StepSeq:
    """One row as the test writes it: a key of its own, and prev_row when it is fed the token in flight
    (the row of the in-flight step's sampled ids it reads)."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_logits: bool
    prev_row: int | None = None
    prompt_logits: bool = False


def _step(inputs, seqs: list[StepSeq], keys: list[int], in_flight: list[int] | None = None):
    """(the table, the plan) of a step of these rows, each request new to a fresh table; in_flight: the
    keys the step before sampled (a row with prev_row reads the id at that row)."""
    table = RequestTable(inputs.resident_rows())
    if in_flight is None:
        in_flight = [-100 - j for j in range(max((s.prev_row or 0) + 1 for s in seqs))]
    in_flight = list(in_flight)
    for s, k in zip(seqs, keys, strict=True):
        if s.prev_row is not None:
            in_flight[s.prev_row] = k
    table.sampled_by_step(in_flight)
    plan = StepPlan(
        keys=list(keys),
        starts=[s.start_pos for s in seqs],
        tokens=[None if s.prev_row is not None else list(s.token_ids) for s in seqs],
        need_logits=[s.need_logits for s in seqs],
        new=tuple(
            NewRequest(k, f"r{k}", [], [], SamplingParams(temperature=0), s.block_table)
            for s, k in zip(seqs, keys, strict=True)
        ),
        prompt_logits=tuple(PromptLogits(i, 0, [], 0) for i, s in enumerate(seqs) if s.prompt_logits),
    )
    table.update(plan)
    return table, plan


def _steady(keys: list[int], starts: list[int]) -> StepPlan:
    """A steady decode of held requests: every row fed the token in flight."""
    return StepPlan(keys=keys, starts=starts)


POISON = -7
BUFFERS = ("input_ids", "positions", "slot_mapping", "logits_indices", "seq_lens", "block_tables")


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(cpu_settings(tiny_checkpoint("qwen2")))


def _poison(inputs) -> None:
    for name in BUFFERS:
        buf = getattr(inputs, name)
        buf.np.fill(POISON)
        buf.dev.fill_(POISON)


def _reference(seqs: list[StepSeq], pad_tokens: int, pad_reqs: int, prev: list[int], bs: int, scratch: int):
    """One token at a time: decodes first, then the others, each in batch order; logits rows the
    need_logits seqs in batch order, then the others."""
    order = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1] + [
        i for i, s in enumerate(seqs) if len(s.token_ids) != 1
    ]
    ids, pos, slots, first, tables, lens = [], [], [], {}, [], []
    for i in order:
        s = seqs[i]
        first[i] = len(ids)
        for j, token in enumerate(s.token_ids):
            p = s.start_pos + j
            ids.append(prev[s.prev_row] if j == 0 and s.prev_row is not None else token)
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
        tables.append(s.block_table)
        lens.append(s.start_pos + len(s.token_ids))
    pad = pad_tokens - len(ids)
    logits = [i for i, s in enumerate(seqs) if s.need_logits] + [
        i for i, s in enumerate(seqs) if not s.need_logits
    ]
    prompt_rows = [
        first[i] + j for i, s in enumerate(seqs) if s.prompt_logits for j in range(len(s.token_ids))
    ]
    return dict(
        input_ids=ids + [0] * pad,
        positions=pos + [0] * pad,
        slot_mapping=slots + [scratch] * pad,
        logits_indices=[first[i] + len(seqs[i].token_ids) - 1 for i in logits] + [0] * (pad_reqs - len(seqs)),
        seq_lens=lens,
        tables=tables,
        prompt_rows=prompt_rows,
    )


def test_the_mixed_layout_equals_a_per_token_reference(runner):
    inputs, bs = runner.inputs, runner.block_size
    seqs = [
        StepSeq(list(range(11, 18)), 4, [9, 3, 14], False),  # a prefill chunk, no sample
        StepSeq([PLACEHOLDER_TOKEN], 9, [5, 6, 7], True, prev_row=2),  # fed the id in flight
        StepSeq([42], 6, [21, 8], True),  # fed a known id
        StepSeq(list(range(30, 35)), 0, [2, 31], True, prompt_logits=True),
    ]  # a whole prompt, its logits
    prev = [101, 102, 103]
    pad_tokens, pad_reqs = 32, 8
    requests, plan = _step(inputs, seqs, [1, 2, 3, 4])
    _poison(inputs)
    layout = inputs.prepare(
        requests, plan, decode=False, pad_tokens=pad_tokens, pad_reqs=pad_reqs, prev_tokens=torch.tensor(prev)
    )
    want = _reference(seqs, pad_tokens, pad_reqs, prev, bs, runner.scratch_slot)
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
        got = getattr(inputs, name).dev[: len(want[name])].tolist()
        assert got == want[name], name
    assert inputs.seq_lens.dev[:4].tolist() == want["seq_lens"]
    for row, table in enumerate(want["tables"]):
        assert inputs.block_tables.dev[row, : len(table)].tolist() == table
        assert not inputs.block_tables.dev[row, len(table) :].any()  # the rest of the row: block 0, not stale
    assert (layout.how, layout.num_tokens, layout.num_reqs, layout.num_logits) == ("mixed", 14, 4, 3)
    assert list(layout.prompt_rows) == want["prompt_rows"]
    # The batch's first seq is a prefill: its decodes are not rows 0..d-1 of both orders, so none are kept.
    assert layout.decode_prefix == 0 and requests.rows.keys is None


def _mixed(inputs, seqs, pad_tokens, pad_reqs, keys):
    table, plan = _step(inputs, seqs, keys)
    return table, inputs.prepare(table, plan, decode=False, pad_tokens=pad_tokens, pad_reqs=pad_reqs)


def test_a_mixed_step_keeps_its_decode_prefix_unless_it_has_prompt_logits(runner):
    inputs = runner.inputs
    decodes = [StepSeq([5], 3, [1], True), StepSeq([6], 7, [2, 3], True)]
    prefill = StepSeq([7, 8, 9], 0, [4], True)
    table, layout = _mixed(inputs, [*decodes, prefill], 5, 4, keys=[10, 11, 12])
    assert layout.decode_prefix == 2 and table.rows.keys == [10, 11]
    assert inputs.takes_rows(table, _steady([10, 11], [4, 8]), decode=True, num_prev=3)
    with_prompt = StepSeq([7, 8, 9], 0, [4], True, prompt_logits=True)
    table, layout = _mixed(inputs, [*decodes, with_prompt], 5, 4, keys=[10, 11, 12])
    assert layout.decode_prefix == 2 and table.rows.keys is None


def test_one_rule_for_the_rows_and_every_way_to_lose_them(runner):
    inputs = runner.inputs
    seqs = [StepSeq([5], 3, [1], True), StepSeq([6], 7, [2, 3], True)]
    prev = torch.zeros(2, dtype=torch.int64)
    table, plan = _step(inputs, seqs, [20, 21], in_flight=[20, 21])
    layout = inputs.prepare(table, plan, decode=True, pad_tokens=2, pad_reqs=2)
    assert (layout.how, layout.num_reqs, layout.num_logits) == ("full_decode", 2, 2)
    rows = _steady([20, 21], [3, 7])
    assert inputs.takes_rows(table, rows, decode=True, num_prev=2)
    assert not inputs.takes_rows(table, rows, decode=False, num_prev=2)  # the general kernel: no rows
    assert not inputs.takes_rows(table, rows, decode=True, num_prev=0)  # no ids in flight
    inputs.invalidate(table)  # a failed step
    assert not inputs.takes_rows(table, rows, decode=True, num_prev=2)
    assert (
        inputs.prepare(table, rows, decode=True, pad_tokens=2, pad_reqs=2, prev_tokens=prev).how
        == "full_decode"
    )
    assert inputs.prepare(table, rows, decode=True, pad_tokens=2, pad_reqs=2, prev_tokens=prev).how == "rows"
    inputs.point_at_scratch(table)  # a capture outside a step
    assert not inputs.takes_rows(table, rows, decode=True, num_prev=2)
    assert inputs.slot_mapping.dev.eq(runner.scratch_slot).all() and not inputs.seq_lens.dev.any()


def test_a_bad_sequence_is_named_with_the_fix(runner):
    inputs = runner.inputs
    with pytest.raises(ValueError, match="sequence 1 of the batch feeds no tokens"):
        _mixed(inputs, [StepSeq([1, 2], 0, [1], True), StepSeq([], 0, [2], True)], 2, 2, [1, 2])
    with pytest.raises(
        ValueError, match=r"sequence 0 reaches position 6 with 1 blocks of 4; it needs ceil\(6/4\)"
    ):
        _mixed(inputs, [StepSeq([1, 2], 4, [1], True)], 2, 1, [1])
