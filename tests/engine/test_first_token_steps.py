"""A new request's first token under steady load comes in the step after its arrival (two with async
scheduling: its tokens are taken once the next step is launched), through the real EngineCore on the tiny
model: the scheduler admits waiting requests into the budget the decodes leave, in the same step. The
measurement is benchmarks/first_token_steps.py's, the engine's share of an open-loop TTFT in steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.worker.runner import ModelRunner
from helpers_model import cpu_settings, tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.first_token_steps import measure  # noqa: E402


@pytest.mark.parametrize(("mode", "steps"), [("off", 1), ("on", 2)])
def test_first_token_one_step_after_arrival_under_load(mode, steps):
    settings = cpu_settings(
        tiny_checkpoint(), async_scheduling=mode, max_num_seqs=12, max_num_batched_tokens=128
    )
    core = EngineCore(ModelRunner(settings), settings)
    # 6 decoding all along, a new request (prompts 2-96 tokens, median 24) before every step: up to 4 of
    # them run at once beside the decodes, so admission, mixed steps and finishing all happen under load.
    row = measure(core, background=6, arrivals=16, prompt_median=24, prompt_cap=96, vocab=500)
    assert row["steps_to_schedule"] == {1: 16}
    assert row["steps_to_first_token"] == {steps: 16}
    assert row["leaked_blocks"] == 0


def test_a_prompt_longer_than_the_budget_takes_its_chunks():
    """The one exception: a prompt past the step's token budget is prefilled in chunks (a step each)."""
    settings = cpu_settings(
        tiny_checkpoint(), async_scheduling="off", max_num_seqs=12, max_num_batched_tokens=64
    )
    core = EngineCore(ModelRunner(settings), settings)
    row = measure(
        core, background=4, arrivals=3, every=8, prompt_median=150, prompt_sigma=0, prompt_cap=150, vocab=500
    )
    # 150 prompt tokens, 60 a step beside 4 decodes: three chunks
    assert row["steps_to_first_token"] == {3: 3}
