"""FP8 on a real GPU (compute capability 8.9+; the lent H200): the kernels compute what the CPU emulation
computes, and an FP8 model's logits through graph replay equal its eager logits.
Run: pytest -m cuda tests/gpu/test_fp8_cuda.py

- The Triton activation quantization equals the torch ops bit for bit (scales and FP8 bytes).
- fp8_mm (torch._scaled_mm) and the block-scaled Triton GEMM equal fp8_gemm.emulated_mm, and the
  weight-only decode kernel (<= WEIGHT_ONLY_MAX_ROWS rows) its fp32 fallback, on the same operands within
  one bf16 rounding of the output (rtol 1e-2), for two different inputs each, with the allocator's free
  memory poisoned with NaN before each call (an output the kernel did not write would show).
- Graph replay vs eager runner, decode batches on both GEMM paths, for a compressed-tensors
  checkpoint, a 128x128 block checkpoint and --quantization fp8: the bf16 tolerance of
  tests/gpu/test_runner_cuda.py (3% of the largest logit; argmax equal where the top-2 gap is clear).
"""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from graphcache.model import fp8_gemm
from graphcache.model.fp8_gemm import (
    RopeArgs,
    block_scaled_mm,
    emulated_mm,
    folds_rope,
    weight_only_mm,
    weight_only_qkv_rope,
    weight_only_silu_mul,
)
from graphcache.model.fp8_linear import Fp8Linear, fp8_mm
from graphcache.model.fp8_quant import FP8, quantize_groups, quantize_rows, quantize_weight
from graphcache.model.fused_ops import rotary_cache_, silu_mul
from helpers_cuda import assert_decode_replays_match, assert_replay_close, poison_allocator
from helpers_fp8 import bf16_copy, write_fp8_checkpoint
from helpers_model import Blocks, cuda_settings, prompt_ids, tiny_checkpoint

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize(
    "rows,k,group", [(1, 4096, 4096), (7, 14336, 14336), (33, 1024, 1024), (5, 4096, 128)]
)
def test_quantization_kernel_is_bit_exact(rows, k, group):
    x = (torch.randn(rows, k, device="cuda") * 3).bfloat16()
    x[0, :17] = 0  # zeros, and (rows > 1) a whole zero row
    if rows > 1:
        x[1] = 0
    want_q, want_s = quantize_groups(x, group, fused=False)
    poison_allocator()
    got_q, got_s = quantize_groups(x, group, fused=True)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 5, 17, 64, 300])
def test_fp8_mm_equals_the_emulation(m):
    n, k = 768, 1024
    w = torch.randn(n, k, device="cuda") / 30
    wq, sw = quantize_weight(w)
    for seed in (0, 1):  # two different inputs
        torch.manual_seed(seed)
        x = (torch.randn(m, k, device="cuda") * (1 + 10 * seed)).bfloat16()
        xq, sa = quantize_rows(x, fused=True)
        poison_allocator()
        got = fp8_mm(xq, wq, sa, sw, torch.bfloat16)
        want = emulated_mm(xq, wq, sa, sw, torch.bfloat16)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("m", [1, 4, 16])
def test_weight_only_kernel_equals_the_fp32_product(m):
    """The decode GEMM (x unquantized, W widened in registers) at the 8B down_proj shape, bf16 and fp16."""
    assert fp8_gemm.WEIGHT_ONLY_MAX_ROWS == 16
    n, k = 4096, 14336
    wq, sw = quantize_weight(torch.randn(n, k, device="cuda") / 100)
    for seed, dtype in ((0, torch.bfloat16), (1, torch.float16)):
        torch.manual_seed(seed)
        x = (torch.randn(m, k, device="cuda") * (1 + 10 * seed)).to(dtype)
        want = weight_only_mm(x, wq, sw, torch.float32, kernel=False)
        poison_allocator()
        got = weight_only_mm(x, wq, sw, dtype)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("m", [1, 4, 16])
def test_gated_weight_only_kernel_equals_silu_mul_of_the_product(m):
    """The gate_up GEMM with the activation in its epilogue at the 8B shape: silu_mul of the plain kernel."""
    inter, k = 14336, 4096
    wq, sw = quantize_weight(torch.randn(2 * inter, k, device="cuda") / 100)
    for seed in (0, 1):
        torch.manual_seed(seed)
        x = (torch.randn(m, k, device="cuda") * (1 + 10 * seed)).bfloat16()
        want = silu_mul(weight_only_mm(x, wq, sw, torch.bfloat16), inter, fused=True)
        poison_allocator()
        got = weight_only_silu_mul(x, wq, sw, torch.bfloat16)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_qkv_kernel_with_rotary_equals_the_gemm_then_rotary_cache():
    """The one-token qkv GEMM with rotary and the KV write in its epilogue, at the 8B shape (32 / 8 heads of
    128), bf16, against the plain one-row GEMM then fused_ops.rotary_cache_: the same output (q, k rotated),
    the same k and v in the token's slot, every other slot still NaN."""
    heads, kv_heads, d, k = 32, 8, 128, 4096
    wq, sw = quantize_weight(torch.randn((heads + 2 * kv_heads) * d, k, device="cuda") / 100)
    angles = torch.outer(torch.arange(4096.0, device="cuda"), torch.rand(d // 2, device="cuda"))
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    for seed, (pos, slot) in enumerate(((3, 11), (4000, 0))):
        torch.manual_seed(seed)
        x = (torch.randn(1, k, device="cuda") * (1 + 10 * seed)).bfloat16()
        caches = torch.full((2, 64, kv_heads, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        want_caches = caches.clone()
        positions = torch.tensor([pos], device="cuda")
        slots = torch.tensor([slot], device="cuda")
        plain = weight_only_mm(x, wq, sw, torch.bfloat16)
        q, kk, v = (t.view(1, -1, d) for t in plain.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
        rotary_cache_(q, kk, v, cos, sin, positions, slots, want_caches[0], want_caches[1], True)  # in place
        rope = RopeArgs(positions, cos, sin, slots, caches[0], caches[1], heads, kv_heads, d)
        assert folds_rope(x, wq, rope)
        poison_allocator()
        got = weight_only_qkv_rope(x, wq, sw, torch.bfloat16, rope)
        assert torch.isfinite(got).all()
        tol = dict(rtol=1e-2, atol=1e-2 * plain.abs().max().item())
        torch.testing.assert_close(got, plain, **tol)
        torch.testing.assert_close(caches[:, slot], want_caches[:, slot], **tol)
        assert caches[:, [s for s in range(64) if s != slot]].isnan().all()


def test_one_token_decode_with_rotary_in_the_gemm_equals_the_two_kernels(checkpoints, monkeypatch):
    """At one row the FP8 model rotates q and k and writes the cache inside the qkv GEMM; its logits, step
    after step (so each step reads the KV the fold wrote), equal those of the same model with the fold off
    (fp8_gemm.ROPE_IN_GEMM), within the replay tolerance."""
    path, kw = checkpoints["ct-channel"]
    calls, kernel = [], fp8_gemm.weight_only_qkv_rope
    monkeypatch.setattr(fp8_gemm, "weight_only_qkv_rope", lambda *args: calls.append(1) or kernel(*args))
    fold = ModelRunner(_settings(path, enforce_eager=True, **kw))
    two = ModelRunner(_settings(path, enforce_eager=True, **kw))
    blocks, prompt = Blocks(16), prompt_ids(9, seed=7)
    table = blocks.table(len(prompt) + 8)
    fold.execute(StepPlan.standalone([StepSeq(list(prompt), 0, table, True)]))
    tokens = [
        *prompt,
        int(two.execute(StepPlan.standalone([StepSeq(list(prompt), 0, table, True)])).logits[0].argmax()),
    ]
    for step in range(5):
        seq = [StepSeq([tokens[-1]], len(tokens) - 1, table, True)]
        monkeypatch.setattr(fp8_gemm, "ROPE_IN_GEMM", True)
        got = fold.execute(StepPlan.standalone(seq)).logits.clone()
        monkeypatch.setattr(fp8_gemm, "ROPE_IN_GEMM", False)
        want = two.execute(StepPlan.standalone(seq)).logits
        assert_replay_close(got, want, f"decode step {step}")
        tokens.append(int(want[0].argmax()))
    assert len(calls) == 5 * len(fold.model.layers)  # the fold ran: once a layer a step, for `fold` only


@pytest.mark.parametrize("m", [1, 9, 100])
def test_block_scaled_gemm_equals_the_emulation(m):
    n, k = 640, 1024
    wq = (torch.randn(n, k, device="cuda") * 40).clamp(-448, 448).to(FP8)
    sw = torch.rand(n // 128, k // 128, device="cuda") / 100
    for seed in (0, 1):
        torch.manual_seed(seed)
        xq, sa = quantize_groups((torch.randn(m, k, device="cuda") * (1 + seed)).bfloat16(), 128, fused=True)
        poison_allocator()
        got = block_scaled_mm(xq, wq, sa, sw, (128, 128), torch.bfloat16)
        want = emulated_mm(xq, wq, sa, sw, torch.bfloat16, (128, 128))
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_fp8_linear_on_cuda_equals_the_cpu_emulation():
    linear = torch.nn.Linear(512, 384, bias=True).bfloat16()
    gpu = Fp8Linear.quantized(linear.cuda())
    gpu.fused = True
    cpu = Fp8Linear.quantized(linear.cpu())
    for m in (1, 40):
        x = torch.randn(m, 512).bfloat16()
        torch.testing.assert_close(gpu(x.cuda()).float().cpu(), cpu(x).float(), rtol=1e-2, atol=2e-2)


# --- graph replay vs eager ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8cuda")
    # head_dim 128 and intermediate 512: every fused part is whole 128x128 blocks
    src = bf16_copy(
        tiny_checkpoint("llama", hidden=256, layers=4, heads=2, kv_heads=1, intermediate=512, head_dim=128),
        root / "bf16",
    )
    return {
        "ct-channel": (write_fp8_checkpoint(src, root / "ct", strategy="channel"), {}),
        "fp8-block": (write_fp8_checkpoint(src, root / "blk", layout="fp8", strategy="block"), {}),
        "on-load": (src, {"quantization": "fp8"}),
    }


def _settings(path, **kw):
    # decode batches of at most 20 rows: captures up to 32 tokens, 256-token sequences
    return cuda_settings(
        path,
        num_kv_blocks=256,
        max_model_len=256,
        capture_sizes=[1, 2, 4, 8, 16, 24, 32],
        max_capture_size=32,
        **kw,
    )


@pytest.mark.parametrize("name", ["ct-channel", "fp8-block", "on-load"])
def test_fp8_graph_replay_equals_eager(checkpoints, name):
    path, kw = checkpoints[name]
    graph = ModelRunner(_settings(path, **kw))
    eager = ModelRunner(_settings(path, enforce_eager=True, **kw))
    assert any(isinstance(m, Fp8Linear) for m in graph.model.modules())
    for num_seqs in (1, 3, 20):  # 20 rows: past WEIGHT_ONLY_MAX_ROWS, the _scaled_mm path
        assert_decode_replays_match(graph, eager, num_seqs, seed=100 * num_seqs, steps=4, what=name)
