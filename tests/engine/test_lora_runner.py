"""LoRA through the runner on the CPU: a batch mixing adapters and base rows gives each row the logits of
its adapter merged into the base weights (peft's merge_and_unload, loaded as a plain model), in replay
(the eager backend's graph path) and eager; slots are reused by LRU; the adapter is checked at load."""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from helpers_lora import peft_adapter
from helpers_model import Blocks, cpu_settings, prompt_ids, run_alone, tiny_checkpoint

pytest.importorskip("peft")

ATOL = 2e-4  # fp32: merged weights round differently from x @ A^T @ B^T


@pytest.fixture(scope="module")
def base():
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base):
    a = peft_adapter(base, r=8, alpha=16, seed=1)
    b = peft_adapter(base, r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), seed=2, rslora=True)
    c = peft_adapter(base, r=16, alpha=8, targets=("k_proj", "o_proj", "gate_proj", "up_proj"), seed=3)
    d = peft_adapter(base, r=2, alpha=32, targets=("v_proj", "o_proj", "up_proj"), seed=4)
    return {"a": a, "b": b, "c": c, "d": d}


def _lora_runner(base, adapters, **overrides):
    settings = dict(
        enable_lora=True,
        lora_modules=[f"{name}={adapter}" for name, (adapter, _) in adapters.items()],
        max_loras=4,
        max_lora_rank=16,
    )
    settings.update(overrides)
    return ModelRunner(cpu_settings(base, **settings))


def _reference(path, ids_list, chunk=None):
    """Each sequence's last-step logits on a plain runner of `path` (the merged model, or the base)."""
    runner = ModelRunner(cpu_settings(path))
    blocks = Blocks(runner.block_size)
    return [run_alone(runner, ids, blocks.table(len(ids)), chunk)[-1] for ids in ids_list]


def _mixed_batch(runner, rows):
    """rows: (adapter or None, ids, context): decodes with `context` tokens already cached (prefilled
    through the same adapter), and prefills (context 0). Returns the plan of the mixed step."""
    blocks = Blocks(runner.block_size)
    seqs = []
    for name, ids, ctx in rows:
        table = blocks.table(len(ids))
        if ctx:
            runner.execute(StepPlan.standalone([StepSeq(ids[:ctx], 0, table, lora_name=name)]))
        seqs.append(StepSeq(ids[ctx:], ctx, table, lora_name=name))
    return StepPlan.standalone(seqs)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_mixed_adapters_and_base_match_merged_weights(base, adapters, enforce_eager):
    runner = _lora_runner(base, adapters, enforce_eager=enforce_eager)
    rows = [
        ("a", prompt_ids(12, seed=1), 11),  # decodes
        (None, prompt_ids(9, seed=2), 8),
        ("b", prompt_ids(7, seed=3), 6),
        ("c", prompt_ids(10, seed=4), 0),  # prefills
        ("a", prompt_ids(6, seed=5), 0),
        (None, prompt_ids(5, seed=6), 0),
        ("d", prompt_ids(6, seed=9), 5),
    ]
    out = runner.execute(_mixed_batch(runner, rows))
    assert out.mode == ("eager" if enforce_eager else "replay")
    for row, (name, ids, _) in enumerate(rows):
        path = base if name is None else adapters[name][1]
        (expected,) = _reference(path, [ids])
        diff = (out.logits[row] - expected).abs().max().item()
        assert diff < ATOL, f"row {row} ({name}): {diff}"
    # the adapters change the logits: the comparison above is not the base model's against itself
    (plain,) = _reference(base, [rows[0][1]])
    assert (out.logits[0] - plain).abs().max().item() > 1e-2


def test_slots_are_reused_least_recently_used_first(base, adapters):
    runner = _lora_runner(base, adapters, max_loras=2, max_cpu_loras=2)
    lora = runner.lora
    assert lora is not None
    ids = prompt_ids(6, seed=9)
    got = {}
    for name in ["a", "b", "a", "c", "b"]:  # c evicts b (a was used after b), then b evicts a
        blocks = Blocks(runner.block_size)
        got[name] = run_alone_lora(runner, ids, blocks.table(len(ids)), name)
        assert name in lora.slot_of
    assert set(lora.slot_of) == {"c", "b"}
    assert len(lora.load_seconds) == 4  # a, b, c, b again: a's second use found it in its slot
    for name in ("a", "b", "c"):
        (expected,) = _reference(adapters[name][1], [ids])
        assert (got[name] - expected).abs().max().item() < ATOL


def run_alone_lora(runner, ids, table, name):
    return runner.execute(StepPlan.standalone([StepSeq(ids, 0, table, lora_name=name)])).logits[0].clone()


def test_base_rows_with_lora_on_equal_a_server_without_it(base, adapters):
    ids = [prompt_ids(9, seed=11), prompt_ids(4, seed=12)]
    with_lora = _lora_runner(base, adapters)
    blocks = Blocks(with_lora.block_size)
    seqs = [StepSeq(i, 0, blocks.table(len(i))) for i in ids]
    logits = with_lora.execute(StepPlan.standalone(seqs)).logits
    expected = _reference(base, ids)
    for row in range(2):
        assert torch.equal(logits[row], expected[row]) or (logits[row] - expected[row]).abs().max() < 1e-6


@pytest.mark.cuda
def test_cuda_graph_replay_of_mixed_adapters_matches_merged_weights(base, adapters):
    """bf16 on CUDA, graphs on: two different adapter mixes replay the same decode graph, each row within
    the replay tolerance of its merged model run eagerly."""
    from helpers_cuda import assert_replay_close, poison_allocator
    from helpers_model import cuda_settings

    poison_allocator()
    modules = [f"{name}={adapter}" for name, (adapter, _) in adapters.items()]
    runner = ModelRunner(
        cuda_settings(base, enable_lora=True, lora_modules=modules, max_loras=3, max_lora_rank=16)
    )
    refs = {
        name: ModelRunner(cuda_settings(merged, enforce_eager=True)) for name, (_, merged) in adapters.items()
    }
    refs[None] = ModelRunner(cuda_settings(base, enforce_eager=True))
    for mix in (["a", None, "b", "c"], ["c", "c", None, "a"]):
        rows = [(name, prompt_ids(10, seed=40 + i), 9) for i, name in enumerate(mix)]
        out = runner.execute(_mixed_batch(runner, rows))
        assert out.mode == "replay"
        for row, (name, ids, _) in enumerate(rows):
            ref = refs[name]
            expected = run_alone(ref, ids, Blocks(ref.block_size).table(len(ids)), chunk=9)[-1]
            assert_replay_close(out.logits[row : row + 1], expected[None], f"{mix} row {row}")


def test_logits_equal_the_unmerged_peft_model(base, adapters):
    """The independent reference: transformers running the PEFT model itself (adapter unmerged)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    runner = _lora_runner(base, adapters)
    for name in ("a", "b"):
        ids = prompt_ids(13, seed=30)
        blocks = Blocks(runner.block_size)
        got = run_alone_lora(runner, ids, blocks.table(len(ids)), name)
        hf = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapters[name][0]
        )
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0, -1].float()
        assert (got - expected).abs().max().item() < ATOL, name
