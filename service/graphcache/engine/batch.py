"""What one step feeds the model, and what the engine needs of a model runner.

Pure data and a Protocol, no torch: the scheduler builds a `StepBatch`, the runner executes it,
and the CPU-only floors (scheduler, block manager, tests with a fake runner) never import the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from graphcache.choices import StepMode
from graphcache.engine.sequence import Sequence

# Input of a decode whose token is still being sampled by the step in flight (async scheduling):
# the runner fills it on the device from that step's sampled ids (StepBatch.prev_tokens).
PLACEHOLDER_TOKEN = -1


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step, as the scheduler picked it."""

    seq: Sequence
    num_tokens: int  # tokens fed this step
    need_logits: bool  # the slice reaches the end of the sequence: sample after this step
    start: int = 0  # position of the first fed token (num_computed_tokens when scheduled)


@dataclass(slots=True)
class StepSeq:
    token_ids: list[int]  # tokens fed this step (a prompt chunk, or the one last sampled token)
    start_pos: int  # position of token_ids[0] = tokens already in the KV cache
    block_table: list[int]  # KV blocks covering at least start_pos + len(token_ids) tokens
    need_logits: bool  # sample after this step (False for a non-final prefill chunk)
    prev_row: int | None = None  # placeholder input: row of StepBatch.prev_tokens holding it
    # Also return the logits of every fed token (prompt logprobs): such a step runs eagerly.
    prompt_logits: bool = False


_SPLIT = (
    "this batch came as decode rows without its sequences (a tensor-parallel rank whose rows disagree "
    "with rank 0's); the ranks' runner states have split"
)


@dataclass(slots=True)
class DecodeRows:
    """A uniform-decode step said as a change to the previous step's rows (persistent rows): every
    sequence feeds one token, the one the step in flight is sampling for it. A runner that holds the
    previous step's rows keeps positions, lengths and block tables on the device and advances them
    there; the host sends only this (docs/ARCHITECTURE.md, "Persistent decode rows")."""

    keys: list[int]  # [n] each row's Sequence.key, in row order
    grown: list[tuple[int, list[int]]]  # (key, whole block table) of the sequences that got a block this step


class StepBatch:
    """One step's sequences. Built either from `seqs`, or (the scheduler's uniform decodes) from `rows`
    plus `build`, which makes the per-row `seqs` only if a runner asks for them (`build_one`: one row's
    StepSeq): a runner on the persistent-rows path builds at most the rows it did not hold, so the host
    builds no StepSeq per row on most decode steps. `keys`: each seq's Sequence.key (the scheduler's
    batches; None for hand-built ones), which lets the runner know its rows after any step."""

    __slots__ = ("_seqs", "_build", "_build_one", "prev_tokens", "rows", "keys")

    def __init__(
        self,
        seqs: list[StepSeq] | None = None,
        prev_tokens: Any = None,
        *,
        rows: DecodeRows | None = None,
        build: Callable[[], list[StepSeq]] | None = None,
        build_one: Callable[[int], StepSeq] | None = None,
        keys: list[int] | None = None,
    ) -> None:
        if seqs is None and rows is None:
            raise ValueError("a StepBatch needs seqs, or rows")
        self._seqs, self._build, self._build_one = seqs, build, build_one
        self.prev_tokens = (
            prev_tokens  # [rows] int64 device ids sampled by the step in flight (placeholder inputs)
        )
        self.rows = rows
        self.keys = keys if keys is not None or rows is None else rows.keys

    @property
    def seqs(self) -> list[StepSeq]:
        if self._seqs is None:
            if self._build is None:
                raise RuntimeError(_SPLIT)
            self._seqs, self._build = self._build(), None
        return self._seqs

    def seq_at(self, i: int) -> StepSeq:
        """Row i's StepSeq, without building the others."""
        if self._seqs is not None:
            return self._seqs[i]
        if self._build_one is None:
            raise RuntimeError(_SPLIT)
        return self._build_one(i)

    def __getstate__(self) -> tuple:  # what a tensor-parallel rank receives: no builders, no device tensor
        return self._seqs, self.rows, self.keys

    def __setstate__(self, state: tuple) -> None:
        self._seqs, self.rows, self.keys = state
        self._build = self._build_one = self.prev_tokens = None

    @property
    def num_tokens(self) -> int:
        if self._seqs is None:
            assert self.rows is not None  # a StepBatch has seqs or rows (__init__ refuses neither)
            return len(self.rows.keys)
        return sum(len(s.token_ids) for s in self._seqs)

    @property
    def uniform_decode(self) -> bool:
        return self._seqs is None or all(len(s.token_ids) == 1 for s in self._seqs)

    @property
    def wants_prompt_logits(self) -> bool:
        return self._seqs is not None and any(s.prompt_logits for s in self._seqs)


@dataclass
class StepResult:
    logits: Any  # [number of need_logits seqs, V] fp32, batch order; valid until the next execute()
    mode: StepMode  # how the step ran: a graph replay (or capture), or eagerly
    # [sum of len(token_ids) over the prompt_logits seqs, V]: the logits of each of their fed tokens,
    # those seqs in batch order, each one's tokens in order; None when no seq asked.
    prompt_logits: Any = None


class Runner(Protocol):
    """What EngineCore and Engine use of a model runner (engine/worker/runner.py's ModelRunner,
    engine/worker/tp_runner.py's TensorParallelRunner; tests' FakeRunner). The facts are read-only
    properties: the engine only reads them, and a runner may hold each as a plain attribute of a
    narrower type (a property member is covariant, a settable attribute would not be)."""

    @property
    def tokenizer(self) -> Any: ...  # model/tokenizer.py's Tokenizer; None: ids only, no text
    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int | None: ...  # token ids of a prompt must be below it (None: not checked)
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def device_type(self) -> str: ...  # "cuda" or "cpu": async scheduling is on by default on CUDA
    @property
    def dtype(self) -> object: ...  # the KV cache's element type; str() names it (torch.bfloat16)
    @property
    def model_path(self) -> object: ...  # the checkpoint directory; str() names it (/v1/models' root)
    @property
    def cache(self) -> Any: ...  # the GraphCache (admin: capture, clear, info, stats, profile)

    def execute(self, batch: StepBatch) -> StepResult: ...

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> Any: ...

    def warmup_descriptors(self) -> list[Any]: ...

    def capture(
        self,
        descriptors: list[Any],
        *,
        pin: bool = True,
        progress: Callable[[int, int, str], None] | None = None,
    ) -> Any: ...

    def watch(self, on_fatal: Callable[[str], None]) -> None:
        """Call on_fatal(reason), from any thread, when the runner can no longer run a step while idle
        (a tensor-parallel worker rank died); the Engine passes its fail()."""
        ...

    def close(self) -> None:
        """Release what outlives the runner object (worker processes, the process group); engine thread, at exit."""
        ...
