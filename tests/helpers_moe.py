"""Tiny random Qwen3-MoE and Mixtral checkpoints written by transformers' own config and model classes.

The weight names and config fields are the ones transformers writes (save_pretrained: the hub layout),
not ours, so the loader's mapping is tested against the real thing. The tokenizer and generation config
are the embedded tiny model's (graphcache.model.tiny), so the engine can serve the checkpoint too.
Weights are redrawn at unit gain (HF's init std 0.02 would make attention uniform and routing a near
tie everywhere), the router at a scale where each token's top-k is clear.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import torch
from graphcache.model.tiny import make_tiny_model

_ROOT: Path | None = None
_MADE: dict[str, Path] = {}

BASE = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts_per_tok=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
# Qwen3-MoE: 8 experts of 32 rows; layer 1 dense (mlp_only_layers) with 96 rows, norm_topk_prob as released.
QWEN3_MOE = dict(
    BASE,
    num_experts=8,
    moe_intermediate_size=32,
    intermediate_size=96,
    mlp_only_layers=[1],
    norm_topk_prob=True,
)
MIXTRAL = dict(BASE, num_hidden_layers=2, num_local_experts=8, intermediate_size=48, head_dim=None)


def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:  # [out, in] linears, [E, out, in] expert stacks, the [E, H] router: unit gain
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def moe_checkpoint(arch: str, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint of `arch` ("qwen3_moe" | "mixtral"), cached for the process."""
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="graphcache-moe-"))
        atexit.register(shutil.rmtree, _ROOT, True)
    key = f"{arch}-{seed}-" + json.dumps(overrides, sort_keys=True)
    if key in _MADE:
        return _MADE[key]
    out = make_tiny_model(_ROOT / f"m{len(_MADE)}", arch="llama", layers=1)  # tokenizer + generation config
    tiny = json.loads((out / "config.json").read_text())
    for f in out.glob("*.safetensors"):
        f.unlink()
    import transformers

    fields = dict(QWEN3_MOE if arch == "qwen3_moe" else MIXTRAL, **overrides)
    fields.update(
        vocab_size=tiny["vocab_size"],
        bos_token_id=tiny["bos_token_id"],
        eos_token_id=tiny["eos_token_id"],
        pad_token_id=0,
    )
    config_cls, model_cls = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields))
    _redraw(model, seed)
    model.save_pretrained(out)
    _MADE[key] = out
    return out
