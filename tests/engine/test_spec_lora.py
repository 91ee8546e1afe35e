"""Speculative decoding on an --enable-lora engine (CPU, tiny qwen2, two PEFT adapters): requests that mix
adapters and base rows emit the same greedy tokens with n-gram drafts and with a draft model as without
speculation. The verify step runs each row's adapter over all of its k + 1 positions; the draft model has no
adapters (vLLM's and SGLang's neither), so an adapter row's drafts are the base draft's, kept only where the
adapted target agrees."""

from __future__ import annotations

import json

import pytest
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.worker.draft_model import build_draft_proposer
from graphcache.engine.worker.runner import ModelRunner
from graphcache.metrics import Metrics
from helpers_lora import peft_adapter
from helpers_model import cpu_settings, prompt_ids, tiny_checkpoint

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base():
    return tiny_checkpoint("qwen2")  # tied, it loops under greedy decoding: n-gram drafts get accepted


@pytest.fixture(scope="module")
def modules(base):
    a, _ = peft_adapter(base, r=8, alpha=16, seed=11)
    b, _ = peft_adapter(base, r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), seed=12)
    return [f"a={a}", f"b={b}"]


def _requests() -> list[tuple[str, list[int], str | None]]:
    """12 requests over adapter a, adapter b and the base model; most prompts repeat a pattern, so the
    n-gram proposer drafts."""
    out = []
    for i in range(12):
        unit = prompt_ids(3 + i % 4, seed=40 + i, vocab=200)
        prompt = (unit * 6)[: 9 + 2 * (i % 5)] if i % 4 else prompt_ids(7 + i, seed=i, vocab=300)
        out.append((f"r{i}", prompt, (None, "a", "b")[i % 3]))
    return out


def _run(base, modules, spec: str | None) -> tuple[dict[str, list[int]], dict]:
    settings = cpu_settings(
        base, enable_lora=True, lora_modules=modules, max_loras=2, speculative_config=spec
    )
    runner = ModelRunner(settings)
    core = EngineCore(runner, settings, Metrics(), proposer=build_draft_proposer(settings, runner))
    tokens: dict[str, list[int]] = {}
    for rid, prompt, lora in _requests():
        params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, lora_name=lora)
        seq = Sequence(rid, list(prompt), params)
        core.check(seq)
        core.add_request(seq)
        tokens[rid] = []
    while core.has_work():
        for out in core.step():
            tokens[out.request_id] += out.token_ids
    counts = core.spec_metrics.snapshot() if core.spec_metrics is not None else {}
    assert core.block_manager.num_free == core.block_manager.num_usable, "leaked KV blocks"
    core.runner.close()
    return tokens, counts


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_adapter_rows_emit_the_same_greedy_tokens_with_speculation(base, modules, method):
    want, _ = _run(base, modules, None)
    config = {"method": method, "num_speculative_tokens": 3}
    config |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {"model": str(base)}
    got, counts = _run(base, modules, json.dumps(config))
    assert got == want
    assert all(len(t) == 14 for t in got.values())
    assert counts["draft_tokens"] > 0 and counts["accepted"] > 0
