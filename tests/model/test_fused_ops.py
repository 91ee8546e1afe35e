"""Fused layer kernels (model/fused_ops.py) against the PyTorch ops they replace.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1; tests/conftest.py sets it),
in fp32 (bf16 on the GPU), on tiny shapes with odd sizes (masking). Outputs are poisoned with NaN first, and
inputs are random (never zeros). The model-level test runs a whole LlamaModel both ways. The `cuda`
tests check bf16 at the Qwen2.5-0.5B shape, and a runner's greedy tokens with the kernels on and off.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from graphcache.model.fused_ops import add_rmsnorm, rotary_, rotary_cache_, silu_mul  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
# Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even, as torch does), so bf16
# runs only on the GPU, where it must match torch bit for bit except the norm (summation order).
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32: only the norm's summation order differs; bf16: a rounding of the norm may flip by one ulp
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert not torch.isnan(a).any()
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_torch(dtype, with_residual):
    gen = torch.Generator().manual_seed(1)
    t, n = 5, 96 + 7
    x = torch.randn(t, n, generator=gen).to(DEVICE, dtype)
    res = torch.randn(t, n, generator=gen).to(DEVICE, dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(DEVICE, dtype)
    want_out, want_res = add_rmsnorm(x, res, w, 1e-6, fused=False)
    got_out, got_res = add_rmsnorm(x, res, w, 1e-6, fused=True)
    _close(got_out, want_out, dtype)
    assert torch.equal(got_res, want_res)  # the residual sum is rounded the same way
    # a second input through the same call: nothing stale
    x2 = torch.randn(t, n, generator=gen).to(DEVICE, dtype) * 3
    _close(add_rmsnorm(x2, res, w, 1e-6, fused=True)[0], add_rmsnorm(x2, res, w, 1e-6, fused=False)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: half = 12, not a power of two (masked)
def test_rotary_in_place_matches_torch(dtype, head_dim):
    gen = torch.Generator().manual_seed(2)
    t, h, k_heads, positions = 4, 3, 1, 64
    qkv = torch.randn(t, (h + 2 * k_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    angles = torch.outer(torch.arange(positions).float(), torch.rand(head_dim // 2, generator=gen))
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    pos = torch.tensor([0, 7, 63, 31], device=DEVICE)

    def views(buf):  # q, k as the model takes them: strided views into the qkv projection
        q = buf[:, : h * head_dim].view(t, h, head_dim)
        k = buf[:, h * head_dim : (h + k_heads) * head_dim].view(t, k_heads, head_dim)
        return q, k

    want_q, want_k = rotary_(*views(qkv.clone()), cos, sin, pos, fused=False)
    buf = qkv.clone()
    got_q, got_k = rotary_(*views(buf), cos, sin, pos, fused=True)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(buf[:, (h + k_heads) * head_dim :], qkv[:, (h + k_heads) * head_dim :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 24])
def test_rotary_with_the_cache_write_matches_rotary_then_index_copy(dtype, head_dim):
    """One kernel for rotary and the k/v slot writes: the same q, k and cache as the three ops it replaces,
    on NaN-poisoned caches (slots no token maps to stay poisoned)."""
    gen = torch.Generator().manual_seed(4)
    t, h, k_heads, positions, slots = 5, 4, 2, 64, 11
    angles = torch.outer(torch.arange(positions).float(), torch.rand(head_dim // 2, generator=gen))
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    for seed in (0, 1):  # two different inputs through the same caches
        qkv = torch.randn(t, (h + 2 * k_heads) * head_dim, generator=gen).to(DEVICE, dtype) * (1 + seed)
        pos = torch.randperm(positions, generator=gen)[:t].to(DEVICE)
        slot_mapping = torch.randperm(slots, generator=gen)[:t].to(DEVICE)

        def split(buf):  # q, k, v as the model takes them: strided views into the qkv projection
            q = buf[:, : h * head_dim].view(t, h, head_dim)
            k = buf[:, h * head_dim : (h + k_heads) * head_dim].view(t, k_heads, head_dim)
            return q, k, buf[:, (h + k_heads) * head_dim :].view(t, k_heads, head_dim)

        caches = []
        for fused in (False, True):
            kc = torch.full((slots, k_heads, head_dim), float("nan"), device=DEVICE, dtype=dtype)
            vc = torch.full_like(kc, float("nan"))
            q, k = rotary_cache_(*split(qkv.clone()), cos, sin, pos, slot_mapping, kc, vc, fused=fused)
            caches.append((q.clone(), k.clone(), kc, vc))
        (wq, wk, wkc, wvc), (gq, gk, gkc, gvc) = caches
        assert torch.equal(gq, wq) and torch.equal(gk, wk)
        assert torch.allclose(gkc, wkc, rtol=0, atol=0, equal_nan=True)  # bit-equal where written
        assert torch.allclose(gvc, wvc, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(gvc[slot_mapping], split(qkv)[2])  # v copied as it is
        assert torch.isnan(gkc).sum() == (slots - t) * k_heads * head_dim  # the other slots untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gen = torch.Generator().manual_seed(3)
    t, inter = 3, 40 + 3
    gate_up = (2 * torch.randn(t, 2 * inter, generator=gen)).to(DEVICE, dtype)
    want = silu_mul(gate_up, inter, fused=False)
    got = silu_mul(gate_up, inter, fused=True)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_adds_a_delta_first(dtype):
    """gate_up_proj's LoRA delta, added by the activation (model/lora_layers.py add_beside_)."""
    gen = torch.Generator().manual_seed(4)
    t, inter = 3, 40 + 3
    gate_up = (2 * torch.randn(t, 2 * inter, generator=gen)).to(DEVICE, dtype)
    delta = torch.randn(t, 2 * inter, generator=gen).to(DEVICE, dtype)
    want = silu_mul(gate_up + delta, inter, fused=False)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for fused in (False, True):
        got = silu_mul(gate_up, inter, fused, delta)
        torch.testing.assert_close(got.float(), want.float(), **tol)
    assert (silu_mul(gate_up, inter, True) - want).abs().max() > 1e-2  # the delta matters


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k normed per head (contiguous), llama: views
def test_runner_logits_equal_with_and_without_fused_ops(arch):
    """A whole model through the runner (fp32, a prefill in three chunks, each reading the KV cache of the last):
    the fused kernels change no logit beyond fp32 noise."""
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import cpu_settings, prompt_ids, run_alone, tiny_checkpoint

    runner = ModelRunner(cpu_settings(tiny_checkpoint(arch)))
    ids = prompt_ids(11, seed=5)

    def run(fused: bool, table: list[int]) -> list[torch.Tensor]:
        runner.model.use_fused_ops(fused)
        return run_alone(runner, ids, table, chunk=4)

    want, got = run(False, [0, 1, 2]), run(True, [5, 4, 3])
    for w, g in zip(want, got, strict=True):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_qwen_shape():
    gen = torch.Generator().manual_seed(4)
    t, n, inter = 256, 896, 4864
    x, res = (torch.randn(t, n, generator=gen).cuda().bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(n, generator=gen)).cuda().bfloat16()
    _close(add_rmsnorm(x, res, w, 1e-6, True)[0], add_rmsnorm(x, res, w, 1e-6, False)[0], torch.bfloat16)
    gate_up = torch.randn(t, 2 * inter, generator=gen).cuda().bfloat16()
    torch.testing.assert_close(
        silu_mul(gate_up, inter, True).float(), silu_mul(gate_up, inter, False).float(), atol=1e-2, rtol=1e-2
    )


def test_rotary_with_the_cache_write_rounds_into_an_fp8_cache():
    """FP8 caches (model/kv_dtype.py): the kernel writes what rotary then kv_dtype.write_slots_ write, E4M3
    saturated at +-448 (k and v scaled past it here)."""
    from graphcache.model.kv_dtype import FP8_KV

    gen = torch.Generator().manual_seed(5)
    t, h, k_heads, head_dim, slots = 5, 4, 2, 16, 12
    angles = torch.outer(torch.arange(64).float(), torch.rand(head_dim // 2, generator=gen))
    emb = torch.cat([angles, angles], dim=-1)  # the tables' layout: each angle for d and d + D/2
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    qkv = (torch.randn(t, (h + 2 * k_heads) * head_dim, generator=gen) * 200).to(DEVICE)
    pos = torch.tensor([0, 7, 63, 31, 2], device=DEVICE)
    slot_mapping = torch.tensor([3, 0, 11, 6, 8], device=DEVICE)
    caches = []
    for fused in (False, True):
        buf = qkv.clone()
        q = buf[:, : h * head_dim].view(t, h, head_dim)
        k = buf[:, h * head_dim : (h + k_heads) * head_dim].view(t, k_heads, head_dim)
        v = buf[:, (h + k_heads) * head_dim :].view(t, k_heads, head_dim)
        kc = torch.zeros(slots, k_heads, head_dim, device=DEVICE, dtype=FP8_KV)
        vc = torch.zeros_like(kc)
        rotary_cache_(q, k, v, cos, sin, pos, slot_mapping, kc, vc, fused=fused)
        caches.append((kc.float(), vc.float()))
    (wk, wv), (gk, gv) = caches
    assert wk.abs().max() == 448 and wv.abs().max() == 448  # saturated, not NaN
    for got, want in ((gk, wk), (gv, wv)):
        assert torch.isfinite(got).all()
        if not INTERPRET:
            assert torch.equal(got, want)  # round to nearest even, both
            continue
        # The interpreter mis-rounds a value whose mantissa rounds up into the next binade (-127.76 -> -64
        # where E4M3 holds -128): a few such slips, everything else bit-equal.
        assert (got != want).float().mean() < 0.05
