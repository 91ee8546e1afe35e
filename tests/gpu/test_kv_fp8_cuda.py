"""An FP8 KV cache on a real GPU (model/kv_dtype.py; compute capability 8.9+): the triton decode and unified
kernels widen E4M3 K/V in registers, the rotary kernel writes them saturated.
Run: pytest -m cuda tests/gpu/test_kv_fp8_cuda.py

- Graph replay equals eager on an FP8 cache (decode batches of 1, 3 and 20 rows; the bf16 tolerance of
  tests/gpu/test_runner_cuda.py), for a bf16 model and an FP8 one (whose one-token qkv GEMM then leaves the
  rotary and the cache write to the rotary kernel: its epilogue writes 16-bit caches only).
- Mixed steps (fresh chunks, a cached prefix, decodes) on the unified kernel: logits within 5% of max |logit|
  of the same runner on a bf16 cache (E4M3 keeps 3 mantissa bits of K and V).
"""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.worker.runner import ModelRunner
from graphcache.model import fp8_gemm
from graphcache.model.kv_dtype import FP8_KV
from helpers_cuda import assert_decode_replays_match
from helpers_model import cuda_settings, gqa_checkpoint, tiny_checkpoint
from test_unified_attention import _mixed_steps

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _settings(path, **kw):
    kw = {"capture_sizes": [1, 2, 4, 8, 16, 24, 32], "max_capture_size": 32, **kw}
    return cuda_settings(path, num_kv_blocks=256, max_model_len=256, **kw)


@pytest.mark.parametrize("quantization", ["auto", "fp8"])
def test_replay_on_an_fp8_cache_equals_eager(quantization, monkeypatch):
    path = tiny_checkpoint("llama", hidden=256, layers=4, heads=2, kv_heads=1, intermediate=512, head_dim=128)
    folds = []
    real = fp8_gemm.folds_rope
    monkeypatch.setattr(fp8_gemm, "folds_rope", lambda *a, **k: folds.append(r := real(*a, **k)) or r)
    kw = dict(kv_cache_dtype="fp8", quantization=quantization)
    graph = ModelRunner(_settings(path, **kw))
    eager = ModelRunner(_settings(path, enforce_eager=True, **kw))
    assert graph.kv_storage.dtype == eager.kv_storage.dtype == FP8_KV
    for num_seqs in (1, 3, 20):
        assert_decode_replays_match(graph, eager, num_seqs, seed=70 * num_seqs, steps=4, what="fp8 cache")
    assert not any(folds)  # never the rope-in-GEMM epilogue on an FP8 cache


def test_mixed_steps_on_an_fp8_cache_are_close_to_bf16():
    path = gqa_checkpoint()
    kw = dict(attention_backend="triton", enforce_eager=True)
    bf16 = ModelRunner(cuda_settings(path, **kw))
    fp8 = ModelRunner(cuda_settings(path, kv_cache_dtype="fp8", **kw))
    assert fp8.kv_storage.dtype == FP8_KV and fp8.attention_kernel == "triton"
    for got, want in zip(_mixed_steps(fp8), _mixed_steps(bf16), strict=True):
        assert torch.isfinite(got).all()
        assert (got.float() - want.float()).abs().max().item() < 0.05 * want.float().abs().max().item()
