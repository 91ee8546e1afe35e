"""Temperature, min_p, top-k and top-p sampling by rejection: one Triton program per row, no threshold
search.

Why: finding the top-p threshold first (a top-k prefix, then a bisection for flat rows) costs a
dozen launches and passes per step; drawing first and checking after costs two or three passes over
the row in one launch. The draw is race_draw.py's exponential race (token = argmax exp(z_i) / E_i, E_i
from a counter hash of (key, i)), so a seeded row's tokens depend only on its seed and its logits.

z = (x - max) * (1 / T), the reciprocal once per row (a multiply per token, not a division; the
threshold path's filtered_logits scales the same way, so both paths see the same z). The kept tokens
are those with z >= floor (NaN and -inf logits never are), floor = max(log(min_p), z_k), where
z_k = (t_k - max) * (1 / T) is the z of the row's k-th largest logit t_k (NaN counted as -inf; found in
the kernel by kth_select.py's radix select, after the max pass; t_k -inf: no top-k), computed with z's own arithmetic,
so the k-th token itself and every token tied with it are kept. That is filtered_logits' set: min_p,
then the k largest (the k-th largest z of the min_p survivors is z_k when at least k survive, else every
survivor stays, as here where z_k < log(min_p)). The nucleus is the set
{i kept : mass(z_j > z_i) < top_p * mass(kept)} (mass = sum exp(z) over kept tokens): the smallest top
set reaching top_p of the kept tokens' renormalized mass, with every token tied at the cut kept (the
same set as filter_threshold.py's threshold). The top token is always in it (its mass above is 0),
whatever top_p is.

Per row:
  1. a pass for the max (the argmax too: greedy rows and rows with no finite max take it); with top-k
     rows it keeps each lane's top three, from which kth_select.py finds t_k (passes of its own only
     in the rare row where a lane has three values above it);
  2. a pass for the race over every kept token (candidate c) and their total mass;
  3. rows with top_p < 1: a pass for mass(z_j > z_c). Below top_p * mass: c is in the nucleus, done.
     Else c and everything below it are outside: race again over z > z_c with the next round's key
     (fresh randomness), and check again.
Why this draws from the nucleus exactly: each round draws from the distribution restricted to a set
that contains the whole nucleus; a draw inside is accepted, so the accepted token has the nucleus'
distribution (rejection sampling with a shrinking proposal). The first draw lands outside with
probability 1 - (the nucleus' mass), about 1 - top_p, and each rejection removes on average half of the
mass still outside, so a row at top_p 0.95 takes one round 95% of the time and few follow even at a
small top_p; after ROUNDS rejections (flat rows at a tiny top_p) the threshold is found exactly by
bisection on the bits of |z| (31 passes) and the race runs over z >= thr.

Per token the kernel's passes are cheap on purpose (they are its whole cost: the memory traffic is a
few microseconds): the max pass needs no NaN fix (NaN > max is false), later passes fold NaN, -inf and
min_p into one compare (z >= the row's floor is false for all three), exp(z) is ex2 of z * log2(e),
and the race's clock is race_draw's 32-bit hash and one log.

The torch function is the CPU path and the kernel's reference; both take the same steps with the same
keys, so they draw the same tokens up to fp32 summation order at the nucleus' edge and the last ulp of
exp, log and the race's comparison. The kernel's race (block, warps and per-lane comparisons) is
race_draw's, so a row without top_p draws exactly race_draw's token on the GPU too.
"""

from __future__ import annotations

import torch

from graphcache.engine.sample import kth_select, race_draw
from graphcache.engine.sample.kth_select import kth_largest_tl, kth_logits, lane_max_tl, lane_top3_tl, low_bit
from graphcache.engine.sample.race_draw import (
    BLOCK,
    GAMMA,
    MASK64,
    WARPS,
    beats_tl,
    clock_tl,
    clocks,
    key_words_tl,
    mix64,
    mix64_tensor,
    to_int64,
    weight_tl,
    weights,
    winner_tl,
)
from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = [
    "HAVE_TRITON",
    "ROUNDS",
    "nucleus_draw",
    "nucleus_draw_torch",
    "nucleus_draw_triton",
    "round_key",
    "step_keys",
]

ROUNDS = 32  # rejections before the exact threshold (a row reaching it: a flat row at a tiny top_p)
ROUND_GAMMA = 0xD1B54A32D192ED03  # odd, unrelated to GAMMA: keys of later rounds
_CHUNK = 32  # rows per torch step: bounds the [rows, V] temporaries
_NEG_INF = float("-inf")
_FLOOR = -3.4028234663852886e38  # -FLT_MAX: z >= it keeps every finite z (and no -inf or NaN)


def round_key(key: int, r: int) -> int:
    """The race key of rejection round r (round 0: the row's own key, so a row without top_p draws
    exactly race_draw's token)."""
    return key & MASK64 if r == 0 else mix64(key + r * ROUND_GAMMA)


# --- torch path (CPU, and the reference) ----------------------------------------------------------
def _round_keys(keys: torch.Tensor, r: int) -> torch.Tensor:
    """round_key on an int64 tensor of uint64 bits."""
    return keys if r == 0 else mix64_tensor(keys + to_int64((r * ROUND_GAMMA) & MASK64))


def _race(w: torch.Tensor, keep: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax over kept tokens of w / E (race_draw_torch's draw): [R] int64, the first index on ties."""
    return (torch.where(keep, w, 0.0) / clocks(keys, w.shape[-1])).argmax(dim=-1)


def _exact_threshold(z: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[R] the largest v with mass(z >= v) >= target, by bisection on the fp32 bits of -z (z <= 0);
    w [R, V]: exp(z) of the kept tokens, 0 elsewhere."""
    bits = (-z).contiguous().view(torch.int32)  # ordered like -z
    lo = torch.zeros(z.shape[0], dtype=torch.int32, device=z.device)
    hi = torch.full((z.shape[0],), 0x7F800000, dtype=torch.int32, device=z.device)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        good = (w * (bits <= mid.view(-1, 1))).sum(dim=-1) >= target
        hi = torch.where(good, mid, hi)
        lo = torch.where(good, lo, mid + 1)
    return lo.view(torch.float32).neg()


def step_keys(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's race key: keys[r] itself where steps[r] < 0 (an unseeded row's random key), else
    race_draw.row_key's mix for a seeded row: mix64(keys[r] + (steps[r] + 1) * GAMMA), keys[r] being
    mix64(seed). int64 tensors of uint64 bits; the kernel does the same."""
    return torch.where(steps < 0, keys, mix64_tensor(keys + (steps + 1) * to_int64(GAMMA)))


def nucleus_draw_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor,
    keys: torch.Tensor,
    rounds: int = ROUNDS,
    top_k_logit: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [R, V] (any float dtype); per row temperature [R] (<= 0: greedy), top_p [R] (>= 1: off),
    log_min_p [R] (-inf: off), keys [R] int64 (the race keys, uint64 bits), top_k_logit [R] (the row's
    k-th largest logit, kth_logits: tokens below it are dropped; -inf or None: no top-k) -> tokens [R]
    int64."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for a in range(0, logits.shape[0], _CHUNK):
        s = slice(a, a + _CHUNK)
        tk = None if top_k_logit is None else top_k_logit[s]
        out[s] = _draw_chunk(logits[s], temperature[s], top_p[s], log_min_p[s], keys[s], rounds, tk)
    return out


def _draw_chunk(x, temperature, top_p, log_min_p, keys, rounds, top_k_logit=None):
    x = x.float().nan_to_num(nan=_NEG_INF, posinf=float("inf"), neginf=_NEG_INF)
    m, top = x.max(dim=-1)
    rt = 1.0 / temperature.float().clamp_min(1e-30).view(-1, 1)  # [R, 1]; greedy rows: replaced below
    z = (x - m.view(-1, 1)) * rt
    floor = log_min_p.float().clamp_min(_FLOOR).view(-1, 1)  # [R, 1]
    if top_k_logit is not None:  # the k-th token's z, by z's arithmetic: it and its ties stay
        tk = top_k_logit.float().view(-1, 1)
        # -inf (no top-k) leaves the floor as it is (not max(floor, -inf * rt): NaN where rt is 0)
        floor = torch.where(tk > _NEG_INF, torch.maximum(floor, (tk - m.view(-1, 1)) * rt), floor)
    kept = z >= floor  # [R, V]: not -inf, not below min_p or the k-th largest
    w = torch.where(kept, weights(z), 0.0)  # [R, V]: exp(z) of the kept tokens, 0 elsewhere
    target = top_p.float() * w.sum(dim=-1)
    token = _race(w, kept, keys)
    pending = top_p < 1  # rows still checking their candidate
    for r in range(rounds + 1):
        if not bool(pending.any()):
            break
        zc = z.gather(1, token.view(-1, 1))  # [R, 1]
        above = (w * (z > zc)).sum(dim=-1)
        inside = (above < target) | (above == 0)
        pending &= ~inside
        if r == rounds or not bool(pending.any()):
            break
        drawn = _race(w, z > zc, _round_keys(keys, r + 1))
        token = torch.where(pending, drawn, token)
    if bool(pending.any()):  # the exact threshold for rows that ran out of rounds
        thr = _exact_threshold(z, w, target)
        drawn = _race(w, z >= thr.view(-1, 1), _round_keys(keys, rounds + 1))
        token = torch.where(pending, drawn, token)
    random_row = (temperature > 0) & m.isfinite()
    return torch.where(random_row, token, top)


# --- Triton path -------------------------------------------------------------------------------------
# Literal constants: a jitted function may not read module globals that are not constexpr.
# 0x9E3779B97F4A7C15 = GAMMA, 0xD1B54A32D192ED03 = ROUND_GAMMA, -3.4028234663852886e38 = _FLOOR.
# The race's helpers (key_words_tl, clock_tl, weight_tl, beats_tl, winner_tl) are race_draw.py's, the top-k
# select's (lane_max_tl, lane_top3_tl, kth_largest_tl) kth_select.py's; _jit_kernel rebinds the imported names to their jitted forms.
def _z_block(base, offs, mask, m, rt):
    """z = (x - m) * rt [BLOCK] fp32 (NaN stays NaN: every compare on it is false)."""
    x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
    return (x - m) * rt


def _mix(h):
    """mix64 on uint64 values (they wrap; >> is logical): per row only (keys), never per token."""
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB
    return h ^ (h >> 31)


def _race_above(base, vocab, m, rt, floor, key, STRICT: tl.constexpr, BLOCK: tl.constexpr):
    """(the winner of the race over z > floor (STRICT) or z >= floor, the first index on ties; the
    mass of those tokens, sum exp(z), summed in the same pass)."""
    k0, k1 = key_words_tl(key)
    cols = tl.arange(0, BLOCK)
    best_w = tl.zeros([BLOCK], tl.float32)  # each lane's best (w, E, index), as in race_draw's kernel
    best_e = tl.full([BLOCK], 1.0, tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        z = _z_block(base, offs, offs < vocab, m, rt)
        if STRICT:
            kept = z > floor
        else:
            kept = z >= floor
        w = tl.where(kept, weight_tl(z), 0.0)
        mass += w
        e = clock_tl(k0, k1, offs)
        better = beats_tl(w, e, best_w, best_e)  # strict: a lane's earlier index wins ties
        best_w = tl.where(better, w, best_w)
        best_e = tl.where(better, e, best_e)
        best_i = tl.where(better, offs, best_i)
    return winner_tl(best_w, best_e, best_i), tl.sum(mass, axis=0)


def _mass(base, vocab, m, rt, floor, BLOCK: tl.constexpr):
    """sum exp(z) over z > floor (floor: a kept token's z, so the min_p floor is implied)."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        z = _z_block(base, offs, offs < vocab, m, rt)
        acc += tl.where(z > floor, weight_tl(z), 0.0)
    return tl.sum(acc, axis=0)


def _mass_at_or_below_key(base, vocab, m, rt, zlo, c, BLOCK: tl.constexpr):
    """sum exp(z) over the kept tokens (z >= zlo) whose key (the fp32 bits of -z) is <= c."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        z = _z_block(base, offs, offs < vocab, m, rt)
        below = ((-z).to(tl.int32, bitcast=True) <= c) & (z >= zlo)
        acc += tl.where(below, weight_tl(z), 0.0)
    return tl.sum(acc, axis=0)


def _round_key_of(key, r):
    """round_key (r >= 1) of the row's key (uint64 bits) as int64, what key_words_tl takes."""
    return _mix(key + r.to(tl.uint64) * 0xD1B54A32D192ED03).to(tl.int64, bitcast=True)


def _nucleus_kernel(
    x_ptr, rows_ptr, stride_x, vocab, params_ptr, key_ptr, step_ptr, out_ptr,
    BLOCK: tl.constexpr, ROUNDS: tl.constexpr, NPARAMS: tl.constexpr, TOP_K: tl.constexpr,
    LOW_BIT: tl.constexpr,
):  # fmt: skip
    w = tl.program_id(0)
    base = x_ptr + tl.load(rows_ptr + w) * stride_x
    t = tl.load(params_ptr + NPARAMS * w)
    p = tl.load(params_ptr + NPARAMS * w + 1)
    zlo = tl.maximum(tl.load(params_ptr + NPARAMS * w + 2), -3.4028234663852886e38)  # the kept floor
    key = tl.load(key_ptr + w).to(tl.uint64, bitcast=True)
    step = tl.load(step_ptr + w)
    if step >= 0:  # a seeded row: race_draw.row_key from mix64(seed) and the step
        key = _mix(key + (step + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
    # 1. the max and its first index (NaN is never the max; a row with no number above -inf takes
    # token 0, as torch's argmax); with top-k rows, each lane's top three stay for the select
    if TOP_K:
        mx, m2, m3, mi = lane_top3_tl(base, vocab, BLOCK)
    else:
        mx, mi = lane_max_tl(base, vocab, BLOCK)
    m = tl.max(mx, axis=0)
    token = tl.min(tl.where(mx == m, mi, 2147483647), axis=0)
    if (t > 0) & (m > float("-inf")) & (m < float("inf")):
        rt = tl.math.div_rn(1.0, t)  # once per row: the passes multiply
        if TOP_K:  # the k-th largest logit's z, as _z_block computes it
            k = tl.load(params_ptr + NPARAMS * w + 3).to(tl.int32)
            if (k > 0) & (k < vocab):  # a row without top-k keeps its floor untouched
                tk = kth_largest_tl(base, vocab, mx, m2, m3, m, k, BLOCK, LOW_BIT)
                if tk > float("-inf"):  # fewer than k numbers: every one stays
                    zlo = tl.maximum(zlo, (tk - m) * rt)
        # 2. the first candidate (and the total mass, for top_p)
        key0 = key.to(tl.int64, bitcast=True)
        token, total = _race_above(base, vocab, m, rt, zlo, key0, False, BLOCK)
        if p < 1:
            target = p * total
            r = 0
            pending = 1
            while pending != 0:
                zc = (tl.load(base + token).to(tl.float32) - m) * rt
                above = _mass(base, vocab, m, rt, zc, BLOCK)
                if (above < target) | (above == 0):
                    pending = 0
                elif r == ROUNDS:
                    # 3b. out of rounds: the exact threshold, then the race over z >= thr
                    lo = tl.full((), 0, tl.int32)
                    hi = tl.full((), 2139095040, tl.int32)  # the fp32 bits of +inf
                    for _ in range(31):
                        mid = lo + (hi - lo) // 2
                        good = _mass_at_or_below_key(base, vocab, m, rt, zlo, mid, BLOCK) >= target
                        hi = tl.where(good, mid, hi)
                        lo = tl.where(good, lo, mid + 1)
                    thr = -(lo.to(tl.float32, bitcast=True))
                    token, _ = _race_above(base, vocab, m, rt, thr, _round_key_of(key, r + 1), False, BLOCK)
                    pending = 0
                else:
                    # 3a. c and all below it are outside the nucleus: draw again above it
                    r += 1
                    token, _ = _race_above(base, vocab, m, rt, zc, _round_key_of(key, r), True, BLOCK)
    tl.store(out_ptr + w, token.to(tl.int64))


_KERNEL = None


def _jit_kernel():
    """Jit the helpers, then the kernel (it finds them as this module's globals)."""
    global _KERNEL, _mix, _z_block, _race_above, _mass, _mass_at_or_below_key, _round_key_of
    if _KERNEL is None:
        globals().update(race_draw.jit_helpers())  # key_words_tl, clock_tl, weight_tl, beats_tl, winner_tl
        globals().update(kth_select.jit_helpers())  # kth_largest_tl, lane_max_tl, lane_top3_tl
        _mix = triton.jit(_mix)
        _z_block = triton.jit(_z_block)
        _race_above = triton.jit(_race_above)
        _mass = triton.jit(_mass)
        _mass_at_or_below_key = triton.jit(_mass_at_or_below_key)
        _round_key_of = triton.jit(_round_key_of)
        _KERNEL = triton.jit(_nucleus_kernel)
    return _KERNEL


def nucleus_draw(
    logits: torch.Tensor,
    rows: torch.Tensor,
    params: torch.Tensor,
    keys: torch.Tensor,
    steps: torch.Tensor,
    *,
    rounds: int = ROUNDS,
    block: int = BLOCK,
    warps: int = WARPS,
    top_k: bool | None = None,
) -> torch.Tensor:
    """tokens [W] int64: one draw per entry of rows [W] (int64 indices into logits [R, V], any float
    dtype). Per entry: params [W, 4] fp32 (temperature, <= 0: greedy; top_p, >= 1: off; log(min_p),
    -inf: off; top_k, off unless 1 <= top_k < V; [W, 3]: no row has top-k; top_k=False: the 4th column
    is 0 on every row, so the kernel skips what top-k needs),
    keys [W] int64 and steps [W] int64 (step_keys: the race key is keys itself where the step is < 0,
    else row_key's mix of keys = mix64(seed) and the step). On CUDA one launch, no host
    sync, no allocation but the output (graph-capturable); elsewhere the torch path. block and warps
    other than race_draw's BLOCK and WARPS are for benchmarks: a near tie may then resolve otherwise
    than race_draw's kernel would."""
    if not (logits.is_cuda and HAVE_TRITON):
        x, p = logits.index_select(0, rows), params.float()
        tk = kth_logits(x, p[:, 3]) if p.shape[1] > 3 and top_k is not False else None
        return nucleus_draw_torch(x, p[:, 0], p[:, 1], p[:, 2], step_keys(keys, steps), rounds, tk)
    return nucleus_draw_triton(
        logits, rows, params, keys, steps, rounds=rounds, block=block, warps=warps, top_k=top_k
    )


def nucleus_draw_triton(
    logits: torch.Tensor,
    rows: torch.Tensor,
    params: torch.Tensor,
    keys: torch.Tensor,
    steps: torch.Tensor,
    *,
    rounds: int = ROUNDS,
    block: int = BLOCK,
    warps: int = WARPS,
    top_k: bool | None = None,
) -> torch.Tensor:
    """nucleus_draw's launch on any device: CUDA, or CPU tensors under TRITON_INTERPRET=1 (the tests)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, vocab = rows.numel(), logits.shape[-1]
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        _jit_kernel()[(n,)](
            logits,
            rows,
            logits.stride(0),
            vocab,
            params.contiguous(),
            keys,
            steps,
            out,
            BLOCK=min(block, triton.next_power_of_2(vocab)),
            ROUNDS=rounds,
            NPARAMS=params.shape[1],
            TOP_K=params.shape[1] == 4 if top_k is None else top_k,
            LOW_BIT=low_bit(logits.dtype),
            num_warps=warps,
        )
    return out


assert GAMMA == 0x9E3779B97F4A7C15  # the kernel's literal
assert ROUND_GAMMA == 0xD1B54A32D192ED03
assert _FLOOR == -3.4028234663852886e38 == -torch.finfo(torch.float32).max
