"""Embedding (pooling) requests through the engine on the CPU, against transformers' own vectors.

A pooling request is a prefill-only request: its chunks batch with others through the same steps, mean pooling
accumulates across chunks, last-token pooling takes the last chunk's last row; its KV blocks are free right after.
"""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.pooling import PoolingSpec
from graphcache.engine.sched.scheduler import SchedulerOutput
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.worker.runner import ModelRunner
from graphcache.model.embedding_config import embedding_config
from helpers_embedding import embedding_checkpoint, hf_embedding
from helpers_model import cpu_settings, prompt_ids

TOL = 1e-4


def make_core(path, **overrides) -> EngineCore:
    settings = cpu_settings(path, **overrides)
    return EngineCore(ModelRunner(settings), settings)


def embed(
    core: EngineCore, prompts: dict[str, list[int]], spec: PoolingSpec, between=None
) -> dict[str, Sequence]:
    """Add every prompt as a pooling request, step until all are done; the finished sequences by id."""
    seqs = {}
    for rid, ids in prompts.items():
        seq = Sequence(rid, list(ids), SamplingParams(temperature=0, pooling=spec), stream=False)
        core.check(seq)
        core.add_request(seq)
        seqs[rid] = seq
    finals = {}
    for step in range(1000):
        if not core.has_work():
            break
        if between is not None:
            between(step, core)
        for out in core.step():
            if out.finished and out.request_id in prompts:
                finals[out.request_id] = out
    assert set(finals) == set(prompts)
    for rid, out in finals.items():
        assert out.finish_reason == "stop", out.error
        assert out.token_ids == [] and out.completion_tokens == 0
        assert out.prompt_tokens == len(prompts[rid])
        seqs[rid].embedding = out.embedding
    assert core.block_manager.num_free == core.block_manager.num_usable, "KV blocks freed right after"
    return seqs


def assert_close(got, want: torch.Tensor) -> None:
    got = torch.tensor(got)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_batch_of_lengths_and_a_chunked_prompt_equal_hf(pooling, async_scheduling):
    """Prompts of different lengths batched together, one longer than the step's token budget (chunked over
    three steps): each vector equals transformers' hidden states pooled and normalized by hand."""
    path = embedding_checkpoint(pooling)
    prompts = {f"r{n}": prompt_ids(n, seed=n) for n in (1, 5, 17, 40)}
    prompts["long"] = prompt_ids(150, seed=7)  # > max_num_batched_tokens = 64
    core = make_core(path, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    seqs = embed(core, prompts, PoolingSpec(pooling))
    for rid, ids in prompts.items():
        assert_close(seqs[rid].embedding, hf_embedding(path, ids, pooling))
        assert abs(torch.tensor(seqs[rid].embedding).norm().item() - 1) < 1e-5


def test_a_base_model_checkpoint_without_lm_head():
    """Saved as sentence-transformers saves Qwen3-Embedding 4B/8B (Qwen3Model, no "model." prefix, no LM head):
    it loads, and its vectors equal transformers'."""
    path = embedding_checkpoint("last", base_model=True)
    prompts = {f"r{n}": prompt_ids(n, seed=n) for n in (3, 20, 70)}
    core = make_core(path, max_num_batched_tokens=32)
    seqs = embed(core, prompts, PoolingSpec("last"))
    for rid, ids in prompts.items():
        assert_close(seqs[rid].embedding, hf_embedding(path, ids, "last"))


def test_unnormalized_and_cut_vectors():
    path = embedding_checkpoint("mean", matryoshka=True)
    ids = prompt_ids(30, seed=3)
    core = make_core(path, max_num_batched_tokens=16)
    raw = embed(core, {"a": ids}, PoolingSpec("mean", normalize=False))["a"].embedding
    assert_close(raw, hf_embedding(path, ids, "mean", normalize=False))
    cut = embed(core, {"b": ids}, PoolingSpec("mean", dimensions=16))["b"].embedding
    assert len(cut) == 16
    assert_close(cut, hf_embedding(path, ids, "mean", dimensions=16))


def test_preempted_mean_pooling_starts_over():
    """A mean-pooling request preempted between its chunks re-prefills from position 0: the worker pools the
    recomputed prompt from the start, so no chunk counts twice."""
    path = embedding_checkpoint("mean")
    ids = prompt_ids(60, seed=11)

    def preempt_once(step, core):
        seq = core.requests.get("p")
        if step == 2 and seq is not None and seq.num_computed_tokens:
            core.scheduler._preempt(seq, SchedulerOutput())

    core = make_core(path, max_num_batched_tokens=16)
    seq = embed(core, {"p": ids}, PoolingSpec("mean"), between=preempt_once)["p"]
    assert seq.num_preemptions == 1
    assert_close(seq.embedding, hf_embedding(path, ids, "mean"))


def test_last_pooling_uses_the_prefix_cache_mean_does_not():
    """Last-token pooling may take cached blocks (its last token is always computed); mean pooling reads every
    position's hidden state, so it never does. Both still equal the reference."""
    ids = prompt_ids(40, seed=5)
    for pooling, cached in (("last", True), ("mean", False)):
        path = embedding_checkpoint(pooling)
        core = make_core(path, enable_prefix_caching=True)
        embed(core, {"a": ids}, PoolingSpec(pooling))
        seq = embed(core, {"b": ids}, PoolingSpec(pooling))["b"]
        assert (seq.num_cached_tokens > 0) is cached
        assert_close(seq.embedding, hf_embedding(path, ids, pooling))


def test_a_prompt_of_the_whole_window_is_served_and_a_longer_one_refused():
    path = embedding_checkpoint("last")
    core = make_core(path, max_model_len=64, max_num_batched_tokens=32)
    ids = prompt_ids(64, seed=2)
    seq = embed(core, {"w": ids}, PoolingSpec("last"))["w"]
    assert_close(seq.embedding, hf_embedding(path, ids, "last"))
    with pytest.raises(InvalidRequest, match="maximum context length is 64") as e:
        core.check(Sequence("x", prompt_ids(65), SamplingParams(pooling=PoolingSpec())))
    assert e.value.param == "input"


def test_embeddings_batch_with_generation_in_one_step():
    """On one engine, pooling rows and generating rows share steps: each gets what it would alone."""
    path = embedding_checkpoint("mean")
    core = make_core(path, max_num_batched_tokens=32)
    gen = Sequence("g", prompt_ids(10, seed=1), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    core.check(gen)
    core.add_request(gen)
    core.step()  # the generation prefill, then decodes beside the embeddings
    ids = prompt_ids(45, seed=9)
    seq = embed(core, {"e": ids}, PoolingSpec("mean"))["e"]
    assert_close(seq.embedding, hf_embedding(path, ids, "mean"))
    alone = make_core(path)
    g2 = Sequence("g", prompt_ids(10, seed=1), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    alone.check(g2)
    alone.add_request(g2)
    while alone.has_work():
        alone.step()
    assert gen.output_token_ids == g2.output_token_ids


def test_checkpoint_detection():
    assert embedding_config(embedding_checkpoint("mean")).pooling == "mean"
    assert embedding_config(embedding_checkpoint("cls")).pooling == "cls"
    no_normalize = embedding_config(embedding_checkpoint("last", normalize=False))
    assert no_normalize.pooling == "last" and not no_normalize.normalize
    by_name = embedding_config(embedding_checkpoint(None))
    assert by_name.pooling == "last" and by_name.normalize and not by_name.matryoshka
    assert embedding_config(embedding_checkpoint(None), "generate") is None
    matryoshka = embedding_config(embedding_checkpoint("mean", matryoshka=True))
    assert matryoshka.matryoshka and matryoshka.matryoshka_dimensions == (16, 32, 64)
    from helpers_model import tiny_checkpoint

    overridden = embedding_config(
        embedding_checkpoint("last"), pooler_config={"pooling_type": "MEAN", "normalize": False}
    )
    assert (
        overridden.pooling == "mean" and not overridden.normalize and overridden.source == "--pooler-config"
    )

    assert embedding_config(tiny_checkpoint("qwen3")) is None
    assert embedding_config(tiny_checkpoint("qwen3"), "pooling").pooling == "last"


@pytest.mark.timeout(900)
@pytest.mark.asyncio
async def test_tensor_parallel_embeddings_equal_hf(tmp_path):
    """tensor_parallel_size=2 on the CPU (gloo): every rank pools its copy of the final hidden states (they are
    whole after the layers' all-reduce); rank 0's vectors come back, equal to transformers'."""
    import asyncio

    from graphcache.config import Settings
    from graphcache.engine.loop.engine import Engine

    path = embedding_checkpoint("mean")
    settings = Settings(
        model=path,
        device="cpu",
        dtype="float32",
        tensor_parallel_size=2,
        cache_dir=str(tmp_path),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        num_kv_blocks=64,
        block_size=16,
        capture_sizes=[1, 2, 4, 8],
        max_capture_size=8,
        warmup_decode_sizes=[],
    )
    engine = Engine(settings)
    engine.start()
    try:
        assert engine.wait_ready(300), engine.error
        prompts = [prompt_ids(n, seed=n) for n in (4, 30, 130)]  # the last chunked by 64

        async def one(i: int, ids: list[int]):
            params = SamplingParams(temperature=0, pooling=PoolingSpec("mean"))
            return [out async for out in engine.generate(f"e{i}", ids, params, stream=False)][-1]

        outs = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
        for out, ids in zip(outs, prompts, strict=True):
            assert out.finish_reason == "stop", out.error
            assert_close(out.embedding, hf_embedding(path, ids, "mean"))
    finally:
        engine.shutdown()
