"""The model's configuration: config.json (+ generation_config.json) -> ModelConfig.

Pure data about the checkpoint, read before any weight is touched; the loader (weights) and the
decoder (llama.py) both build on it, and neither imports the other for it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

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
    # The base models (no LM head), as sentence-transformers saves decoder embedding models
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
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


# Bounds on config.json's sizes, past every published model by a wide margin (the largest today: 126
# layers, hidden 18432, intermediate 53248, vocabulary 262144, 128 heads, head_dim 256, 384 experts,
# 10M positions). A value past one is a typo or a hostile file: refused before anything is built, since
# building it would not fail but run for minutes and take the machine's memory (1,000,000 layers did).
MAX_LAYERS = 1024
MAX_HIDDEN_SIZE = 65536
MAX_INTERMEDIATE_SIZE = 1 << 18
MAX_VOCAB_SIZE = 1 << 21
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_EXPERTS = 1024
MAX_POSITIONS = 1 << 24
FIX_CONFIG = "fix config.json or download it again"
_REQUIRED = object()


def _shown(value: Any) -> str:
    """A config value as a message shows it: its repr, bounded (a hostile file's string may be huge)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def int_field(hf: dict[str, Any], key: str, low: int, high: int, default: Any = _REQUIRED) -> Any:
    """config.json's integer `key`, within [low, high]; `default` when it is absent or null (none given:
    it is required). A float with an integral value counts (4.0); anything else is refused, in one
    line naming the field, its value and the bound."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelLoadError(
                f"config.json lacks {key!r}; {FIX_CONFIG} (a Llama-family model's config has it)"
            )
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(
            f"config.json has a malformed field: {key} is {_shown(value)}, not an integer; {FIX_CONFIG}"
        )
    if value < low:
        raise ModelLoadError(f"config.json {key} is {value}, below the minimum {low}; {FIX_CONFIG}")
    if value > high:
        raise ModelLoadError(
            f"config.json {key} is {value}, over the bound {high} (no published model comes near it); "
            f"{FIX_CONFIG}"
        )
    return value


def float_field(hf: dict[str, Any], key: str, default: float, *, positive: bool, within: str = "") -> float:
    """config.json's number `key` (default when absent): finite, and > 0 (positive) or >= 0. `within`
    names the object that holds it in messages ("rope_scaling ")."""
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(
            f"config.json has a malformed field: {within}{key} is {_shown(value)}, not a number; {FIX_CONFIG}"
        )
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "a finite number above 0" if positive else "a finite number, 0 or more"
        raise ModelLoadError(f"config.json {within}{key} is {value}, it must be {bound}; {FIX_CONFIG}")
    return value


def _token_ids(value: Any, key: str, vocab_size: int, where: str = "config.json") -> list[int]:
    """eos_token_id (one id or a list) as a list of ids of the vocabulary."""
    ids = value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ModelLoadError(
                f"{where} has a malformed field: {key} is {_shown(value)}, not a token id or a list of "
                f"them; fix {where} or download it again"
            )
        if not 0 <= i < vocab_size:
            raise ModelLoadError(
                f"{where} {key} {i} is outside the vocabulary (vocab_size {vocab_size}); "
                f"fix {where} or download it again"
            )
    return list(ids)


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
        except (TypeError, ValueError, ArithmeticError, AttributeError) as e:
            raise ModelLoadError(
                f"config.json has a malformed field ({type(e).__name__}: {e}); re-download config.json"
            ) from None

    @classmethod
    def _from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        if not isinstance(archs, list):
            raise ModelLoadError(
                f"config.json has a malformed field: architectures is {_shown(archs)}, not a list "
                f'(e.g. ["LlamaForCausalLM"]); {FIX_CONFIG}'
            )
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
        sizes = _sizes(hf)
        theta, scaling = _rope_params(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        window = hf.get("sliding_window")
        if arch in ("qwen2", "qwen3", "qwen3_moe"):
            # Qwen configs carry a sliding_window value but only use it when use_sliding_window is true.
            window = window if hf.get("use_sliding_window") else None
        eos, bos = hf.get("eos_token_id"), hf.get("bos_token_id")
        vocab = sizes["vocab_size"]
        return cls(
            architecture=arch,
            **sizes,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float_field(hf, "rms_norm_eps", 1e-6, positive=False),
            max_position_embeddings=int_field(hf, "max_position_embeddings", 1, MAX_POSITIONS, 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            eos_token_ids=[] if eos is None else _token_ids(eos, "eos_token_id", vocab),
            bos_token_id=None if bos is None else _token_ids(bos, "bos_token_id", vocab)[0],
            o_bias=arch in ("llama", "qwen3", "qwen3_moe") and attention_bias,
            sliding_window=int_field(
                {"sliding_window": window or None}, "sliding_window", 1, MAX_POSITIONS, None
            ),
            quantization_config=_quantization_config(hf),
            **_moe_params(arch, hf),
        )


class _Sizes(TypedDict):
    """The dimensions `_sizes` reads: ModelConfig's fields of the same names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def _sizes(hf: dict[str, Any]) -> _Sizes:
    """The model's dimensions from config.json, each an integer within its bound, and consistent: the
    heads split hidden_size (unless head_dim is given), the KV heads split the heads, head_dim is even
    (rotary pairs its halves). Checked before anything is built from them."""
    heads = int_field(hf, "num_attention_heads", 1, MAX_HEADS)
    hidden = int_field(hf, "hidden_size", 1, MAX_HIDDEN_SIZE)
    kv_heads = int_field(hf, "num_key_value_heads", 1, MAX_HEADS, heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"config.json num_key_value_heads {kv_heads} does not divide num_attention_heads {heads} "
            f"(each KV head serves a whole group of heads); {FIX_CONFIG}"
        )
    head_dim = int_field(hf, "head_dim", 1, MAX_HEAD_DIM, None)
    if head_dim is None:
        if hidden % heads:
            raise ModelLoadError(
                f"config.json hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                f"(and no head_dim is given); {FIX_CONFIG}"
            )
        head_dim = int_field({"head_dim": hidden // heads}, "head_dim", 1, MAX_HEAD_DIM)
    if head_dim % 2:
        raise ModelLoadError(
            f"config.json head_dim is {head_dim}, an odd number: rotary embeddings need an even head_dim; "
            f"{FIX_CONFIG}"
        )
    return _Sizes(
        vocab_size=int_field(hf, "vocab_size", 1, MAX_VOCAB_SIZE),
        hidden_size=hidden,
        intermediate_size=int_field(hf, "intermediate_size", 1, MAX_INTERMEDIATE_SIZE),
        num_layers=int_field(hf, "num_hidden_layers", 1, MAX_LAYERS),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
    )


def _moe_params(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's expert fields from a Qwen3-MoE or Mixtral config.json ({} for a dense model).

    Qwen3-MoE: layer i is sparse unless it is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
    (dense layers keep intermediate_size); transformers 5 writes num_experts as num_local_experts.
    Mixtral: every layer is sparse, its experts have intermediate_size rows, top-k weights renormalized."""
    if arch not in ("qwen3_moe", "mixtral"):
        return {}
    layers = int_field(hf, "num_hidden_layers", 1, MAX_LAYERS)
    if arch == "mixtral":
        experts = int_field(hf, "num_local_experts", 1, MAX_EXPERTS, 8)
        inter, norm = int_field(hf, "intermediate_size", 1, MAX_INTERMEDIATE_SIZE), True
        sparse = tuple(range(layers))
    else:
        key = "num_experts" if hf.get("num_experts") else "num_local_experts"
        experts = int_field(hf, key, 0, MAX_EXPERTS, 0)
        inter = int_field(hf, "moe_intermediate_size", 1, MAX_INTERMEDIATE_SIZE)
        norm = bool(hf.get("norm_topk_prob", False))
        step = int_field(hf, "decoder_sparse_step", 0, MAX_LAYERS, 1) or 1
        dense = {int(i) for i in hf.get("mlp_only_layers") or ()}
        sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    top_k = int_field(hf, "num_experts_per_tok", 0, MAX_EXPERTS, 2)
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
        theta = float_field(
            {"rope_theta": hf.get("rope_theta"), **params}, "rope_theta", 10000.0, positive=True
        )
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = float_field(hf, "rope_theta", 10000.0, positive=True)
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
    # What model/llama.py's rope_inv_freq reads: positive numbers (a zero would divide by it).
    keys = ["factor"]
    if rope_type == "llama3":
        keys += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    for key in keys:
        if key not in scaling:
            raise ModelLoadError(f"config.json rope_scaling ({rope_type}) lacks {key!r}; {FIX_CONFIG}")
        float_field(scaling, key, 0.0, positive=True, within="rope_scaling ")
    if rope_type == "llama3" and float(scaling["high_freq_factor"]) <= float(scaling["low_freq_factor"]):
        raise ModelLoadError(
            f"config.json rope_scaling high_freq_factor {scaling['high_freq_factor']} is not above "
            f"low_freq_factor {scaling['low_freq_factor']}; {FIX_CONFIG}"
        )
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
            config.eos_token_ids = _token_ids(eos, "eos_token_id", config.vocab_size, gen_file.name)
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
