"""An FP8 KV cache (model/kv_dtype.py, settings.model.kv_cache_dtype): E4M3 rounding that saturates, slot
writes and gathers through uint8 views, and runners on every attention path the CPU runs (SDPA gathers; the
unified and decode Triton kernels under Triton's interpreter) against the same runner on a full-precision
cache: the cache holds about 4x the blocks of an fp32 one, and the logits move only by the E4M3 rounding
of K and V."""

from __future__ import annotations

import pytest
import torch
from graphcache.model.kv_dtype import FP8_KV, cache_dtype, gather_slots, to_cache, write_slots_
from graphcache.model.triton_support import HAVE_TRITON
from test_unified_attention import _mixed_steps


def test_cache_dtype_setting():
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype("fp8", torch.bfloat16) == cache_dtype("fp8_e4m3", torch.float32) == FP8_KV
    with pytest.raises(ValueError, match="use one of auto, fp8, fp8_e4m3"):
        cache_dtype("fp8_e5m2", torch.bfloat16)


def test_fp8_rounding_saturates_instead_of_overflowing():
    x = torch.tensor([0.3, -2.5, 447.0, 1000.0, -1e6])
    got = to_cache(x, FP8_KV).float()
    assert torch.isfinite(got).all() and got[3] == 448 and got[4] == -448
    assert (got[:3] - x[:3]).abs().max() <= x[:3].abs().max() / 16  # 3 mantissa bits
    assert torch.equal(to_cache(x, torch.float32), x)


@pytest.mark.parametrize("dtype", [torch.float32, FP8_KV])
def test_slot_writes_and_gathers(dtype):
    slots = torch.zeros(10, 2, 4, dtype=dtype)
    x = torch.randn(3, 2, 4)
    index = torch.tensor([7, 2, 5])
    write_slots_(slots, index, x)
    back = gather_slots(slots, 0, index, torch.float32)
    assert back.dtype == torch.float32
    assert torch.equal(back, to_cache(x, dtype).float())
    assert not gather_slots(slots, 0, torch.tensor([0, 1]), torch.float32).any()  # the rest untouched


def _runners(monkeypatch, kernel: str, decode: str):
    import graphcache.engine.worker.runner as runner_mod
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import cpu_settings, tiny_checkpoint

    path = tiny_checkpoint("qwen2", hidden=64, layers=2, heads=8, kv_heads=2)
    if kernel != "sdpa":
        monkeypatch.setattr(runner_mod, "select_attention_kernel", lambda *args: kernel)
    if decode != "torch":
        monkeypatch.setattr(runner_mod, "select_decode_kernel", lambda *args: decode)
    kw = dict(num_kv_blocks=None, enforce_eager=True, decode_attention_backend=decode)
    full = ModelRunner(cpu_settings(path, **kw))
    fp8 = ModelRunner(cpu_settings(path, kv_cache_dtype="fp8", **kw))
    return full, fp8


@pytest.mark.parametrize(
    "kernel,decode",
    [
        ("sdpa", "torch"),
        pytest.param("triton", "varlen", marks=pytest.mark.skipif(not HAVE_TRITON, reason="triton")),
        pytest.param("triton", "triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="triton")),
    ],
)
def test_runner_on_an_fp8_cache(monkeypatch, kernel, decode):
    full, fp8 = _runners(monkeypatch, kernel, decode)
    assert fp8.kv_storage.dtype == FP8_KV and full.kv_storage.dtype == torch.float32
    assert fp8.attention_kernel == kernel and fp8.decode_kernel == decode
    # The CPU's default cache (its byte cap) holds 4x the fp32 blocks, up to the per-sequence ceiling
    assert fp8.num_kv_blocks >= min(4 * full.num_kv_blocks, 8 * fp8.max_blocks_per_seq) - 1
    steps = list(zip(_mixed_steps(fp8), _mixed_steps(full), strict=True))
    for got, want in steps:
        assert torch.isfinite(got).all()
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() < 0.05 * scale  # E4M3 K and V: a few % of the largest logit
    # The steps that read cached context (a cached prefix, decodes) read E4M3 values. On SDPA fresh chunks
    # attend to the step's own k and v, so the first step is exact; the unified kernel reads every row's
    # keys from the pages, fresh ones included.
    assert all((got - want).abs().max().item() > 0 for got, want in steps[1:])
    assert torch.equal(*steps[0]) == (kernel == "sdpa")


def test_flash_attention_refuses_an_fp8_cache(monkeypatch):
    import graphcache.engine.worker.runner as runner_mod
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import cpu_settings, tiny_checkpoint

    monkeypatch.setattr(runner_mod, "select_attention_kernel", lambda *args: "flash_paged")
    with pytest.raises(RuntimeError, match="kv_cache_dtype=fp8 needs the triton attention"):
        ModelRunner(cpu_settings(tiny_checkpoint("qwen2"), kv_cache_dtype="fp8"))


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
def test_the_kernels_of_an_fp8_cache_compile_for_sm90():
    """scripts/kv_fp8_sm90.py: the rotary + cache-write, decode and unified kernels at the 8B shape with FP8
    E4M3 K/V, compiled for Hopper (sm_90) on this machine without a GPU, so that Triton's lowering of the
    saturating stores and widening loads fails here, not on the device. A process of its own: these tests
    run Triton's interpreter (TRITON_INTERPRET), under which an offline compile cannot run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "kv_fp8_sm90.py")], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.count("converts E4M3") == 3, out.stdout
