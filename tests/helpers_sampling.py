"""Torch references for the sampling kernels' tests, independent of the kernels: the filtered row z, the
top-k / top-p threshold by a full sort, the test logits shapes and the race keys; and the sampler fed
Sequences (SequenceSampler)."""

from __future__ import annotations

import torch
from graphcache.engine.sample import race_draw as rd
from graphcache.engine.sample.sampler import Sampler
from graphcache.engine.sample.state import SamplingState

NEG_INF = float("-inf")


def keys_of(seeds, step=0) -> torch.Tensor:
    """[len(seeds)] int64: each seed's race key at `step`, as a seeded row's key is made."""
    return torch.tensor([rd.to_int64(rd.row_key(s, step)) for s in seeds], dtype=torch.int64)


def sort_threshold(z: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """thr [R] by sorting each row (independent of the kernels): the k-th largest value, then the top-p
    cut over the tokens >= it, both keeping every token tied with the cut; in float64 sums."""
    rows, vocab = z.shape
    out = torch.empty(rows)
    for r in range(rows):
        vals = z[r].double().sort(descending=True).values
        finite = vals[vals > NEG_INF]
        thr_k = NEG_INF
        if int(k[r]) < vocab and int(k[r]) <= finite.numel():
            thr_k = float(vals[int(k[r]) - 1])
        thr = thr_k
        if float(p[r]) < 1:
            kept = finite[finite >= thr_k]
            w = kept.exp()
            cum = w.cumsum(0)
            target = float(p[r]) * float(cum[-1])
            # the first position whose mass reaches the target, widened to its tie group
            j = int((cum < target).sum().clamp(max=kept.numel() - 1))
            thr = max(thr, float(kept[j]))
        out[r] = thr
    return out


def z_of(logits: torch.Tensor, t: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """[R, V] fp32: (logits - row max) * (1 / T) (as the sampler scales) with NaN and the tokens below
    log(min_p) at -inf."""
    x = logits.float().nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    z = (x - x.max(dim=-1, keepdim=True).values) * (1.0 / t.float().view(-1, 1))
    return z.masked_fill(z < log_min_p.view(-1, 1), NEG_INF)


def rows_of(name: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    """[rows, vocab] test logits of one shape: normal, flat (long nuclei), peaked, bf16 ties, a few
    distinct values (every cut inside a tie group), or mostly -inf (row 0 with one finite token)."""
    g = torch.Generator().manual_seed(seed)
    if name == "normal":
        return torch.randn(rows, vocab, generator=g) * 3
    if name == "flat":
        return torch.randn(rows, vocab, generator=g) * 0.05
    if name == "peaked":
        return torch.randn(rows, vocab, generator=g) * 8
    if name == "bf16_ties":  # bf16 logits tie by the hundred at this vocabulary
        return (torch.randn(rows, vocab, generator=g) * 2 + 1).to(torch.bfloat16)
    if name == "few_values":  # five distinct values: every cut is inside a tie group
        return torch.randint(-2, 3, (rows, vocab), generator=g).float() + 0.5
    if name == "minus_inf":
        x = torch.randn(rows, vocab, generator=g) * 3
        x[torch.rand(rows, vocab, generator=g) < 0.6] = NEG_INF
        x[0, 1:] = NEG_INF
        x[0, 0] = 2.5
        return x
    raise KeyError(name)


class SequenceSampler(Sampler):
    """The sampler, fed the scheduler's Sequences: each call reads them as the worker's rows
    (SamplingState.of: their outputs so far, and num_generated counting a token still in flight), so a
    test can append outputs or set num_inflight between calls as the engine would."""

    def sample_device(self, logits, seqs, plain_greedy=None):
        return super().sample_device(logits, [_state(s) for s in seqs], plain_greedy)

    def processed_logits(self, logits, seqs):
        return super().processed_logits(logits, [_state(s) for s in seqs])


def _state(seq) -> SamplingState:
    return seq if isinstance(seq, SamplingState) else SamplingState.of(seq)
