"""Our decoder + paged attention vs Hugging Face transformers' implementation, on tiny random
checkpoints of every supported architecture, in float32.

Tolerance: max |logit difference| < 1e-4 (logits have magnitude ~1-5; observed differences are
~1e-6 or exactly 0: the same fp32 math, fused q/k/v and gate/up matmuls aside).
"""

from __future__ import annotations

import json

import pytest
import torch
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from graphcache.model.loader import ModelConfig, ModelLoadError, load_model, read_config
from graphcache.model.tiny import make_tiny_model
from helpers_model import Blocks, cpu_settings, hf_logits, prompt_ids, run_alone, tiny_checkpoint

ATOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=32),  # Qwen3 sets head_dim apart from hidden/heads
    "mistral": dict(arch="mistral"),
    "llama3-rope": dict(arch="llama", rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, max_positions=256),
    "llama-mha-untied": dict(arch="llama", kv_heads=4, tie_word_embeddings=False),
    "qwen2-untied": dict(arch="qwen2", tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    kw = dict(CASES[request.param])
    path = tiny_checkpoint(kw.pop("arch"), **kw)
    ids = prompt_ids(40, seed=1)
    return path, ids, hf_logits(path, ids)


def test_prefill_matches_hf(case):
    path, ids, ref = case
    runner = ModelRunner(cpu_settings(path))
    (logits,) = run_alone(runner, ids, Blocks(runner.block_size).table(len(ids)))
    assert (logits - ref[-1]).abs().max().item() < ATOL


def test_decode_steps_match_hf(case):
    """Prefill 17 tokens, then decode the rest one token at a time through the paged cache:
    every step's logits equal HF's full-sequence logits at that position."""
    path, ids, ref = case
    runner = ModelRunner(cpu_settings(path))
    table = Blocks(runner.block_size).table(len(ids))
    logits = runner.execute(StepPlan.standalone([StepSeq(ids[:17], 0, table, True)])).logits[0]
    diffs = [(logits - ref[16]).abs().max().item()]
    for pos in range(17, len(ids)):
        logits = runner.execute(StepPlan.standalone([StepSeq([ids[pos]], pos, table, True)])).logits[0]
        diffs.append((logits - ref[pos]).abs().max().item())
    assert max(diffs) < ATOL, diffs


def test_chunked_prefill_matches_hf(case):
    """Chunks of 7 attend to cached context + themselves (the masked prefill path)."""
    path, ids, ref = case
    runner = ModelRunner(cpu_settings(path))
    table = Blocks(runner.block_size).table(len(ids))
    steps = run_alone(runner, ids, table, chunk=7)
    ends = list(range(7, len(ids), 7)) + [len(ids)]
    for logits, end in zip(steps, ends, strict=True):
        assert (logits - ref[end - 1]).abs().max().item() < ATOL


def test_llama3_rope_scaling_is_applied():
    path = tiny_checkpoint("llama", rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, max_positions=256)
    cfg = read_config(path)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    from graphcache.model.llama import rope_inv_freq

    plain = ModelConfig(**{**cfg.__dict__, "rope_scaling": None})
    assert not torch.equal(rope_inv_freq(cfg), rope_inv_freq(plain))  # the scaled case differs


def test_transformers5_rope_parameters_format():
    hf = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    hf.pop("rope_scaling")
    hf["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 1234.0,
        **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"},
    }
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling["factor"] == 8.0


def test_sharded_checkpoint_loads_identically(tmp_path):
    single = tiny_checkpoint("qwen2")
    sharded = make_tiny_model(tmp_path / "sharded", arch="qwen2", shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    a, _ = load_model(single, "float32", "cpu")
    b, _ = load_model(sharded, "float32", "cpu")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_load(dtype):
    model, cfg = load_model(tiny_checkpoint("llama"), dtype, "cpu")
    assert model.embed_tokens.weight.dtype == getattr(torch, dtype)
    assert model.rotary.cos.dtype == getattr(torch, dtype)


def test_tied_embeddings_share_storage():
    model, cfg = load_model(tiny_checkpoint("qwen3"), "float32", "cpu")
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


def test_config_fields_per_arch():
    assert read_config(tiny_checkpoint("qwen2")).qkv_bias
    assert read_config(tiny_checkpoint("qwen3", head_dim=32)).qk_norm
    assert read_config(tiny_checkpoint("qwen3", head_dim=32)).head_dim == 32
    llama = read_config(tiny_checkpoint("llama"))
    assert not llama.qkv_bias and not llama.qk_norm and llama.eos_token_ids == [2, 4]


# --- loader errors: each names what is wrong and the fix ---


def test_error_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope", "float32", "cpu")


def test_error_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path, "float32", "cpu")


def test_error_missing_weights(tmp_path):
    path = make_tiny_model(tmp_path / "m", arch="llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(path, "float32", "cpu")


def test_error_unsupported_architecture(tmp_path):
    path = make_tiny_model(tmp_path / "m", arch="llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM.*Qwen3ForCausalLM"
    ):
        load_model(path, "float32", "cpu")


def test_error_shape_mismatch_names_tensor_and_shapes(tmp_path):
    path = make_tiny_model(tmp_path / "m", arch="llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError,
        match=r"shape mismatch for model\.layers\.0\.mlp\.\w+\.weight.*checkpoint has .*192.*implies .*100",
    ):
        load_model(path, "float32", "cpu")


def test_error_missing_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(tmp_path / "m", arch="llama")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="1 tensors missing.*layers.1.self_attn.k_proj"):
        load_model(path, "float32", "cpu")


def test_error_unsupported_rope_type():
    hf = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    hf["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ModelLoadError, match="yarn.*supported: default, linear, llama3"):
        ModelConfig.from_hf(hf)


def test_bind_kv_cache_views_each_layer_as_slots_and_pages():
    """The graph's KV write and the paged kernels index the same memory through views made once."""
    path = tiny_checkpoint("llama")
    model, cfg = load_model(path, torch.float32, "cpu")
    storage = torch.zeros(cfg.num_layers, 2, 5, 4, cfg.num_kv_heads, cfg.head_dim)
    model.bind_kv_cache([storage[i] for i in range(cfg.num_layers)])
    attn = model.layers[1].attn
    assert attn.kv_cache.shape == (2, 20, cfg.num_kv_heads, cfg.head_dim)
    attn.v_slots[4 * 3 + 2] = 1.0  # slot of block 3, offset 2
    assert storage[1, 1, 3, 2].eq(1).all() and attn.v_blocks[3, 2].eq(1).all()
    assert storage.sum() == attn.v_slots[14].numel()  # nothing else was touched
    with pytest.raises(ValueError, match="contiguous"):
        model.bind_kv_cache([storage[i].transpose(1, 2) for i in range(cfg.num_layers)])
