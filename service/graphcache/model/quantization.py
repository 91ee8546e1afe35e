"""Which linear layers run in FP8, and where their weights and scales come from.

Two sources, one kind of layer (fp8_linear.Fp8Linear):
- an FP8 checkpoint, as published. config.json's `quantization_config` says how it was quantized:
  * quant_method "fp8" (vLLM / HF FineGrainedFP8): `weight` float8_e4m3fn with `weight_scale` (one per
    tensor) or, with `weight_block_size` [128, 128], `weight_scale_inv` (one per 128x128 block);
    activation_scheme dynamic, or static (its `input_scale` is not read: activations are scaled per
    token each step); `ignored_layers` / `modules_to_not_convert` stay 16-bit.
  * quant_method "compressed-tensors" (llm-compressor, e.g. RedHatAI/neuralmagic *-FP8-dynamic):
    format float-quantized (or naive-quantized), config_groups whose `weights` are {num_bits 8, type
    float, symmetric, static, strategy tensor | channel | block}, `input_activations` FP8 dynamic per
    token, static per tensor (served dynamic per token) or absent (weight-only: served W8A8 all the
    same); `ignore` (names or `re:` patterns, typically lm_head) stays 16-bit. `weight_scale` is [N, 1]
    for channel, one element for tensor, [N / 128, K / 128] for block.
- a 16-bit checkpoint with `--quantization fp8`: loaded as usual, then each decoder projection is
  quantized with one scale per output row (amax / 448).

Only the decoder's projections (q/k/v/o, gate/up/down) become FP8; embeddings, norms and the LM head stay
in the model dtype. A fused layer (qkv_proj, gate_up_proj) is FP8 only when all its parts are; a
per-tensor scale is expanded to every row of its part, so fused parts keep their own scales exactly.
Anything else is refused at start, in one line naming what is supported.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, Self, TypeVar, cast

import torch
from torch import nn

from graphcache.choices import QUANTIZATIONS
from graphcache.model.config import ModelConfig, ModelLoadError
from graphcache.model.fp8_linear import Fp8Linear

log = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_QUANTIZATION",
    "Fp8Scheme",
    "check_checkpoint_dtype",
    "fp8_layers",
    "quantize_on_load",
    "resolve_quantization",
    "scale_targets",
]

SUPPORTED_QUANTIZATION = (
    "quant_method fp8 (E4M3 weights with per-tensor or 128x128 block scales), quant_method "
    "compressed-tensors with FP8 weights (float, 8 bits, strategy tensor, channel or block) and dynamic or "
    "static FP8 activations, or a bf16/fp16 checkpoint with --quantization fp8"
)
# Checkpoint tensors no layer here reads: static activation scales (activations are scaled per token each
# step) and KV-cache / attention output scales (an FP8 KV cache stores K and V with a scale of 1,
# model/kv_dtype.py; the runner warns when a checkpoint calibrated k_scale / v_scale).
_UNUSED_SCALES = ("input_scale", "k_scale", "v_scale", "q_scale", "prob_scale", "output_scale")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


@dataclass(frozen=True)
class Fp8Scheme:
    source: str  # "fp8" | "compressed-tensors" (config.json) | "--quantization fp8"
    on_load: bool = False  # quantize the 16-bit weights after loading them
    block: tuple[int, int] | None = None  # (rows, cols) of one weight scale; None: per row (or tensor)
    per_tensor: bool = False  # the checkpoint's weight_scale is one number per tensor
    scale_suffix: str = "weight_scale"  # the checkpoint's name of the scale next to `weight`
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors group targets ("Linear": every layer)
    ignore: tuple[str, ...] = ()  # layers left 16-bit (names, suffixes or `re:` patterns)

    def quantizes(self, hf_module: str) -> bool:
        """Whether the checkpoint's layer `hf_module` (e.g. model.layers.0.self_attn.q_proj) is FP8."""
        if self.on_load:
            return True
        targeted = "Linear" in self.targets or _matches(hf_module, self.targets)
        return targeted and not _matches(hf_module, self.ignore)

    def unused(self, hf_name: str) -> bool:
        return not self.on_load and hf_name.rsplit(".", 1)[-1] in _UNUSED_SCALES

    def describe(self) -> str:
        if self.on_load:
            return "fp8 (quantized on load: per-row weight scales, per-token activation scales)"
        scales = (
            f"{self.block[0]}x{self.block[1]} block"
            if self.block
            else "per-tensor"
            if self.per_tensor
            else "per-channel"
        )
        return f"{self.source} FP8 checkpoint ({scales} weight scales, per-token activation scales)"


def _matches(name: str, patterns: Iterable[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False


def _unsupported(what: str) -> ModelLoadError:
    return ModelLoadError(f"unsupported quantization: {what}; supported: {SUPPORTED_QUANTIZATION}")


def resolve_quantization(config: ModelConfig, requested: str = "auto") -> Fp8Scheme | None:
    """The checkpoint's scheme (config.json quantization_config), or quantize-on-load for `requested`
    "fp8" on a 16-bit checkpoint; None: no quantization. ModelLoadError names what is supported."""
    qc = config.quantization_config
    if requested not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {requested!r}; use one of {', '.join(QUANTIZATIONS)}")
    if qc is None:
        return Fp8Scheme("--quantization fp8", on_load=True) if requested == "fp8" else None
    method = qc.get("quant_method")
    if config.num_experts:
        raise _unsupported(
            f"a quantized mixture-of-experts checkpoint ({config.architecture}, quant_method {method!r})"
        )
    if method == "fp8":
        scheme = _fp8_method(qc)
    elif method == "compressed-tensors":
        scheme = _compressed_tensors(qc)
    else:
        raise _unsupported(f"config.json quantization_config has quant_method {method!r}")
    if requested == "fp8":
        log.info("--quantization fp8: the checkpoint is FP8 already (%s), served as it is", method)
    return scheme


def _fp8_method(qc: Mapping[str, Any]) -> Fp8Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(f"quant_method fp8 with fmt {fmt!r} (only e4m3)")
    activations = qc.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise _unsupported(f"quant_method fp8 with activation_scheme {activations!r}")
    if activations == "static":
        log.info("the checkpoint's static input scales are not used: activations are scaled per token")
    block = _block(qc.get("weight_block_size"))
    ignore = tuple(qc.get("ignored_layers") or ()) + tuple(qc.get("modules_to_not_convert") or ())
    return Fp8Scheme(
        "fp8",
        block=block,
        per_tensor=block is None,
        scale_suffix="weight_scale_inv" if block else "weight_scale",
        ignore=ignore,
    )


def _compressed_tensors(qc: Mapping[str, Any]) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized", None):
        raise _unsupported(f"compressed-tensors format {fmt!r}")
    sparsity = qc.get("sparsity_config")
    if sparsity and sparsity.get("format") not in (None, "dense"):
        raise _unsupported(f"compressed-tensors sparsity format {sparsity.get('format')!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _unsupported("compressed-tensors without config_groups")
    strategies, targets = set(), []
    for name, group in groups.items():
        w, a = group.get("weights"), group.get("input_activations")
        if not w or w.get("num_bits") != 8 or w.get("type") != "float":
            bits, kind = (w or {}).get("num_bits"), (w or {}).get("type")
            raise _unsupported(f"compressed-tensors group {name!r} has {bits}-bit {kind} weights")
        if w.get("dynamic") or not w.get("symmetric", True):
            raise _unsupported(f"compressed-tensors group {name!r} has dynamic or asymmetric weight scales")
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise _unsupported(f"compressed-tensors group {name!r} has weight strategy {strategy!r}")
        block = _block(w.get("block_structure")) if strategy == "block" else None
        strategies.add((strategy, block))
        if a is not None and (a.get("num_bits") != 8 or a.get("type") != "float"):
            raise _unsupported(
                f"compressed-tensors group {name!r} has {a.get('num_bits')}-bit {a.get('type')} activations"
            )
        if a is not None and not a.get("dynamic"):
            log.info(
                "compressed-tensors group %s: static input scales unused, activations scaled per token", name
            )
        if group.get("output_activations"):
            raise _unsupported(f"compressed-tensors group {name!r} quantizes output activations")
        targets += list(group.get("targets") or ["Linear"])
    if len(strategies) > 1:
        raise _unsupported(
            f"compressed-tensors groups with different weight strategies {sorted(map(str, strategies))}"
        )
    if qc.get("kv_cache_scheme"):
        log.warning("the checkpoint's kv_cache_scheme is not used: the KV cache stays in the model dtype")
    ((strategy, block),) = strategies
    return Fp8Scheme(
        "compressed-tensors",
        block=block,
        per_tensor=strategy == "tensor",
        targets=tuple(targets),
        ignore=tuple(qc.get("ignore") or ()),
    )


def _block(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        raise _unsupported(f"weight block size {value!r} (two integers, e.g. [128, 128])")
    bn, bk = value
    if bn < 1 or bk < 16 or bk & (bk - 1):
        raise _unsupported(f"weight block size {value!r} (the column block must be a power of two >= 16)")
    return bn, bk


# --- the model side -----------------------------------------------------------------------------------------


class _Target(Protocol):
    """loader.Target, as far as this module reads it (a NamedTuple: _replace makes the scale's target;
    its fields are read-only, hence properties here)."""

    @property
    def name(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def shard_dim(self) -> int | None: ...
    @property
    def start(self) -> int: ...
    @property
    def full(self) -> int: ...

    def _replace(
        self,
        *,
        name: str = ...,
        offset: int = ...,
        rows: int = ...,
        shard_dim: int | None = ...,
        start: int = ...,
        full: int = ...,
        broadcast: bool = ...,
    ) -> Self: ...


T = TypeVar("T", bound=_Target)


def _projections(model: nn.Module, targets: Mapping[str, T]) -> dict[str, list[tuple[str, T]]]:
    """Our linear module -> its checkpoint parts (HF module name, weight target): the decoder's *_proj layers."""
    parts: dict[str, list[tuple[str, T]]] = {}
    for hf, t in targets.items():
        if not (hf.endswith("_proj.weight") and t.name.endswith(".weight")):
            continue
        module = t.name[: -len(".weight")]
        if isinstance(model.get_submodule(module), nn.Linear):
            parts.setdefault(module, []).append((hf[: -len(".weight")], t))
    return parts


def _check_device(scheme: Fp8Scheme, dtype: torch.dtype, device: torch.device) -> None:
    if device.type != "cuda":
        return
    if dtype != torch.bfloat16:
        raise ModelLoadError(
            f"FP8 layers on CUDA compute in bfloat16: set dtype bfloat16 or auto (got {dtype})"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ModelLoadError(
            f"FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper); this GPU is {major}.{minor}: "
            "serve a bf16 checkpoint without --quantization fp8"
        )


def _check_shapes(
    module: str, layer: nn.Linear, parts: list[tuple[str, T]], scheme: Fp8Scheme, cuda: bool
) -> None:
    k, n = layer.in_features, layer.out_features
    if scheme.block is None:
        if cuda and (k % 16 or n % 16):
            raise ModelLoadError(
                f"{module} is [{n}, {k}]: FP8 GEMMs need both dimensions multiples of 16; serve this model in bf16"
            )
        return
    bn, bk = scheme.block
    if k % bk:
        raise ModelLoadError(
            f"{module} has {k} input columns, not a multiple of the {bk}-column weight blocks"
        )
    for hf, t in parts:
        edges = [t.offset, t.rows] if t.rows >= 0 else []
        edges += [t.start] if t.shard_dim == 0 else []
        if any(e % bn for e in edges) or (t.shard_dim == 1 and t.start % bk):
            raise ModelLoadError(
                f"{hf}: its rows in {module} (or this rank's tensor-parallel shard) do not start on a "
                f"{bn}x{bk} weight block; lower tensor_parallel_size"
            )


def fp8_layers(
    model: nn.Module, targets: Mapping[str, T], scheme: Fp8Scheme, dtype: torch.dtype, device: torch.device
) -> list[str]:
    """Before the weights load (model still on the meta device): swap every projection the checkpoint
    holds in FP8 for an empty Fp8Linear and return their names. Quantize-on-load swaps nothing yet
    (quantize_on_load does, after loading) but checks the same, and returns the layers it will quantize."""
    _check_device(scheme, dtype, device)
    chosen = []
    for module, parts in _projections(model, targets).items():
        fp8 = [scheme.quantizes(hf) for hf, _ in parts]
        if not any(fp8):
            continue
        if not all(fp8):
            names = ", ".join(hf for hf, _ in parts)
            raise _unsupported(
                f"the parts of one fused layer ({names}) are not all FP8 (quantization_config ignore)"
            )
        layer = cast(nn.Linear, model.get_submodule(module))  # _projections keeps nn.Linear modules only
        _check_shapes(module, layer, parts, scheme, device.type == "cuda")
        if not scheme.on_load:
            _swap(model, module, Fp8Linear.like(layer, scheme.block))
        chosen.append(module)
    if not chosen:
        raise ModelLoadError(
            f"{scheme.describe()}: no decoder layer is FP8 (check quantization_config targets and ignore)"
        )
    log.info("%s: %d FP8 layers", scheme.describe(), len(chosen))
    return chosen


def scale_targets(targets: Mapping[str, T], layers: list[str], scheme: Fp8Scheme) -> dict[str, T]:
    """The checkpoint's scale tensors of the FP8 layers -> where they load, derived from their weights'
    targets: a part's rows of a per-row scale (every row of the part from a per-tensor scale), or its rows
    of blocks. A row-parallel shard (weight split along K) reads all of its output rows' scales."""
    if scheme.on_load:
        return {}
    chosen = set(layers)
    out: dict[str, T] = {}
    for hf, t in targets.items():
        module = t.name[: -len(".weight")]
        if not (hf.endswith(".weight") and t.name.endswith(".weight") and module in chosen):
            continue
        name = hf[: -len("weight")] + scheme.scale_suffix
        if scheme.block is not None:
            bn, bk = scheme.block
            if t.shard_dim == 1:  # row-parallel: this rank's K blocks of every row block
                out[name] = t._replace(
                    name=module + ".weight_scale_inv", start=t.start // bk, full=-(-t.full // bk)
                )
            else:
                rows = -(-t.rows // bn) if t.rows >= 0 else -1
                out[name] = t._replace(
                    name=module + ".weight_scale_inv",
                    offset=t.offset // bn,
                    rows=rows,
                    start=t.start // bn,
                    full=-(-t.full // bn),
                )
        elif scheme.per_tensor:
            out[name] = t._replace(
                name=module + ".weight_scale", shard_dim=None, start=0, full=0, broadcast=True
            )
        elif t.shard_dim == 1:
            out[name] = t._replace(name=module + ".weight_scale", shard_dim=None, start=0, full=0)
        else:
            out[name] = t._replace(name=module + ".weight_scale")
    return out


def check_checkpoint_dtype(
    hf_name: str, tensor: torch.Tensor, dest: torch.Tensor, scheme: Fp8Scheme | None
) -> None:
    """A float8 checkpoint tensor may only load into an FP8 weight, and an FP8 weight only from float8."""
    fp8_in, fp8_dest = tensor.dtype in _FP8_DTYPES, dest.dtype in _FP8_DTYPES
    if fp8_in and scheme is None:
        raise _unsupported(
            f"{hf_name} is {tensor.dtype} but config.json has no quantization_config (a ModelOpt "
            "hf_quant_config.json is not read)"
        )
    if fp8_in and not fp8_dest:
        raise _unsupported(
            f"{hf_name} is {tensor.dtype} in the checkpoint, but only the decoder's projections can be FP8 "
            "here (add it to quantization_config ignore and store it in bf16)"
        )
    if fp8_dest and tensor.dtype != dest.dtype:
        raise ModelLoadError(
            f"{hf_name} is {tensor.dtype} in the checkpoint, but quantization_config makes it an "
            f"{dest.dtype} weight; the checkpoint and config.json's quantization_config disagree"
        )


@torch.no_grad()
def quantize_on_load(model: nn.Module, layers: list[str]) -> None:
    """--quantization fp8: replace each loaded 16-bit projection by its FP8 quantization (per-row scales)."""
    for module in layers:
        # fp8_layers chose them: nn.Linear modules (not yet swapped)
        _swap(model, module, Fp8Linear.quantized(cast(nn.Linear, model.get_submodule(module))))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the 16-bit weights' memory goes back to the device (the KV cache is sized on it)


def _swap(model: nn.Module, module: str, new: nn.Module) -> None:
    parent, _, leaf = module.rpartition(".")
    setattr(model.get_submodule(parent), leaf, new)
