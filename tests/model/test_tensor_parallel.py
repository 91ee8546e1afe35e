"""Tensor parallelism on the CPU: 2 gloo processes each load their shard of the same checkpoint through
the real loader and runner, and their logits equal the unsharded model's (model/parallel.py)."""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from graphcache.model.config import ModelLoadError, read_config
from graphcache.model.llama import LlamaModel
from graphcache.model.parallel import TensorParallel, vocab_shard
from helpers_dist import gloo_group, run_ranks
from helpers_model import cpu_settings, prompt_ids, tiny_checkpoint

PROMPTS = (prompt_ids(7, seed=1), prompt_ids(5, seed=2))  # two different inputs
TABLES = ([0, 1], [2, 3])  # block_size 4: 8 tokens each


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """A prefill of both prompts, then a decode step of both: [2, V] fp32 logits per step."""
    prefill = StepPlan.standalone(
        [StepSeq(list(p), 0, t, need_logits=True) for p, t in zip(PROMPTS, TABLES, strict=True)]
    )
    first = runner.execute(prefill).logits.float().clone()
    nxt = first.argmax(-1).tolist()
    decode = StepPlan.standalone(
        [
            StepSeq([nxt[i]], len(p), t, need_logits=True)
            for i, (p, t) in enumerate(zip(PROMPTS, TABLES, strict=True))
        ]
    )
    second = runner.execute(decode).logits.float().clone()
    return [first, second]


def _parity_rank(rank: int, world: int, port: int, paths: list[str], out_dir: str) -> None:
    with gloo_group(rank, world, port):
        tp = TensorParallel.from_group()
        results = {}
        for path in paths:
            for eager in (True, False):  # eager steps, and the graph cache's (eager-backend) captures
                runner = ModelRunner(
                    cpu_settings(path, tensor_parallel_size=world, enforce_eager=eager), tp=tp
                )
                kv = runner.kv_storage.shape  # [layers, 2, blocks, bs, K / N, D]
                assert kv[4] == runner.model_config.num_kv_heads // world, kv
                results[(path, eager)] = _steps(runner)
        torch.save(results, f"{out_dir}/rank{rank}.pt")


CHECKPOINTS = {
    "llama": dict(arch="llama"),  # GQA 4 / 2 heads, untied head
    # Biased q/k/v, tied embeddings, and a vocabulary of 1027 rows: not divisible by 2 (padded shard).
    "qwen2-odd-vocab": dict(arch="qwen2", model_vocab_size=1027),
    # Experts split by their intermediate rows, the router replicated (model/moe.py).
    "qwen3_moe": dict(arch="qwen3_moe"),
}


def test_sharded_logits_equal_unsharded(tmp_path):
    paths = {name: str(tiny_checkpoint(**kw)) for name, kw in CHECKPOINTS.items()}
    assert read_config(paths["qwen2-odd-vocab"]).vocab_size % 2 == 1
    run_ranks(_parity_rank, 2, list(paths.values()), str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, path in paths.items():
            ref = _steps(ModelRunner(cpu_settings(path, enforce_eager=True)))
            for eager in (True, False):
                for step, (a, b) in enumerate(zip(got[(path, eager)], ref, strict=True)):
                    assert a.shape == b.shape
                    assert b.abs().max() > 0.1  # real logits, not a vacuous match of zeros
                    torch.testing.assert_close(
                        a,
                        b,
                        atol=1e-4,
                        rtol=1e-4,
                        msg=lambda m, n=name, r=rank, s=step, e=eager: (
                            f"{n} rank {r} step {s} eager={e}: {m}"
                        ),
                    )


def test_kv_heads_not_divisible_is_refused_with_the_fix():
    config = read_config(tiny_checkpoint("llama"))  # 4 heads, 2 KV heads
    with (
        pytest.raises(ModelLoadError, match="set tensor_parallel_size to a divisor of 2"),
        torch.device("meta"),
    ):
        LlamaModel(config, tp=TensorParallel(rank=0, size=4))


def test_vocab_shards_cover_the_vocabulary_once():
    for vocab, n in [(1027, 2), (1024, 4), (5, 4), (3, 8)]:
        shards = [vocab_shard(vocab, r, n) for r in range(n)]
        rows = [i for start, real, _ in shards for i in range(start, start + real)]
        assert rows == list(range(vocab))
        assert len({per for _, _, per in shards}) == 1


def test_runner_without_its_shard_is_refused_with_the_fix():
    with pytest.raises(RuntimeError, match="tp=TensorParallel.from_group.*or let the Engine start the ranks"):
        ModelRunner(cpu_settings(tiny_checkpoint("llama"), tensor_parallel_size=2))
