"""Tiny LoRA adapters for tests, written by the `peft` library over a tiny checkpoint, and the independent
reference: the same adapter merged into the base weights (peft's merge_and_unload), saved as a model
directory graphcache (or transformers) loads like any other.

Adapters are made once per process per recipe; malformed ones are written by hand (`write_adapter`).
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

_ROOT: Path | None = None
_MADE: dict[str, tuple[Path, Path]] = {}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
)


def _root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="graphcache-lora-"))
        atexit.register(shutil.rmtree, _ROOT, True)
    return _ROOT


def peft_adapter(
    base: Path,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    seed: int = 0,
    rslora: bool = False,
    magnitude: float = 0.05,
) -> tuple[Path, Path]:
    """(adapter directory, merged model directory) of a random LoRA adapter on `base`, both cached for the
    process. B is random too (PEFT starts it at zero), scaled so the adapter moves the logits clearly."""
    key = f"{base}-{r}-{alpha}-{targets}-{seed}-{rslora}-{magnitude}"
    if key in _MADE:
        return _MADE[key]
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, lora_dropout=0.0
    )
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * magnitude)
    out = _root() / f"a{len(_MADE)}"
    adapter, merged = out / "adapter", out / "merged"
    peft_model.save_pretrained(adapter)
    peft_model.merge_and_unload().save_pretrained(merged)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, merged / name)
    _MADE[key] = (adapter, merged)
    return adapter, merged


def write_adapter(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A hand-written PEFT directory (malformed adapters for the refusal tests)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    return path


def lora_tensor(layer: int, module: str, half: str) -> str:
    part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{part}.{module}.lora_{half}.weight"
