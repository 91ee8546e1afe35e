"""Log probabilities of chosen tokens, computed on the device from raw logits.

"Raw" as in vLLM's default: log_softmax of the model's logits in fp32, before penalties, bias,
temperature or any filter, so a token's logprob does not depend on how it was sampled. For m
chosen tokens (sampled ones, or prompt tokens for `echo`) one batched pass gives each token's
logprob, its rank (1 = most likely: 1 + the tokens strictly more likely), and the top k
alternatives (k = the largest any row asked for; each row is cut to its own k on the host).

The worker computes them in the step (engine/worker/sampling.py) and copies the results to the host
asynchronously, like the sampled tokens; the core reads them once the step's copy event is done.

Prompt logprobs (params.prompt_logprobs, for `echo`): entry i = log p(prompt[i] | prompt[:i]) comes
from the logits at position i - 1, entry 0 is None. The scheduler puts a PromptLogits in the step's plan
for each row whose chunk covers positions with no entry yet, and the worker returns those positions'
logprobs; chunks accumulate into Sequence.prompt_logprobs, and an entry computed twice (a recompute
after preemption) is recorded once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from graphcache.engine.plan import StepPlan
from graphcache.engine.sample.controls import to_device
from graphcache.engine.sequence import Sequence, TokenLogprob

log = logging.getLogger("graphcache.engine")

# Rows per log_softmax pass: bounds the fp32 [rows, V] temporary (a long prompt chunk with
# prompt_logprobs has one row per token: 8192 x 152k fp32 would be 5 GB in one pass).
ROWS_PER_PASS = 512


@dataclass
class Logprobs:
    """m chosen tokens' log probabilities; on the device, or (to_host) on the host."""

    logprob: torch.Tensor  # [m] fp32: log p(chosen token)
    rank: torch.Tensor  # [m] int64: 1 + how many tokens are strictly more likely
    top_logprobs: torch.Tensor  # [m, k] fp32, most likely first
    top_ids: torch.Tensor  # [m, k] int64

    def to_host(self) -> Logprobs:
        """Queue the copies to pinned host memory (CUDA; no wait): valid once the stream reaches
        them (the caller records an event after). On the CPU, itself."""
        if not self.logprob.is_cuda:
            return self
        return Logprobs(
            *(_pinned_copy(t) for t in (self.logprob, self.rank, self.top_logprobs, self.top_ids))
        )

    def entries(self, token_ids: list[int], ks: list[int]) -> list[TokenLogprob]:
        """Host side: one TokenLogprob per row (row i is token_ids[i]'s), keeping its top ks[i]."""
        logprob, rank = self.logprob.tolist(), self.rank.tolist()
        top_lp, top_ids = self.top_logprobs.tolist(), self.top_ids.tolist()
        return [
            TokenLogprob(
                token_id=t,
                logprob=logprob[i],
                rank=rank[i],
                top=list(zip(top_ids[i][:k], top_lp[i][:k], strict=True)),
            )
            for i, (t, k) in enumerate(zip(token_ids, ks, strict=True))
        ]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> Logprobs:
    """Raw log probabilities of token_ids[i] under logits[i]: logits [m, V] (any float dtype),
    token_ids [m] int64 on the same device, k >= 0 alternatives per row. Nothing waits for the GPU."""
    m, vocab = logits.shape
    k = min(k, vocab)
    dev = logits.device
    logprob = torch.empty(m, dtype=torch.float32, device=dev)
    rank = torch.empty(m, dtype=torch.int64, device=dev)
    top_lp = torch.empty(m, k, dtype=torch.float32, device=dev)
    top_ids = torch.empty(m, k, dtype=torch.int64, device=dev)
    for lo in range(0, m, ROWS_PER_PASS):
        hi = min(m, lo + ROWS_PER_PASS)
        lp = logits[lo:hi].float().log_softmax(dim=-1)  # [r, V] fp32
        chosen = lp.gather(1, token_ids[lo:hi].unsqueeze(1))  # [r, 1]
        logprob[lo:hi] = chosen.squeeze(1)
        rank[lo:hi] = (lp > chosen).sum(dim=-1) + 1
        if k:
            values, ids = lp.topk(k, dim=-1)  # sorted, most likely first
            top_lp[lo:hi], top_ids[lo:hi] = values, ids
    return Logprobs(logprob, rank, top_lp, top_ids)


# --- prompt logprobs: which positions a step computes, and recording them ----------------------


@dataclass
class PromptSpan:
    """Prompt logprob entries one sequence's chunk yields (the core's record of a plan's PromptLogits):
    entries first_entry .. + len(targets), entry i = log p(prompt[i] | prompt[:i])."""

    seq: Sequence
    first_entry: int  # prompt index of the first target
    targets: list[int]  # prompt[first_entry : first_entry + count]


def prompt_token_logprobs(prompt_logits: torch.Tensor | None, plan: StepPlan) -> Logprobs | None:
    """The plan's PromptLogits targets' logprobs from the step's per-position logits (the fed tokens of
    those rows, in plan order), one batched pass."""
    spans = plan.prompt_logits
    if not spans:
        return None
    if prompt_logits is None:
        raise RuntimeError(
            "the runner returned no StepOutput.prompt_logits for a step with PromptLogits rows; "
            "the runner must return every fed token's logits of those rows"
        )
    rows: list[int] = []
    targets: list[int] = []
    base = 0
    for span in spans:
        rows += range(base + span.offset, base + span.offset + len(span.targets))
        targets += span.targets
        fed = plan.fed(span.row)
        base += 1 if fed is None else len(fed)
    dev = prompt_logits.device
    k = max(span.k for span in spans)
    if len(spans) == 1:  # one contiguous run of rows: a view, not a [m, V] copy
        chosen = prompt_logits[rows[0] : rows[-1] + 1]
    else:
        chosen = prompt_logits.index_select(0, to_device(rows, torch.int64, dev))  # [m, V]
    return token_logprobs(chosen, to_device(targets, torch.int64, dev), k).to_host()


def record_sampled_logprobs(
    seqs: list[Sequence], lengths: list[int], token_ids: list[int | None], logprobs: Logprobs
) -> None:
    """Host side, after Scheduler.postprocess: append each sampled token's entry to its sequence if
    postprocess appended the token (lengths: the output lengths before it; a token dropped past a
    finish, or a failed sampling, gets none), so output_logprobs stays aligned with output_token_ids."""
    ids = [t if t is not None else -1 for t in token_ids]
    entries = logprobs.entries(ids, [seq.params.logprobs or 0 for seq in seqs])  # each one's is set
    for seq, length, entry in zip(seqs, lengths, entries, strict=True):
        if seq.num_output_tokens == length + 1:
            seq.output_logprobs.append(entry)
            seq.cumulative_logprob += entry.logprob


def record_prompt_logprobs(spans: list[PromptSpan], logprobs: Logprobs) -> None:
    """Host side: append the spans' prompt entries, each index once (a recompute after preemption,
    or a chunk launched before the previous one completed, may compute an entry again)."""
    targets = [t for span in spans for t in span.targets]
    ks = [span.seq.params.prompt_logprobs or 0 for span in spans for _ in span.targets]  # each one's is set
    entries = logprobs.entries(targets, ks)
    start = 0
    for span in spans:
        mine, start = entries[start : start + len(span.targets)], start + len(span.targets)
        recorded = span.seq.prompt_logprobs
        if not recorded:
            recorded.append(None)  # prompt token 0 has no context
        if span.first_entry > len(recorded):  # positions never computed (a cached prefix?)
            log.warning(
                "request %s: prompt logprobs %d..%d were not computed (prefix cache hit?); they are None",
                span.seq.request_id,
                len(recorded),
                span.first_entry - 1,
            )
            recorded += [None] * (span.first_entry - len(recorded))
        for i, entry in enumerate(mine):
            if span.first_entry + i == len(recorded):  # else recorded already
                recorded.append(entry)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
