"""Hugging Face model directory -> (LlamaModel, ModelConfig).

Reads config.json for the Llama family (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, Qwen3-MoE, Mixtral),
then streams the safetensors weights (one file, or shards listed in model.safetensors.index.json) into
our fused modules: q/k/v go into one qkv_proj, gate/up into one gate_up_proj, and a sparse layer's
per-expert tensors into two stacked expert parameters (model/moe.py), so the forward pass launches
fewer kernels. Every failure names the file or tensor and what would fix it.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from graphcache.model.config import ModelConfig, ModelLoadError, read_config, resolve_dtype
from graphcache.model.llama import LlamaModel
from graphcache.model.parallel import TensorParallel, vocab_shard
from graphcache.model.quantization import (
    Fp8Scheme,
    check_checkpoint_dtype,
    fp8_layers,
    quantize_on_load,
    resolve_quantization,
    scale_targets,
)

log = logging.getLogger(__name__)

# (weight files done, weight files in all, the file just read), called after each weight file. A
# context variable, so the engine sets it around building its runner and no layer in between passes it.
ShardProgress = Callable[[int, int, str], None]
_shard_progress: contextvars.ContextVar[ShardProgress | None] = contextvars.ContextVar(
    "graphcache_shard_progress", default=None
)


@contextlib.contextmanager
def reporting_shards(callback: ShardProgress) -> Iterator[None]:
    """While open, load_model calls `callback` after each weight file it reads (on this thread)."""
    token = _shard_progress.set(callback)
    try:
        yield
    finally:
        _shard_progress.reset(token)


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(
                f"{index} is unreadable or malformed ({type(e).__name__}: {e}); download it again"
            ) from None
        if not all(isinstance(n, str) for n in names):
            raise ModelLoadError(f"{index} maps tensors to non-file names; download it again")
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


class Target(NamedTuple):
    """Where one checkpoint tensor goes: rows [offset, offset + rows) of our parameter `name` (rows -1: all
    of it), read from the checkpoint's slice [start, start + rows) along `shard_dim` (None: whole)."""

    name: str
    offset: int = 0
    rows: int = -1
    shard_dim: int | None = None
    start: int = 0
    full: int = 0  # the checkpoint tensor's size along shard_dim that config.json implies
    broadcast: bool = False  # a one-element checkpoint tensor fills every row (a per-tensor FP8 scale)


def _hf_targets(config: ModelConfig, tp: TensorParallel | None = None) -> dict[str, Target]:
    """HF tensor name -> Target inside our (possibly fused, possibly sharded) parameters. A rank of a
    tensor-parallel group reads its heads of q/k/v, its columns of o_proj, its intermediate rows of
    gate/up and columns of down, and its vocabulary rows (model/parallel.py has the split)."""
    tp = tp or TensorParallel.single()
    r, n = tp.rank, tp.size
    q = config.num_heads * config.head_dim // n  # this rank's share of each
    kv = config.num_kv_heads * config.head_dim // n
    inter = config.intermediate_size // n

    def split(name: str, offset: int, rows: int, dim: int) -> Target:
        # Whole tensor at tp size 1: today's loading path, byte for byte.
        return Target(name, offset, rows) if n == 1 else Target(name, offset, rows, dim, r * rows, rows * n)

    t: dict[str, Target] = {"model.norm.weight": Target("norm.weight")}
    vocab_names = {"model.embed_tokens.weight": "embed_tokens.weight"}
    if not config.tie_word_embeddings:
        vocab_names["lm_head.weight"] = "lm_head.weight"
    for hf, ours in vocab_names.items():
        if n == 1:
            t[hf] = Target(ours)
        else:
            start, rows, _ = vocab_shard(config.vocab_size, r, n)
            t[hf] = Target(ours, 0, rows, 0, start, config.vocab_size)
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        kinds = ["weight", "bias"] if config.qkv_bias else ["weight"]
        for kind in kinds:
            t[hf + f"self_attn.q_proj.{kind}"] = split(ours + f"attn.qkv_proj.{kind}", 0, q, 0)
            t[hf + f"self_attn.k_proj.{kind}"] = split(ours + f"attn.qkv_proj.{kind}", q, kv, 0)
            t[hf + f"self_attn.v_proj.{kind}"] = split(ours + f"attn.qkv_proj.{kind}", q + kv, kv, 0)
        t[hf + "self_attn.o_proj.weight"] = (
            Target(ours + "attn.o_proj.weight")
            if n == 1
            else Target(ours + "attn.o_proj.weight", 0, -1, 1, r * q, q * n)
        )
        if config.o_bias:  # added once after the all-reduce: every rank holds all of it
            t[hf + "self_attn.o_proj.bias"] = Target(ours + "attn.o_proj.bias")
        if config.qk_norm:
            t[hf + "self_attn.q_norm.weight"] = Target(ours + "attn.q_norm.weight")
            t[hf + "self_attn.k_norm.weight"] = Target(ours + "attn.k_norm.weight")
        if i in config.moe_layers:
            t.update(_expert_targets(config, hf, ours + "mlp.", tp))
        else:
            t[hf + "mlp.gate_proj.weight"] = split(ours + "mlp.gate_up_proj.weight", 0, inter, 0)
            t[hf + "mlp.up_proj.weight"] = split(ours + "mlp.gate_up_proj.weight", inter, inter, 0)
            t[hf + "mlp.down_proj.weight"] = (
                Target(ours + "mlp.down_proj.weight")
                if n == 1
                else Target(ours + "mlp.down_proj.weight", 0, -1, 1, r * inter, inter * n)
            )
        t[hf + "input_layernorm.weight"] = Target(ours + "input_norm.weight")
        t[hf + "post_attention_layernorm.weight"] = Target(ours + "post_attn_norm.weight")
    return t


def _expert_targets(config: ModelConfig, hf: str, ours: str, tp: TensorParallel) -> dict[str, Target]:
    """A sparse layer's router and per-expert tensors (Qwen3-MoE: mlp.gate, mlp.experts.N.{gate,up,down}_proj;
    Mixtral: block_sparse_moe.gate, block_sparse_moe.experts.N.{w1,w3,w2}) -> rows of the stacked expert
    parameters of model/moe.py: expert e's gate and up at rows e*2I and e*2I + I of [E * 2I, H], its down
    at rows e*H of [E * H, I]. At tp > 1 a rank reads its I/N gate/up rows and down columns of each."""
    r, n = tp.rank, tp.size
    inter, hidden = config.moe_intermediate_size // n, config.hidden_size
    if config.architecture == "mixtral":
        prefix, names = hf + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        prefix, names = hf + "mlp.", ("gate_proj", "up_proj", "down_proj")
    gate_up, down = ours + "experts_gate_up", ours + "experts_down"
    t = {prefix + "gate.weight": Target(ours + "router")}
    for e in range(config.num_experts):
        ex = f"{prefix}experts.{e}."
        for half, name in enumerate(names[:2]):  # gate, then up
            rows = e * 2 * inter + half * inter
            t[f"{ex}{name}.weight"] = (
                Target(gate_up, rows, inter)
                if n == 1
                else Target(gate_up, rows, inter, 0, r * inter, inter * n)
            )
        t[f"{ex}{names[2]}.weight"] = (
            Target(down, e * hidden, hidden)
            if n == 1
            else Target(down, e * hidden, hidden, 1, r * inter, inter * n)
        )
    return t


def _read(f, hf_name: str, target: Target, dest: torch.Tensor) -> torch.Tensor:
    """The checkpoint tensor, or this rank's slice of it (only that slice is read from disk)."""
    if target.shard_dim is None:
        return f.get_tensor(hf_name)
    sl = f.get_slice(hf_name)
    full, dim = list(sl.get_shape()), target.shard_dim
    if len(full) != dest.dim() or full[dim] != target.full:  # a slice alone could fit a wrong checkpoint
        raise ModelLoadError(
            f"shape mismatch for {hf_name}: checkpoint has {tuple(full)}, config.json implies "
            f"{target.full} along dim {dim}; config.json and the weights disagree"
        )
    index = [slice(None)] * len(full)
    index[dim] = slice(target.start, target.start + dest.shape[dim])
    return sl[tuple(index)]


def kv_cache_scale_names(path: Path) -> list[str]:
    """The checkpoint's calibrated KV-cache scales (`*.k_scale`, `*.v_scale`: llm-compressor's kv_cache_scheme,
    vLLM's FP8 cache scales), read from the shards' headers only. The FP8 cache here stores K and V with a
    scale of 1 (model/kv_dtype.py); the runner warns when a checkpoint calibrated others."""
    names: list[str] = []
    for file in weight_files(path):
        with _open(file) as f:
            names += [n for n in f.keys() if n.endswith((".k_scale", ".v_scale"))]  # noqa: SIM118
    return names


def _open(file: Path):
    """safe_open(file), or ModelLoadError: a short file or a bad header fails here, before any data is read."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors' own error type: a short file or a bad header
        raise ModelLoadError(
            f"{file} is not a readable safetensors file ({type(e).__name__}: {e}); it is truncated "
            "or corrupt: download it again"
        ) from None


def _checkpoint_shape(target: Target, param: torch.Tensor) -> tuple[int, ...]:
    """The shape config.json implies for the checkpoint tensor that loads into `target` of `param`: the
    rows it fills, whole along a sharded dimension (a rank reads its slice of the full tensor)."""
    dest = param if target.rows < 0 else param.narrow(0, target.offset, target.rows)
    shape = list(dest.shape)
    if target.shard_dim is not None:
        shape[target.shard_dim] = target.full
    return tuple(shape)


# The safetensors header's dtype names (those torch has).
_HEADER_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def check_checkpoint(
    path: Path,
    files: list[Path],
    targets: dict[str, Target],
    params: dict[str, torch.nn.Parameter],
    scheme: Fp8Scheme | None = None,
) -> None:
    """Before any weight is allocated (params may be on the meta device), from the safetensors headers
    alone (no tensor data is read): every file's header is readable (a truncated or corrupt file fails
    here), each tensor has the shape config.json implies and a dtype its parameter takes (as loading
    checks them, in the same order), and every tensor config.json implies is in one of the files.
    ModelLoadError names the file, the tensor and both shapes."""
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in files:
        with _open(file) as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if hf_name in targets:
                    header = f.get_slice(hf_name)
                    found[hf_name] = (file, tuple(header.get_shape()), header.get_dtype())
    for hf_name, (file, shape, dtype) in found.items():
        target = targets[hf_name]
        param = params[target.name]
        expected = _checkpoint_shape(target, param)
        if shape != expected and not (target.broadcast and math.prod(shape) == 1):
            raise ModelLoadError(
                f"shape mismatch for {hf_name} in {file}: checkpoint has {shape}, config.json implies "
                f"{expected}; config.json and the weights disagree: download both again (the same revision)"
            )
        if dtype in _HEADER_DTYPES:
            check_checkpoint_dtype(
                hf_name, torch.empty(0, dtype=_HEADER_DTYPES[dtype], device="meta"), param, scheme
            )
    missing = [hf for hf in targets if hf not in found]
    if missing:
        first = missing[0]
        shape = _checkpoint_shape(targets[first], params[targets[first].name])
        others = "".join(f", {name}" for name in missing[1:3])
        raise ModelLoadError(
            f"{len(missing)} tensors missing from the safetensors in {path}, e.g. {first} (config.json "
            f"implies shape {shape}){others}; the download is incomplete or config.json is not this "
            "checkpoint's: download the model again"
        )


def _base_model_naming(files: list[Path], targets: dict[str, Target]) -> tuple[dict[str, Target], bool]:
    """The targets as the checkpoint names them, and whether it has no LM head. sentence-transformers saves the
    base model (Qwen3-Embedding, 4B and 8B): tensor names without "model." and no lm_head.weight. Such a
    checkpoint serves embeddings; its missing head is tied to the embeddings, so a step's throwaway sample
    of a pooling row has weights to read (its logits are never a generation's)."""
    names: set[str] = set()
    for file in files:
        with _open(file) as f:
            names.update(f.keys())  # noqa: SIM118 (safe_open is not a dict)
    if "model.embed_tokens.weight" not in names and "embed_tokens.weight" in names:
        targets = {hf.removeprefix("model."): t for hf, t in targets.items()}
    headless = "lm_head.weight" in targets and "lm_head.weight" not in names
    if headless:
        targets = {hf: t for hf, t in targets.items() if hf != "lm_head.weight"}
        log.warning(
            "the checkpoint has no lm_head.weight (a base model, as embedding checkpoints are saved): the head is "
            "tied to the embeddings; serve it for embeddings (--runner pooling), not for text"
        )
    return targets, headless


def _load_file(
    file: Path,
    targets: dict[str, Target],
    params: dict[str, torch.nn.Parameter],
    config: ModelConfig,
    loaded: set[str],
    scheme: Fp8Scheme | None = None,
) -> None:
    """Copy one safetensors file's tensors into their parameters; adds their names to `loaded`."""
    with _open(file) as f:
        for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            target = targets.get(hf_name)
            if target is None:
                if scheme is not None and scheme.unused(hf_name):  # static activation / KV-cache scales
                    continue
                if not hf_name.endswith("rotary_emb.inv_freq") and hf_name != "lm_head.weight":
                    log.warning(
                        "ignoring tensor %s from %s (not used by %s)", hf_name, file.name, config.architecture
                    )
                continue
            param = params[target.name]
            dest = param.data if target.rows < 0 else param.data.narrow(0, target.offset, target.rows)
            tensor = _read(f, hf_name, target, dest)
            if target.broadcast and tensor.numel() == 1:
                tensor = tensor.reshape(()).expand(dest.shape)
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ModelLoadError(
                    f"shape mismatch for {hf_name} in {file.name}: checkpoint has {tuple(tensor.shape)}, "
                    f"config.json implies {tuple(dest.shape)}; config.json and the weights disagree"
                )
            check_checkpoint_dtype(hf_name, tensor, dest, scheme)
            dest.copy_(tensor.to(dest.dtype))  # the model dtype, or FP8 weights and fp32 scales as they are
            loaded.add(hf_name)


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    *,
    max_positions: int | None = None,
    tp: TensorParallel | None = None,
    quantization: str = "auto",
) -> tuple[LlamaModel, ModelConfig]:
    """Build the model on `device` in `dtype` and fill it from the directory's safetensors.

    max_positions bounds the rotary cos/sin table (default: the config's max_position_embeddings).
    tp: this process's tensor-parallel shard (model/parallel.py): it reads only its slices of the same
    checkpoint every rank reads. None = the whole model.
    quantization: "auto" (as config.json's quantization_config says) or "fp8" (FP8 projections, quantized
    on load if the checkpoint is 16-bit): model/quantization.py.
    Returns (LlamaModel, ModelConfig); the config is the whole model's (heads etc. before the split)."""
    path = Path(path)
    config = read_config(path)
    scheme = resolve_quantization(config, quantization)
    dtype = resolve_dtype(dtype)
    device = torch.device(device)
    files = weight_files(path)
    # Build on the meta device, then allocate uninitialized storage: no wasted random init of
    # billions of weights that are overwritten right after.
    with torch.device("meta"):
        model = LlamaModel(config, max_positions=max_positions, tp=tp).to(dtype)
    targets = _hf_targets(config, model.tp)
    fp8 = fp8_layers(model, targets, scheme, dtype, device) if scheme is not None else []
    if scheme is not None:
        targets |= scale_targets(targets, fp8, scheme)
    targets, headless = _base_model_naming(files, targets)
    # The checkpoint against config.json, from the safetensors headers: a mismatch, a missing tensor or
    # a truncated file is refused before the model's memory is allocated.
    check_checkpoint(path, files, targets, dict(model.named_parameters()), scheme)
    model.to_empty(device=device)  # allocated once, already in the target dtype
    if model.tp.enabled:  # the last vocabulary shard's padding rows are read by no checkpoint tensor
        model.embed_tokens.weight.data.zero_()
        model.lm_head.weight.data.zero_()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    progress = _shard_progress.get()
    log.info("loading %d weight file(s) from %s", len(files), path)
    for done, file in enumerate(files, start=1):
        _load_file(file, targets, params, config, loaded, scheme)
        log.info("loaded weights %d/%d (%s)", done, len(files), file.name)
        if progress is not None:
            progress(done, len(files), file.name)
    missing = [hf for hf in targets if hf not in loaded]
    if missing:
        raise ModelLoadError(
            f"{len(missing)} tensors missing from the safetensors in {path}, e.g. {missing[:5]}"
        )
    if scheme is not None and scheme.on_load:
        quantize_on_load(model, fp8)
    if config.tie_word_embeddings or headless:
        model.tie_weights()
    model.init_rotary(device)
    model.eval()
    return model, config
