"""GPU: embedding requests through the engine on CUDA (graphs captured for the other steps, async scheduling on)
equal transformers' vectors computed on the CPU in float32, for last and mean pooling, a batch of lengths and a
prompt chunked over several steps; generation requests beside them give the tokens they give alone.

Run on the GPU: `pytest -m cuda tests/gpu/test_embeddings_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.pooling import PoolingSpec
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.worker.runner import ModelRunner
from helpers_embedding import embedding_checkpoint, hf_embedding
from helpers_model import cuda_settings, prompt_ids

pytestmark = pytest.mark.cuda

# float32 on the GPU against float32 on the CPU: other kernels, the same arithmetic up to summation order.
FP32_TOL = 1e-3
# bfloat16 weights and activations: the vectors point the same way.
BF16_MIN_COSINE = 0.995


def run(core: EngineCore, seqs: list[Sequence]) -> None:
    for seq in seqs:
        core.check(seq)
        core.add_request(seq)
    for _ in range(1000):
        if not core.has_work():
            break
        core.step()
    assert all(seq.is_finished and seq.finish_reason in ("stop", "length") for seq in seqs), seqs


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_embeddings_equal_the_cpu_reference(pooling, dtype):
    path = embedding_checkpoint(pooling)
    settings = cuda_settings(path, dtype=dtype, max_num_batched_tokens=64, async_scheduling="on")
    core = EngineCore(ModelRunner(settings), settings)
    prompts = [prompt_ids(n, seed=n) for n in (1, 7, 33, 200)]  # 200 > 64: chunked over four steps
    gen_prompt = prompt_ids(12, seed=99)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    gen = Sequence("g", list(gen_prompt), SamplingParams(**vars(params)))
    seqs = [
        Sequence(f"e{i}", list(p), SamplingParams(temperature=0, pooling=PoolingSpec(pooling)))
        for i, p in enumerate(prompts)
    ]
    run(core, [gen, *seqs])
    assert core.block_manager.num_free == core.block_manager.num_usable
    for seq, ids in zip(seqs, prompts, strict=True):
        got = torch.tensor(seq.embedding)
        want = hf_embedding(path, ids, pooling)
        if dtype == "float32":
            assert (got - want).abs().max().item() < FP32_TOL
        else:
            assert torch.nn.functional.cosine_similarity(got, want, dim=0).item() > BF16_MIN_COSINE
    alone = EngineCore(ModelRunner(settings), settings)
    gen_alone = Sequence("g", list(gen_prompt), SamplingParams(**vars(params)))
    run(alone, [gen_alone])
    if dtype == "float32":  # bf16 batch shapes may flip a near-tie
        assert gen.output_token_ids == gen_alone.output_token_ids
    assert core.steps_by_mode.get("replay", 0) > 0, "the generation's decode steps replayed graphs"
