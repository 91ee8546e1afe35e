"""The embedded default model: a small random-weight checkpoint in Hugging Face layout.

`make_tiny_model` writes config.json, model.safetensors (or shards + index), tokenizer.json (a
byte-level BPE trained offline on data/corpus.txt, so any text encodes), tokenizer_config.json
with a ChatML chat template, and generation_config.json. Same seed, same bytes of weights: tests
and servers on different machines see the same model. Transformers loads it too, which is how the
tests check our logits against HF's implementation.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch

ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
MOE_ARCHS = ("qwen3_moe", "mixtral")
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4
# ChatML; with `tools` (OpenAI tool dicts), tool results and assistant tool calls rendered the way
# Qwen2.5's template does (Hermes <tool_call> markup: what api/openai/tool_calls.py parses). Plain chats
# render exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\n<tool_call>\n'"
    ' + \'{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for call in message.tool_calls %}"
    "{% if call.function is defined %}{% set call = call.function %}{% endif %}"
    '{{ \'\n<tool_call>\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{% if call.arguments is string %}{{ call.arguments }}{% else %}{{ call.arguments | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Bump when the default model's recipe changes, so old cache dirs are not reused.
DEFAULT_MODEL_NAME = "graphcache-tiny-llama-v2"  # v2: the chat template renders tools
DEFAULT_SHAPE = dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384, max_positions=2048)


def corpus_text() -> str:
    return resources.files("graphcache.model").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int = 1024):
    """Byte-level BPE on the shipped corpus; BOS is prepended by the post-processor like Llama 3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def _hf_config(
    arch: str,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    inter: int,
    head_dim: int,
    max_positions: int,
    rope_theta: float,
    rope_scaling: dict | None,
    tie: bool,
    bos: int,
    eos: list[int],
    moe: dict[str, int] | None = None,
) -> dict[str, Any]:
    """moe (qwen3_moe / mixtral): experts, experts_per_tok, moe_intermediate (every layer sparse)."""
    cfg: dict[str, Any] = {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie,
        "bos_token_id": bos,
        "eos_token_id": eos[0],
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch in ("llama", "qwen3", "qwen3_moe"):
        cfg["attention_bias"] = False
    if arch in ("mistral", "mixtral"):
        cfg["sliding_window"] = None
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    if arch == "qwen3_moe" and moe:
        cfg.update(
            num_experts=moe["experts"],
            num_experts_per_tok=moe["experts_per_tok"],
            moe_intermediate_size=moe["moe_intermediate"],
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if arch == "mixtral" and moe:  # a Mixtral expert has intermediate_size rows
        cfg.update(
            num_local_experts=moe["experts"],
            num_experts_per_tok=moe["experts_per_tok"],
            intermediate_size=moe["moe_intermediate"],
        )
    return cfg


def _random_weights(
    arch: str,
    gen: torch.Generator,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    inter: int,
    head_dim: int,
    tie: bool,
    moe: dict[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights. Unit-gain linears (std 1/sqrt(fan_in)) and non-trivial norm weights and
    biases: attention patterns are far from uniform, so a wrong mask or a wrong mapping shows. moe: as
    _hf_config's; every layer gets a router and per-expert tensors under the arch's names."""

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) / in_f**0.5

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dim, generator=gen)

    w = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        if arch == "qwen2":
            for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                w[p + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(rows * head_dim, generator=gen)
        if arch in ("qwen3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        if arch in MOE_ARCHS and moe:
            w.update(_expert_weights(arch, p, linear, hidden, moe))
            continue
        w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    w["model.norm.weight"] = norm(hidden)
    if not tie:
        w["lm_head.weight"] = linear(vocab, hidden)
    return w


def _expert_weights(
    arch: str, prefix: str, linear, hidden: int, moe: dict[str, int]
) -> dict[str, torch.Tensor]:
    """One sparse layer's router and experts, named as the released checkpoints name them."""
    inter = moe["moe_intermediate"]
    if arch == "mixtral":
        p, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        p, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    w = {p + "gate.weight": linear(moe["experts"], hidden)}
    for e in range(moe["experts"]):
        w[f"{p}experts.{e}.{names[0]}.weight"] = linear(inter, hidden)
        w[f"{p}experts.{e}.{names[1]}.weight"] = linear(inter, hidden)
        w[f"{p}experts.{e}.{names[2]}.weight"] = linear(hidden, inter)
    return w


def _save_weights(weights: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    from safetensors.torch import save_file

    meta = {"format": "pt"}
    if shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata=meta)
        return
    names = list(weights)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, str(out / file), metadata=meta)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_tiny_model(
    dir: str | Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    head_dim: int | None = None,
    vocab_size: int = 1024,
    max_positions: int = 2048,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    tie_word_embeddings: bool | None = None,
    shards: int = 1,
    model_vocab_size: int | None = None,
    experts: int = 8,
    experts_per_tok: int = 2,
    moe_intermediate: int | None = None,
) -> Path:
    """Write a random-weight HF checkpoint of `arch` into `dir` and return its path.

    vocab_size is the BPE target; the model's vocab is the trained size rounded up to 64 (like
    real checkpoints, the embedding may be larger than the tokenizer). tie_word_embeddings
    defaults to True for Qwen (as in small Qwen releases), False otherwise. model_vocab_size
    widens the embedding and LM head to a real model's size (e.g. 151936 for Qwen2.5) so
    benchmarks pay for the real output layer; ids past the tokenizer decode to nothing. experts,
    experts_per_tok and moe_intermediate (default intermediate) shape the sparse MLP of every layer of the
    mixture-of-experts archs (qwen3_moe, mixtral)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    vocab = max(-(-tok.get_vocab_size() // 64) * 64, model_vocab_size or 0)
    head_dim = head_dim or hidden // heads
    inter = intermediate or 3 * hidden
    tie = arch.startswith("qwen") if tie_word_embeddings is None else tie_word_embeddings
    bos = tok.token_to_id(BOS)
    eos = [tok.token_to_id(EOS), tok.token_to_id(IM_END)]
    moe = (
        dict(experts=experts, experts_per_tok=experts_per_tok, moe_intermediate=moe_intermediate or inter)
        if arch in MOE_ARCHS
        else None
    )
    cfg = _hf_config(
        arch,
        vocab,
        hidden,
        layers,
        heads,
        kv_heads,
        inter,
        head_dim,
        max_positions,
        rope_theta,
        rope_scaling,
        tie,
        bos,
        eos,
        moe,
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator().manual_seed(seed)
    _save_weights(
        _random_weights(arch, gen, vocab, hidden, layers, heads, kv_heads, inter, head_dim, tie, moe),
        out,
        shards,
    )
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "model_max_length": max_positions,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    gen_cfg = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": 0, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return out


def make_default_model(dir: str | Path, *, arch: str = "llama", seed: int = 0) -> Path:
    """The embedded default's shape (DEFAULT_SHAPE) written to `dir`: what `make-tiny-model` should write."""
    s = DEFAULT_SHAPE
    return make_tiny_model(
        dir,
        arch=arch,
        seed=seed,
        hidden=s["hidden"],
        layers=s["layers"],
        heads=s["heads"],
        kv_heads=s["kv_heads"],
        intermediate=s["intermediate"],
        max_positions=s["max_positions"],
    )


def default_model_dir(cache_dir: str | Path, seed: int = 0) -> Path:
    """The embedded model under cache_dir, created on first use. Atomic: built in a temp dir and
    renamed, so concurrent servers (or a crash halfway) never see a half-written checkpoint."""
    cache_dir = Path(cache_dir)
    target = cache_dir / (DEFAULT_MODEL_NAME if seed == 0 else f"{DEFAULT_MODEL_NAME}-seed{seed}")
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=cache_dir))
    try:
        make_default_model(tmp, seed=seed)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: theirs is complete, use it
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
