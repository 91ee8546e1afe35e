"""A LoRA adapter as PEFT writes it (adapter_config.json + adapter_model.safetensors) -> `LoraWeights`.

What is served: LoRA (not DoRA, no trained biases, no extra saved modules) on the decoder's q/k/v/o and
gate/up/down projections, rank up to --max-lora-rank, scale lora_alpha / r (lora_alpha / sqrt(r) with
use_rslora). The scale is folded into B at load, so a slot holds A [r, in] and B * scale [out, r] per
projection. Everything else is refused at load with one line that names the fix: a wrong base shape, a rank
past the bound, an unknown target, a missing or unreadable file.

q/k/v and gate/up are fused in the model (one qkv_proj, one gate_up_proj), so an adapter's pieces are kept
apart here (`LoraPiece.piece`: q=0, k=1, v=2; gate=0, up=1): each goes into its own rank rows and output
rows of the fused projection's slot (model/lora_layers.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from graphcache.model.config import ModelConfig
from graphcache.model.source import REPO_ID, hub_error_message

__all__ = ["LORA_TARGETS", "LoraLoadError", "LoraPiece", "LoraWeights", "read_lora", "resolve_lora_dir"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoraLoadError(ValueError):
    """An adapter that cannot be served; the message is one line: what is wrong, then the fix."""


# PEFT module name -> (our fused projection, its piece index)
LORA_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may sit before .weight)
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass(frozen=True)
class LoraPiece:
    """One PEFT module's adapter: y[:, rows of piece] += x @ a.T @ b.T (b carries the scale)."""

    piece: int
    a: torch.Tensor  # [r, in] fp32
    b: torch.Tensor  # [out_piece, r] fp32, times the adapter's scale


@dataclass
class LoraWeights:
    name: str
    path: Path
    rank: int
    scale: float
    # (layer, projection) -> its pieces; projection in qkv, o, gate_up, down
    pieces: dict[tuple[int, str], list[LoraPiece]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for ps in self.pieces.values() for p in ps)

    def targets(self) -> list[str]:
        return sorted({proj for _, proj in self.pieces})


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in, out) of the base model's projection."""
    h, q, kv, i = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
        config.intermediate_size,
    )
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def resolve_lora_dir(name: str, spec: str) -> Path:
    """The adapter's local directory: `spec` itself, or a hub id fetched into the Hugging Face cache."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists() or not REPO_ID.match(spec) or spec.startswith(("/", ".", "~")):
        raise LoraLoadError(
            f"adapter {name!r}: {spec!r} is not a directory; pass the directory PEFT saved "
            f"({CONFIG_FILE} + {WEIGHTS_FILE}) or a hub id as org/name"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))
    except Exception as exc:  # noqa: BLE001 - the library's failures become one line with a fix
        raise LoraLoadError(f"adapter {name!r}: {hub_error_message(exc, spec, None)}") from exc


def _read_config(name: str, path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoraLoadError(
            f"adapter {name!r}: {file} is missing; pass the directory PEFT's save_pretrained wrote"
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LoraLoadError(
            f"adapter {name!r}: {file} is not readable JSON ({e}); save the adapter again"
        ) from None
    if not isinstance(config, dict):
        raise LoraLoadError(f"adapter {name!r}: {file} is not a JSON object; save the adapter again")
    return config


def _check_config(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scale) from the config; LoraLoadError naming the fix for what is not served."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraLoadError(f"adapter {name!r} is a {peft_type} adapter; only LoRA adapters are served")
    if config.get("use_dora"):
        raise LoraLoadError(
            f"adapter {name!r} is DoRA (use_dora); merge it into the base weights and serve that"
        )
    if config.get("bias", "none") not in ("none", None):
        raise LoraLoadError(
            f"adapter {name!r} trains biases (bias={config['bias']!r}); retrain with bias='none' or merge it"
        )
    if config.get("modules_to_save"):
        raise LoraLoadError(
            f"adapter {name!r} saves whole modules ({config['modules_to_save']}); only LoRA on q/k/v/o/gate/up/"
            "down projections is served: merge the adapter into the base weights and serve that"
        )
    if config.get("fan_in_fan_out"):
        raise LoraLoadError(
            f"adapter {name!r} has fan_in_fan_out (GPT-2 Conv1D layers); not a Llama-family adapter"
        )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraLoadError(
            f"adapter {name!r} has per-module ranks or alphas (rank_pattern / alpha_pattern); retrain with one "
            "r and lora_alpha, or merge it"
        )
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, int | float):
        raise LoraLoadError(f"adapter {name!r}: adapter_config.json needs an integer r >= 1 and a lora_alpha")
    if r > max_rank:
        raise LoraLoadError(
            f"adapter {name!r} has rank {r}, more than --max-lora-rank {max_rank}; raise --max-lora-rank to {r}"
        )
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(scale)


def read_lora(name: str, path: Path, config: ModelConfig, max_rank: int) -> LoraWeights:
    """The adapter at `path` checked against the base model's config; LoraLoadError naming the fix."""
    adapter_config = _read_config(name, path)
    rank, scale = _check_config(name, adapter_config, max_rank)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        hint = (
            " (found adapter_model.bin: convert it to safetensors)"
            if (path / "adapter_model.bin").is_file()
            else ""
        )
        raise LoraLoadError(
            f"adapter {name!r}: {file} is missing{hint}; save the adapter with safe_serialization"
        )
    shapes = projection_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                m = _TENSOR.match(key)
                if m is None:
                    raise LoraLoadError(
                        f"adapter {name!r} has tensor {key}, an unknown target; only q_proj, k_proj, v_proj, "
                        "o_proj, gate_proj, up_proj and down_proj of the decoder layers are served: retrain "
                        "with target_modules among those"
                    )
                layer, module, half = int(m.group(1)), m.group(2), m.group(3)
                halves.setdefault((layer, module), {})[half] = f.get_tensor(key).float()
    except LoraLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken file of any kind is one line
        raise LoraLoadError(
            f"adapter {name!r}: {file} is unreadable ({type(e).__name__}: {e}); save it again"
        ) from None
    if not halves:
        raise LoraLoadError(f"adapter {name!r}: {file} holds no LoRA tensors; save the adapter again")
    weights = LoraWeights(name, path, rank, scale)
    base = adapter_config.get("base_model_name_or_path") or "another base model"
    for (layer, module), ab in sorted(halves.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoraLoadError(
                f"adapter {name!r}: {where} has lora_{next(iter(ab))} but not its pair; save it again"
            )
        if layer >= config.num_layers:
            raise LoraLoadError(
                f"adapter {name!r}: {where} is past the base model's {config.num_layers} layers: it was trained "
                f"for {base}; serve it with that model"
            )
        proj, piece = LORA_TARGETS[module]
        if proj in ("gate_up", "down") and layer in config.moe_layers:
            raise LoraLoadError(
                f"adapter {name!r}: {where} targets a sparse (mixture-of-experts) MLP; adapters on experts are "
                "not served: retrain with attention targets only"
            )
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != fan_in
            or b.shape[0] != fan_out
            or a.shape[0] != b.shape[1]
        ):
            raise LoraLoadError(
                f"adapter {name!r}: {where} is lora_A {list(a.shape)} / lora_B {list(b.shape)}, but the base "
                f"model's {module} is {fan_in} -> {fan_out}: it was trained for {base}; serve it with that model"
            )
        if a.shape[0] > max_rank:
            raise LoraLoadError(
                f"adapter {name!r}: {where} has rank {a.shape[0]}, more than --max-lora-rank {max_rank}; raise "
                f"--max-lora-rank to {a.shape[0]}"
            )
        weights.pieces.setdefault((layer, proj), []).append(
            LoraPiece(piece, a.contiguous(), (b * scale).contiguous())
        )
    return weights
