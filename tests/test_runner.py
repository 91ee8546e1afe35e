"""ModelRunner on the CPU (eager capture backend): batching, padding and the paged cache must not
change any sequence's logits. Tolerance: max |diff| < 1e-4 vs the sequence run alone (fp32)."""

from __future__ import annotations

import pytest
import torch
from helpers_model import Blocks, cpu_settings, prompt_ids, run_alone, tiny_checkpoint

from service.engine.runner import ModelRunner, StepBatch, StepSeq
from service.graphs.descriptor import BatchDescriptor

ATOL = 1e-4


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("llama")


def _histories(runner, n_decodes=3, prefill_lens=(13, 6), decode_ctx=(9, 20, 5)):
    """Sequences for a mixed step: decodes that already have context in the cache, and new prefills.
    Returns (batch, expected logits per seq) where expected comes from each sequence run alone."""
    blocks = Blocks(runner.block_size)
    seqs, expected = [], []
    for i, ctx in enumerate(decode_ctx[:n_decodes]):
        ids = prompt_ids(ctx + 1, seed=10 + i)
        table = blocks.table(ctx + 1)
        alone = run_alone(runner, ids, table, chunk=ctx)   # prefill ctx, then one decode token
        expected.append(alone[-1])
        seqs.append(StepSeq([ids[-1]], ctx, table, True))  # the batched step recomputes that decode
    for j, n in enumerate(prefill_lens):
        ids = prompt_ids(n, seed=20 + j)
        table = blocks.table(n)
        expected.append(run_alone(runner, ids, table)[-1])
        seqs.append(StepSeq(ids, 0, table, True))
    return seqs, expected


def test_mixed_batch_equals_each_sequence_alone(path):
    runner = ModelRunner(cpu_settings(path))
    seqs, expected = _histories(runner)
    # Interleave decodes and prefills: the runner reorders internally, rows come back in batch order.
    order = [3, 0, 1, 4, 2]
    batch = StepBatch([seqs[i] for i in order])
    logits = runner.execute(batch)
    assert logits.shape == (5, runner.model_config.vocab_size) and logits.dtype == torch.float32
    assert runner.last_mode == "replay"  # 2*13+... tokens padded to a capture size, eager backend
    for row, i in enumerate(order):
        assert (logits[row] - expected[i]).abs().max().item() < ATOL


def test_decode_batch_uses_padded_decode_descriptor(path):
    runner = ModelRunner(cpu_settings(path))
    seqs, expected = _histories(runner, n_decodes=3, prefill_lens=())
    logits = runner.execute(StepBatch(seqs))   # 3 decodes -> 4:4:decode with one pad request
    assert BatchDescriptor(4, 4, True) in runner.cache
    for row in range(3):
        assert (logits[row] - expected[row]).abs().max().item() < ATOL


def test_need_logits_rows_come_first_in_batch_order(path):
    runner = ModelRunner(cpu_settings(path))
    seqs, expected = _histories(runner)
    seqs[0].need_logits = False     # e.g. a non-final prefill chunk
    seqs[3].need_logits = False
    logits = runner.execute(StepBatch(seqs))
    assert logits.shape[0] == 3
    for row, i in enumerate([1, 2, 4]):
        assert (logits[row] - expected[i]).abs().max().item() < ATOL


def test_padding_never_writes_other_kv_blocks(path):
    runner = ModelRunner(cpu_settings(path))
    ids = prompt_ids(5)
    table = [7, 8]
    before = runner.kv_cache.clone()
    runner.execute(StepBatch([StepSeq(ids, 0, table, True)]))   # 5 tokens padded to 8
    changed = (runner.kv_cache != before).flatten(3).any(-1)    # [layers, 2, blocks]
    touched = sorted(set(changed.nonzero()[:, 2].tolist()))
    assert touched == [7, 8]


def test_oversized_batch_runs_eagerly_with_same_logits(path):
    runner = ModelRunner(cpu_settings(path, capture_sizes=[1, 2, 4, 8], max_capture_size=8))
    ids = prompt_ids(30, seed=3)
    table = Blocks(runner.block_size).table(30)
    logits = runner.execute(StepBatch([StepSeq(ids, 0, table, True)]))
    assert runner.last_mode == "eager"
    small = ModelRunner(cpu_settings(path))
    ref = run_alone(small, ids, Blocks(small.block_size).table(30))[-1]
    assert (logits[0] - ref).abs().max().item() < ATOL


def test_enforce_eager_never_captures(path):
    runner = ModelRunner(cpu_settings(path, enforce_eager=True, warmup_decode_sizes=[1, 2]))
    report = runner.warmup()
    assert report.captured == [] and len(runner.cache) == 0
    ids = prompt_ids(6)
    runner.execute(StepBatch([StepSeq(ids, 0, Blocks(4).table(6), True)]))
    assert runner.last_mode == "eager" and len(runner.cache) == 0


def test_warmup_captures_decode_sizes_and_writes_no_kv(path):
    runner = ModelRunner(cpu_settings(path, warmup_decode_sizes=[1, 2, 4, 8], warmup_descriptors=["16:2"]))
    before = runner.kv_cache.clone()
    report = runner.warmup()
    assert sorted(report.captured) == sorted(["8:8:decode", "4:4:decode", "2:2:decode", "1:1:decode", "16:2"])
    assert torch.equal(runner.kv_cache, before)
    # A warmup (e.g. the admin endpoint) between steps must not disturb a running sequence.
    ids = prompt_ids(12, seed=5)
    table = Blocks(runner.block_size).table(12)
    first = run_alone(runner, ids[:11], table)[-1]
    runner.cache.warmup([BatchDescriptor(32, 4)])
    step = runner.execute(StepBatch([StepSeq([ids[11]], 11, table, True)]))[0]
    fresh = ModelRunner(cpu_settings(path))
    ref = run_alone(fresh, ids, Blocks(fresh.block_size).table(12), chunk=11)
    assert (first - ref[0]).abs().max().item() < ATOL
    assert (step - ref[1]).abs().max().item() < ATOL


def test_default_tiny_model_when_no_model_set(tmp_path):
    from service.config import Settings

    runner = ModelRunner(Settings(cache_dir=tmp_path, device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                                  warmup_decode_sizes=[]))
    assert runner.model_config.architecture == "llama" and runner.dtype == torch.float32
    assert runner.max_model_len == 2048 and runner.num_kv_blocks == 4 * 2048 // 16
    ids = runner.tokenizer.encode("Hello there")
    logits = runner.execute(StepBatch([StepSeq(ids, 0, list(range(1)), True)]))
    assert torch.isfinite(logits).all()


def test_bad_block_table_is_rejected_with_a_fix(path):
    runner = ModelRunner(cpu_settings(path))
    with pytest.raises(ValueError, match="needs ceil"):
        runner.execute(StepBatch([StepSeq(prompt_ids(9), 0, [0, 1], True)]))


def test_graph_debug_addresses_stay_fixed_across_steps(path):
    runner = ModelRunner(cpu_settings(path, graph_debug=True))
    blocks = Blocks(runner.block_size)
    tables = [blocks.table(12) for _ in range(3)]
    runner.execute(StepBatch([StepSeq(prompt_ids(5, seed=i), 0, tables[i], True) for i in range(3)]))
    for pos in (5, 6, 7):   # same 4:4:decode descriptor: captured once, then replayed with checks
        runner.execute(StepBatch([StepSeq([9], pos, tables[i], True) for i in range(3)]))
        assert runner.last_mode == "replay"
    assert runner.cache.stats().hits == 2


def test_default_model_dir_is_created_once(tmp_path):
    from service.model.tiny import default_model_dir

    first = default_model_dir(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tiny-")]  # no temp dirs left
