"""ModelRunner on a real GPU (bf16): logits through graph replay equal logits of an enforce_eager
runner, step by step, over mixed prefill/decode batches and decode batches of several sizes, for
two different prompt sets. Run on the lent H200: pytest -m cuda tests/gpu/test_runner_cuda.py

Tolerance (bf16; padded and unpadded GEMM shapes may pick different kernels): per step, max
|graph - eager| <= 3% of max |eager logit| (logits ~1-5 here), and equal argmax wherever the
eager top-2 gap exceeds that tolerance (a near-tie may flip under bf16 rounding).
"""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from graphcache.graphs.descriptor import BatchDescriptor
from helpers_cuda import assert_replay_close
from helpers_model import Blocks, cuda_settings, gqa_checkpoint, prompt_ids

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def path():
    return gqa_checkpoint()


def _drive(graph: ModelRunner, eager: ModelRunner, seed: int, num_seqs: int = 20):
    """Prefill num_seqs prompts in mixed batches (with decodes of the earlier ones), then decode in
    shrinking batches. Both runners get identical inputs (greedy tokens from the eager run)."""
    lens = [5 + (seed * 7 + 11 * i) % 50 for i in range(num_seqs)]
    prompts = [prompt_ids(n, seed=100 * seed + i) for i, n in enumerate(lens)]
    blocks = Blocks(16)
    tables = [blocks.table(n + 40) for n in lens]
    tokens = [list(p) for p in prompts]  # running token lists
    done = [0] * num_seqs  # tokens in the KV cache
    modes, steps = [], 0

    def step(active: list[int]):
        nonlocal steps
        seqs = [StepSeq(tokens[i][done[i] :], done[i], tables[i], True) for i in active]
        graph.out_logits.fill_(float("nan"))  # a replay that skipped the LM head would show
        result = graph.execute(StepPlan.standalone(seqs))
        g = result.logits.clone()
        e = eager.execute(
            StepPlan.standalone([StepSeq(list(s.token_ids), s.start_pos, s.block_table, True) for s in seqs])
        ).logits
        assert_replay_close(
            g, e, f"step {steps} ({len(active)} seqs, {sum(len(s.token_ids) for s in seqs)} tokens)"
        )
        modes.append(result.mode)
        steps += 1
        for row, i in enumerate(active):
            done[i] = len(tokens[i])
            tokens[i].append(int(e[row].argmax()))

    # Mixed steps: each adds a few prefills next to decodes of the sequences already started.
    started: list[int] = []
    waiting = list(range(num_seqs))
    while waiting:
        new, budget = [], 200 - len(started)
        while waiting and len(prompts[waiting[0]]) <= budget:
            budget -= len(prompts[waiting[0]])
            new.append(waiting.pop(0))
        step(started + new)
        started += new
    for size in (num_seqs, num_seqs, 8, 8, 3, 3, 1):  # decode batches: 32/8/4/1 descriptors
        step(list(range(size)))
    return modes


@pytest.mark.parametrize("seed,mode", [(1, "full"), (2, "full"), (1, "breakable")])
def test_replay_logits_equal_eager_logits(path, seed, mode):
    """Graph replay (decode: the Triton kernel, in the graph or as the break) against an eager runner
    whose decode steps use the independent FlashAttention varlen kernel."""
    graph = ModelRunner(cuda_settings(path, decode_capture_mode=mode))
    eager = ModelRunner(cuda_settings(path, enforce_eager=True, decode_attention_backend="varlen"))
    assert graph.backend == "cuda" and eager.backend == "eager" and graph.dtype == torch.bfloat16
    assert graph.decode_kernel == "triton"
    modes = _drive(graph, eager, seed)
    assert set(modes) == {"replay"}, modes  # every step fits a capture size
    entries = graph.cache.entries()
    assert {e.mode for e in entries if e.descriptor.endswith(":decode")} == {mode}
    mixed_mode = "full" if graph.attention_kernel == "triton" else "breakable"  # mixed_capture_mode=full
    assert {e.mode for e in entries if not e.descriptor.endswith(":decode")} <= {mixed_mode}
    descs = {e.descriptor for e in entries}
    decode_descs = {d for d in descs if d.endswith(":decode")}
    assert len(descs) >= 3 and {"32:32:decode", "8:8:decode", "4:4:decode"} <= decode_descs, descs
    stats = graph.cache.stats()
    assert stats.hits >= 3, stats  # repeated decode sizes replay cached graphs


def test_warmed_up_runner_matches_eager_and_hits(path):
    graph = ModelRunner(
        cuda_settings(path, warmup_decode_sizes=[1, 4, 8, 32], warmup_descriptors=["256:32", "128:8"])
    )
    kv_before = graph.kv_cache.clone()
    report = graph.warmup()
    assert not report.failed and len(report.captured) == 6, report
    assert torch.equal(graph.kv_cache, kv_before)  # warmup captures write no KV slot
    eager = ModelRunner(cuda_settings(path, enforce_eager=True))
    misses = graph.cache.stats().misses
    _drive(graph, eager, seed=3, num_seqs=12)
    assert graph.cache.stats().hits > 0 and BatchDescriptor(8, 8, True) in graph.cache
    assert graph.cache.stats().misses >= misses


def test_admin_warmup_between_steps_keeps_logits(path):
    """A capture requested between steps (admin warmup) must not touch the running sequences' KV."""
    graph = ModelRunner(cuda_settings(path))
    eager = ModelRunner(cuda_settings(path, enforce_eager=True))
    ids = prompt_ids(30, seed=9)
    table = Blocks(16).table(40)
    for r in (graph, eager):
        r.execute(StepPlan.standalone([StepSeq(ids[:29], 0, table, True)]))
    graph.capture([BatchDescriptor(64, 4), BatchDescriptor(2, 2, True)])
    g = graph.execute(StepPlan.standalone([StepSeq([ids[29]], 29, table, True)])).logits.clone()
    e = eager.execute(StepPlan.standalone([StepSeq([ids[29]], 29, table, True)])).logits
    assert_replay_close(g, e, "decode after admin warmup")
