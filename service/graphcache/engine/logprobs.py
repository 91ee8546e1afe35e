"""Log probabilities of chosen tokens, computed on the device from raw logits.

"Raw" as in vLLM's default: log_softmax of the model's logits in fp32, before penalties, bias,
temperature or any filter, so a token's logprob does not depend on how it was sampled. For m
chosen tokens (sampled ones, or prompt tokens for `echo`) one batched pass gives each token's
logprob, its rank (1 = most likely: 1 + the tokens strictly more likely), and the top k
alternatives (k = the largest any row asked for; each row is cut to its own k on the host).

The results are copied to the host asynchronously, like the sampled tokens (engine/core.py's
_InFlight), and read once the step's copy event is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcache.engine.sequence import TokenLogprob

# Rows per log_softmax pass: bounds the fp32 [rows, V] temporary (a long prompt chunk with
# prompt_logprobs has one row per token: 8192 x 152k fp32 would be 5 GB in one pass).
ROWS_PER_PASS = 512


@dataclass
class Logprobs:
    """m chosen tokens' log probabilities; on the device, or (to_host) on the host."""

    logprob: torch.Tensor        # [m] fp32: log p(chosen token)
    rank: torch.Tensor           # [m] int64: 1 + how many tokens are strictly more likely
    top_logprobs: torch.Tensor   # [m, k] fp32, most likely first
    top_ids: torch.Tensor        # [m, k] int64

    def to_host(self) -> Logprobs:
        """Queue the copies to pinned host memory (CUDA; no wait): valid once the stream reaches
        them (the caller records an event after). On the CPU, itself."""
        if not self.logprob.is_cuda:
            return self
        return Logprobs(*(_pinned_copy(t) for t in (self.logprob, self.rank, self.top_logprobs, self.top_ids)))

    def entries(self, token_ids: list[int], ks: list[int]) -> list[TokenLogprob]:
        """Host side: one TokenLogprob per row (row i is token_ids[i]'s), keeping its top ks[i]."""
        logprob, rank = self.logprob.tolist(), self.rank.tolist()
        top_lp, top_ids = self.top_logprobs.tolist(), self.top_ids.tolist()
        return [TokenLogprob(token_id=t, logprob=logprob[i], rank=rank[i],
                             top=list(zip(top_ids[i][:k], top_lp[i][:k], strict=True)))
                for i, (t, k) in enumerate(zip(token_ids, ks, strict=True))]


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
        lp = logits[lo:hi].float().log_softmax(dim=-1)                  # [r, V] fp32
        chosen = lp.gather(1, token_ids[lo:hi].unsqueeze(1))            # [r, 1]
        logprob[lo:hi] = chosen.squeeze(1)
        rank[lo:hi] = (lp > chosen).sum(dim=-1) + 1
        if k:
            values, ids = lp.topk(k, dim=-1)                            # sorted, most likely first
            top_lp[lo:hi], top_ids[lo:hi] = values, ids
    return Logprobs(logprob, rank, top_lp, top_ids)


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small host list of ids as an int64 tensor on `device`, without a stream-wide wait on CUDA
    (pinned memory, non_blocking)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
