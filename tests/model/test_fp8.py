"""FP8 serving on the CPU: checkpoints in the layouts published FP8 models use (compressed-tensors and the
vLLM/HF `fp8` config, tests/helpers_fp8.py writes them from a bf16 checkpoint) and `--quantization fp8`
load through the real loader; the FP8 model's logits stay within a stated bound of the bf16 source's.

The CPU runs the same quantized operands as a GPU (activations per token past 16 rows and unquantized up
to 16, weights per row, tensor or block), multiplied in fp32 instead of on FP8 tensor cores
(model/fp8_linear.py).

Error bound, per position of a 48-token prompt through a 4-layer, hidden-128 random Llama, FP8 against
its bf16 source (both computed in fp32, so only the FP8 rounding differs; logits have std ~1):
  relative L2 error of a position's logits  |l_fp8 - l_bf16| / |l_bf16|:  max < 0.2, mean < 0.12
  greedy (top-1) agreement over the positions                              >= 0.8
Measured: mean 0.077-0.084, max 0.113-0.117, agreement 0.90-0.94 over the layouts. FP8 E4M3 keeps 3
mantissa bits (a rounding error up to 1/16 of each weight and activation); random weights have no
outliers to protect and no structure to average it out, so this is a ceiling for trained models' error.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import torch
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine, SamplingParams
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from graphcache.metrics import Metrics
from graphcache.model.config import ModelLoadError
from graphcache.model.fp8_gemm import (
    WEIGHT_ONLY_MAX_ROWS,
    RopeArgs,
    _launch_gemm,
    emulated_mm,
    folds_rope,
    weight_only_mm,
    weight_only_qkv_rope,
    weight_only_silu_mul,
)
from graphcache.model.fp8_linear import Fp8Linear, fp8_kernel_variant, fp8_layouts
from graphcache.model.fp8_quant import (
    FP8,
    MIN_SCALE,
    _quantize_torch,
    _quantize_triton,
    quantize_rows,
    quantize_weight,
)
from graphcache.model.fused_ops import rotary_cache_, silu_mul
from graphcache.model.loader import load_model
from graphcache.model.parallel import TensorParallel
from helpers_dist import gloo_group, run_ranks
from helpers_fp8 import bf16_copy, write_fp8_checkpoint
from helpers_model import Blocks, cpu_settings, prompt_ids, tiny_checkpoint
from safetensors.torch import load_file, save_file

SHAPE = dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384)
REL_MAX, REL_MEAN, AGREE = 0.2, 0.12, 0.8
PROMPT = prompt_ids(48, seed=1)
LAYOUTS = {  # name -> write_fp8_checkpoint kwargs
    "ct-channel": dict(layout="compressed-tensors", strategy="channel"),
    "ct-tensor": dict(layout="compressed-tensors", strategy="tensor"),
    "ct-block": dict(layout="compressed-tensors", strategy="block", block=(32, 32)),
    "fp8-tensor": dict(layout="fp8", strategy="tensor"),
    "fp8-block": dict(layout="fp8", strategy="block", block=(32, 32)),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8")


@pytest.fixture(scope="module")
def bf16(root):
    return bf16_copy(tiny_checkpoint("llama", **SHAPE), root / "bf16")


@pytest.fixture(scope="module")
def checkpoints(root, bf16):
    return {name: write_fp8_checkpoint(bf16, root / name, **kw) for name, kw in LAYOUTS.items()}


def prompt_logits(path, ids=PROMPT, **settings) -> torch.Tensor:
    """[len(ids), V] fp32 logits of every position, one eager prefill."""
    runner = ModelRunner(cpu_settings(path, **settings))
    table = Blocks(runner.block_size).table(len(ids))
    result = runner.execute(StepPlan.standalone([StepSeq(list(ids), 0, table, True, prompt_logits=True)]))
    return result.prompt_logits.float()


@pytest.fixture(scope="module")
def reference(bf16):
    return prompt_logits(bf16)


def assert_within_bound(logits: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    rel = (logits - ref).norm(dim=-1) / ref.norm(dim=-1)
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert rel.max() < REL_MAX and rel.mean() < REL_MEAN, (
        f"{what}: relative error {rel.mean():.3f} / {rel.max():.3f}"
    )
    assert agree >= AGREE, f"{what}: top-1 agreement {agree:.2f}"
    assert rel.mean() > 1e-3, f"{what}: no FP8 rounding at all (did the layers stay 16-bit?)"


# --- the quantization rule ----------------------------------------------------------------------------------


def test_quantize_rows_maps_each_rows_amax_to_448():
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [[0.01], [1], [100], [3], [0], [7]]
    )
    xq, scale = quantize_rows(x)
    assert xq.dtype == FP8 and scale.shape == (6, 1) and scale.dtype == torch.float32
    amax = x.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(scale[amax > 0], (amax / 448)[amax > 0], rtol=0, atol=0)
    assert scale[4].item() == pytest.approx(MIN_SCALE) and (xq[4].float() == 0).all()  # a zero row
    deq = xq.float() * scale
    assert (deq.abs().amax(dim=1) == amax.squeeze(1)).all()  # the largest entry is exact (448 * scale)
    assert ((deq - x).abs() <= x.abs() / 16 + scale * 2**-9).all()  # within half an E4M3 step


def _interpreter_rounding_slip(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where Triton's interpreter (the CPU test path) rounds a float to fp8 unlike the hardware: without
    carrying into the next exponent (it returns half of the power of two the cast gives), or one step
    off among subnormals (|x| < 2^-6, steps of 2^-9). The GPU test (tests/gpu/test_fp8_cuda.py) compares
    the compiled kernel bit for bit."""
    w, g = want.float().abs(), got.float().abs()
    carry = (w == 2 ** torch.log2(w).round()) & (g == w / 2)
    subnormal = (w < 2**-6) & ((g - w).abs() == 2**-9)
    return carry | subnormal


@pytest.mark.parametrize("rows,k,group", [(5, 96, 96), (3, 10000, 10000), (4, 512, 128)])
def test_triton_quantization_computes_the_torch_numbers(rows, k, group):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 3
    x[1] = 0
    got_q, got_s = _quantize_triton(x, group)
    want_q, want_s = _quantize_torch(x, group)
    assert got_s.shape == want_s.shape and torch.equal(got_s, want_s)
    differ = got_q.view(torch.uint8) != want_q.view(torch.uint8)
    assert differ.float().mean() < 0.05
    assert _interpreter_rounding_slip(got_q[differ], want_q[differ]).all()


def test_fp8_linear_multiplies_the_quantized_operands():
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=gen) / 8)
        linear.bias.copy_(torch.randn(48, generator=gen))
    fp8 = Fp8Linear.quantized(linear)
    for x in (
        torch.randn(WEIGHT_ONLY_MAX_ROWS + 4, 64, generator=gen),
        torch.randn(WEIGHT_ONLY_MAX_ROWS + 1, 64, generator=gen) * 50,
    ):  # two different inputs, past the decode sizes: x quantized per token (W8A8)
        xq, sa = quantize_rows(x)
        want = (xq.float() * sa) @ fp8.dequantized_weight().t() + linear.bias
        got = fp8(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        exact = linear(x)
        assert ((got - exact).norm() / exact.norm()).item() < 0.08


def test_fp8_linear_leaves_decode_sized_inputs_unquantized():
    """Up to WEIGHT_ONLY_MAX_ROWS rows x is multiplied as it is by the dequantized W (what the GPU's
    weight-only decode kernel computes), on every device."""
    gen = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(64, 48, bias=True)
    fp8 = Fp8Linear.quantized(linear)
    for x in (torch.randn(1, 64, generator=gen), torch.randn(WEIGHT_ONLY_MAX_ROWS, 64, generator=gen) * 50):
        want = x @ fp8.dequantized_weight().t() + linear.bias
        torch.testing.assert_close(fp8(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        exact = linear(x)
        assert ((fp8(x) - exact).norm() / exact.norm()).item() < 0.05  # W's rounding alone


def test_fp8_kernel_variants_split_steps_where_the_kernels_compile_anew():
    """A capture's warm-up key: one variant per set of step sizes that share every compiled FP8 kernel, so that
    a capture never meets a kernel that has not run (a Triton load inside a capture invalidates it)."""
    model = torch.nn.Sequential(Fp8Linear.quantized(torch.nn.Linear(64, 48)))
    rows = fp8_layouts(model)
    assert rows == frozenset({None}) and fp8_layouts(torch.nn.Linear(4, 4)) == frozenset()
    variants = {t: fp8_kernel_variant(rows, t) for t in (1, 2, 16, 17, 512)}
    assert variants[2] == variants[16] and variants[17] == variants[512]
    assert len({variants[1], variants[2], variants[17]}) == 3
    blocks = frozenset({(128, 128)})
    assert len({fp8_kernel_variant(blocks, t) for t in (1, 16, 17, 64, 65, 4096)}) == 3  # BLOCK_M 16, 64, 128
    assert fp8_kernel_variant(frozenset(), 7) == ()


@pytest.mark.parametrize("m,n,k", [(1, 200, 256), (5, 64, 384), (20, 96, 128)])
def test_block_scaled_kernel_computes_the_emulated_product(m, n, k):
    gen = torch.Generator().manual_seed(m)
    xq = (torch.randn(m, k, generator=gen) * 40).clamp(-448, 448).to(FP8)
    wq = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(FP8)
    # 128x128 block scales: [T, K / 128] token-major, [ceil(N / 128), K / 128]
    sa = torch.rand(k // 128, m, generator=gen).t() + 0.1
    sw = torch.rand(-(-n // 128), k // 128, generator=gen) + 0.1
    want = emulated_mm(xq, wq, sa, sw, torch.float32, (128, 128))
    got = _launch_gemm(xq, wq, sa, sw, (128, 128), torch.float32)  # the kernel, interpreted on the CPU
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize(
    "m,n,k", [(1, 200, 256), (1, 72, 2048), (16, 96, 640), (16, 96, 512)]
)  # ragged and even K
def test_weight_only_kernel_multiplies_x_by_the_dequantized_weight(m, n, k):
    # fp16 x: Triton's interpreter (this CPU path) multiplies bf16 wrongly; the GPU test runs bf16.
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m).unsqueeze(1)).half()
    wq, sw = quantize_weight(torch.randn(n, k, generator=gen))
    want = weight_only_mm(x, wq, sw, torch.float32, kernel=False)  # the fp32 product
    got = _launch_gemm(x, wq, None, sw, None, torch.float32)  # the kernel, interpreted on the CPU
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("m,inter,k", [(1, 100, 256), (1, 36, 1024), (5, 48, 384), (5, 48, 512)])
def test_gated_weight_only_kernel_is_silu_mul_of_the_product(m, inter, k):
    """The gate_up GEMM with silu(gate) * up in its epilogue (one row: multiply-adds; more: the MMA path)
    equals silu_mul of the plain kernel's [T, 2I] output, each factor rounded to x's dtype."""
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(m, k, generator=gen) * 3).half()  # fp16: the interpreter's bf16 products are wrong
    wq, sw = quantize_weight(torch.randn(2 * inter, k, generator=gen))
    plain = _launch_gemm(x, wq, None, sw, None, torch.float16)  # [T, 2I], the kernel interpreted
    want = silu_mul(plain, inter, fused=False)
    got = _launch_gemm(x, wq, None, sw, None, torch.float16, gated=True)
    assert got.shape == (m, inter)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    cpu = weight_only_silu_mul(x, wq, sw, torch.float16)  # the CPU path: the fp32 product, then silu_mul
    torch.testing.assert_close(cpu, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def _rope_case(heads: int, kv_heads: int, d: int, k: int, seed: int):
    """One token's qkv operands, a rotary table and NaN-poisoned caches [2, slots, K, D]: fp16 (the
    interpreter's bf16 products are wrong; the GPU test runs bf16)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=gen) * 2).half()
    wq, sw = quantize_weight(torch.randn((heads + 2 * kv_heads) * d, k, generator=gen))
    angles = torch.outer(torch.arange(64.0), torch.rand(d // 2, generator=gen) * 3)
    emb = torch.cat([angles, angles], dim=-1)
    caches = torch.full((2, 9, kv_heads, d), float("nan"), dtype=torch.float16)
    rope = RopeArgs(
        torch.tensor([37]), emb.cos().half(), emb.sin().half(), torch.tensor([5]), caches[0], caches[1],
        heads, kv_heads, d,
    )  # fmt: skip
    return x, wq, sw, rope, caches


@pytest.mark.parametrize("heads,kv_heads,d,k", [(4, 2, 16, 256), (6, 2, 8, 512), (2, 2, 32, 256)])
def test_qkv_kernel_rotates_and_writes_the_cache_as_the_two_steps_do(heads, kv_heads, d, k):
    """The one-token qkv GEMM with rotary and the KV write in its epilogue (ROPE) leaves what the plain
    GEMM, then rotary_cache_, leave: q and k rotated in its output, k and v in the token's slot, every
    other slot untouched (still NaN)."""
    x, wq, sw, rope, caches = _rope_case(heads, kv_heads, d, k, seed=d + k)
    assert folds_rope(x, wq, rope, kernel=True) is False  # the CPU takes the two steps in production
    got = weight_only_qkv_rope(x, wq, sw, torch.float16, rope)  # the kernel, interpreted on the CPU
    got_caches = caches.clone()
    caches.fill_(float("nan"))
    plain = _launch_gemm(x, wq, None, sw, None, torch.float16)  # the plain one-row kernel, interpreted
    q, kk, v = plain.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, kk, v = q.view(1, heads, d), kk.view(1, kv_heads, d), v.view(1, kv_heads, d)
    q, kk = rotary_cache_(q, kk, v, rope.cos, rope.sin, rope.positions, rope.slot_mapping, *caches, False)
    want = torch.cat([q.flatten(), kk.flatten(), v.flatten()]).view(1, -1)
    tol = dict(rtol=2e-3, atol=2e-3 * want.abs().max().item())
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_caches[:, 5], caches[:, 5], **tol)
    assert got_caches[:, [s for s in range(9) if s != 5]].isnan().all()


def test_fp8_mlp_applies_silu_mul_like_the_unfused_layers():
    """Fp8Linear.silu_mul_forward is silu_mul(layer(x)) at decode sizes and beyond them."""
    gen = torch.Generator().manual_seed(5)
    fp8 = Fp8Linear.quantized(torch.nn.Linear(64, 96, bias=False))
    for x in (torch.randn(1, 64, generator=gen), torch.randn(WEIGHT_ONLY_MAX_ROWS + 3, 64, generator=gen)):
        torch.testing.assert_close(fp8.silu_mul_forward(x, 48), silu_mul(fp8(x), 48, fused=False))


# --- loading what was published -------------------------------------------------------------------------------


def _parts(layer: int, q: int, kv: int, inter: int) -> dict[str, tuple[str, int, int]]:
    """HF projection -> (our fused module, first row, rows)."""
    p, ours = f"model.layers.{layer}.", f"layers.{layer}."
    return {
        p + "self_attn.q_proj": (ours + "attn.qkv_proj", 0, q),
        p + "self_attn.k_proj": (ours + "attn.qkv_proj", q, kv),
        p + "self_attn.v_proj": (ours + "attn.qkv_proj", q + kv, kv),
        p + "self_attn.o_proj": (ours + "attn.o_proj", 0, -1),
        p + "mlp.gate_proj": (ours + "mlp.gate_up_proj", 0, inter),
        p + "mlp.up_proj": (ours + "mlp.gate_up_proj", inter, inter),
        p + "mlp.down_proj": (ours + "mlp.down_proj", 0, -1),
    }


def _checkpoint_weight(tensors: dict, hf: str, block: tuple[int, int] | None) -> torch.Tensor:
    w = tensors[hf + ".weight"].float()
    scale = tensors.get(hf + ".weight_scale", tensors.get(hf + ".weight_scale_inv")).float()
    if block is None:
        return w * scale.reshape(-1, 1)  # [N, 1] or one number
    s = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return w * s[: w.shape[0], : w.shape[1]]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loaded_layers_hold_the_checkpoints_weights_and_scales(checkpoints, name):
    """Every fused part's rows of weight x scale are the checkpoint's, exactly (scales expanded, blocks placed)."""
    model, cfg = load_model(checkpoints[name], "float32", "cpu")
    tensors = load_file(checkpoints[name] / "model.safetensors")
    block = LAYOUTS[name].get("block") if LAYOUTS[name]["strategy"] == "block" else None
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for layer in range(cfg.num_layers):
        for hf, (module, start, rows) in _parts(layer, q, kv, cfg.intermediate_size).items():
            fp8 = model.get_submodule(module)
            assert isinstance(fp8, Fp8Linear) and fp8.block == block
            got = fp8.dequantized_weight()
            got = got if rows < 0 else got[start : start + rows]
            assert torch.equal(got, _checkpoint_weight(tensors, hf, block)), f"{name}: {hf}"
    assert model.lm_head.weight.dtype == torch.float32  # the LM head (ignored) stays 16-bit
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"].float())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_checkpoint_logits_within_the_bound_of_its_bf16_source(checkpoints, reference, name):
    assert_within_bound(prompt_logits(checkpoints[name]), reference, name)


def test_quantize_on_load_is_within_the_bound_and_equals_the_channel_checkpoint(bf16, checkpoints, reference):
    on_load = prompt_logits(bf16, quantization="fp8")
    assert_within_bound(on_load, reference, "--quantization fp8")
    # The same rule (per-row amax / 448) written by llm-compressor's layout: the very same numbers.
    assert torch.equal(on_load, prompt_logits(checkpoints["ct-channel"]))
    # --quantization fp8 on an FP8 checkpoint serves the checkpoint as it is.
    assert torch.equal(
        prompt_logits(checkpoints["ct-tensor"], quantization="fp8"), prompt_logits(checkpoints["ct-tensor"])
    )


def test_static_and_weight_only_checkpoints_serve_with_per_token_activation_scales(
    root, bf16, checkpoints, caplog
):
    static = write_fp8_checkpoint(bf16, root / "static", strategy="tensor", static_activations=True)
    weight_only = write_fp8_checkpoint(bf16, root / "w8a16", strategy="tensor", activations=False)
    fp8_static = write_fp8_checkpoint(
        bf16, root / "fp8-static", layout="fp8", strategy="tensor", static_activations=True
    )
    want = prompt_logits(checkpoints["ct-tensor"])
    with caplog.at_level(logging.WARNING, logger="graphcache.model.loader"):
        for path in (static, weight_only, fp8_static):
            assert torch.equal(prompt_logits(path), want), path.name
    assert "input_scale" not in caplog.text  # read by no layer, and not warned about either


def test_calibrated_kv_cache_scales_are_named_when_an_fp8_cache_cannot_apply_them(root, bf16, caplog):
    """A checkpoint with llm-compressor's kv_cache_scheme carries k_scale / v_scale per attention layer. The FP8
    cache stores K and V with a scale of 1, so it says so (as vLLM warns of its scale 1.0); a 16-bit cache
    has nothing to scale and stays quiet, as the loader is about these tensors."""
    path = write_fp8_checkpoint(bf16, root / "kv-scales", strategy="tensor")
    for file in path.glob("*.safetensors"):
        tensors = load_file(file)
        for name in [n for n in tensors if n.endswith("self_attn.k_proj.weight")]:
            attn = name.removesuffix("k_proj.weight")
            tensors[attn + "k_scale"], tensors[attn + "v_scale"] = torch.tensor(0.05), torch.tensor(0.04)
        save_file(tensors, file, {"format": "pt"})
    loggers = ("graphcache.engine.worker.runner", "graphcache.model.loader")
    with caplog.at_level(logging.WARNING):
        ModelRunner(cpu_settings(path))
    assert not [r for r in caplog.records if r.name in loggers], caplog.text
    with caplog.at_level(logging.WARNING):
        ModelRunner(cpu_settings(path, kv_cache_dtype="fp8"))
    warned = [r.getMessage() for r in caplog.records if r.name == "graphcache.engine.worker.runner"]
    assert len(warned) == 1 and "KV-cache scales (8 tensors such as model.layers." in warned[0], warned
    assert "kv_cache_dtype=auto" in warned[0]


def test_engine_generates_with_an_fp8_checkpoint(checkpoints, tmp_path):
    """Greedy generation through the whole engine: the same tokens alone and batched (per-token scales keep
    rows independent), and mostly the bf16 model's tokens."""
    settings = cpu_settings(
        checkpoints["ct-channel"], cache_dir=tmp_path, max_num_batched_tokens=64, max_model_len=128
    )
    engine = Engine(settings, Metrics(), runner_factory=ModelRunner)
    engine.start()
    assert engine.wait_ready(120), engine.error
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [prompt_ids(n, seed=20 + n) for n in (5, 9, 14, 20)]

    async def collect(rid, prompt):
        ids = []
        async for out in engine.generate(rid, prompt, params):
            ids += out.token_ids
        return ids

    async def run():
        alone = [await collect(f"a{i}", p) for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(collect(f"b{i}", p) for i, p in enumerate(prompts)))
        return alone, together

    try:
        alone, together = asyncio.run(run())
    finally:
        engine.shutdown()
    assert all(len(ids) == 12 for ids in alone)
    assert list(together) == alone


# --- what is refused, in one line -----------------------------------------------------------------------------

REFUSED = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "ct-int8": None,  # compressed-tensors W8A8 int8
    "ct-w4a16": None,  # compressed-tensors pack-quantized int4
    "fp8-e5m2": {"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"},
}


def _ct_variant(name: str) -> dict:
    from helpers_fp8 import _compressed_tensors_config

    cfg = _compressed_tensors_config("channel", (128, 128), False, True, ("lm_head",))
    group = cfg["config_groups"]["group_0"]
    if name == "ct-int8":
        cfg["format"] = "int-quantized"
        group["weights"]["type"] = group["input_activations"]["type"] = "int"
    else:
        cfg["format"] = "pack-quantized"
        group["weights"].update(num_bits=4, type="int", strategy="group", group_size=128)
        group["input_activations"] = None
    return cfg


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_quantization_is_a_one_line_startup_error(root, bf16, name):
    qc = REFUSED[name] or _ct_variant(name)
    path = write_fp8_checkpoint(bf16, root / f"refused-{name}", quantization_config=qc)
    with pytest.raises(ModelLoadError) as e:
        load_model(path, "float32", "cpu")
    message = str(e.value)
    assert (
        "\n" not in message and "supported: quant_method fp8" in message and "--quantization fp8" in message
    )
    assert (qc.get("quant_method") if name in ("awq", "gptq", "bitsandbytes") else "") in message


def test_serve_refuses_an_unsupported_method_before_loading(root, bf16):
    """`graphcache serve`'s startup check (cli.check_model_dir) says it in one line, exit 2, nothing loaded."""
    from graphcache.cli import StartupError, check_model_dir

    path = write_fp8_checkpoint(bf16, root / "refused-at-start", quantization_config=REFUSED["gptq"])
    with pytest.raises(StartupError, match="quant_method 'gptq'; supported: quant_method fp8") as e:
        check_model_dir(path, None)
    assert "\n" not in str(e.value)
    check_model_dir(write_fp8_checkpoint(bf16, root / "accepted-at-start"), None)


def test_a_config_that_disagrees_with_the_weights_names_both(root, bf16):
    """quantization_config says FP8 but the projections are bf16 (or the ignore list splits a fused layer)."""
    lying = root / "lying"
    write_fp8_checkpoint(bf16, lying, strategy="channel")
    bf16_tensors = load_file(bf16 / "model.safetensors")
    from safetensors.torch import save_file

    save_file(bf16_tensors, str(lying / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ModelLoadError, match="disagree"):
        load_model(lying, "float32", "cpu")
    split = write_fp8_checkpoint(bf16, root / "split", ignore=("lm_head", "model.layers.0.self_attn.k_proj"))
    with pytest.raises(ModelLoadError, match="not all FP8"):
        load_model(split, "float32", "cpu")


def test_fp8_weights_without_a_quantization_config_are_refused(root, checkpoints):
    """E.g. ModelOpt's checkpoints, whose scheme is in hf_quant_config.json rather than config.json."""
    path = root / "no-config"
    write_fp8_checkpoint(checkpoints["ct-channel"].parent / "bf16", path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="no quantization_config"):
        load_model(path, "float32", "cpu")


def test_ignored_layers_stay_16_bit(root, bf16):
    path = write_fp8_checkpoint(bf16, root / "ignore-down", ignore=("lm_head", "re:.*down_proj$"))
    model, _ = load_model(path, "float32", "cpu")
    assert isinstance(model.layers[0].mlp.gate_up_proj, Fp8Linear)
    assert not isinstance(model.layers[0].mlp.down_proj, Fp8Linear)
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.float32


def test_quantization_setting(monkeypatch):
    assert Settings().model.quantization == "auto"
    monkeypatch.setenv("GRAPHCACHE_QUANTIZATION", "fp8")
    assert Settings().model.quantization == "fp8"
    with pytest.raises(ValueError, match="auto.*fp8"):
        Settings(quantization="awq")


# --- tensor parallel ---------------------------------------------------------------------------------------------

TP_LAYOUTS = ("ct-channel", "ct-tensor", "fp8-block")
TP_PROMPTS = (prompt_ids(7, seed=1), prompt_ids(5, seed=2))


def _last_logits(runner: ModelRunner) -> torch.Tensor:
    """[2, V] fp32: the last position's logits of two prompts prefilled together."""
    seqs = [StepSeq(list(p), 0, [2 * i, 2 * i + 1], True) for i, p in enumerate(TP_PROMPTS)]
    return runner.execute(StepPlan.standalone(seqs)).logits.float().clone()


def _tp_rank(rank: int, world: int, port: int, paths: list[str], out_dir: str) -> None:
    with gloo_group(rank, world, port):
        tp = TensorParallel.from_group()
        out = {}
        for path in paths:
            runner = ModelRunner(cpu_settings(path, tensor_parallel_size=world, enforce_eager=True), tp=tp)
            layers = {
                n: m.dequantized_weight() for n, m in runner.model.named_modules() if isinstance(m, Fp8Linear)
            }
            out[path] = (layers, _last_logits(runner))
        torch.save(out, f"{out_dir}/rank{rank}.pt")


def _rank_rows(full: torch.Tensor, parts: list[int], rank: int, world: int) -> torch.Tensor:
    """Rank's rows of each fused part (column parallel): [q | k | v] -> [q_r | k_r | v_r]."""
    chunks, start = [], 0
    for rows in parts:
        per = rows // world
        chunks.append(full[start + rank * per : start + (rank + 1) * per])
        start += rows
    return torch.cat(chunks)


def test_tensor_parallel_ranks_hold_their_shards_of_the_fp8_layers(checkpoints, reference, tmp_path):
    """2 gloo ranks: each Fp8Linear holds exactly its rows (q/k/v, gate/up) or columns (o, down) of the
    unsharded layer's weight x scales; the logits stay within the bound (a row-parallel layer quantizes
    its rank's share of the activations with its own per-token scale, so not bit-equal to 1 rank)."""
    paths = [str(checkpoints[name]) for name in TP_LAYOUTS]
    run_ranks(_tp_rank, 2, paths, str(tmp_path))
    for path in paths:
        whole = ModelRunner(cpu_settings(path, enforce_eager=True))
        cfg = whole.model_config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        want_logits = _last_logits(whole)
        for rank in range(2):
            layers, logits = torch.load(tmp_path / f"rank{rank}.pt")[path]
            for name, w in layers.items():
                full = whole.model.get_submodule(name).dequantized_weight()
                if name.endswith("qkv_proj"):
                    want = _rank_rows(full, [q, kv, kv], rank, 2)
                elif name.endswith("gate_up_proj"):
                    want = _rank_rows(full, [inter, inter], rank, 2)
                else:  # row parallel: this rank's input columns
                    per = full.shape[1] // 2
                    want = full[:, rank * per : (rank + 1) * per]
                assert torch.equal(w, want), f"{path} rank {rank} {name}"
            rel = (logits - want_logits).norm(dim=-1) / want_logits.norm(dim=-1)
            assert rel.max() < REL_MAX / 2, f"{path} rank {rank}: {rel}"


# --- the benchmark the GPU run uses -------------------------------------------------------------------------------


@pytest.mark.slow
def test_fp8_bench_smoke(tmp_path):
    """benchmarks/fp8_bench.py end to end on the CPU (tiny model): the H200 run (scripts/gpu_check.sh fp8)
    breaks here first."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import fp8_bench

    for kv in ("auto", "fp8"):  # the FP8 run with the model's KV cache, then with an FP8 one
        out = tmp_path / f"fp8_{kv}.json"
        assert fp8_bench.main(["--smoke", "--kv-cache-dtype", kv, "--out", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["fp8_kv_cache_dtype"] == kv
        assert [r["batch"] for r in report["decode"]] == [1, 4]
        assert 0 < report["logits"]["rel_error_mean"] < REL_MEAN
        assert report["greedy"]["sequences"] == 2
