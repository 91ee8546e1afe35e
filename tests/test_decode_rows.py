"""Persistent decode rows (engine/worker/decode_rows.py): a steady decode step advances the runner's device
buffers in place instead of laying every row out from the host. Every such step must leave exactly
the buffers a full layout (InputBatch.full_decode) of the same batch writes, through rows that
leave, blocks that grow, preemption and admissions in between; and the engine's outputs must equal
the synchronous engine's, which never takes that path."""

from __future__ import annotations

import pickle

import pytest
import torch
from graphcache.engine.batch import DecodeRows, StepBatch, StepSeq
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.worker.runner import ModelRunner
from graphcache.engine.worker.tp_worker import execute_payload
from helpers_model import cpu_settings, prompt_ids, tiny_checkpoint
from test_async_scheduling import drive

POISON = -7
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]  # cuda: graph replay, async by default


def _requests(n: int = 9):
    # Different lengths: rows leave one by one; block size 4: tables grow every 4 decode steps.
    return [
        (
            f"q{i}",
            prompt_ids(3 + (5 * i) % 11, seed=i),
            SamplingParams(max_tokens=5 + (7 * i) % 19, temperature=0, ignore_eos=True),
        )
        for i in range(n)
    ]


def _layout(runner: ModelRunner, batch: StepBatch, pad: int) -> dict[str, torch.Tensor]:
    """The decode buffers the step reads: pads included, block tables up to each row's length."""
    n = len(batch.rows.keys)
    inputs = runner.inputs
    out = {
        name: getattr(inputs, name).dev[:pad].clone()
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices")
    }
    for i, s in enumerate(batch.seqs[:n]):
        out[f"table{i}"] = inputs.block_tables.dev[i, : len(s.block_table)].clone()
    return out


def _checked_core(settings, counts: dict) -> EngineCore:
    """A core whose runner, after every step it takes from persistent rows, poisons the buffers, lays
    the same batch out in full and asserts both wrote the same."""
    runner = ModelRunner(settings)
    inputs = runner.inputs
    rows, from_rows = inputs.rows, inputs.decode_from_rows

    def apply_then_compare(batch, pad):
        decode_rows, prev = batch.rows, batch.prev_tokens
        before = None if rows.keys is None else list(rows.keys)
        layout = from_rows(batch, pad)
        if layout is None:
            return None
        counts["applied"] += 1
        counts["gathered"] += decode_rows.keys != before
        counts["new_rows"] += before is not None and not set(decode_rows.keys) <= set(before)
        counts["grown"] += bool(decode_rows.grown)
        got = _layout(runner, batch, pad)
        for buf in (
            inputs.input_ids,
            inputs.positions,
            inputs.slot_mapping,
            inputs.seq_lens,
            inputs.block_tables,
            inputs.logits_indices,
        ):
            buf.dev.fill_(POISON)
        inputs._write_full_decode(
            batch.seqs, pad, prev
        )  # the host layout alone: the rows' state stays the path's
        inputs._host_tables_stale = True  # as the rows path leaves the host row cache
        want = _layout(runner, batch, pad)
        for name in want:
            assert torch.equal(got[name], want[name]), (name, got[name], want[name])
        return layout

    inputs.decode_from_rows = apply_then_compare
    return EngineCore(runner, settings)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_rows_advanced_on_the_device_equal_a_full_layout_and_outputs_equal_sync(device):
    path = tiny_checkpoint("qwen2")
    reqs = _requests()
    counts = dict(applied=0, gathered=0, grown=0, new_rows=0)
    # 5 rows for 9 requests: admissions (mixed steps) between decode runs; 24 blocks of 4: preemption.
    kw = dict(max_num_seqs=5, num_kv_blocks=24, device=device)
    rows_on = cpu_settings(path, async_scheduling="on", **kw)
    core = _checked_core(rows_on, counts)
    got = drive(core, reqs)
    sync = cpu_settings(path, async_scheduling="off", **kw)
    want = drive(EngineCore(ModelRunner(sync), sync), reqs)
    assert got == want
    assert core.scheduler.num_preemptions > 0
    # Each kind of change was exercised: rows in place, rows that left or came (after a mixed step), blocks added.
    assert (
        counts["applied"] > 10 and counts["gathered"] > 0 and counts["grown"] > 0 and counts["new_rows"] > 0
    ), counts


@pytest.mark.slow
def test_a_request_that_ends_with_its_prefill_leaves_no_stale_pad():
    """3 decodes (padded to 4 rows) + a prefill of a max_tokens=1 request: the next step has the same 3
    decode rows as the mixed step, whose row 3 held a prefill token writing a real slot. The rows path
    must write that pad row again (the checked core compares it with a full layout)."""
    path = tiny_checkpoint("qwen2")
    counts = dict(applied=0, gathered=0, grown=0, new_rows=0)
    settings = cpu_settings(path, async_scheduling="on")
    core = _checked_core(settings, counts)
    long = [
        (f"d{i}", prompt_ids(5 + i, seed=i), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        for i in range(3)
    ]
    short = ("s", prompt_ids(9, seed=7), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    for rid, prompt, params in long:
        core.add_request(Sequence(rid, list(prompt), params))
    for _ in range(4):
        core.step()
    core.add_request(Sequence(short[0], list(short[1]), short[2]))
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    sync = cpu_settings(path, async_scheduling="off")
    want = drive(EngineCore(ModelRunner(sync), sync), [*long, short])
    assert len(tokens["s"]) == 1 and tokens["s"] == want["s"][0]
    assert counts["applied"] > 5, counts


def test_a_new_sequence_or_unknown_rows_fall_back_to_a_full_layout():
    settings = cpu_settings(tiny_checkpoint("qwen2"), async_scheduling="on")
    runner = ModelRunner(settings)
    rows, prev = runner.inputs.rows, torch.zeros(2, dtype=torch.int64)
    assert not rows.applicable(DecodeRows([1, 2], []), 2)  # nothing laid out yet
    rows.remember([1, 2], [1, 1], 2)
    assert rows.applicable(DecodeRows([1, 2], []), 2)
    assert rows.applicable(DecodeRows([2], []), 2)  # a row left
    assert not rows.applicable(DecodeRows([2, 3], []), 2)  # sequence 3 is new: it needs its StepSeq
    assert not rows.applicable(DecodeRows([1, 2], []), 1)  # fewer sampled ids than rows
    fed_known = StepSeq([5], 4, [0, 1], True)  # a row fed a known token, not one in flight
    assert not rows.apply(DecodeRows([3], []), 1, prev[:1], lambda i: fed_known, lambda: None)
    assert not rows.apply(DecodeRows([1, 2], [(2, [])]), 2, prev, None, lambda: None)  # a table that shrank
    assert rows.keys == [1, 2] and list(rows._num_blocks[:2]) == [1, 1]  # nothing touched
    runner.capture([])  # a capture outside a step rewrites the buffers: the rows are no longer known
    assert rows.keys is None


def test_a_rows_batch_builds_its_sequences_only_when_asked_and_pickles_without_them():
    built = []
    batch = StepBatch(rows=DecodeRows([4, 5], [(5, [1, 2])]), build=lambda: built.append(1) or [])
    assert batch.num_tokens == 2 and batch.uniform_decode and not batch.wants_prompt_logits and not built
    sent = pickle.loads(pickle.dumps(batch))
    assert sent.rows.keys == [4, 5] and sent.rows.grown == [(5, [1, 2])]
    with pytest.raises(RuntimeError, match="runner states have split"):
        _ = sent.seqs
    assert batch.seqs == [] and built == [1]
    with pytest.raises(ValueError, match="needs seqs, or rows"):
        StepBatch()


def test_what_a_tensor_parallel_rank_receives_keeps_the_keys():
    """A mixed step's keys must reach the other ranks: rank 0's runner remembers its decode rows from
    them, and a later rows-only step would find the other ranks' rows unknown (a split) without them."""
    mixed = StepBatch([StepSeq([1], 3, [0], True), StepSeq([4, 5], 0, [1], True)], keys=[7, 8])
    sent, _ = execute_payload(mixed, rows_only=False)
    assert pickle.loads(pickle.dumps(sent)).keys == [7, 8]
    decode = StepBatch(
        rows=DecodeRows([7], []), build=lambda: [], prev_tokens=torch.zeros(1, dtype=torch.int64)
    )
    sent, num_prev = execute_payload(decode, rows_only=True)
    got = pickle.loads(pickle.dumps(sent))
    assert got.keys == [7] and got.rows.keys == [7] and num_prev == 1 and got.prev_tokens is None
