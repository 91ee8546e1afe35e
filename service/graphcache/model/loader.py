"""Hugging Face model directory -> (LlamaModel, ModelConfig).

Reads config.json for the Llama family (Llama 2/3, Qwen2/2.5, Qwen3, Mistral), then streams the
safetensors weights (one file, or shards listed in model.safetensors.index.json) into our fused
modules: q/k/v go into one qkv_proj, gate/up into one gate_up_proj, so the forward pass launches
fewer kernels. Every failure names the file or tensor and what would fix it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from graphcache.model.config import ModelConfig, ModelLoadError, read_config, resolve_dtype
from graphcache.model.llama import LlamaModel

log = logging.getLogger(__name__)

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
               *, max_positions: int | None = None) -> tuple[LlamaModel, ModelConfig]:
    """Build the model on `device` in `dtype` and fill it from the directory's safetensors.

    max_positions bounds the rotary cos/sin table (default: the config's max_position_embeddings).
    Returns (LlamaModel, ModelConfig)."""
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
