"""Mixed steps above the fine capture sizes: coarse buckets, their default rule, and replay through the
cache (breakable on the CPU's eager backend; full, the unified kernel inside the graph, interpreted by
Triton on the CPU and real on CUDA) against eager steps of the same batches."""

from __future__ import annotations

import os

import pytest
import torch
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.capture_sizes import host_bound_buckets, resolve_capture_sizes
from graphcache.engine.worker.runner import ModelRunner
from graphcache.graphs.descriptor import BatchDescriptor, CaptureSizes, descriptor_for, mixed_buckets
from helpers_model import Blocks, cpu_settings, gqa_checkpoint, prompt_ids, tiny_checkpoint

ATOL = 1e-4
BUCKETS = [96, 128, 192]  # above cpu_settings' fine sizes (..64), within its 256 batched tokens


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("llama")


# --- sizes -------------------------------------------------------------------------------------


def test_bucket_ladder_bounds_padding_to_half_a_step():
    ladder = mixed_buckets(256, 8192)
    assert ladder == [384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert mixed_buckets(256, 6000)[-1] == 6000 and mixed_buckets(256, 256) == []
    sizes = CaptureSizes([256, *ladder])
    for n in range(257, 8193, 7):
        assert sizes.pad(n) <= 1.5 * n


def test_default_buckets_stop_where_steps_turn_gpu_bound():
    # Decoder weights of Qwen2.5-0.5B (24 layers) and Llama-3-8B (32 layers).
    ladder = mixed_buckets(256, 8192)
    assert host_bound_buckets(ladder, decoder_params=358_000_000, num_layers=24)[-1] == 6144
    assert host_bound_buckets(ladder, decoder_params=6_980_000_000, num_layers=32) == [384]


def test_fp8_per_row_weights_take_every_bucket(path):
    """W8A8 steps stay host-bound at every size measured (capture_sizes' docstring): at the 8B shape, where
    bf16 keeps 384 only, they pad to every bucket up to the token limit; without graphs still none."""
    s = cpu_settings(path, max_num_batched_tokens=2048)
    params = {"decoder_params": 6_980_000_000, "num_layers": 32}
    sizes, bf16 = resolve_capture_sizes(s, graphs=True, **params)
    _, fp8 = resolve_capture_sizes(s, graphs=True, quantized_activations=True, **params)
    assert [b for b in bf16 if b > sizes.max] == host_bound_buckets(mixed_buckets(sizes.max, 2048), **params)
    assert [b for b in fp8 if b > sizes.max] == mixed_buckets(sizes.max, 2048)
    assert fp8.max == 2048
    _, eager = resolve_capture_sizes(s, graphs=False, quantized_activations=True, **params)
    assert list(eager) == list(sizes)


@pytest.mark.parametrize("quantization", ["auto", "fp8"])
def test_the_runner_names_per_row_fp8_weights_to_the_rule(path, monkeypatch, quantization):
    seen = {}

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return resolve_capture_sizes(*args, **kwargs)

    monkeypatch.setattr("graphcache.engine.worker.runner.resolve_capture_sizes", recording)
    ModelRunner(cpu_settings(path, quantization=quantization))
    assert seen["quantized_activations"] is (quantization == "fp8")


def test_resolve_capture_sizes(path):
    s = cpu_settings(path)
    sizes, mixed = resolve_capture_sizes(s, graphs=False, decoder_params=1, num_layers=1)
    assert list(mixed) == list(sizes)  # no graphs: padding would only cost
    _, mixed = resolve_capture_sizes(s, graphs=True, decoder_params=1, num_layers=1)
    assert list(mixed) == [*sizes, 96, 128, 192, 256]  # tiny model: every bucket is host-bound
    explicit = cpu_settings(path, mixed_capture_sizes=[32, 100, 300])
    _, mixed = resolve_capture_sizes(explicit, graphs=False, decoder_params=1, num_layers=1)
    assert list(mixed) == [*sizes, 100]  # only above the fine sizes, within the token limit


def test_descriptor_for_pads_mixed_steps_to_buckets_and_decodes_to_fine_sizes():
    fine = CaptureSizes([1, 2, 4, 8, 16, 32, 64])
    mixed = CaptureSizes([*fine, *BUCKETS])
    assert descriptor_for(70, 5, False, fine, 8, mixed) == BatchDescriptor(96, 8)
    assert descriptor_for(20, 3, False, fine, 8, mixed) == BatchDescriptor(32, 8)
    assert descriptor_for(193, 5, False, fine, 8, mixed) is None
    assert descriptor_for(3, 3, True, fine, 8, mixed) == BatchDescriptor(4, 4, True)


# --- runner: breakable (CPU eager backend) ---------------------------------------------------------


def _big_steps(runner):
    """Two mixed steps past the fine sizes: four fresh prompts and the head of a chunked one (98 tokens: bucket 128);
    then four decodes over those prompts, a fresh prompt and the chunked one's next chunk over its cached
    prefix (134 tokens: bucket 192). Returns each step's logits [rows, V] and its mode."""
    blocks = Blocks(runner.block_size)
    prompts = [prompt_ids(20, seed=30 + i) for i in range(4)]
    tables = [blocks.table(21) for _ in prompts]
    fresh, long = prompt_ids(70, seed=40), prompt_ids(78, seed=41)
    t_fresh, t_long = blocks.table(70), blocks.table(78)
    steps = [
        [
            *(StepSeq(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)),
            StepSeq(long[:18], 0, t_long, False),
        ],
        [
            *(StepSeq([7 + i], 20, t, True) for i, t in enumerate(tables)),
            StepSeq(fresh, 0, t_fresh, True),
            StepSeq(long[18:78], 18, t_long, True),
        ],
    ]
    out = []
    for seqs in steps:
        result = runner.execute(StepPlan.standalone(seqs))
        out.append((result.logits[: len(seqs)].float().clone(), result.mode))
    return out


def test_mixed_step_past_fine_sizes_replays_and_equals_eager(path):
    expected = _big_steps(ModelRunner(cpu_settings(path, enforce_eager=True)))
    runner = ModelRunner(cpu_settings(path, mixed_capture_sizes=BUCKETS))
    assert runner._graph_mode(False) == "breakable"  # sdpa kernel: attention stays the eager break
    got = _big_steps(runner)
    assert BatchDescriptor(128, 8) in runner.cache and BatchDescriptor(192, 8) in runner.cache
    for (logits, mode), (ref, ref_mode) in zip(got, expected, strict=True):
        assert mode == "replay" and ref_mode == "eager"
        assert (logits - ref).abs().max().item() < ATOL


def test_mixed_bucket_pads_write_only_the_scratch_slot(path):
    runner = ModelRunner(cpu_settings(path, mixed_capture_sizes=BUCKETS))
    scratch_block = runner.num_kv_blocks
    storage = runner.kv_storage  # [layers, 2, blocks + 1, bs, K, D]
    storage[:, :, scratch_block] = 12345.0  # poisoned: a pad's K/V may be anything
    before = storage.clone()
    blocks = Blocks(runner.block_size, first=3)
    tables = [blocks.table(35), blocks.table(35)]
    result = runner.execute(
        StepPlan.standalone([StepSeq(prompt_ids(35, seed=i), 0, t, True) for i, t in enumerate(tables)])
    )
    assert result.mode == "replay" and BatchDescriptor(96, 8) in runner.cache  # 70 tokens padded to 96
    changed = (storage != before).flatten(3).any(-1)  # [layers, 2, blocks + 1]
    assert sorted(set(changed.nonzero()[:, 2].tolist())) == [*tables[0], *tables[1], scratch_block]
    scratch_changed = (storage[:, :, scratch_block] != before[:, :, scratch_block]).flatten(3).any(-1)
    assert scratch_changed[:, :, 0].all() and not scratch_changed[:, :, 1:].any()


def test_warmup_captures_the_mixed_buckets(path):
    runner = ModelRunner(cpu_settings(path, mixed_capture_sizes=BUCKETS, warmup_mixed_sizes=None))
    assert [str(d) for d in runner.warmup_descriptors()] == ["96:8", "128:8", "192:8"]
    before = runner.kv_cache.clone()
    report = runner.warmup()
    assert sorted(report.captured) == ["128:8", "192:8", "96:8"]
    assert torch.equal(runner.kv_cache, before)
    assert (
        ModelRunner(
            cpu_settings(path, mixed_capture_sizes=BUCKETS, warmup_mixed_sizes=[])
        ).warmup_descriptors()
        == []
    )
    with pytest.raises(ValueError, match="warmup_mixed_sizes"):
        ModelRunner(cpu_settings(path, mixed_capture_sizes=BUCKETS, warmup_mixed_sizes=[100]))


# --- runner: full (unified kernel inside the graph) --------------------------------------------------


def _poison_request_rows(runner):
    """Garbage where a mixed graph reads past the real requests: the step's layout must overwrite it."""
    i = runner.inputs
    i.cu_seqlens.dev.fill_(1 << 20)
    i.seq_lens.dev.fill_(1 << 20)
    i.block_tables.dev.fill_(1 << 20)


@pytest.mark.skipif(
    not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()),
    reason="needs triton's interpreter or CUDA",
)
def test_full_mixed_graph_equals_eager_interpreted(monkeypatch):
    """mixed_capture_mode=full on the CPU: the unified kernel (Triton's interpreter) is called in the
    step function with the descriptor's fixed grid over the padded static rows, as in a full graph."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the CUDA version of this test is test_cuda_full_mixed_graph_replay_equals_eager")
    import graphcache.engine.worker.runner as runner_mod

    path = tiny_checkpoint("qwen2", hidden=64, layers=2, heads=8, kv_heads=2)
    settings = dict(decode_attention_backend="varlen", mixed_capture_sizes=BUCKETS)
    reference = ModelRunner(cpu_settings(path, enforce_eager=True, **settings))  # eager, SDPA: independent
    assert reference.attention_kernel == "sdpa"
    expected = _big_steps(reference)
    monkeypatch.setattr(runner_mod, "select_attention_kernel", lambda *args: "triton")
    runner = ModelRunner(cpu_settings(path, **settings))
    assert runner._graph_mode(False) == "full"
    _poison_request_rows(runner)
    calls, real = [], ModelRunner.mixed_graph_metadata

    def spy(self, num_reqs):
        calls.append(num_reqs)
        return real(self, num_reqs)

    monkeypatch.setattr(runner_mod.ModelRunner, "mixed_graph_metadata", spy)
    got = _big_steps(runner)
    assert calls and set(calls) == {8}
    for (logits, mode), (ref, _) in zip(got, expected, strict=True):
        assert mode == "replay" and torch.isfinite(logits).all()
        assert (logits - ref).abs().max().item() < ATOL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_cuda_full_mixed_graph_replay_equals_eager(mode):
    """bf16 on CUDA: mixed steps past the fine sizes replay a captured graph (full: the unified kernel
    inside it) and give the eager runner's logits on two different steps, request rows poisoned first."""
    path = gqa_checkpoint()
    settings = dict(
        device="cuda",
        dtype="bfloat16",
        block_size=16,
        attention_backend="triton",
        decode_attention_backend="varlen",
        mixed_capture_sizes=BUCKETS,
        mixed_capture_mode=mode,
    )
    expected = _big_steps(ModelRunner(cpu_settings(path, enforce_eager=True, **settings)))
    runner = ModelRunner(cpu_settings(path, warmup_mixed_sizes=None, **settings))
    assert runner.backend == "cuda" and runner._graph_mode(False) == mode
    assert runner.warmup().captured  # captured outside a step, then replayed by the steps
    assert BatchDescriptor(128, 8) in runner.cache
    _poison_request_rows(runner)
    got = _big_steps(runner)
    for (logits, step_mode), (ref, _) in zip(got, expected, strict=True):
        assert step_mode == "replay" and torch.isfinite(logits).all()
        # The graph's fixed tile shape differs from the eager step's choice: bf16 rounding differs.
        assert (logits - ref).abs().max().item() <= 0.03 * ref.abs().max().item()


@pytest.mark.slow
def test_big_steps_benchmark_smoke(tmp_path):
    """benchmarks/big_steps.py end to end on the CPU (tiny shape, sizes 32..128): every cell filled."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import big_steps

    out = tmp_path / "big_steps.json"
    assert big_steps.main(["--smoke", "--make-model", f"tiny:{tmp_path / 'tiny'}", "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert [r["size"] for r in result["rows"]] == [32, 64, 128]
    for r in result["rows"]:
        assert r["eager_ran"] == "eager" and r["breakable_ran"] == "replay" and r["full_ran"] == "replay"
        assert r["breakable"]["capture_s"] >= 0 and r["full_half_ms"] > 0


def test_with_graphs_and_no_bucket_the_largest_size_is_warmed_as_a_mixed_graph():
    """A large model keeps no mixed bucket above max_capture_size 512 (capture_sizes.py): one mixed graph of
    the largest capture size is still captured at start, so the mixed step's kernels compile before serving
    rather than in the first prefill while requests wait. Not without CUDA graphs, nor when the settings name
    the mixed sizes (warmup_mixed_sizes=[] keeps all of them lazy)."""
    from graphcache.config import Settings
    from graphcache.engine.worker.warmup_plan import warmup_descriptors
    from graphcache.graphs.descriptor import CaptureSizes

    settings = Settings(max_num_seqs=256, max_num_batched_tokens=8192, warmup_decode_sizes=[])
    sizes = CaptureSizes([8, 16, 256, 512])
    assert [str(d) for d in warmup_descriptors(settings, sizes, sizes, graphs=True)] == ["512:256"]
    assert warmup_descriptors(settings, sizes, sizes, graphs=False) == []
    lazy = Settings(
        max_num_seqs=256, max_num_batched_tokens=8192, warmup_decode_sizes=[], warmup_mixed_sizes=[]
    )
    assert warmup_descriptors(lazy, sizes, sizes, graphs=True) == []
    with_buckets = CaptureSizes([8, 16, 256, 512, 768])
    assert [str(d) for d in warmup_descriptors(settings, sizes, with_buckets, graphs=True)] == ["768:256"]
