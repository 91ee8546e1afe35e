"""The seam between the scheduler and the worker: what one step asks (`StepPlan`) and what it gives back
(`StepOutput`), and what the engine needs of a model runner (`Runner`).

A `StepPlan` is plain data, frozen, with no torch and no callables (vLLM v1's SchedulerOutput is the
model): a per-step change to what the worker holds. The worker keeps each request it was told of
(`NewRequest`) until a plan lists its key in `finished` (engine/worker/request_table.py); a plan names the
step's requests by key, with the tokens each feeds, and the blocks a held request got. Under tensor
parallelism a plan pickles as it is. The scheduler builds it (engine/sched/scheduler.py), the runner
executes it: `Runner.execute(plan) -> StepOutput` is the whole contract.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from graphcache.choices import StepMode
from graphcache.engine.sequence import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request the worker does not hold: its first step, or its first since it was preempted."""

    key: int  # Sequence.key: unique for the process's lifetime
    request_id: str  # for logs
    prompt_ids: list[int]  # its prompt (the sampler's repetition penalty reads it)
    output_ids: list[int]  # tokens it generated before a preemption (empty for a new request)
    params: SamplingParams
    block_table: list[int]  # its whole block table (a copy: later plans send the blocks it gets)


@dataclass(frozen=True, slots=True)
class PromptLogits:
    """Prompt logprobs one row of a step computes: the logits of its fed tokens `offset` on give entries
    first_entry .. + len(targets) of its prompt's logprobs (entry i = log p(prompt[i] | prompt[:i]))."""

    row: int  # the step's row (an index into StepPlan.keys)
    offset: int  # first fed token whose logits are used
    targets: list[int]  # the prompt tokens they predict
    k: int  # top alternatives per entry (params.prompt_logprobs)


@dataclass(frozen=True, slots=True)
class GrammarMask:
    """The tokens a structured-output row may sample next, from its grammar (engine/sample/structured.py):
    computed on the scheduler's side, applied by the worker to the row's logits before sampling."""

    rows: tuple[int, ...]  # sampled rows (indices among the step's need_logits rows) the mask covers
    bits: Any  # [len(rows), ceil(V / 32)] int32 numpy array: bit t % 32 of word t // 32 allows token t


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step as plain data. Row i of the step is the request keys[i], which feeds the tokens of
    positions starts[i] .. starts[i] + n - 1 (n = len(tokens[i]), or 1 for an in-flight row).

    Steady decodes (async scheduling: every row feeds the token the step in flight samples for it) say
    only keys and starts: `tokens` and `need_logits` are None, so the host builds nothing per row for them."""

    keys: list[
        int
    ]  # [R] Sequence.key of each row: running decodes first, then prefill chunks, then admissions
    starts: list[int]  # [R] tokens of each row already in the KV cache (its first fed token's position)
    # [R] the ids each row feeds; None for a row fed the one token the step in flight samples for it (async
    # scheduling: the worker takes it from that step's sampled ids on the device). None: every row is such.
    tokens: list[list[int] | None] | None = None
    need_logits: list[bool] | None = (
        None  # [R] sample after this step (False: a non-final prefill chunk); None: all
    )
    new: tuple[NewRequest, ...] = ()  # requests first held from this step on (their rows are in keys)
    grown: tuple[tuple[int, list[int]], ...] = ()  # (key, the blocks appended to its table) of held requests
    finished: tuple[int, ...] = ()  # keys the worker drops before this step: finished, or preempted
    prompt_logits: tuple[PromptLogits, ...] = ()  # rows returning every fed token's logits: run eagerly
    grammar: GrammarMask | None = None  # the structured-output rows' masks
    # Speculative decoding: (row, n) of the verify rows, each feeding [its last token, n drafts] (the drafts
    # are tokens[row][1:], n >= 1, the row samples). The step returns the logits of every fed position of
    # those rows and verifies the drafts (StepOutput.spec_tokens). Run eagerly, like prompt_logits.
    verify: tuple[tuple[int, int], ...] = ()
    # (key, table length) of held requests whose block table was cut back (the blocks past a rolled-back
    # speculation went back to the pool): applied before `grown`
    trimmed: tuple[tuple[int, int], ...] = ()
    # Rows of embedding requests (SamplingParams.pooling): the step keeps their final hidden states (their
    # mean accumulates across chunks) and, in a row's last chunk, returns its pooled vector. Run eagerly.
    pooling: tuple[int, ...] = ()
    sample: bool = True  # False: return the logits without sampling (a hand-built step: tests, benchmarks)

    @property
    def num_reqs(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        tokens = self.tokens
        return len(self.keys) if tokens is None else sum(1 if t is None else len(t) for t in tokens)

    @property
    def uniform_decode(self) -> bool:
        """Every row feeds one token."""
        return self.tokens is None or all(t is None or len(t) == 1 for t in self.tokens)

    @property
    def num_sampled(self) -> int:
        return len(self.keys) if self.need_logits is None else sum(self.need_logits)

    def sampled_keys(self) -> list[int]:
        """The keys of the rows that sample, in row order (the order of the step's sampled ids)."""
        if self.need_logits is None:
            return self.keys
        return [k for k, wanted in zip(self.keys, self.need_logits, strict=True) if wanted]

    def fed(self, row: int) -> list[int] | None:
        """Row's fed ids; None: the one token in flight."""
        return None if self.tokens is None else self.tokens[row]

    @classmethod
    def standalone(cls, seqs: Iterable[StepSeq], *, sample: bool = False) -> StepPlan:
        """A hand-built step (tests, benchmarks): row i is a request of its own, (re)declared new with
        key -(i + 1) in every such plan, greedy, its tokens given; the logits come back unsampled."""
        seqs = list(seqs)
        keys = [-(i + 1) for i in range(len(seqs))]
        greedy = SamplingParams(temperature=0.0)
        return cls(
            keys=keys,
            starts=[s.start_pos for s in seqs],
            tokens=[list(s.token_ids) for s in seqs],
            need_logits=[s.need_logits for s in seqs],
            new=tuple(
                NewRequest(
                    k,
                    f"standalone{-k}",
                    [],
                    [],
                    greedy if s.lora_name is None else replace(greedy, lora_name=s.lora_name),
                    list(s.block_table),
                )
                for k, s in zip(keys, seqs, strict=True)
            ),
            prompt_logits=tuple(PromptLogits(i, 0, [], 0) for i, s in enumerate(seqs) if s.prompt_logits),
            sample=sample,
        )


@dataclass(slots=True)
class StepSeq:
    """One row of a hand-built step (StepPlan.standalone): what a request feeds, where, and its blocks."""

    token_ids: list[int]  # tokens fed this step
    start_pos: int  # position of token_ids[0] = tokens already in the KV cache
    block_table: list[int]  # KV blocks covering at least start_pos + len(token_ids) tokens
    need_logits: bool = True  # its logits row is returned (False: a non-final prefill chunk)
    prompt_logits: bool = False  # also return the logits of every fed token (StepOutput.prompt_logits)
    lora_name: str | None = None  # the LoRA adapter the row runs through (None: the base model)


@dataclass
class StepOutput:
    """What a step gives back. Device tensors and host copies; the host copies are valid once `ready`
    (a CUDA event, None on the CPU) is done, and nothing in it waits for the device."""

    mode: StepMode  # how the step ran: a graph replay (or capture), or eagerly
    # [number of need_logits rows, V]: their logits in row order, a view of a static buffer valid until the
    # next execute (sampling may have processed them in place)
    logits: Any
    sampled: Any = None  # [need_logits rows] int64 ids sampled, on the device; None: the plan did not sample
    host: Any = None  # the same on the host (pinned on CUDA)
    ready: Any = None  # recorded after the copies to the host (CUDA); None: nothing to wait for
    failed: list[int] = field(default_factory=list)  # sampled rows whose sampling failed (their id is 0)
    logprob_rows: list[int] = field(default_factory=list)  # sampled rows whose request asked for logprobs
    logprobs: Any = None  # engine/sample/logprobs.py's Logprobs of their tokens (host copies), or None
    prompt_logprobs: Any = (
        None  # Logprobs of the plan's PromptLogits targets, in order (host copies), or None
    )
    # [sum of the fed tokens of the prompt_logits rows, V]: each fed token's logits, those rows in plan order
    prompt_logits: Any = None
    # The plan's verify rows, in plan.verify order (host copies, valid once `ready`): [B, K + 1] int64, row b
    # emits spec_tokens[b, :spec_accepted[b] + 1] (its accepted drafts, then the correction or the bonus,
    # which is also its entry of `sampled`); -1 past them. None: the plan had no verify rows.
    spec_tokens: Any = None
    spec_accepted: Any = None  # [B] int64: drafts accepted per verify row
    # The pooling rows that ended their prompt this step (their last chunk), as keys in plan order, and
    # their vectors: [len(pooled_keys), D] float32 host copy (valid once `ready`), cut and normalized as
    # each request's PoolingSpec says (D: the hidden size; a row cut to fewer dimensions has zeros after them).
    pooled_keys: list[int] = field(default_factory=list)
    pooled: Any = None


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
    @property
    def lora(self) -> Any: ...  # engine/worker/lora_slots.py's LoraSlots (--enable-lora), else None

    def execute(self, plan: StepPlan) -> StepOutput: ...

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
