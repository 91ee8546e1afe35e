"""Shared helpers for tests that need tiny checkpoints, a CPU runner, or HF reference logits.

Checkpoints are written once per process per recipe (make_tiny_model is deterministic) into a
temp dir, so many tests can share them cheaply.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import torch
from graphcache.config import Settings
from graphcache.model.tiny import make_tiny_model

_ROOT: Path | None = None
_MADE: dict[str, Path] = {}


def tiny_checkpoint(arch: str = "llama", **kwargs) -> Path:
    """A tiny HF checkpoint of `arch` (kwargs go to make_tiny_model), cached for the process."""
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="graphcache-tiny-"))
        atexit.register(shutil.rmtree, _ROOT, True)
    key = f"{arch}-" + "-".join(f"{k}={v}" for k, v in sorted(kwargs.items()))
    if key not in _MADE:
        _MADE[key] = make_tiny_model(_ROOT / f"m{len(_MADE)}", arch=arch, **kwargs)
    return _MADE[key]


def gqa_checkpoint() -> Path:
    """The GPU tests' tiny Qwen2: qkv bias and GQA (8 query heads over 2 KV heads, head_dim 32) both on the
    captured path, 4 layers; the untied head keeps logits ~1-5."""
    return tiny_checkpoint(
        "qwen2", hidden=256, layers=4, heads=8, kv_heads=2, intermediate=512, tie_word_embeddings=False
    )


def cpu_settings(model: Path, **overrides) -> Settings:
    """Small, fast CPU settings: eager backend, small capture sizes, no warmup unless asked. Every miss
    captures at once and no capture-time budget applies, and speculation's payoff rule (which times
    steps) is off, so which steps replay or speculate does not depend on how busy the machine is (the
    admission, budget and payoff tests set their own)."""
    base = dict(
        model=model,
        device="cpu",
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=256,
        block_size=4,
        num_kv_blocks=256,
        capture_sizes=[1, 2, 4, 8, 16, 32, 64],
        max_capture_size=64,
        warmup_decode_sizes=[],
        warmup_mixed_sizes=[],
        max_model_len=256,
        admission="always",
        capture_time_share=1.0,
        speculative_step_payoff=False,
    )
    base.update(overrides)
    return Settings(**base)


def cuda_settings(model: Path, **overrides) -> Settings:
    """cpu_settings for the GPU tests' tiny runners: bf16 on CUDA, 16-token KV blocks, captures up to 256
    tokens (the overrides change any of it)."""
    base = dict(
        device="cuda",
        dtype="bfloat16",
        block_size=16,
        num_kv_blocks=512,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        max_model_len=512,
        capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        max_capture_size=256,
    )
    base.update(overrides)
    return cpu_settings(model, **base)


@torch.no_grad()
def hf_logits(
    path: Path, ids: list[int], dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> torch.Tensor:
    """[len(ids), V] fp32 logits of transformers' own implementation over the full sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model(torch.tensor([ids], device=device)).logits[0].float().cpu()


class Blocks:
    """Hands out disjoint KV block tables, like the engine's block manager, for runner tests."""

    def __init__(self, block_size: int, first: int = 0) -> None:
        self.block_size, self.next = block_size, first

    def table(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        table = list(range(self.next, self.next + n))
        self.next += n
        return table


def prompt_ids(n: int, seed: int = 0, vocab: int = 500) -> list[int]:
    """n token ids drawn from the trained vocab (ids 5.. skip the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()


def run_alone(runner, ids: list[int], table: list[int], chunk: int | None = None) -> list[torch.Tensor]:
    """Feed ids through the runner as one sequence: prefill (optionally in chunks), return the
    logits row of every step ([V] fp32 each)."""
    from graphcache.engine.plan import StepPlan, StepSeq

    out, pos, chunk = [], 0, chunk or len(ids)
    while pos < len(ids):
        part = ids[pos : pos + chunk]
        logits = runner.execute(StepPlan.standalone([StepSeq(part, pos, table, need_logits=True)])).logits
        out.append(logits[0].clone())
        pos += len(part)
    return out


def recorded_descriptors(cache) -> list:
    """Every descriptor cache.run (a runner's graph cache) is asked for from now on, in order; the runs
    themselves are unchanged."""
    seen: list = []
    run = cache.run

    def recording_run(desc, real_tokens=None):
        seen.append(desc)
        return run(desc, real_tokens=real_tokens)

    cache.run = recording_run
    return seen
