"""The two graph variants of an --enable-lora runner (graphs/descriptor.py: `lora`): a step with an adapter
token replays its shape's LoRA variant, a step with none the plain one, captured with the LoRA layers skipped
(so it runs exactly the kernels of a runner without LoRA); warmup and the admin warmup take both variants.
CPU (the eager backend's "replay" runs the same step function) and one CUDA test of the graphs themselves."""

from __future__ import annotations

import pytest
import torch
from graphcache.api.openai.utility_requests import WarmupRequest
from graphcache.api.server.admin import _descriptors
from graphcache.api.server.errors import APIError
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from graphcache.engine.worker.warmup_plan import warmup_descriptors, with_lora_variants
from graphcache.graphs.descriptor import BatchDescriptor as D
from graphcache.graphs.descriptor import CaptureSizes
from graphcache.model import lora_layers
from helpers_lora import peft_adapter
from helpers_model import Blocks, cpu_settings, prompt_ids, recorded_descriptors, tiny_checkpoint

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base():
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base):
    return {
        "a": peft_adapter(base, r=8, alpha=16, seed=1),
        "b": peft_adapter(base, r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), seed=2),
    }


def _modules(adapters) -> list[str]:
    return [f"{name}={adapter}" for name, (adapter, _) in adapters.items()]


@pytest.fixture
def lora_calls(monkeypatch):
    """How many times the LoRA layers did work (the CPU path, lora_add_reference)."""
    calls = {"n": 0}
    real = lora_layers.lora_add_reference

    def counting(y, x, a, b, index):
        calls["n"] += 1
        real(y, x, a, b, index)

    monkeypatch.setattr(lora_layers, "lora_add_reference", counting)
    return calls


def _decode_step(runner, rows, blocks):
    """rows: (adapter or None, ids): each row's prompt but its last token prefilled alone, then the plan of
    one decode step of all of them (each feeding its last token)."""
    seqs = []
    for name, ids in rows:
        table = blocks.table(len(ids))
        runner.execute(StepPlan.standalone([StepSeq(ids[:-1], 0, table, lora_name=name)]))
        seqs.append(StepSeq(ids[-1:], len(ids) - 1, table, lora_name=name))
    return StepPlan.standalone(seqs)


# --- the variant each step picks ----------------------------------------------------------------------


def test_each_step_replays_the_variant_of_its_rows(base, adapters, lora_calls):
    runner = ModelRunner(cpu_settings(base, enable_lora=True, lora_modules=_modules(adapters), max_loras=2))
    seen = recorded_descriptors(runner.cache)
    blocks = Blocks(runner.block_size)
    plain = _decode_step(runner, [(None, prompt_ids(7, seed=1)), (None, prompt_ids(5, seed=2))], blocks)
    assert [d.lora for d in seen] == [False, False]  # the prefills of base rows
    lora_calls["n"] = 0
    out = runner.execute(plain)
    assert out.mode == "replay" and seen[-1] == D(2, 2, True)
    assert lora_calls["n"] == 0  # no adapter row: the LoRA layers launch nothing
    seen.clear()
    mixed = _decode_step(runner, [(None, prompt_ids(7, seed=3)), ("a", prompt_ids(6, seed=4))], blocks)
    assert [d.lora for d in seen] == [False, True]  # the base row's prefill, then the adapter row's
    lora_calls["n"] = 0
    out = runner.execute(mixed)
    assert out.mode == "replay" and seen[-1] == D(2, 2, True, lora=True)
    assert lora_calls["n"] > 0
    held = {e.descriptor for e in runner.cache.entries()}
    assert {"2:2:decode", "2:2:decode:lora"} <= held  # /admin/cache lists both variants


def test_eager_steps_skip_the_layers_by_the_host_flag(base, adapters, lora_calls):
    runner = ModelRunner(
        cpu_settings(base, enable_lora=True, lora_modules=_modules(adapters), max_loras=2, enforce_eager=True)
    )
    ids = prompt_ids(6, seed=5)
    runner.execute(StepPlan.standalone([StepSeq(ids, 0, Blocks(runner.block_size).table(6))]))
    assert lora_calls["n"] == 0
    runner.execute(StepPlan.standalone([StepSeq(ids, 0, Blocks(runner.block_size).table(6), lora_name="b")]))
    assert lora_calls["n"] > 0


def test_a_capture_outside_a_step_records_its_descriptors_variant(base, adapters, lora_calls):
    runner = ModelRunner(cpu_settings(base, enable_lora=True, lora_modules=_modules(adapters), max_loras=2))
    runner.capture([D(4, 4, True)])
    assert lora_calls["n"] == 0
    runner.capture([D(4, 4, True, lora=True)])
    assert lora_calls["n"] > 0
    plain = ModelRunner(cpu_settings(base))
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.capture([D(4, 4, True, lora=True)])


def test_lora_off_base_rows_are_unchanged(base, adapters):
    """A runner with --enable-lora gives base rows exactly the logits of one without it, in both layouts."""
    ids = [prompt_ids(9, seed=11), prompt_ids(4, seed=12)]
    got = []
    for settings in (
        cpu_settings(base, enable_lora=True, lora_modules=_modules(adapters)),
        cpu_settings(base),
    ):
        runner = ModelRunner(settings)
        plan = _decode_step(runner, [(None, i) for i in ids], Blocks(runner.block_size))
        got.append(runner.execute(plan).logits.clone())
    assert torch.equal(got[0], got[1])


# --- warmup --------------------------------------------------------------------------------------------


def test_warmup_takes_both_variants_with_lora_on(base):
    sizes, mixed = CaptureSizes([1, 2, 4, 8]), CaptureSizes([1, 2, 4, 8, 16])
    common = dict(
        warmup_decode_sizes=None, warmup_mixed_sizes=None, max_num_seqs=8, capture_sizes=[1, 2, 4, 8]
    )
    off = warmup_descriptors(cpu_settings(base, **common), sizes, mixed, graphs=True)
    on = warmup_descriptors(cpu_settings(base, enable_lora=True, **common), sizes, mixed, graphs=True)
    assert [str(d) for d in off] == ["1:1:decode", "2:2:decode", "4:4:decode", "8:8:decode", "16:8"]
    assert not any(d.lora for d in off)
    assert set(on) == set(off) | {d.with_lora() for d in off}
    # within the entry budget: every decode variant first, then the mixed ones while they fit
    capped = warmup_descriptors(
        cpu_settings(base, enable_lora=True, cache_max_entries=9, **common), sizes, mixed, graphs=True
    )
    assert set(capped) == set(off) | {d.with_lora() for d in off if d.uniform_decode}
    assert with_lora_variants([D(8, 8, True), D(16, 8)], 2) == [D(8, 8, True), D(16, 8)]
    with pytest.raises(ValueError, match="enable-lora"):
        warmup_descriptors(cpu_settings(base, warmup_descriptors=["8:8:decode:lora"]), sizes, mixed)


def test_admin_warmup_sizes_take_both_variants_only_with_lora_on(base):
    on = cpu_settings(base, enable_lora=True)
    got = _descriptors(WarmupRequest(sizes=[4], descriptors=["8:8:lora"]), on)
    assert set(got) == {D(4, 4, True), D(4, 4, True, lora=True), D(8, 8, False, lora=True)}
    off = cpu_settings(base)
    assert _descriptors(WarmupRequest(sizes=[4]), off) == [D(4, 4, True)]
    with pytest.raises(APIError) as e:
        _descriptors(WarmupRequest(descriptors=["8:8:decode:lora"]), off)
    assert e.value.status == 400 and "LoRA" in e.value.message


# --- CUDA: the graphs themselves -----------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_plain_variant_equals_the_base_runner_and_lora_variant_the_eager_reference(base, adapters):
    """bf16, graphs on, NaN in the allocator's free memory and in the logits buffer before each step. On two
    different inputs: a decode step with no adapter row replays the plain variant and gives bit for bit the
    logits of a runner without --enable-lora replaying the same step; a decode step with adapter rows
    replays the LoRA variant and matches the --enable-lora runner run eagerly (replay tolerance)."""
    from helpers_cuda import assert_replay_close, poison_allocator
    from helpers_model import cuda_settings

    poison_allocator()
    lora = dict(enable_lora=True, lora_modules=_modules(adapters), max_loras=2, max_lora_rank=16)
    graphs = ModelRunner(cuda_settings(base, **lora))
    plain = ModelRunner(cuda_settings(base))
    eager = ModelRunner(cuda_settings(base, enforce_eager=True, **lora))
    seen = recorded_descriptors(graphs.cache)
    for seed in (0, 1):
        prompts = [prompt_ids(9 + i, seed=100 * seed + i) for i in range(3)]
        want = None
        for runner in (plain, graphs):
            step = _decode_step(runner, [(None, p) for p in prompts], Blocks(runner.block_size))
            runner.out_logits.fill_(float("nan"))
            out = runner.execute(step)
            assert out.mode == "replay", f"seed {seed}: the no-adapter step ran {out.mode}"
            got = out.logits.clone()
            assert torch.isfinite(got).all()
            if want is None:
                want = got
        assert seen[-1] == D(4, 4, True), seen[-1]  # 3 rows pad to 4, plain variant
        assert torch.equal(got, want), f"seed {seed}: {(got.float() - want.float()).abs().max().item()}"

        rows = [("a", prompts[0]), (None, prompts[1]), ("b", prompts[2])]
        step = _decode_step(graphs, rows, Blocks(graphs.block_size))
        graphs.out_logits.fill_(float("nan"))
        out = graphs.execute(step)
        assert out.mode == "replay" and seen[-1] == D(4, 4, True, lora=True), (out.mode, seen[-1])
        got = out.logits.clone()
        reference = eager.execute(_decode_step(eager, rows, Blocks(eager.block_size))).logits
        assert_replay_close(got, reference, f"seed {seed}, adapters a, -, b")
        assert not torch.equal(got[0], want[0])  # the adapter changed its row
