"""What one step feeds the model, and what the engine needs of a model runner.

Pure data and a Protocol, no torch: the scheduler builds a `StepBatch`, the runner executes it,
and the CPU-only floors (scheduler, block manager, tests with a fake runner) never import the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

StepMode = Literal["replay", "eager"]
# Input of a decode whose token is still being sampled by the step in flight (async scheduling):
# the runner fills it on the device from that step's sampled ids (StepBatch.prev_tokens).
PLACEHOLDER_TOKEN = -1


@dataclass(slots=True)
class StepSeq:
    token_ids: list[int]       # tokens fed this step (a prompt chunk, or the one last sampled token)
    start_pos: int             # position of token_ids[0] = tokens already in the KV cache
    block_table: list[int]     # KV blocks covering at least start_pos + len(token_ids) tokens
    need_logits: bool          # sample after this step (False for a non-final prefill chunk)
    prev_row: int | None = None   # placeholder input: row of StepBatch.prev_tokens holding it
    # Also return the logits of every fed token (prompt logprobs): such a step runs eagerly.
    prompt_logits: bool = False


@dataclass
class StepBatch:
    seqs: list[StepSeq]
    prev_tokens: Any = None    # [rows] int64 device ids sampled by the step in flight (placeholder inputs)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def uniform_decode(self) -> bool:
        return all(len(s.token_ids) == 1 for s in self.seqs)

    @property
    def wants_prompt_logits(self) -> bool:
        return any(s.prompt_logits for s in self.seqs)


@dataclass
class StepResult:
    logits: Any        # [number of need_logits seqs, V] fp32, batch order; valid until the next execute()
    mode: StepMode     # how the step ran: a graph replay (or capture), or eagerly
    # [sum of len(token_ids) over the prompt_logits seqs, V]: the logits of each of their fed tokens,
    # those seqs in batch order, each one's tokens in order; None when no seq asked.
    prompt_logits: Any = None


class Runner(Protocol):
    """What EngineCore and Engine use of a model runner (engine/runner.py; tests' FakeRunner)."""

    tokenizer: Any
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int | None          # token ids of a prompt must be below it (None: not checked)
    eos_token_ids: frozenset[int]
    device_type: str                # "cuda" or "cpu": async scheduling is on by default on CUDA
    cache: Any                      # the GraphCache (admin: capture, clear, info, stats)

    def execute(self, batch: StepBatch) -> StepResult: ...

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> Any: ...

    def warmup_descriptors(self) -> list[Any]: ...

    def capture(self, descriptors: list[Any], *, pin: bool = True,
                progress: Callable[[int, int, str], None] | None = None) -> Any: ...
