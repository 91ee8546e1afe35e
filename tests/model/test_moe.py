"""Mixture-of-experts models (model/moe.py) against Hugging Face transformers, on the CPU, in fp32.

Tiny random Qwen3-MoE and Mixtral checkpoints written by transformers' own classes (helpers_moe.py: the
hub's weight names and config fields) load through our loader, and give HF's logits on two prompts:
prefill, decode steps through the paged cache, and both prompts batched in one step. A Qwen3-MoE with a
dense layer among the sparse ones (mlp_only_layers) and one with decoder_sparse_step 2 and unnormalized
top-k weights cover the config's layer choice and both routing variants. The engine's greedy tokens equal
HF's greedy tokens. The grouped-GEMM kernels (moe_kernel.py) run in Triton's interpreter against the
PyTorch reference, at shapes with masked edges and several alignment chunks.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine, SamplingParams
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from graphcache.metrics import Metrics
from graphcache.model.config import ModelConfig, ModelLoadError, read_config
from graphcache.model.loader import load_model
from graphcache.model.moe import SparseMoE, experts_reference, route
from helpers_model import Blocks, cpu_settings, hf_logits, prompt_ids, tiny_checkpoint
from helpers_moe import moe_checkpoint

ATOL = 1e-4
CASES = {
    "qwen3_moe": dict(arch="qwen3_moe"),  # layers sparse, dense, sparse; norm_topk_prob
    "qwen3_moe-step2": dict(
        arch="qwen3_moe", decoder_sparse_step=2, num_hidden_layers=4, mlp_only_layers=[], norm_topk_prob=False
    ),
    "mixtral": dict(arch="mixtral"),
}
PROMPTS = (prompt_ids(29, seed=1), prompt_ids(23, seed=2))


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    kw = dict(CASES[request.param])
    path = moe_checkpoint(kw.pop("arch"), **kw)
    return path, [hf_logits(path, ids) for ids in PROMPTS]


def test_config_marks_the_sparse_layers():
    assert read_config(moe_checkpoint("qwen3_moe")).moe_layers == (0, 2)  # layer 1 in mlp_only_layers
    step2 = read_config(
        moe_checkpoint("qwen3_moe", **{k: v for k, v in CASES["qwen3_moe-step2"].items() if k != "arch"})
    )
    assert step2.moe_layers == (1, 3) and not step2.norm_topk_prob
    mixtral = read_config(moe_checkpoint("mixtral"))
    assert mixtral.moe_layers == (0, 1) and mixtral.norm_topk_prob
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 48)
    model, _ = load_model(moe_checkpoint("qwen3_moe"))
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["SparseMoE", "MLP", "SparseMoE"]


def test_prefill_and_decode_match_hf(case):
    """Per prompt: prefill 17 tokens, then decode the rest one at a time: every step's logits are HF's."""
    path, refs = case
    runner = ModelRunner(cpu_settings(path))
    blocks = Blocks(runner.block_size)
    for ids, ref in zip(PROMPTS, refs, strict=True):
        table = blocks.table(len(ids))
        logits = runner.execute(StepPlan.standalone([StepSeq(ids[:17], 0, table, True)])).logits[0]
        diffs = [(logits - ref[16]).abs().max().item()]
        for pos in range(17, len(ids)):
            logits = runner.execute(StepPlan.standalone([StepSeq([ids[pos]], pos, table, True)])).logits[0]
            diffs.append((logits - ref[pos]).abs().max().item())
        assert ref.abs().max() > 0.5  # real logits, not a vacuous match
        assert max(diffs) < ATOL, diffs


def test_two_prompts_in_one_step_match_hf(case):
    """Both prompts' tokens in one step: each token is routed on its own (52 rows, all experts busy)."""
    path, refs = case
    runner = ModelRunner(cpu_settings(path))
    blocks = Blocks(runner.block_size)
    batch = StepPlan.standalone([StepSeq(list(ids), 0, blocks.table(len(ids)), True) for ids in PROMPTS])
    logits = runner.execute(batch).logits
    for row, ref in zip(logits, refs, strict=True):
        assert (row - ref[-1]).abs().max().item() < ATOL


@torch.no_grad()
def _hf_greedy(path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_engine_greedy_equals_hf(arch, tmp_path):
    path = moe_checkpoint(arch)
    settings = Settings(
        model=path,
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        warmup_decode_sizes=[],
        cache_dir=tmp_path,
    )
    engine = Engine(settings, Metrics())
    engine.start()
    try:
        assert engine.wait_ready(120), engine.error
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

        async def one(i: int, ids: list[int]) -> list[int]:
            out: list[int] = []
            async for o in engine.generate(f"g{i}", ids, params):
                out += o.token_ids
            return out

        async def both():
            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(PROMPTS)))

        got = asyncio.run(both())
    finally:
        engine.shutdown()
    assert got == [_hf_greedy(path, ids, 6) for ids in PROMPTS]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_tiny_writer_moe_matches_hf(arch):
    """make_tiny_model's MoE checkpoints (what benchmarks/model_shapes.py writes) load and match HF too."""
    path = tiny_checkpoint(arch)
    ids = PROMPTS[0]
    runner = ModelRunner(cpu_settings(path))
    logits = runner.execute(
        StepPlan.standalone([StepSeq(ids, 0, Blocks(runner.block_size).table(len(ids)), True)])
    ).logits
    assert (logits[0] - hf_logits(path, ids)[-1]).abs().max().item() < ATOL


def test_active_params_count_top_k_experts():
    model, cfg = load_model(moe_checkpoint("mixtral"))
    moe = model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    total = sum(p.numel() for p in model.layers.parameters())
    assert model.active_decoder_params() == total - cfg.num_layers * (8 - 2) * per_expert


# --- config errors name what is supported ---


def test_unsupported_architecture_lists_the_moe_ones():
    hf = json.loads((moe_checkpoint("mixtral") / "config.json").read_text())
    hf["architectures"] = ["Qwen2MoeForCausalLM"]
    with pytest.raises(ModelLoadError, match="Qwen2MoeForCausalLM.*Qwen3MoeForCausalLM, MixtralForCausalLM"):
        ModelConfig.from_hf(hf)


def test_top_k_above_expert_count_is_refused():
    hf = json.loads((moe_checkpoint("mixtral") / "config.json").read_text())
    hf["num_experts_per_tok"] = 9
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=9 of 8 experts"):
        ModelConfig.from_hf(hf)


def test_a_quantized_moe_checkpoint_is_refused_in_one_line():
    """The experts' FP8 scales are not read: such a checkpoint would load wrong, so it is refused."""
    from graphcache.model.quantization import resolve_quantization

    hf = json.loads((moe_checkpoint("qwen3_moe") / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with pytest.raises(ModelLoadError, match="quantized mixture-of-experts checkpoint .*; supported:") as e:
        resolve_quantization(ModelConfig.from_hf(hf))
    assert "\n" not in str(e.value)


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    src = moe_checkpoint("mixtral")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="experts.5.w3"):
        load_model(tmp_path)


# --- routing and the grouped GEMM (Triton interpreter on the CPU) ---


def test_routing_variants():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route(logits, 2, renormalize=False, weight_dtype=torch.float32)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, probs[:, :2])
    w, _ = route(logits, 2, renormalize=True, weight_dtype=torch.float32)
    assert torch.allclose(w, torch.softmax(logits[:, :2], -1))  # Mixtral: a softmax over the top-k logits


def _random_experts(t: int, e: int, k: int, hidden: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    w_gate_up = torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5
    w_down = torch.randn(e, hidden, inter, generator=g) / inter**0.5
    weights, ids = route(torch.randn(t, e, generator=g), k, True, torch.float32)
    return x, w_gate_up, w_down, weights, ids


@pytest.mark.parametrize(
    "t,e,k,n_per_expert",
    [(1, 8, 2, None), (600, 8, 2, None), (600, 128, 8, None), (40, 16, 4, "skewed")],
)
def test_align_matches_reference(t, e, k, n_per_expert):
    """Sorted ids, block experts and the padded count equal the PyTorch alignment (several chunks: the
    prefix sums carry across chunks and across _offsets_kernel's steps at 128 experts)."""
    pytest.importorskip("triton")
    from graphcache.model.moe_kernel import align_by_expert, align_reference

    g = torch.Generator().manual_seed(t + e)
    ids = torch.topk(torch.rand(t, e, generator=g), k).indices
    if n_per_expert == "skewed":  # most tokens on two experts, most experts idle
        ids = torch.stack([torch.zeros(t, dtype=torch.long), torch.ones(t, dtype=torch.long)], 1)
        ids = torch.cat([ids, torch.randint(2, e, (t, k - 2), generator=g)], 1)
    for block_m in (16, 64):
        got = align_by_expert(ids.reshape(-1), e, block_m)
        want = align_reference(ids.reshape(-1), e, block_m)
        used = int(want[2])
        assert torch.equal(got[2], want[2])
        assert torch.equal(got[0][:used], want[0][:used])
        assert torch.equal(got[1][: used // block_m], want[1][: used // block_m])


@pytest.mark.parametrize("t,e,k,hidden,inter", [(1, 8, 2, 64, 32), (37, 8, 2, 48, 40), (50, 16, 4, 40, 24)])
def test_fused_experts_match_reference(t, e, k, hidden, inter):
    """Odd hidden/inter sizes (masked tiles), one token (mostly padding rows), two inputs per call shape."""
    pytest.importorskip("triton")
    from graphcache.model.moe_kernel import MoeBlocks, fused_experts

    for seed in (0, 1):
        x, w_gate_up, w_down, weights, ids = _random_experts(t, e, k, hidden, inter, seed)
        want = experts_reference(x, w_gate_up, w_down, weights, ids)
        for blocks in (MoeBlocks(16, 32, 32, 4, 2), MoeBlocks(32, 16, 16, 4, 2)):
            got = fused_experts(x, w_gate_up, w_down, weights, ids, blocks)
            assert not torch.isnan(got).any()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tensor_parallel_needs_divisible_expert_rows():
    from graphcache.model.parallel import check_shardable

    cfg = read_config(moe_checkpoint("mixtral"))  # experts of 48 rows
    check_shardable(cfg, 2)
    with pytest.raises(ModelLoadError, match="moe_intermediate_size \\(51\\)"):
        check_shardable(ModelConfig(**{**cfg.__dict__, "moe_intermediate_size": 51}), 2)
