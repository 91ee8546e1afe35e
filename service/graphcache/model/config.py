"""The model's configuration: config.json (+ generation_config.json) -> ModelConfig.

Pure data about the checkpoint, read before any weight is touched; the loader (weights) and the
decoder (llama.py) both build on it, and neither imports the other for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# HF `architectures[0]` -> our name. All share one decoder; they differ in biases, norms and (the last
# two) a sparse mixture-of-experts MLP (model/moe.py).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


class ModelLoadError(ValueError):
    """The model directory cannot be loaded; the message says what is wrong and how to fix it."""


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "qwen3_moe" | "mixtral"
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
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rotary
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    o_bias: bool = False  # Llama attention_bias also biases o_proj
    sliding_window: int | None = None  # we attend fully: the runner caps max_model_len to this
    # Mixture of experts (qwen3_moe, mixtral); num_experts 0 = every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's gate/up rows
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1 (Mixtral always)
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is sparse; the others use intermediate_size
    # config.json's quantization_config (older compressed-tensors: compression_config), as written;
    # model/quantization.py reads it. None = 16-bit weights.
    quantization_config: dict[str, Any] | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        try:
            return cls._from_hf(hf)
        except ModelLoadError:
            raise
        except KeyError as e:
            raise ModelLoadError(
                f"config.json lacks {e.args[0]!r}; re-download config.json or add the field "
                "(it is a Hugging Face config of a Llama-family model)"
            ) from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(
                f"config.json has a malformed field ({e}); re-download config.json"
            ) from None

    @classmethod
    def _from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; use a model of a supported "
                f"architecture (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' is supported")
        if hf.get("mlp_bias"):
            raise ModelLoadError("mlp_bias=true is not supported (no released Llama-family model uses it)")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        theta, scaling = _rope_params(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        window = hf.get("sliding_window")
        if arch in ("qwen2", "qwen3", "qwen3_moe"):
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
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=hf.get("bos_token_id"),
            o_bias=arch in ("llama", "qwen3", "qwen3_moe") and attention_bias,
            sliding_window=int(window) if window else None,
            quantization_config=_quantization_config(hf),
            **_moe_params(arch, hf),
        )


def _moe_params(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's expert fields from a Qwen3-MoE or Mixtral config.json ({} for a dense model).

    Qwen3-MoE: layer i is sparse unless it is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
    (dense layers keep intermediate_size); transformers 5 writes num_experts as num_local_experts.
    Mixtral: every layer is sparse, its experts have intermediate_size rows, top-k weights renormalized."""
    if arch not in ("qwen3_moe", "mixtral"):
        return {}
    layers = int(hf["num_hidden_layers"])
    if arch == "mixtral":
        experts, inter, norm = int(hf.get("num_local_experts", 8)), int(hf["intermediate_size"]), True
        sparse = tuple(range(layers))
    else:
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        inter, norm = int(hf["moe_intermediate_size"]), bool(hf.get("norm_topk_prob", False))
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in hf.get("mlp_only_layers") or ()}
        sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    top_k = int(hf.get("num_experts_per_tok", 2))
    if sparse and not 0 < top_k <= experts:
        raise ModelLoadError(
            f"config.json routes each token to num_experts_per_tok={top_k} of {experts} experts; it must be "
            "between 1 and the number of experts: re-download config.json"
        )
    return dict(
        num_experts=experts if sparse else 0,
        num_experts_per_tok=top_k if sparse else 0,
        moe_intermediate_size=inter if sparse else 0,
        norm_topk_prob=norm,
        moe_layers=sparse,
    )


def _quantization_config(hf: dict[str, Any]) -> dict[str, Any] | None:
    qc = hf.get("quantization_config") or hf.get("compression_config")
    if qc is not None and not isinstance(qc, dict):
        raise ModelLoadError(
            f"config.json quantization_config is a {type(qc).__name__}, not an object; re-download it"
        )
    return qc


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
        raise ModelLoadError(
            f"unsupported rope scaling type {rope_type!r} (config.json rope_scaling); supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (serve a model whose rope scaling is one of them)"
        )
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
        raise ModelLoadError(
            f"model directory {str(path)!r} does not exist; pass a Hugging Face model "
            "directory (config.json, *.safetensors, tokenizer.json), or leave model unset "
            "to use the embedded tiny model"
        )
    if not cfg_file.is_file():
        raise ModelLoadError(f"{cfg_file} is missing; a Hugging Face model directory needs config.json")
    config = ModelConfig.from_hf(_read_json(cfg_file))
    gen_file = path / "generation_config.json"
    if gen_file.is_file():  # generation_config's eos list (e.g. Llama 3 <|eot_id|>) wins over config.json's
        eos = _read_json(gen_file).get("eos_token_id")
        if eos is not None:
            config.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
    return config


def _read_json(file: Path) -> dict[str, Any]:
    """A JSON object from `file`, or ModelLoadError naming the file, the problem and the fix."""
    try:
        data = json.loads(file.read_text())
    except OSError as e:
        raise ModelLoadError(f"cannot read {file} ({e.strerror or e}); fix its permissions") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{file} is not valid JSON ({e}); re-download it") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} holds a JSON {type(data).__name__}, not an object; re-download it")
    return data
