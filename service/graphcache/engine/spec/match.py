"""accept_matching: a verify step's tokens for one-hot drafts, by sampling every fed position and keeping the
drafts that match.

A request b with n_b drafts d_0..d_{n_b-1} has n_b + 1 verify positions; p_j is the target's distribution
(after its temperature, top-k, top-p and min-p) for the token after the context and d_0..d_{j-1}. The
sampler draws x_j ~ p_j at every position, independently; the row accepts the leading drafts with
x_j = d_j and emits x_0..x_a, a the number accepted: the accepted drafts, then x_a, the first sample that
differs from its draft (or the bonus x_{n_b} when every draft matched).

Why this is exact. For a draft proposed with certainty (q_j one-hot at d_j: every host proposer, n-gram
and the draft model's greedy drafts), speculative sampling (rejection.py) accepts d_j with probability
min(1, p_j(d_j) / 1) = p_j(d_j) and on rejection draws from the residual, p_j with d_j removed and
renormalised. Sampling x_j ~ p_j and accepting when x_j = d_j does both at once: P(accept) = p_j(d_j), and
given x_j != d_j, x_j is distributed as p_j conditioned on not being d_j, the residual. Greedy rows
(temperature 0) sample the argmax, so they accept while the drafts equal it and then emit it: plain greedy
decoding's tokens.

Why this way: the draw is the plain sampler's own (sample/nucleus_draw.py: one launch, no sort, no
probability tensor), so a sampled verify step costs what sampling as many decode rows costs, where
building each position's filtered distribution for rejection sampling cost more than the model step at a
100-row batch of sampled requests (BENCHMARKS.md §19). And a seeded request's draw at output position i is
keyed by (seed, i), as in plain decoding (Sampler.sample_positions): with speculation it emits the tokens
it emits without, given the same logits.

Nothing here syncs with the host.
"""

from __future__ import annotations

import torch

__all__ = ["PLACEHOLDER", "accept_matching", "position_offsets"]

PLACEHOLDER = -1  # token ids past a row's emitted tokens


def position_offsets(drafts: list[list[int]]) -> list[int]:
    """Each verify position's output position relative to its row's last fed one (whose token the row's
    sampling state counts: request_table.py), rows packed in order: [-n_0..0, -n_1..0, ...]."""
    return [j - len(d) for d in drafts for j in range(len(d) + 1)]


def accept_matching(drafts: list[list[int]], sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts: B rows' drafts (host lists); sampled [sum(n_b + 1)] int64: a draw at every verify position,
    rows packed in order -> (token_ids [B, K + 1] int64, each row's accepted drafts and its next token,
    padded with PLACEHOLDER; num_accepted [B] int64), K = the longest row's drafts."""
    B, dev = len(drafts), sampled.device
    K = max(1, max(map(len, drafts)))
    gather, padded, first = [], [], 0
    for d in drafts:
        n = len(d)
        gather += [first + min(j, n) for j in range(K + 1)]  # positions past n repeat the row's last one
        padded += list(d) + [PLACEHOLDER] * (K - n)  # a pad never matches a sampled id (>= 0)
        first += n + 1
    host = torch.tensor(gather + padded, dtype=torch.int64)
    if dev.type == "cuda":
        host = host.pin_memory()
    both = host.to(dev, non_blocking=True)
    x = sampled.index_select(0, both[: B * (K + 1)]).view(B, K + 1)  # [B, K + 1]
    draft_ids = both[B * (K + 1) :].view(B, K)  # [B, K]
    num_accepted = (x[:, :K] == draft_ids).to(torch.int64).cumprod(dim=1).sum(dim=1)  # leading matches
    emitted = torch.arange(K + 1, device=dev).unsqueeze(0) <= num_accepted.unsqueeze(1)  # [B, K + 1]
    return torch.where(emitted, x, PLACEHOLDER), num_accepted
