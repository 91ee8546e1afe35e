"""Hugging Face model directory -> (LlamaModel, ModelConfig).

Reads config.json for the Llama family (Llama 2/3, Qwen2/2.5, Qwen3, Mistral), then streams the
safetensors weights (one file, or shards listed in model.safetensors.index.json) into our fused
modules: q/k/v go into one qkv_proj, gate/up into one gate_up_proj, so the forward pass launches
fewer kernels. Every failure names the file or tensor and what would fix it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# HF `architectures[0]` -> our name. All four share one decoder; they differ in biases and norms.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class ModelLoadError(ValueError):
    """The model directory cannot be loaded; the message says what is wrong and how to fix it."""


@dataclass
class ModelConfig:
    architecture: str                  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # normalized: has "rope_type"; None = plain rotary
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool                     # Qwen2 always; Llama when attention_bias
    qk_norm: bool                      # Qwen3: RMSNorm over head_dim on q and k before rotary
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    o_bias: bool = False               # Llama attention_bias also biases o_proj
    sliding_window: int | None = None  # we attend fully: the runner caps max_model_len to this

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' is supported")
        if hf.get("mlp_bias"):
            raise ModelLoadError("mlp_bias=true is not supported (no released Llama-family model uses it)")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        theta, scaling = _rope_params(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        window = hf.get("sliding_window")
        if arch == "qwen2" or arch == "qwen3":
            # Qwen configs carry a sliding_window value but only use it when use_sliding_window is true.
            window = window if hf.get("use_sliding_window") else None
        eos = hf.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            qk_norm=arch == "qwen3",
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=hf.get("bos_token_id"),
            o_bias=arch in ("llama", "qwen3") and attention_bias,
            sliding_window=int(window) if window else None,
        )


def _rope_params(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the classic `rope_theta` + `rope_scaling` keys or the
    transformers-5 `rope_parameters` dict (which holds rope_theta inside)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf["rope_scaling"]) if hf.get("rope_scaling") else None
    if scaling is None:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope scaling type {rope_type!r}; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    return theta, scaling


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use one of bfloat16, float16, float32")
    return DTYPES[dtype]


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist; pass a Hugging Face model "
                             "directory (config.json, *.safetensors, tokenizer.json), or leave model unset "
                             "to use the embedded tiny model")
    if not cfg_file.is_file():
        raise ModelLoadError(f"{cfg_file} is missing; a Hugging Face model directory needs config.json")
    config = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    gen_file = path / "generation_config.json"
    if gen_file.is_file():  # generation_config's eos list (e.g. Llama 3 <|eot_id|>) wins over config.json's
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        if eos is not None:
            config.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
    return config


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} lists shards that are missing from {path}: {missing[:5]}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {bins[:3]}: convert them to safetensors)" if bins else ""
        raise ModelLoadError(f"no *.safetensors weights in {path}{hint}")
    return files


def _hf_targets(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF tensor name -> (our parameter name, row offset, rows) inside possibly fused parameters."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    t: dict[str, tuple[str, int, int]] = {"model.embed_tokens.weight": ("embed_tokens.weight", 0, -1),
                                          "model.norm.weight": ("norm.weight", 0, -1)}
    if not config.tie_word_embeddings:
        t["lm_head.weight"] = ("lm_head.weight", 0, -1)
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        kinds = ["weight", "bias"] if config.qkv_bias else ["weight"]
        for kind in kinds:
            t[hf + f"self_attn.q_proj.{kind}"] = (ours + f"attn.qkv_proj.{kind}", 0, q)
            t[hf + f"self_attn.k_proj.{kind}"] = (ours + f"attn.qkv_proj.{kind}", q, kv)
            t[hf + f"self_attn.v_proj.{kind}"] = (ours + f"attn.qkv_proj.{kind}", q + kv, kv)
        t[hf + "self_attn.o_proj.weight"] = (ours + "attn.o_proj.weight", 0, -1)
        if config.o_bias:
            t[hf + "self_attn.o_proj.bias"] = (ours + "attn.o_proj.bias", 0, -1)
        if config.qk_norm:
            t[hf + "self_attn.q_norm.weight"] = (ours + "attn.q_norm.weight", 0, -1)
            t[hf + "self_attn.k_norm.weight"] = (ours + "attn.k_norm.weight", 0, -1)
        t[hf + "mlp.gate_proj.weight"] = (ours + "mlp.gate_up_proj.weight", 0, inter)
        t[hf + "mlp.up_proj.weight"] = (ours + "mlp.gate_up_proj.weight", inter, inter)
        t[hf + "mlp.down_proj.weight"] = (ours + "mlp.down_proj.weight", 0, -1)
        t[hf + "input_layernorm.weight"] = (ours + "input_norm.weight", 0, -1)
        t[hf + "post_attention_layernorm.weight"] = (ours + "post_attn_norm.weight", 0, -1)
    return t


def load_model(path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               *, max_positions: int | None = None):
    """Build the model on `device` in `dtype` and fill it from the directory's safetensors.

    max_positions bounds the rotary cos/sin table (default: the config's max_position_embeddings).
    Returns (LlamaModel, ModelConfig)."""
    from safetensors import safe_open

    from service.model.llama import LlamaModel

    path = Path(path)
    config = read_config(path)
    dtype = resolve_dtype(dtype)
    device = torch.device(device)
    files = weight_files(path)
    # Build on the meta device, then allocate uninitialized storage: no wasted random init of
    # billions of weights that are overwritten right after.
    with torch.device("meta"):
        model = LlamaModel(config, max_positions=max_positions).to(dtype)
    model.to_empty(device=device)  # allocated once, already in the target dtype
    params = dict(model.named_parameters())
    targets = _hf_targets(config)
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                target = targets.get(hf_name)
                if target is None:
                    if not hf_name.endswith("rotary_emb.inv_freq") and hf_name != "lm_head.weight":
                        log.warning("ignoring tensor %s from %s (not used by %s)", hf_name, file.name,
                                    config.architecture)
                    continue
                name, offset, rows = target
                param = params[name]
                tensor = f.get_tensor(hf_name)
                dest = param.data if rows < 0 else param.data.narrow(0, offset, rows)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"shape mismatch for {hf_name} in {file.name}: checkpoint has {tuple(tensor.shape)}, "
                        f"config.json implies {tuple(dest.shape)}; config.json and the weights disagree")
                dest.copy_(tensor.to(dtype))
                loaded.add(hf_name)
    missing = [hf for hf in targets if hf not in loaded]
    if missing:
        raise ModelLoadError(f"{len(missing)} tensors missing from the safetensors in {path}, e.g. {missing[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.init_rotary(device)
    model.eval()
    return model, config
