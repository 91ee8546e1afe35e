"""A row's k-th largest logit (NaN counted as -inf): the top-k floor of nucleus_draw.py's kernel, found
inside that kernel by radix select, and its torch twin (the CPU path and the reference).

Why in the kernel: a torch.topk of the top-k rows before the launch cost a decode step at 256 rows
about 0.9 ms (index_select, nan_to_num, a multi-kernel topk and a gather, with their host launches:
BENCHMARKS.md §15), three times the budget for all of sampling. Inside the kernel it costs a row a few
register passes after the max pass it shares (~0.05 ms at 256 rows, §16), and the host only uploads k.

The select works on order keys: uint32s ordered as the fp32 values (flip every bit of a negative
float, the sign bit of a positive one), NaN mapped to -inf first. A digit is 4 bits; for each digit,
from the top, a 16-bin histogram (tl.histogram) of the keys that match the prefix found so far picks
the digit where the count of keys at or above it reaches k.

Most rows need no pass of their own: the kernel's max pass keeps each lane's three largest values in
registers (lane_top3_tl; BLOCK lanes, each over offsets lane, lane + BLOCK, ...). The k-th largest of
those 3 * BLOCK values, L (the digits over registers), is a lower bound, since k values of the row are
at or above it; and it is the answer when no lane's third value exceeds it, since every value above it
is then one of the collected ones, fewer than k. A lane with three values above L is what the check
cannot clear (at 151,936 tokens over 8,192 lanes and k 50, about 1 row in 3,400). Then the select
reads the row once per remaining digit, starting at the first digit where L and the max differ (every
candidate lies between them); without a bound (k above 3 * BLOCK) from the top. Logits of a 16-bit
dtype widen to fp32 with their low 13 (fp16) or 16 (bf16) bits fixed by the sign, so the digits stop
above LOW_BIT and those bits are filled in (_fill_low).
"""

from __future__ import annotations

from typing import Any

import torch

from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "kth_largest_triton", "kth_logits", "low_bit"]

_NEG_INF = float("-inf")


def low_bit(dtype: torch.dtype) -> int:
    """The lowest fp32 bit a logit of this dtype can set once widened (the select's LOW_BIT)."""
    return {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)


def kth_logits(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[R] fp32: the k[r]-th largest logit of row r of logits [R, V] (NaN counted as -inf: torch.topk
    alone would rank NaN first), -inf where top-k is off (k [R], any number dtype: off unless
    1 <= k < V). One torch.topk at the rows' largest k; reads that k on the host (a sync on CUDA)."""
    vocab = logits.shape[-1]
    k = k.to(torch.int64)
    out = torch.full((logits.shape[0],), _NEG_INF, device=logits.device)
    on = ((k > 0) & (k < vocab)).nonzero().view(-1)
    if on.numel():
        x = logits.index_select(0, on).float().nan_to_num_(nan=_NEG_INF, posinf=float("inf"), neginf=_NEG_INF)
        vals = x.topk(int(k[on].max()), dim=-1, sorted=True).values  # [n, kmax], descending
        out[on] = vals.gather(1, (k[on] - 1).view(-1, 1)).view(-1)
    return out


# --- Triton: helpers that nucleus_draw.py's kernel calls (jit_helpers) --------------------------------
# Literal constants: 2147483648 = 0x80000000, the sign bit of an fp32 (and the order keys' top bit).
def order_key_tl(x):
    """uint32 keys [N] ordered as the fp32 values x [N], NaN as -inf."""
    b = tl.where(x == x, x, float("-inf")).to(tl.uint32, bitcast=True)
    return tl.where(b >= 2147483648, ~b, b | 2147483648)


def _key_value(key):
    """The fp32 value whose order key is `key` (a scalar)."""
    return tl.where(key >= 2147483648, key ^ 2147483648, ~key).to(tl.float32, bitcast=True)


def _fill_low(key, shift):
    """key with its bits below `shift` as every logit sharing its higher bits has them (the low bits a
    16-bit dtype never sets: 0 in a positive float's key, 1 in a negative one's, whose bits are flipped)."""
    low = (tl.full((), 1, tl.uint32) << shift.to(tl.uint32)) - 1
    return tl.where(key >= 2147483648, key, key | low)


def _digit_bins(keys, valid, prefix, shift):
    """[N] int32: each key's digit (bits shift..shift+3) where it is valid and matches prefix above
    the digit; 16 (a bin no digit takes) elsewhere."""
    s = shift.to(tl.uint32)
    match = valid & (((keys >> s) >> 4) == ((prefix >> s) >> 4))
    return tl.where(match, ((keys >> s) & 15).to(tl.int32), 16)


def _pick_digit(hist, above, k):
    """(d, above'): from hist [32] (bins 0-15 the digits of the matching keys; 16 the rest) and the
    count `above` of keys above the prefix, the largest digit d with above + count(digit >= d) >= k,
    and above + count(digit > d)."""
    idx = tl.arange(0, 32)
    h = tl.where(idx < 16, hist, 0)
    at_or_above = above + tl.cumsum(h, axis=0, reverse=True)  # [32]
    d = tl.max(tl.where((idx < 16) & (at_or_above >= k), idx, 0), axis=0)
    return d, tl.sum(tl.where(idx == d, at_or_above - h, 0), axis=0)


def _lane_bound(m1, m2, m3, k, LOW_BIT: tl.constexpr):
    """The order key of the k-th largest of the lanes' top three values m1, m2, m3 [BLOCK] each, by
    digits over registers (k <= 3 * BLOCK): an element's key, its low bits filled."""
    keys1, keys2, keys3 = order_key_tl(m1), order_key_tl(m2), order_key_tl(m3)
    kl = tl.full((), 0, tl.uint32)
    above = tl.full((), 0, tl.int32)
    for i in tl.static_range(8 - LOW_BIT // 4):
        shift = tl.full((), 28 - 4 * i, tl.int32)
        hist = tl.histogram(_digit_bins(keys1, keys1 == keys1, kl, shift), 32)
        hist += tl.histogram(_digit_bins(keys2, keys2 == keys2, kl, shift), 32)
        hist += tl.histogram(_digit_bins(keys3, keys3 == keys3, kl, shift), 32)
        d, above = _pick_digit(hist, above, k)
        kl = kl | (d.to(tl.uint32) << shift.to(tl.uint32))
    return _fill_low(kl, tl.full((), 28 - 4 * (7 - LOW_BIT // 4), tl.int32))


def kth_largest_tl(base, vocab, m1, m2, m3, m, k, BLOCK: tl.constexpr, LOW_BIT: tl.constexpr):
    """The k-th largest (fp32, NaN as -inf) of the row at base [vocab] (1 <= k < vocab), given each
    lane's three largest values m1 >= m2 >= m3 [BLOCK] (lane_top3_tl) and the row's max m."""
    km = order_key_tl(m)
    # 1. the k-th largest of the lanes' top three: a lower bound (k values at or above it), and the
    # answer itself when no lane's third value is above it (every value above it is then one of
    # those, fewer than k)
    kl = tl.full((), 0, tl.uint32)  # below every key: no bound
    exact = k < 0
    if k <= 3 * BLOCK:
        kl = _lane_bound(m1, m2, m3, k, LOW_BIT)
        exact = tl.max(m3, axis=0) <= _key_value(kl)
    result = _key_value(kl)
    if not exact:
        # 2. the digits where the bound and the max agree are every candidate's
        shift = tl.full((), 28, tl.int32)
        while (shift + 4 > LOW_BIT) & ((kl >> shift.to(tl.uint32)) == (km >> shift.to(tl.uint32))):
            shift -= 4
        result = m  # the bound is the max: the k-th largest is the max
        if shift + 4 > LOW_BIT:
            # 3. the rest, a pass over the row per digit
            s = shift.to(tl.uint32)
            prefix = ((km >> s) >> 4) << 4 << s
            above = tl.full((), 0, tl.int32)
            cols = tl.arange(0, BLOCK)
            while shift + 4 > LOW_BIT:
                hist = tl.zeros([32], tl.int32)
                for start in range(0, vocab, BLOCK):
                    offs = start + cols
                    x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
                    hist += tl.histogram(_digit_bins(order_key_tl(x), offs < vocab, prefix, shift), 32)
                d, above = _pick_digit(hist, above, k)
                prefix = prefix | (d.to(tl.uint32) << shift.to(tl.uint32))
                shift -= 4
            result = _key_value(_fill_low(prefix, shift + 4))
    return result


def lane_max_tl(base, vocab, BLOCK: tl.constexpr):
    """(each lane's max [BLOCK] over offsets lane, lane + BLOCK, ... (-inf where it has none), and the
    first offset holding it; 0 where no value exceeds -inf). NaN > max is false: NaN is never a max."""
    cols = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    mi = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        better = x > mx
        mi = tl.where(better, offs, mi)
        mx = tl.where(better, x, mx)
    return mx, mi


def lane_top3_tl(base, vocab, BLOCK: tl.constexpr):
    """lane_max_tl's (max, first offset), with each lane's second and third largest values between
    them (-inf where the lane has fewer; a tie counts each time): (m1, m2, m3, index of m1)."""
    cols = tl.arange(0, BLOCK)
    m1 = tl.full([BLOCK], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK], float("-inf"), tl.float32)
    m3 = tl.full([BLOCK], float("-inf"), tl.float32)
    mi = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        b1, b2 = x > m1, x > m2
        m3 = tl.where(b2, m2, tl.where(x > m3, x, m3))
        m2 = tl.where(b1, m1, tl.where(b2, x, m2))
        mi = tl.where(b1, offs, mi)
        m1 = tl.where(b1, x, m1)
    return m1, m2, m3, mi


def _kth_kernel(x_ptr, rows_ptr, stride_x, vocab, k_ptr, out_ptr, BLOCK: tl.constexpr, LOW_BIT: tl.constexpr):
    """One row per program: out[w] = kth_largest_tl of row rows[w] at k[w] (-inf where 1 <= k < V fails)."""
    w = tl.program_id(0)
    base = x_ptr + tl.load(rows_ptr + w) * stride_x
    k = tl.load(k_ptr + w).to(tl.int32)
    result = tl.full((), float("-inf"), tl.float32)
    if (k > 0) & (k < vocab):
        m1, m2, m3, _ = lane_top3_tl(base, vocab, BLOCK)
        result = kth_largest_tl(base, vocab, m1, m2, m3, tl.max(m1, axis=0), k, BLOCK, LOW_BIT)
    tl.store(out_ptr + w, result)


_HELPERS: dict = {}
_KERNEL: Any = None  # the jitted kernel, made on first use (jit_helpers)


def jit_helpers() -> dict:
    """The select's helpers, jitted once, by name (nucleus_draw.py's kernel copies them into its module,
    where a jitted function looks up what it calls)."""
    global _KERNEL
    if not _HELPERS:
        for name in ("order_key_tl", "_key_value", "_fill_low", "_digit_bins", "_pick_digit", "_lane_bound"):
            globals()[name] = triton.jit(globals()[name])
        for name in ("kth_largest_tl", "lane_max_tl", "lane_top3_tl"):
            _HELPERS[name] = globals()[name] = triton.jit(globals()[name])
        _KERNEL = triton.jit(_kth_kernel)
    return _HELPERS


def kth_largest_triton(
    logits: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, *, block: int = 8192, warps: int = 32
):
    """[W] fp32: kth_logits(logits[rows], k) by the kernel's select alone (CUDA, or CPU tensors under
    TRITON_INTERPRET=1): for tests and benchmarks; nucleus_draw's kernel runs the same code inline."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, vocab = rows.numel(), logits.shape[-1]
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        jit_helpers()
        _KERNEL[(n,)](
            logits, rows, logits.stride(0), vocab, k.to(torch.float32).contiguous(), out,
            BLOCK=min(block, triton.next_power_of_2(vocab)), LOW_BIT=low_bit(logits.dtype), num_warps=warps,
        )  # fmt: skip
    return out


assert 2147483648 == 0x80000000  # the kernels' literal
