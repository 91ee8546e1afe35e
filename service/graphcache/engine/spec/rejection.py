"""rejection_sample: exact speculative sampling of a verify step, batched, on any device.

A request b with n_b drafts d_0..d_{n_b-1} (0 <= n_b <= K) has n_b + 1 target rows: p_j, the target's
distribution for the token after the context and d_0..d_{j-1}; row n_b is the bonus row. The rule
(Leviathan et al. 2023; Chen et al. 2023; vLLM's RejectionSampler):
  - draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)), q_j the distribution it was drawn
    from; drafts are tried in order and the first rejection ends the row;
  - at the first rejected j the row emits one token from the residual max(p_j - q_j, 0), renormalised;
    if every draft is accepted it emits the bonus token, drawn from p_{n_b};
  - so a row emits num_accepted + 1 tokens, and each is distributed exactly as the target's.
Host proposals (n-gram) are deterministic: q_j is one-hot at d_j (draft_probs None), the acceptance is
p_j(d_j) and the residual is p_j with d_j removed. A draft q_j(d_j) = 0 is rejected (as vLLM does: such
a token was never drawn from q). Greedy rows accept while d_j equals the target's argmax and then emit
the argmax: the tokens plain greedy decoding emits.

Randomness comes in: `accept_uniforms` [B, K] (one per draft) and `draw_uniforms` [B] (the residual or
bonus draw, by inverse CDF, so one uniform per row suffices), all in [0, 1). Whoever calls decides where
they come from: uniforms() below draws them from per-request torch generators for seeded rows (vLLM's
way) and one shared generator for the rest; a counter-based source keyed by (seed, position), like the
sampler's race_draw hash, fits the same arguments. Every step is row-wise: a row's tokens depend only on
its own inputs, never on the batch it shares.

Layout: drafts are padded per request ([B, K]), target rows are packed (the verify step's logits rows in
request order: request b's rows start at sum_{c<b} (n_c + 1)). Nothing here syncs with the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PLACEHOLDER", "Verified", "rejection_sample", "uniforms"]

PLACEHOLDER = -1  # token_ids past a row's emitted tokens


@dataclass(frozen=True)
class Verified:
    """What a verify step emits. Row b's tokens are token_ids[b, :num_accepted[b] + 1]: its accepted
    drafts, then the correction or the bonus token; PLACEHOLDER after them."""

    token_ids: torch.Tensor  # [B, K + 1] int64
    num_accepted: torch.Tensor  # [B] int64: drafts accepted, 0..n_b


def rejection_sample(
    *,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    greedy: torch.Tensor,
    target_probs: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    accept_uniforms: torch.Tensor | None = None,
    draw_uniforms: torch.Tensor | None = None,
    bonus_token_ids: torch.Tensor | None = None,
) -> Verified:
    """Accept or reject each request's drafts against the target; see the module docstring.

    draft_token_ids   [B, K] int64: row b's drafts in its first n_b entries (the rest are ignored)
    num_draft_tokens  [B] int64: n_b, 0..K
    greedy            [B] bool: rows decoded by argmax
    target_probs      [T, V] float, T = sum(n_b + 1): the target's distributions (after temperature,
                      top-k, top-p, min-p and logits controls), packed; None only if every row is greedy
    target_argmax     [T] int64: the target's greedy token per row, as the plain sampler picks it (argmax
                      of the logits: a softmax can tie two logits that differ); None: target_probs.argmax
    draft_probs       [B, K, V] float or None (one-hot at the drafts: host or greedy proposals)
    accept_uniforms   [B, K] and draw_uniforms [B], in [0, 1): needed with target_probs
    bonus_token_ids   [B] int64 or None: the bonus already drawn by the plain sampler from the bonus row;
                      then a row with no drafts emits exactly what plain decoding would, bit for bit
    """
    B, K = draft_token_ids.shape
    device = draft_token_ids.device
    n = num_draft_tokens.to(device=device, dtype=torch.int64)  # [B]
    start = torch.cumsum(n + 1, 0) - (n + 1)  # [B]: each request's first target row
    pos = torch.arange(K, device=device)  # [K]
    valid = pos[None, :] < n[:, None]  # [B, K]: real drafts
    rows = start[:, None] + torch.minimum(pos[None, :], n[:, None])  # [B, K]: padding -> the bonus row
    drafts = torch.where(valid, draft_token_ids, 0)  # [B, K]: padding as token 0, a safe index
    if target_argmax is None:
        if target_probs is None:
            raise ValueError("rejection_sample needs target_probs or target_argmax")
        target_argmax = target_probs.argmax(dim=-1)  # [T]
    accept = target_argmax[rows] == drafts  # [B, K]: the greedy test
    if target_probs is not None:
        if accept_uniforms is None or draw_uniforms is None:
            raise ValueError("rejection_sample with target_probs needs accept_uniforms and draw_uniforms")
        p = target_probs[rows, drafts].float()  # [B, K]: p_j(d_j)
        if draft_probs is None:
            random_accept = accept_uniforms < p  # q_j(d_j) = 1; strict: a p of 0 is never accepted
        else:
            q = draft_probs.gather(2, drafts[:, :, None]).squeeze(2).float()  # [B, K]: q_j(d_j)
            random_accept = (accept_uniforms * q < p) & (q > 0)  # u < p / q without the division
        accept = torch.where(greedy[:, None], accept, random_accept)
    # The accepted prefix: a rejection (or the end of the drafts) stops the row.
    num_accepted = (accept & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    final_row = start + num_accepted  # [B]: the row the last token comes from
    final = target_argmax[final_row]  # [B]: greedy rows' correction or bonus
    rejected = num_accepted < n  # [B]: the last token is a correction (else the bonus)
    if target_probs is not None:
        assert draw_uniforms is not None
        sampled = _draw_final(
            target_probs, final_row, drafts, draft_probs, num_accepted, rejected, draw_uniforms
        )
        final = torch.where(greedy, final, sampled)
    if bonus_token_ids is not None:
        final = torch.where(rejected, final, bonus_token_ids.to(device=device, dtype=torch.int64))
    kept = pos[None, :] < num_accepted[:, None]  # [B, K]
    token_ids = torch.full((B, K + 1), PLACEHOLDER, dtype=torch.int64, device=device)
    token_ids[:, :K] = torch.where(kept, draft_token_ids.to(torch.int64), PLACEHOLDER)
    token_ids.scatter_(1, num_accepted[:, None], final[:, None])
    return Verified(token_ids, num_accepted)


def _draw_final(
    target_probs: torch.Tensor,
    final_row: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_accepted: torch.Tensor,
    rejected: torch.Tensor,
    draw_uniforms: torch.Tensor,
) -> torch.Tensor:
    """Each row's last token: from the residual max(p - q, 0) where a draft was rejected, from p (the
    bonus row) where none was. One uniform per row, by inverse CDF. -> [B] int64"""
    B, K = drafts.shape
    dist = target_probs[final_row].float()  # [B, V]: a copy, safe to edit
    if K > 0:
        j = num_accepted.clamp(max=K - 1)[:, None]  # [B, 1]: the rejected position (clamped if none)
        if draft_probs is None:  # one-hot q: the residual is p without the rejected draft
            d = drafts.gather(1, j)  # [B, 1]
            dist.scatter_(1, d, torch.where(rejected[:, None], 0.0, dist.gather(1, d)))
        else:
            q = draft_probs[torch.arange(B, device=dist.device), j[:, 0]].float()  # [B, V]
            dist = torch.where(rejected[:, None], (dist - q).clamp_(min=0.0), dist)
    # A residual that rounds to nothing (p == q up to rounding: a rejection of probability ~0) falls
    # back to p, so the draw never divides by zero.
    total = dist.sum(dim=-1, keepdim=True)  # [B, 1]
    dist = torch.where(total > 0, dist, target_probs[final_row].float())
    # float64 prefix sums: over 152k tokens fp32 rounding would bias the tail of the vocabulary.
    cdf = dist.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    x = draw_uniforms.to(device=cdf.device, dtype=torch.float64)[:, None] * cdf[:, -1:]  # [B, 1]
    # right=True: the first index whose prefix sum exceeds x, never a token of probability 0.
    token = torch.searchsorted(cdf, x, right=True)[:, 0]
    return token.clamp_(max=dist.shape[-1] - 1)


def uniforms(
    generators: Sequence[torch.Generator | None],
    num_speculative_tokens: int,
    device: torch.device | str,
    default: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_uniforms [B, K] and draw_uniforms [B] for B rows: K + 1 per row every step, whatever its
    number of drafts, so a seeded row's generator advances the same way however the proposer did. Rows
    with a generator (seeded requests: one torch.Generator on `device` each, seeded once) draw from it,
    so their tokens repeat run to run and do not depend on the batch; the rest share `default` (None:
    torch's global generator), in one call."""
    B, K = len(generators), num_speculative_tokens
    u = torch.rand((B, K + 1), generator=default, device=device)  # [B, K + 1]
    for i, generator in enumerate(generators):
        if generator is not None:
            u[i] = torch.rand((K + 1,), generator=generator, device=device)
    return u[:, :K], u[:, K]
