"""Structured output: constrain sampling to a JSON schema, a regex, a list of choices or a grammar.

The grammar engine is llguidance (Microsoft's, also a vLLM backend). It was picked over xgrammar
because `llguidance.LLTokenizer` builds straight from the tokenizer.json text we already load
(model/tokenizer.py, the `tokenizers` library): no transformers tokenizer object, no hub access, no
vocabulary re-derivation; its wheel is abi3 (one build for every Python), computes a mask in tens of
microseconds with an Earley parser over a lazily built lexer (no per-grammar precompile of the
whole vocabulary), and it accepts JSON schema, regex, Lark and GBNF, plus `%json {schema}` inside a
Lark rule, which is how tool calls force Hermes markup around schema-checked arguments
(api/openai/tool_calls.py).

Life of a constrained request (the lead wires these calls; none of them is made here):
  1. submit (API side, off the event loop: compiling a large schema can take ~100 ms):
     `structured.check(spec)` compiles it through the cache, InvalidRequest(param=...) when it is
     invalid; the engine's check() may call it again (a cache hit).
  2. EngineCore.add_request: `seq.grammar = structured.new_matcher(spec)` (a copy of the cached
     compiled matcher: cheap).
  3. Scheduler.schedule, building the step's plan: `structured.masks(sampled seqs)` (the scheduler's
     grammar_masks hook) fills a bitmask of the ids each grammar row may sample next, on the host, and
     the plan carries it (StepPlan.grammar); the worker, after taking the raw logprob rows and BEFORE
     sampling, sets the other ids to -inf in those rows (`apply_grammar_mask`, in place).
  4. Scheduler.postprocess, right after a token is appended: `accept(seq, token)` (False: the token
     broke the grammar: finish "error"); when the stop rules found no reason,
     `is_done(seq)` -> finish "stop" (the grammar is complete: nothing but EOS could follow).
  5. Async scheduling: a mask needs the previous token accepted, so a step is never launched while
     a step holding one of its grammar sequences is in flight (complete the pending step first).

Vocabulary: the model's logits may be wider than the tokenizer (embedding padded to a multiple of
64/128): the matcher is built over max(model, tokenizer) ids, and ids without a token string are
never allowed, so padding ids are masked too. EOS is allowed exactly when the grammar accepts.

Hardening (docs/RELIABILITY.md, "Structured output limits"): a spec is bounded in depth before it is
compiled (engine/sample/grammar_bounds.py); it compiles on a big-stack thread of a bounded pool
(engine/sample/grammar_compiler.py), under llguidance limits (lexer fuel, short error texts), and its first
mask plus one step past the first allowed token are computed there too, within a time budget. A spec
that is unsatisfiable (the first mask allows nothing), past the library's limits, or too slow is an
InvalidRequest naming its field; nothing failed is cached. The cache is bounded by entries and by bytes:
an entry's bytes are the C heap's growth while it compiled and took its first masks (glibc mallinfo2),
at least its grammar text's length. While generating, a sequence's mask cost is bounded
(engine/sample/grammar_matcher.py).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from graphcache.engine.plan import GrammarMask
from graphcache.engine.sample.controls import to_device
from graphcache.engine.sample.grammar_cache import GrammarCache
from graphcache.engine.sample.grammar_compiler import GrammarLimits
from graphcache.engine.sequence import Sequence
from graphcache.engine.stopping import grammar_accepts, grammar_done

__all__ = ["StructuredOutput", "accept", "apply_grammar_mask", "is_done"]


class StructuredOutput(GrammarCache):
    """The grammar cache plus masking: masks() says which ids each grammar row may sample next, as data the
    scheduler puts in the step's plan; apply_grammar_mask() sets the others to -inf in the worker. One per
    engine; the engine thread masks while API threads check()."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        cache_size: int | None = None,
        limits: GrammarLimits | None = None,
        metrics: Any = None,
    ) -> None:
        super().__init__(tokenizer, vocab_size, cache_size, limits, metrics)

    # --- masking ---------------------------------------------------------------------------
    def masks(self, seqs: list[Sequence]) -> GrammarMask | None:
        """The masks of the rows whose seq has a grammar (row i belongs to seqs[i]; None: no such row),
        filled on the host (all rows in one parallel llguidance call)."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return None
        bitmask = np.empty((len(rows), self._words), dtype=np.int32)  # [G, words]
        jobs: list[tuple[Any, int]] = []
        timed: list[tuple[Any, int]] = []
        states = [seqs[i].grammar for i in rows]
        for k, state in enumerate(states):
            state.note_error()
            if state.failure is None:
                (timed if state.watched else jobs).append((state, k))
        self._compute_masks(bitmask, jobs, timed)
        for k, state in enumerate(states):
            if state.failure is not None:
                # A failed grammar (postprocess ends the request): allow EOS only so the row still samples.
                bitmask[k] = 0
                for eos in self.eos_token_ids:
                    bitmask[k, eos // 32] |= np.int32(_bit(eos % 32))
        return GrammarMask(tuple(rows), bitmask)

    def _compute_masks(self, bitmask: np.ndarray, jobs: list, timed: list) -> None:
        """Fill bitmask rows: `jobs` in one parallel call, watched rows one at a time, each timed and charged
        (grammar_matcher.py). A parallel call over the per-token bound puts its rows under watch."""
        limits, ptr, row_bytes, n = self.limits, bitmask.ctypes.data, self._words * 4, bitmask.shape[0]
        if jobs:
            start = time.perf_counter()
            self._executor.unsafe_compute_mask_ptr(
                [(state.matcher, k) for state, k in jobs], ptr, row_bytes, n
            )
            if (time.perf_counter() - start) * 1e3 > limits.mask_ms_per_token:
                for state, _ in jobs:
                    state.watched = True
        for state, k in timed:
            start = time.perf_counter()
            self._executor.unsafe_compute_mask_ptr([(state.matcher, k)], ptr, row_bytes, n)
            state.charge(time.perf_counter() - start, limits.mask_ms_per_token, limits.mask_window)
        for state, _ in (*jobs, *timed):
            state.note_error()  # a mask past the library's limits: the request ends with why

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """masks() then apply_grammar_mask(), in one call (tests and tools)."""
        mask = self.masks(seqs)
        if mask is not None:
            apply_grammar_mask(logits, mask)

    def allowed_token_ids(self, seq: Sequence) -> list[int]:
        """The ids seq's grammar allows next (tests and debugging; masks() is the fast path)."""
        logits = torch.zeros(1, self.vocab_size)
        self.apply(logits, [seq])
        return torch.nonzero(logits[0] == 0).flatten().tolist()


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """Set the ids mask does not allow to -inf in its rows of logits [R, V], in place: the mask copied
    once (pinned, asynchronous on CUDA) and applied by one batched op on logits' device."""
    dev, rows = logits.device, mask.rows
    bits = torch.from_numpy(mask.bits)
    if dev.type == "cuda":
        bits = bits.pin_memory().to(dev, non_blocking=True)
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    vocab = logits.shape[-1]
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()  # [G, V]
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = to_device(list(rows), torch.int64, dev)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


# Advancing a matcher and asking if it is complete are stop rules the scheduler runs after every token:
# they live in the torch-free stopping.py; these names keep this module's interface whole.
accept = grammar_accepts
is_done = grammar_done


def _bit(position: int) -> int:
    """Bit `position` of an int32 word, as the signed value torch stores."""
    return (1 << position) - (1 << 32 if position == 31 else 0)


# Methods too, so the engine holds one object: structured.accept(seq, t) / structured.is_done(seq).
StructuredOutput.accept = staticmethod(accept)  # type: ignore[attr-defined]
StructuredOutput.is_done = staticmethod(is_done)  # type: ignore[attr-defined]
