"""The dense kernel of fresh prompts (model/prefill_attention.py, settings.model.prefill_attention): which
requests it takes, that the SDPA fallback computes causal attention, and that a runner on the triton
kernel (Triton's interpreter on the CPU) gives the unified-only runner's logits with it on, over mixed
steps of decode rows, chunks with and without a cached prefix, and pure prefills. The CUDA kernels
(triton, flash) are checked against a float reference and the unified runner by the cuda-marked tests."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

# Sets TRITON_INTERPRET (no CUDA) and the interpreter shim before the first kernel, as that module's tests do.
from graphcache.model.prefill_attention import (  # noqa: E402
    DensePrefill,
    dense_prefill_attention,
    plan_dense_suffix,
    select_prefill_kernel,
)
from test_unified_attention import _mixed_steps  # noqa: E402

CPU = torch.device("cpu")


def _plan(kernel, q_lens, seq_lens):
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return plan_dense_suffix(kernel, starts, seq_lens, torch.tensor(starts, dtype=torch.int32))


def test_dense_part_is_the_trailing_fresh_requests():
    # 2 decodes, a chunk over a 5-token cached prefix, then two fresh prompts
    p = _plan("sdpa", [1, 1, 7, 5, 9], [30, 12, 12, 5, 9])
    assert (p.first_req, p.start, p.end, p.lens, p.max_len) == (3, 9, 23, (5, 9), 9)
    assert p.cu.tolist() == [0, 5, 14]
    # a fresh prompt before a cached chunk stays on the unified kernel
    p = _plan("sdpa", [1, 4, 7, 6], [9, 4, 12, 6])
    assert (p.first_req, p.start, p.lens) == (3, 12, (6,))
    # a pure prefill step is all dense
    p = _plan("flash", [8, 3], [8, 3])
    assert (p.first_req, p.start, p.end, p.kernel) == (0, 0, 11, "flash")
    assert _plan("sdpa", [1, 7], [10, 12]) is None  # ends with a cached chunk
    assert _plan("", [8, 3], [8, 3]) is None  # setting unified: no dense part


def test_select_prefill_kernel():
    f32 = torch.float32
    assert select_prefill_kernel("unified", CPU, f32, 64, "triton") == ""
    assert select_prefill_kernel("flash", CPU, f32, 64, "sdpa") == ""  # only the triton kernel splits
    for setting in ("triton", "flash", "sdpa"):
        assert select_prefill_kernel(setting, CPU, f32, 64, "triton") == "sdpa"  # the CPU fallback
    for gone in ("flex", "cudnn"):  # cudnn: measured 100x slower than unified (BENCHMARKS.md §25)
        with pytest.raises(ValueError, match="use one of"):
            select_prefill_kernel(gone, CPU, f32, 64, "triton")


def _reference(q, k, v, lens, scale):
    """fp32 causal attention of each request's rows over its own rows: [T, H, D]."""
    group = q.shape[1] // k.shape[1]
    out, s = [], 0
    for n in lens:
        qi = q[s : s + n].float().transpose(0, 1)  # [H, n, D]
        ki = k[s : s + n].float().repeat_interleave(group, 1).transpose(0, 1)
        vi = v[s : s + n].float().repeat_interleave(group, 1).transpose(0, 1)
        scores = (qi @ ki.transpose(1, 2)) * scale
        scores = scores.masked_fill(
            torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")
        )
        out.append((scores.softmax(-1) @ vi).transpose(0, 1))
        s += n
    return torch.cat(out)


def _dense_case(kernel, device, dtype, heads=8, kv_heads=2, dim=32, lens=(5, 17, 1, 40), before=6):
    """Rows [0, before) are someone else's (left as NaN); the dense part is `lens` after them."""
    g = torch.Generator().manual_seed(0)
    t = before + sum(lens)
    q = torch.randn(t, heads, dim, generator=g).to(device, dtype)
    k = torch.randn(t, kv_heads, dim, generator=g).to(device, dtype)
    v = torch.randn(t, kv_heads, dim, generator=g).to(device, dtype)
    out = torch.full_like(q, float("nan"))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    plan = DensePrefill(kernel, 1, before, t, tuple(lens), cu, max(lens))
    scale = dim**-0.5
    dense_prefill_attention(q, k, v, out, plan, scale)
    return out, _reference(q[before:], k[before:], v[before:], lens, scale)


def test_sdpa_fallback_matches_reference():
    out, ref = _dense_case("sdpa", "cpu", torch.float32)
    assert out[:6].isnan().all()  # rows before the dense part untouched
    assert (out[6:] - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("shape", [(8, 2, 32), (6, 3, 24)])
def test_triton_kernel_matches_reference(shape):
    """model/prefill_triton.py (interpreted on the CPU), GQA 4 and 2, a head_dim that is no power of two,
    lengths off the 128 / 64 tiles: the float reference, and nothing written outside the dense rows."""
    out, ref = _dense_case("triton", "cuda" if torch.cuda.is_available() else "cpu", torch.float32, *shape)
    assert out[:6].isnan().all()
    assert (out[6:] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("setting", ["sdpa", "flash"])
def test_runner_with_dense_prefill_matches_unified(monkeypatch, setting):
    """Runner on the triton kernel, GQA 4: logits with prefill_attention on (the CPU runs it as SDPA)
    equal the unified-only runner's on mixed steps, and the dense kernel really ran on steps with
    trailing fresh prompts (the pure-prefill step, the decode + cached chunk + fresh chunk step)."""
    import graphcache.engine.worker.runner as runner_mod
    import graphcache.model.attention as attention_mod
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import cpu_settings, tiny_checkpoint

    path = tiny_checkpoint("qwen2", hidden=64, layers=2, heads=8, kv_heads=2)
    m = monkeypatch
    m.setattr(runner_mod, "select_attention_kernel", lambda *args: "triton")
    unified = ModelRunner(cpu_settings(path, decode_attention_backend="varlen", enforce_eager=True))
    expected = _mixed_steps(unified)
    calls = []
    real = attention_mod.dense_prefill_attention
    m.setattr(attention_mod, "dense_prefill_attention", lambda *a: calls.append(a[4]) or real(*a))
    dense = ModelRunner(
        cpu_settings(path, decode_attention_backend="varlen", enforce_eager=True, prefill_attention=setting)
    )
    assert dense.attention_kernel == "triton" and dense._planner.prefill_kernel == "sdpa"
    got = _mixed_steps(dense)
    for g, ref in zip(got, expected, strict=True):
        assert torch.isfinite(g).all()
        assert (g - ref).abs().max().item() < 1e-4
    # step 1: two fresh prompts (all dense); step 2: decode + cached chunk on unified, fresh chunk dense
    # (2 layers each); step 3: decodes only
    assert [(p.first_req, p.lens) for p in calls] == [(0, (7, 5))] * 2 + [(2, (5,))] * 2


# ---------------------------------------------------------------------------------------------- CUDA


@pytest.mark.parametrize("kernel", ["triton", "flash", "sdpa"])
@pytest.mark.parametrize("shape", [(32, 8, 128), (14, 2, 64)])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dense_kernels_match_reference(kernel, shape):
    heads, kv_heads, dim = shape
    out, ref = _dense_case(
        kernel, "cuda", torch.bfloat16, heads, kv_heads, dim, lens=(300, 17, 1, 1024, 129), before=40
    )
    assert out[:40].isnan().all()
    assert not out[40:].isnan().any()
    assert (out[40:].float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("mode", [{"enforce_eager": True}, {"mixed_capture_mode": "breakable"}])
@pytest.mark.parametrize("setting", ["triton", "flash"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runner_dense_prefill_matches_unified(monkeypatch, setting, mode):
    """bf16 runners, eager or with breakable mixed graphs (the dense kernel runs in the eager break; "full"
    mixed graphs keep attention inside and never split): logits with prefill_attention=triton / flash within
    3% of max |logit| of the unified-only runner's, and the dense kernel ran."""
    import graphcache.model.attention as attention_mod
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import cpu_settings, gqa_checkpoint

    path = gqa_checkpoint()
    calls = []
    real = attention_mod.dense_prefill_attention
    monkeypatch.setattr(attention_mod, "dense_prefill_attention", lambda *a: calls.append(a[4]) or real(*a))
    got = {}
    for value in ("unified", setting):
        runner = ModelRunner(
            cpu_settings(
                path,
                device="cuda",
                dtype="bfloat16",
                block_size=16,
                attention_backend="triton",
                decode_attention_backend="varlen",
                prefill_attention=value,
                **mode,
            )
        )
        assert runner._planner.prefill_kernel == ("" if value == "unified" else setting)
        got[value] = _mixed_steps(runner)
    assert calls and all(p.kernel == setting for p in calls)
    for dense, unified in zip(got[setting], got["unified"], strict=True):
        dense, unified = dense.float(), unified.float()
        assert torch.isfinite(dense).all()
        assert (dense - unified).abs().max().item() <= 0.03 * unified.abs().max().item()
