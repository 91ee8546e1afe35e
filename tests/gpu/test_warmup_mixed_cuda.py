"""The default warmup on CUDA with no mixed bucket in use (issue 41: the 8B shape at max_capture_size 512
keeps none) captures one mixed graph of the largest capture size, so the unified attention kernel is
compiled before serving: the first mixed steps after it (a lazily captured size, an eager step past the
largest size) compile no new variant of it, where a compile on a cold Triton cache stalls every request for
up to seconds. Run on the lent GPU: pytest -m cuda tests/gpu/test_warmup_mixed_cuda.py"""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.model import unified_attention
from helpers_model import Blocks, cuda_settings, prompt_ids, tiny_checkpoint

pytestmark = pytest.mark.cuda


def _compiled_variants(jit_fn) -> int:
    """Compiled specializations a Triton JITFunction holds in memory (Triton 3.x's device_caches, or the
    older per-device `cache` dicts)."""
    caches = getattr(jit_fn, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in getattr(jit_fn, "cache", {}).values())


def test_mixed_kernels_compile_at_warmup():
    path = tiny_checkpoint("qwen2", hidden=256, layers=2, heads=8, kv_heads=2, intermediate=512)
    settings = cuda_settings(
        path,
        capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128],
        max_capture_size=128,
        max_num_batched_tokens=512,
        mixed_capture_sizes=[],  # no bucket above the decode sizes, as the 8B shape at 512
        warmup_decode_sizes=[1, 8],
        warmup_mixed_sizes=None,  # the server's default (cpu_settings turns it off)
    )
    runner = ModelRunner(settings)
    if runner.attention_kernel != "triton":
        pytest.skip(f"mixed steps use the {runner.attention_kernel} kernel here, not the unified Triton one")
    assert BatchDescriptor(128, 32) in runner.warmup_descriptors()
    report = runner.warmup()
    assert not report.failed and BatchDescriptor(128, 32) in runner.cache, report
    kernel = unified_attention._kernel()
    before = _compiled_variants(kernel)
    assert before >= 1
    blocks = Blocks(runner.block_size)
    modes = []
    for n in (20, 200):  # 40 tokens: a capture of 64 (admission always); 400: eager past 128
        seqs = [StepSeq(prompt_ids(n, seed=i), 0, blocks.table(n), True) for i in range(2)]
        modes.append(runner.execute(StepPlan.standalone(seqs)).mode)
    torch.cuda.synchronize()
    assert modes == ["replay", "eager"]
    assert _compiled_variants(kernel) == before, "a mixed step compiled the unified kernel after the warmup"
