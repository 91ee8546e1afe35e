"""Persistent decode rows (engine/worker/request_table.py's ResidentRows): a steady decode step advances the
runner's device buffers in place instead of laying every row out from the host. Every such step must leave
exactly the buffers a layout from the host (InputBatch.prepare's, how "full_decode") of the same plan writes,
through rows that leave, blocks that grow, preemption and admissions in between; and the engine's outputs
must equal the synchronous engine's, which never takes that path."""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.plan import NewRequest, StepPlan
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.worker.runner import ModelRunner
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


def _layout(runner: ModelRunner, plan: StepPlan, pad: int) -> dict[str, torch.Tensor]:
    """The decode buffers the step reads: pads included, block tables up to each row's length."""
    inputs = runner.inputs
    out = {
        name: getattr(inputs, name).dev[:pad].clone()
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices")
    }
    for i, table in enumerate(runner.table.block_tables(plan.keys)):
        out[f"table{i}"] = inputs.block_tables.dev[i, : len(table)].clone()
    return out


def _checked_core(settings, counts: dict) -> EngineCore:
    """A core whose runner, after every step it takes from persistent rows, poisons the buffers, lays
    the same plan out from the host and asserts both wrote the same (and that the block tables the worker
    built from the plans are the scheduler's)."""
    runner = ModelRunner(settings)
    inputs = runner.inputs
    advance = inputs._advance

    def apply_then_compare(table, rows, plan, pad, prev):
        before = None if rows.keys is None else list(rows.keys)
        layout = advance(table, rows, plan, pad, prev)
        if layout is None:
            return None
        running = {seq.key: seq for seq in core.scheduler.running}
        for key, blocks in zip(plan.keys, table.block_tables(plan.keys), strict=True):
            assert blocks == running[key].block_table, key
        counts["applied"] += 1
        counts["gathered"] += plan.keys != before
        counts["new_rows"] += before is not None and not set(plan.keys) <= set(before)
        counts["grown"] += bool(plan.grown)
        got = _layout(runner, plan, pad)
        for buf in (
            inputs.input_ids,
            inputs.positions,
            inputs.slot_mapping,
            inputs.seq_lens,
            inputs.block_tables,
            inputs.logits_indices,
        ):
            buf.dev.fill_(POISON)
        # The host layout alone: the rows' state stays the path's.
        state = (rows.keys, rows._row_of, rows._num_blocks.copy(), rows.arange_rows)
        inputs._host_tables_stale = True  # as a mixed layout leaves the host row cache
        inputs._lay_out(table, plan, True, pad, pad, prev)
        rows.keys, rows._row_of, rows._num_blocks, rows.arange_rows = state
        want = _layout(runner, plan, pad)
        for name in want:
            assert torch.equal(got[name], want[name]), (name, got[name], want[name])
        return layout

    inputs._advance = apply_then_compare
    core = EngineCore(runner, settings)
    return core


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
    table, prev = runner.table, torch.zeros(2, dtype=torch.int64)
    rows = table.rows
    greedy = SamplingParams(temperature=0)
    table.update(StepPlan([], [], new=tuple(NewRequest(k, f"r{k}", [], [], greedy, [0]) for k in (1, 2, 3))))
    table.sampled_by_step([1, 2])  # the step in flight samples 1 and 2, not 3

    def steady(keys, grown=()):
        return StepPlan(keys=keys, starts=[4] * len(keys), grown=grown)

    assert not rows.follows(steady([1, 2]), table, 2)  # nothing laid out yet
    rows.remember([1, 2], [1, 1], 2)
    assert rows.follows(steady([1, 2]), table, 2)
    assert rows.follows(steady([2]), table, 2)  # a row left
    assert not rows.follows(
        steady([2, 3]), table, 2
    )  # request 3 is new to the rows and no id is in flight for it
    assert not rows.follows(steady([1, 2]), table, 1)  # fewer sampled ids than rows
    fed_known = StepPlan(keys=[1], starts=[4], tokens=[[5]])  # a row fed a known token, not one in flight
    assert not rows.follows(fed_known, table, 2)
    table.get(2).block_table = []  # the worker's table of 2 shorter than its device row: they split
    assert rows.apply(steady([1, 2], grown=((2, []),)), table, prev, lambda: None) is None
    assert rows.keys == [1, 2] and list(rows._num_blocks[:2]) == [1, 1]  # nothing touched
    runner.capture([])  # a capture outside a step rewrites the buffers: the rows are no longer known
    assert rows.keys is None
