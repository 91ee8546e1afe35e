"""The step's input layout (engine/worker/input_batch.py): the mixed layout against a per-token reference
written here, the facts each layout returns, and the one rule for when the persistent rows are used."""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.batch import PLACEHOLDER_TOKEN, DecodeRows, StepBatch, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from helpers_model import cpu_settings, tiny_checkpoint

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
    _poison(inputs)
    layout = inputs.mixed(seqs, pad_tokens, pad_reqs, torch.tensor(prev), keys=[1, 2, 3, 4])
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
    assert layout.decode_prefix == 0 and inputs.rows.keys is None


def test_a_mixed_step_keeps_its_decode_prefix_unless_it_has_prompt_logits(runner):
    inputs = runner.inputs
    decodes = [StepSeq([5], 3, [1], True), StepSeq([6], 7, [2, 3], True)]
    prefill = StepSeq([7, 8, 9], 0, [4], True)
    layout = inputs.mixed([*decodes, prefill], 5, 4, keys=[10, 11, 12])
    assert layout.decode_prefix == 2 and inputs.rows.keys == [10, 11]
    assert inputs.takes_rows(
        StepBatch(rows=DecodeRows([10, 11], []), prev_tokens=torch.zeros(3, dtype=torch.int64)), decode=True
    )
    with_prompt = StepSeq([7, 8, 9], 0, [4], True, prompt_logits=True)
    layout = inputs.mixed([*decodes, with_prompt], 5, 4, keys=[10, 11, 12])
    assert layout.decode_prefix == 2 and inputs.rows.keys is None


def test_one_rule_for_the_rows_and_every_way_to_lose_them(runner):
    inputs = runner.inputs
    seqs = [StepSeq([5], 3, [1], True), StepSeq([6], 7, [2, 3], True)]
    prev = torch.zeros(2, dtype=torch.int64)
    layout = inputs.full_decode(seqs, 2, keys=[20, 21])
    assert (layout.how, layout.num_reqs, layout.num_logits) == ("full_decode", 2, 2)
    rows = StepBatch(rows=DecodeRows([20, 21], []), build=lambda: seqs, prev_tokens=prev)
    assert inputs.takes_rows(rows, decode=True)
    assert not inputs.takes_rows(rows, decode=False)  # the general kernel: no rows
    assert not inputs.takes_rows(StepBatch(rows=DecodeRows([20, 21], [])), decode=True)  # no ids in flight
    inputs.invalidate()  # a failed step
    assert not inputs.takes_rows(rows, decode=True)
    assert inputs.prepare(rows, decode=True, pad_tokens=2, pad_reqs=2).how == "full_decode"
    assert inputs.prepare(rows, decode=True, pad_tokens=2, pad_reqs=2).how == "rows"
    inputs.point_at_scratch()  # a capture outside a step
    assert not inputs.takes_rows(rows, decode=True)
    assert inputs.slot_mapping.dev.eq(runner.scratch_slot).all() and not inputs.seq_lens.dev.any()


def test_a_bad_sequence_is_named_with_the_fix(runner):
    inputs = runner.inputs
    with pytest.raises(ValueError, match="sequence 1 of the batch feeds no tokens"):
        inputs.mixed([StepSeq([1, 2], 0, [1], True), StepSeq([], 0, [2], True)], 2, 2)
    with pytest.raises(
        ValueError, match=r"sequence 0 reaches position 6 with 1 blocks of 4; it needs ceil\(6/4\)"
    ):
        inputs.mixed([StepSeq([1, 2], 4, [1], True)], 2, 1)
