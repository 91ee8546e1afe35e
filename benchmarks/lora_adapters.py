"""Random LoRA adapters in PEFT's format for a model directory: the benchmarks' adapters (offline_throughput.py
--loras). Every decoder projection (q/k/v/o, gate/up/down) at the given rank, small random A and B, so the
adapter changes the logits a little and the kernels do their full work; bf16 like a trained adapter."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapters(model_dir: Path, out: Path, count: int, rank: int, seed: int = 0) -> list[str]:
    """`count` adapters under out/lora{i}; returns their --lora-modules entries (lora{i}=DIR)."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    shapes = {  # (in, out)
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    g = torch.Generator().manual_seed(seed)
    modules = []
    for i in range(count):
        path = out / f"lora{i}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(layers):
            for name in TARGETS:
                fan_in, fan_out = shapes[name]
                part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, fan_in, generator=g) / fan_in**0.5
                ).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).bfloat16()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        adapter_config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS),
        }
        (path / "adapter_config.json").write_text(json.dumps(adapter_config))
        modules.append(f"lora{i}={path}")
    return modules
