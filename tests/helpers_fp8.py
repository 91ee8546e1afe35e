"""FP8 checkpoints for tests, written the way published ones are, from a 16-bit checkpoint.

`write_fp8_checkpoint(src, dst, layout=...)` quantizes the decoder's projections of `src` and writes
them with config.json's quantization_config:
  compressed-tensors  llm-compressor's FP8 layout (RedHatAI / neuralmagic *-FP8-dynamic): `weight`
                      float8_e4m3fn + `weight_scale` [N, 1] (channel), [1] (tensor) or [N/bn, K/bk]
                      (block); format float-quantized, one config group targeting Linear, ignore lm_head;
                      static activations add a per-tensor `input_scale`
  fp8                 vLLM / HF fine-grained FP8: `weight` + `weight_scale` (a 0-dim per-tensor scale) or,
                      with a block, `weight_scale_inv` [N/bn, K/bk] (DeepSeek / Qwen3-FP8)
Every other tensor is stored in bf16, as in those checkpoints. The quantization is the textbook one
(amax / 448 per scale group, round to nearest), computed here independently of graphcache's code.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: torch.Tensor, strategy: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    if strategy == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(1)
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    if strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX  # [N, 1]
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:n, :k] = w
    blocks = padded.view(nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


def bf16_copy(src: Path, dst: Path) -> Path:
    """`src` with every weight cast to bf16 (config.json says so): the 16-bit source an FP8 checkpoint is made from."""
    _copy_side_files(src, dst)
    for file in sorted(src.glob("*.safetensors")):
        save_file(
            {n: t.to(torch.bfloat16) for n, t in load_file(file).items()}, dst / file.name, {"format": "pt"}
        )
    _edit_config(dst, torch_dtype="bfloat16")
    return dst


def write_fp8_checkpoint(
    src: Path,
    dst: Path,
    *,
    layout: str = "compressed-tensors",
    strategy: str = "channel",
    block: tuple[int, int] = (128, 128),
    static_activations: bool = False,
    activations: bool = True,
    ignore: tuple[str, ...] = ("lm_head",),
    quantization_config: dict | None = None,
) -> Path:
    """An FP8 copy of the 16-bit checkpoint `src` in `dst` (see the module doc); returns dst.
    quantization_config replaces the one written (for tests of configs the server refuses)."""
    _copy_side_files(src, dst)
    block_scales = strategy == "block"
    for file in sorted(src.glob("*.safetensors")):
        out: dict[str, torch.Tensor] = {}
        for name, t in load_file(file).items():
            module = name.rsplit(".", 1)[0]
            if (
                name.endswith(".weight")
                and module.rsplit(".", 1)[-1] in PROJ
                and not _ignored(module, ignore)
            ):
                q, scale = _quantize(t, strategy, block)
                out[name] = q
                if layout == "fp8" and block_scales:
                    out[module + ".weight_scale_inv"] = scale
                elif layout == "fp8":
                    out[module + ".weight_scale"] = scale.reshape(())
                else:
                    out[module + ".weight_scale"] = scale
                if static_activations:
                    out[module + ".input_scale"] = torch.tensor([0.02])
            else:
                out[name] = t.to(torch.bfloat16)
        save_file(out, dst / file.name, {"format": "pt"})
    if quantization_config is None:
        quantization_config = (
            _fp8_config(block if block_scales else None, static_activations, ignore)
            if layout == "fp8"
            else _compressed_tensors_config(strategy, block, static_activations, activations, ignore)
        )
    _edit_config(dst, torch_dtype="bfloat16", quantization_config=quantization_config)
    return dst


def _ignored(module: str, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors' rule: an entry is a module name, or a regular expression after `re:`."""
    return any(re.match(p[3:], module) if p.startswith("re:") else module == p for p in ignore)


def _fp8_config(block: tuple[int, int] | None, static: bool, ignore: tuple[str, ...]) -> dict:
    cfg: dict = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic", "fmt": "e4m3"}
    if block is not None:
        cfg["weight_block_size"] = list(block)
    if ignore:
        cfg["ignored_layers"] = list(ignore)
    return cfg


def _compressed_tensors_config(
    strategy: str, block: tuple[int, int], static: bool, activations: bool, ignore: tuple[str, ...]
) -> dict:
    def args(strategy: str, dynamic: bool, block_structure=None) -> dict:
        return {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "group_size": None,
            "strategy": strategy,
            "block_structure": block_structure,
            "dynamic": dynamic,
            "actorder": None,
            "observer": None if dynamic else "minmax",
            "observer_kwargs": {},
        }

    weights = args(strategy, False, list(block) if strategy == "block" else None)
    inputs = args("tensor", False) if static else args("group" if strategy == "block" else "token", True)
    if strategy == "block" and not static:
        inputs["group_size"] = block[1]
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "ignore": list(ignore),
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs if activations else None,
                "output_activations": None,
                "format": "float-quantized",
            }
        },
    }


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)


def _edit_config(dst: Path, **fields) -> None:
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
