"""The uniform-decode path: decode attention read from static device buffers, captured inside the
graph (full mode) or run as the eager break (breakable), against the general kernel (varlen) and
against each sequence alone. CPU: the eager capture backend and the torch decode kernel; the Triton
kernel and real CUDA graphs are covered by tests/gpu and tests/model/test_decode_attention.py."""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from graphcache.graphs.descriptor import BatchDescriptor
from helpers_model import Blocks, cpu_settings, prompt_ids, run_alone, tiny_checkpoint

ATOL = 1e-4


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen2")  # GQA (heads sharing a KV head) and qkv bias


def _decode_run(runner: ModelRunner, n: int, steps: int = 3) -> list[torch.Tensor]:
    """n sequences of different lengths prefilled, then `steps` decode steps: logits of each step."""
    blocks = Blocks(runner.block_size)
    ids = [prompt_ids(5 + 3 * i, seed=i) for i in range(n)]
    tables = [blocks.table(len(x) + steps + 1) for x in ids]
    for x, table in zip(ids, tables, strict=True):
        run_alone(runner, x, table)
    out = []
    for step in range(steps):
        batch = StepPlan.standalone(
            [StepSeq([7 + step], len(x) + step, table, True) for x, table in zip(ids, tables, strict=True)]
        )
        result = runner.execute(batch)
        out.append(result.logits.float().clone())
    return out


@pytest.mark.parametrize("n", [1, 3, 6])
def test_full_and_breakable_decode_equal_the_general_kernel(path, n):
    ref = _decode_run(ModelRunner(cpu_settings(path, decode_attention_backend="varlen")), n)
    for mode in ("full", "breakable"):
        runner = ModelRunner(cpu_settings(path, decode_capture_mode=mode))
        assert runner.decode_kernel == "torch"
        got = _decode_run(runner, n)
        for g, r in zip(got, ref, strict=True):
            assert (g - r).abs().max().item() < ATOL, mode
        entry = next(e for e in runner.cache.entries() if e.descriptor.endswith(":decode"))
        assert entry.mode == ("full" if mode == "full" else "breakable")
        assert (entry.breaks == 0) == (mode == "full")


def test_decode_equals_each_sequence_alone(path):
    runner = ModelRunner(cpu_settings(path))
    blocks = Blocks(runner.block_size)
    ids = [prompt_ids(9 + 4 * i, seed=20 + i) for i in range(3)]
    tables = [blocks.table(len(x) + 1) for x in ids]
    for x, table in zip(ids, tables, strict=True):
        run_alone(runner, x[:-1], table)
    logits = runner.execute(
        StepPlan.standalone([StepSeq([x[-1]], len(x) - 1, t, True) for x, t in zip(ids, tables, strict=True)])
    )
    for row, x in enumerate(ids):
        alone = ModelRunner(cpu_settings(path))
        ref = run_alone(alone, x, Blocks(alone.block_size).table(len(x)))[-1]
        assert (logits.logits[row].float() - ref).abs().max().item() < ATOL


def test_decode_rows_change_between_steps(path):
    """The block-table row cache: a row whose sequence changes (finish, new block, a mixed step in
    between) is rewritten; stale rows never leak into another sequence's attention."""
    runner = ModelRunner(cpu_settings(path))
    ref_runner = ModelRunner(cpu_settings(path, decode_attention_backend="varlen"))
    rng = torch.Generator().manual_seed(3)
    for r in (runner, ref_runner):
        r._blocks = Blocks(r.block_size)
    live = []
    for step in range(12):
        if step in (0, 4, 8):  # new sequences (a mixed/prefill step in between)
            x = prompt_ids(6 + step, seed=step)
            tables = {id(r): r._blocks.table(len(x) + 20) for r in (runner, ref_runner)}
            for r in (runner, ref_runner):
                run_alone(r, x, tables[id(r)])
            live.append({"pos": len(x), "tables": tables})
        if step == 6:
            live.pop(0)  # the first one finished: rows shift up
        tok = int(torch.randint(5, 500, (1,), generator=rng))
        got = runner.execute(
            StepPlan.standalone([StepSeq([tok], s["pos"], s["tables"][id(runner)], True) for s in live])
        )
        ref = ref_runner.execute(
            StepPlan.standalone([StepSeq([tok], s["pos"], s["tables"][id(ref_runner)], True) for s in live])
        )
        assert (got.logits.float() - ref.logits.float()).abs().max().item() < ATOL, step
        for s in live:
            s["pos"] += 1


def test_full_decode_warmup_capture_writes_no_kv(path):
    runner = ModelRunner(cpu_settings(path, warmup_decode_sizes=[1, 2, 4, 8]))
    before = runner.kv_cache.clone()
    report = runner.warmup()
    assert sorted(report.captured) == sorted(["8:8:decode", "4:4:decode", "2:2:decode", "1:1:decode"])
    assert torch.equal(runner.kv_cache, before)
    assert all(e.mode == "full" for e in runner.cache.entries())
    info = runner.cache.info()
    assert {e["mode"] for e in info["entries"]} == {"full"}
    # A capture between steps (admin warmup) does not disturb running sequences.
    ids = prompt_ids(12, seed=5)
    table = Blocks(runner.block_size).table(13)
    first = run_alone(runner, ids[:11], table)[-1]
    runner.cache.clear()
    runner.capture([BatchDescriptor(4, 4, True)])
    step = runner.execute(StepPlan.standalone([StepSeq([ids[11]], 11, table, True)])).logits[0].float()
    fresh = ModelRunner(cpu_settings(path))
    ref = run_alone(fresh, ids, Blocks(fresh.block_size).table(12), chunk=11)
    assert (first - ref[0]).abs().max().item() < ATOL
    assert (step - ref[1]).abs().max().item() < ATOL


def test_decode_position_past_the_table_is_rejected(path):
    runner = ModelRunner(cpu_settings(path))
    with pytest.raises(ValueError, match="needs ceil"):
        runner.execute(StepPlan.standalone([StepSeq([5], 8, [0, 1], True)]))  # position 8 with 2 blocks of 4


def test_decode_kernel_selection():
    from graphcache.model.attention import select_decode_kernel

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_decode_kernel(cpu, torch.float32, 64, 16) == "torch"
    assert select_decode_kernel(cpu, torch.float32, 64, 16, "varlen") == "varlen"
    assert select_decode_kernel(cuda, torch.bfloat16, 64, 24) == "varlen"  # pages not a power of two
    with pytest.raises(RuntimeError, match="needs CUDA"):
        select_decode_kernel(cpu, torch.float32, 64, 16, "triton")
    with pytest.raises(ValueError, match="use one of auto"):
        select_decode_kernel(cpu, torch.float32, 64, 16, "fast")
