"""Random-weight checkpoints at real models' shapes, for benchmarks: `--make-model SHAPE:DIR`.

  qwen05b  Qwen2.5-0.5B (config.json of Qwen/Qwen2.5-0.5B): 24 layers, hidden 896, 14/2 heads, vocab 151936.
  llama8b  Llama-3-8B (config.json of meta-llama/Meta-Llama-3-8B): 32 layers, hidden 4096, 32/8 heads,
           intermediate 14336, vocab 128256, rope theta 500000, 8192 positions; bf16, ~16 GB.
  llama8btied  llama8b with the LM head tied to the embedding (15.5 GB): a random model of this init then
           predicts its own last token at every position (self logit ~2.7x the best other, measured on the
           CPU layer by layer), so greedy outputs repeat their context, as the tied qwen05b's do: the 8B
           workload on which every n-gram step has a draft (issue 37's TPOT formula).
  llama1b  Llama-3.2-1B (config.json of meta-llama/Llama-3.2-1B): 16 layers, hidden 2048, 32/8 heads of 64,
           intermediate 8192, vocab 128256, tied; bf16, ~2.5 GB: an unrelated draft for llama8b (the same
           tokenizer and vocab, other weights: speculation's acceptance near 0).
  qwen3moe Qwen3-30B-A3B's layer (config.json of Qwen/Qwen3-30B-A3B: hidden 2048, 32/4 heads of 128, 128
           experts of 768 rows, top-8, vocab 151936) with 16 of its 48 layers: bf16, ~21 GB, ~10.6B weights
           of which ~1.1B run per token (the expert GEMMs are the real model's, the step a third of it).
  mixtral  Mixtral-8x7B's layer (config.json of mistralai/Mixtral-8x7B-v0.1: hidden 4096, 32/8 heads of 128, 8
           experts of 14336 rows, top-2, vocab 32000) with 8 of its 32 layers: bf16, ~24 GB, ~11.8B weights of
           which ~3.3B run per token.
  tiny     the embedded default shape (graphcache.model.tiny.DEFAULT_SHAPE): CPU smoke runs.
  tinywide tiny with 8,192 ids past the tokenizer's 1,024, as the real shapes: most drawn ids have no text.

Every shape comes from graphcache.model.tiny.make_tiny_model (its tokenizer, config and weight names);
the tokenizer is the embedded byte-level BPE (1024 ids), the embedding and LM head are widened to the
real vocab, so ids past the tokenizer decode to nothing (benchmarks send token-id prompts < 10000).
Shapes too big for make_tiny_model's CPU fp32 weights (llama8b: 32 GB fp32) are written by the same
code on the GPU in bf16: the weights are drawn on the device and saved in shards (about a minute).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
from pathlib import Path

SHAPES = {
    "qwen05b": dict(
        arch="qwen2",
        hidden=896,
        layers=24,
        heads=14,
        kv_heads=2,
        intermediate=4864,
        head_dim=64,
        max_positions=32768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        model_vocab_size=151936,
    ),
    "llama8b": dict(
        arch="llama",
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        intermediate=14336,
        head_dim=128,
        max_positions=8192,
        rope_theta=500_000.0,
        tie_word_embeddings=False,
        model_vocab_size=128256,
    ),
    "llama1b": dict(
        arch="llama",
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        intermediate=8192,
        head_dim=64,
        max_positions=8192,
        rope_theta=500_000.0,
        tie_word_embeddings=True,
        model_vocab_size=128256,
    ),
    "qwen3moe": dict(
        arch="qwen3_moe",
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=4,
        intermediate=6144,
        head_dim=128,
        max_positions=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        model_vocab_size=151936,
        experts=128,
        experts_per_tok=8,
        moe_intermediate=768,
    ),
    "mixtral": dict(
        arch="mixtral",
        hidden=4096,
        layers=8,
        heads=32,
        kv_heads=8,
        intermediate=14336,
        head_dim=128,
        max_positions=32768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        model_vocab_size=32000,
        experts=8,
        experts_per_tok=2,
        moe_intermediate=14336,
    ),
    "tiny": dict(
        arch="llama", hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384, max_positions=2048
    ),
}
SHAPES["llama8btied"] = dict(SHAPES["llama8b"], tie_word_embeddings=True)
# tiny with the vocabulary widened past the tokenizer's 1,024 ids, as every real shape here: most ids the
# model draws decode to no text (what a served benchmark of a big shape sees)
SHAPES["tinywide"] = dict(SHAPES["tiny"], model_vocab_size=8192)
# Shapes whose fp32 weights would not fit a quick CPU write: drawn on the GPU in bf16.
ON_DEVICE = {"llama8b", "llama8btied", "llama1b", "qwen3moe", "mixtral"}
MOE_KEYS = ("experts", "experts_per_tok", "moe_intermediate")  # make_tiny_model's sparse-MLP arguments


def make_model(shape: str, out: Path) -> Path:
    """Write a random checkpoint of SHAPES[shape] to `out` (skipped when out/config.json says it is there)."""
    import torch  # here, not at the top: served benchmarks' client processes import this module
    from graphcache.model import tiny

    if shape not in SHAPES:
        raise SystemExit(f"unknown model shape {shape!r}; choose one of {', '.join(SHAPES)}")
    kwargs = dict(SHAPES[shape])
    marker = out / "shape.txt"
    if marker.is_file() and marker.read_text().strip() == shape and (out / "config.json").is_file():
        return out
    if "model_vocab_size" not in inspect.signature(tiny.make_tiny_model).parameters:
        vocab = kwargs.pop("model_vocab_size", None)
        print(
            f"note: make_tiny_model has no model_vocab_size; the LM head uses the trained BPE vocab, not {vocab}",
            file=sys.stderr,
        )
    if shape in ON_DEVICE and torch.cuda.is_available():
        _make_on_device(tiny, out, kwargs)
    else:
        tiny.make_tiny_model(out, seed=0, **kwargs)
    marker.write_text(shape + "\n")
    return out


def _make_on_device(tiny, out: Path, kwargs: dict) -> None:
    """make_tiny_model's files at a 1-layer stand-in shape (tokenizer, config, generation config), then the
    real config and weights: tiny._random_weights drawn with a CUDA generator under torch.device('cuda'),
    cast to bf16 and copied to the host for safetensors (peak GPU memory: fp32 of all weights plus
    their bf16 copies, 48 GB for llama8b)."""
    import torch

    small = dict(kwargs, layers=1, intermediate=64, model_vocab_size=None)
    if "experts" in kwargs:
        small.update(experts=2, experts_per_tok=1, moe_intermediate=16)
    tiny.make_tiny_model(out, seed=0, **small)
    (out / "model.safetensors").unlink()
    cfg = json.loads((out / "config.json").read_text())
    vocab = max(cfg["vocab_size"], kwargs.get("model_vocab_size") or 0)
    cfg.update(
        vocab_size=vocab,
        num_hidden_layers=kwargs["layers"],
        intermediate_size=kwargs["intermediate"],
        torch_dtype="bfloat16",
    )
    if kwargs["arch"] in ("qwen2", "qwen3", "qwen3_moe"):
        cfg["max_window_layers"] = kwargs["layers"]
    moe = {k: kwargs[k] for k in MOE_KEYS if k in kwargs} or None
    if moe and kwargs["arch"] == "mixtral":  # the real experts (the stand-in had two small ones)
        cfg.update(num_local_experts=moe["experts"], intermediate_size=moe["moe_intermediate"])
    elif moe:
        cfg.update(num_experts=moe["experts"], moe_intermediate_size=moe["moe_intermediate"])
    if moe:
        cfg["num_experts_per_tok"] = moe["experts_per_tok"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):
        weights = tiny._random_weights(
            kwargs["arch"],
            gen,
            vocab,
            kwargs["hidden"],
            kwargs["layers"],
            kwargs["heads"],
            kwargs["kv_heads"],
            kwargs["intermediate"],
            kwargs["head_dim"],
            kwargs["tie_word_embeddings"],
            moe,
        )
    weights = {name: w.to(torch.bfloat16).cpu() for name, w in weights.items()}
    torch.cuda.empty_cache()
    tiny._save_weights(weights, out, shards=8)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", type=Path, help="Hugging Face model directory")
    ap.add_argument(
        "--make-model",
        metavar="SHAPE:DIR",
        help=f"write a random checkpoint of SHAPE ({', '.join(SHAPES)}) to DIR and use it if --model is unset",
    )
    ap.add_argument("--make-qwen05b", type=Path, metavar="DIR", help="the same as --make-model qwen05b:DIR")


def path_or_make(text: str | None) -> Path | None:
    """A model directory, or SHAPE:DIR written by make_model first (a name that is not a shape is a path)."""
    if not text:
        return None
    shape, sep, path = text.partition(":")
    return make_model(shape, Path(path)) if sep and shape in SHAPES else Path(text)


def resolve_model(args: argparse.Namespace) -> Path | None:
    """--model, else the checkpoint --make-model / --make-qwen05b writes (None when neither is given)."""
    spec = args.make_model or (f"qwen05b:{args.make_qwen05b}" if args.make_qwen05b else None)
    made = None
    if spec:
        shape, sep, path = spec.partition(":")
        if not sep:
            raise SystemExit(f"--make-model wants SHAPE:DIR, e.g. llama8b:/tmp/llama8b (got {spec!r})")
        made = make_model(shape, Path(path))
        print(f"model {shape} at {made}", file=sys.stderr)
    return args.model or made


def smoke_model(args: argparse.Namespace) -> None:
    """--smoke without a model named: the tiny model, written to a fresh temp folder."""
    if not (args.model or args.make_model or args.make_qwen05b):
        args.make_model = f"tiny:{tempfile.mkdtemp(prefix='bench-smoke-')}"


def require_model(args: argparse.Namespace) -> Path:
    """resolve_model, or exit naming the flags that give a model."""
    model = resolve_model(args)
    if model is None:
        raise SystemExit("--model DIR (or --make-model SHAPE:DIR, or --smoke) is required")
    return model
