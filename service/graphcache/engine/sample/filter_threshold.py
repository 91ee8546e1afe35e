"""top-k / top-p as one threshold per row, without sorting the vocabulary.

Why: sorting every row's whole vocabulary costs 6-7 ms for 256 rows x 152k on the H200, more than
the model step. Both filters keep the tokens whose (shifted, scaled)
logit z is at least some value of the row, so each row needs one number: thr, and the kept set is
{i : z_i >= thr}.

  top-k: thr_k = the k-th largest z.
  top-p: over the top-k survivors, renormalized: thr_p = the value of the token at which the
         mass of the tokens at or above it first reaches top_p (the smallest nucleus; the most
         likely token always stays, top_p 0 included).
  thr = max(thr_k, thr_p).

Ties at the threshold: every token equal to thr is kept (a sort would keep the first of them in sort
order, an arbitrary choice; a value cut keeps them all, so no token is dropped for its index). With
no ties the kept set is exactly the sort's (tests/engine/test_sampling_kernels.py checks it against
`reference_sort_filter`, the full sort).

How, without a host sync:
  1. torch.topk of a bounded prefix (PREFIX = 4096 per row, clamped to the vocabulary): top-k for
     k <= PREFIX is exact from it, and top-p is exact when the prefix's cumulative mass reaches top_p
     (any peaked distribution). Why 4096: the benchmark's rows (randn * 3, T 0.8, 152k vocabulary)
     have a top_p 0.9 nucleus of ~1,240 tokens; with a 1024 prefix 72% of them would take the
     fallback, with 2048 the worst of 32 rows reached 0.901. Real model rows are usually far peakier.
  2. Rows where it does not (top_k > PREFIX, or a flat distribution whose nucleus is longer than the
     prefix) are flagged on the device, and an exact fallback computes their threshold: a bisection on
     the bits of |z| (z <= 0, so the fp32 bits of |z| are ordered like -z), 31 steps on the count for
     top-k and 31 on the mass for top-p, each step a pass over the row. On CUDA a Triton kernel does it,
     one program per row, and a row that is not flagged returns at once; the result is chosen with
     torch.where. On the CPU (no GPU to wait for) the flagged rows are picked on the host and bisected
     with torch ops, which are also the kernel's reference.

Inputs: z [R, V] fp32 with z <= 0 or -inf (logits minus the row max, over the temperature, min_p
already applied as -inf); rows with NaN (no distribution) get some threshold and are the caller's
business.
"""

from __future__ import annotations

import torch

from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = ["PREFIX", "bisect_thresholds", "reference_sort_filter", "thresholds"]

PREFIX = 4096
_INF_KEY = 0x7F800000  # the fp32 bits of +inf: the largest key of a non-NaN |z|
_NEG_INF = float("-inf")


def _key_to_thr(c: torch.Tensor) -> torch.Tensor:
    """int32 keys [R] -> thresholds [R] fp32: keep z >= -float(bits c) <=> bits(|z|) <= c."""
    return c.to(torch.int32).view(torch.float32).neg()


def thresholds(
    z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, prefix: int = PREFIX
) -> torch.Tensor:
    """thr [R] fp32 (-inf = keep all) for z [R, V]; top_k [R] int (0 or >= V: off) or None; top_p [R]
    (>= 1: off) or None. `prefix` is a parameter for the tests (a small one exercises the fallback)."""
    rows, vocab = z.shape
    dev = z.device
    width = max(1, min(prefix, vocab))
    k = _k_or_vocab(top_k, rows, vocab, dev)  # [R] int64, vocab = off
    p = top_p.float() if top_p is not None else torch.ones(rows, device=dev)
    vals = z.topk(width, dim=-1).values  # [R, width], descending
    k_on = k < vocab
    thr_k = torch.where(
        k_on & (k <= width), vals.gather(1, (k.clamp(1, width) - 1).view(-1, 1)).view(-1), _NEG_INF
    )
    need = k_on & (k > width)  # [R] bool
    thr = thr_k
    if top_p is not None:
        p_on = p < 1
        w = z.exp()  # [R, V]; z <= 0: no overflow
        if top_k is not None:
            w.masked_fill_(z < thr_k.view(-1, 1), 0)
        mass = w.sum(dim=-1)  # [R]: the top-k survivors' mass
        w = vals.exp().masked_fill_(vals < thr_k.view(-1, 1), 0)  # [R, width]
        cum = w.cumsum(dim=-1) / mass.view(-1, 1)  # non-decreasing
        j = (cum < p.view(-1, 1)).sum(dim=-1)  # first index where it reaches top_p
        thr_p = torch.where(p_on, vals.gather(1, j.clamp(max=width - 1).view(-1, 1)).view(-1), _NEG_INF)
        thr = torch.maximum(thr_k, thr_p)
        need = need | (p_on & (j >= width))
    return torch.where(need, _fallback(z, k, p, need), thr)


def _k_or_vocab(top_k: torch.Tensor | None, rows: int, vocab: int, dev: torch.device) -> torch.Tensor:
    if top_k is None:
        return torch.full((rows,), vocab, dtype=torch.int64, device=dev)
    k = top_k.to(torch.int64).clamp(0, vocab)
    return torch.where(k > 0, k, vocab)


def _fallback(z: torch.Tensor, k: torch.Tensor, p: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """Exact thresholds for the rows flagged in need [R] (others: anything)."""
    if z.is_cuda:
        if HAVE_TRITON:
            return bisect_thresholds_triton(z, k, p, need)
        return bisect_thresholds(z, k, p)  # every row: slow, but no sync
    out = torch.full_like(p, _NEG_INF)
    rows = need.nonzero().view(-1)  # the CPU: nothing to wait for
    if rows.numel():
        out[rows] = bisect_thresholds(z[rows], k[rows], p[rows])
    return out


def bisect_thresholds(z: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The exact threshold of every row by bisection on key = bits(|z|) (torch ops, vectorized over rows):
    c_k = the smallest key with count(key <= c_k) >= k, then c_p = the smallest with
    mass(key <= c_p) >= top_p * mass(key <= c_k). k [R] int64 (>= V: off), p [R] fp32 (>= 1: off)."""
    rows, vocab = z.shape
    key = z.abs().view(torch.int32)  # [R, V]; NaN keys exceed _INF_KEY

    def smallest(ok) -> torch.Tensor:  # the smallest c in [0, _INF_KEY] with ok(c) (ok is monotone)
        lo = torch.zeros(rows, dtype=torch.int32, device=z.device)
        hi = torch.full((rows,), _INF_KEY, dtype=torch.int32, device=z.device)
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            good = ok(mid.view(-1, 1))
            hi, lo = torch.where(good, mid, hi), torch.where(good, lo, mid + 1)
        return lo

    full = torch.full((rows,), _INF_KEY, dtype=torch.int32, device=z.device)
    c_k = torch.where(k < vocab, smallest(lambda c: (key <= c).sum(dim=-1) >= k), full)
    w = z.exp()  # [R, V]
    mass = w.masked_fill(key > c_k.view(-1, 1), 0).sum(dim=-1)
    target = p * mass
    c_p = torch.where(p < 1, smallest(lambda c: w.masked_fill(key > c, 0).sum(dim=-1) >= target), full)
    return _key_to_thr(torch.minimum(c_k, c_p))


# --- Triton fallback: one program per row, flagged rows only -------------------------------------------
# Literal constants: a jitted function may not read module globals that are not constexpr.
# 2139095040 = 0x7F800000 (_INF_KEY). Counts are summed in fp32: exact below 2**24 tokens.
def _sum_at_or_below(base, vocab, c, BLOCK: tl.constexpr, MASS: tl.constexpr):
    """One pass over a row: how many tokens (MASS False), or how much exp(z) (MASS True), have key <= c."""
    cols = tl.arange(0, BLOCK)
    acc = tl.full((), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        z = tl.load(base + offs, mask=offs < vocab, other=float("-inf"))
        below = (tl.abs(z).to(tl.int32, bitcast=True) <= c) & (offs < vocab)
        if MASS:
            acc += tl.sum(tl.where(below, tl.exp(z), 0.0), axis=0)
        else:
            acc += tl.sum(below.to(tl.float32), axis=0)
    return acc


def _smallest_key(base, vocab, hi, target, BLOCK: tl.constexpr, MASS: tl.constexpr):
    """The smallest key c in [0, hi] with _sum_at_or_below(c) >= target (it grows with c): 31 passes."""
    lo = tl.full((), 0, tl.int32)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        good = _sum_at_or_below(base, vocab, mid, BLOCK, MASS) >= target
        hi = tl.where(good, mid, hi)
        lo = tl.where(good, lo, mid + 1)
    return lo


def _bisect_kernel(z_ptr, k_ptr, p_ptr, need_ptr, thr_ptr, stride_z, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(need_ptr + row) != 0:
        k = tl.load(k_ptr + row)
        p = tl.load(p_ptr + row)
        base = z_ptr + row * stride_z
        c_k = tl.full((), 2139095040, tl.int32)
        if k < vocab:  # smallest c with count(key <= c) >= k
            c_k = _smallest_key(base, vocab, c_k, k.to(tl.float32), BLOCK, False)
        c_p = tl.full((), 2139095040, tl.int32)
        if p < 1:  # smallest c with mass(key <= c) >= p * mass(key <= c_k)
            target = p * _sum_at_or_below(base, vocab, c_k, BLOCK, True)
            c_p = _smallest_key(base, vocab, c_k, target, BLOCK, True)  # mass(key <= c_k) >= target
        c = tl.minimum(c_k, c_p)
        tl.store(thr_ptr + row, -(c.to(tl.float32, bitcast=True)))


_KERNEL = None


def _jit_kernel():
    """Jit the kernel and, first, the helpers it calls: the kernel finds them as this module's globals."""
    global _KERNEL, _sum_at_or_below, _smallest_key
    if _KERNEL is None:
        _sum_at_or_below = triton.jit(_sum_at_or_below)
        _smallest_key = triton.jit(_smallest_key)
        _KERNEL = triton.jit(_bisect_kernel)
    return _KERNEL


def bisect_thresholds_triton(
    z: torch.Tensor, k: torch.Tensor, p: torch.Tensor, need: torch.Tensor, block: int = 4096
) -> torch.Tensor:
    """bisect_thresholds for the rows flagged in need [R] bool, one Triton launch; -inf elsewhere."""
    kernel = _jit_kernel()
    rows, vocab = z.shape
    if z.stride(1) != 1:
        z = z.contiguous()
    out = torch.full((rows,), _NEG_INF, dtype=torch.float32, device=z.device)
    if rows:
        kernel[(rows,)](
            z,
            k.to(torch.int64).contiguous(),
            p.float().contiguous(),
            need.to(torch.int8),
            out,
            z.stride(0),
            vocab,
            BLOCK=min(block, triton.next_power_of_2(vocab)),
            num_warps=8,
        )
    return out


# --- the reference: a full sort (tests compare against it) ----------------------------------------
def reference_sort_filter(
    z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """z [R, V] fp32 with the top-k then top-p filters applied as -inf, by sorting every row (rank-based:
    of tied tokens at the cut, the sort order decides which stay)."""
    sorted_z, order = z.sort(dim=-1, descending=True)
    vocab = z.shape[-1]
    ranks = torch.arange(vocab, device=z.device).unsqueeze(0)
    if top_k is not None:
        top_k = top_k.clamp(0, vocab)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
        sorted_z = sorted_z.masked_fill(ranks >= k, _NEG_INF)
    if top_p is not None:
        sorted_probs = sorted_z.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; never the first one.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        top_p = top_p.float().unsqueeze(1)
        drop = (mass_before >= top_p) & (top_p < 1) & (ranks > 0)
        sorted_z = sorted_z.masked_fill(drop, _NEG_INF)
    return torch.full_like(z, _NEG_INF).scatter(1, order, sorted_z)
