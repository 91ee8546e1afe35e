"""Temperature, min_p, top-k, top-p and the exponential-race draw in one Triton kernel, over the
logits in the model's dtype: a few passes over each row instead of a dozen, no [R, V] temporaries.

Why: the torch-composed path (sampler.filtered_logits + filter_threshold + race_draw) writes an fp32
copy of the logits, shifts and scales it in place, takes a 4,096-wide topk per row and reads the
copy again for the draw: ~2 ms for 256 rows x 152k on the H200, against ~0.07 ms for greedy. A pass
over bf16 logits of that shape is 78 MB, ~16 us at 4.8 TB/s.

One program per row. z = (x - max) / T (IEEE division, as torch computes it), NaN -> -inf, tokens
with z < log(min_p) -> -inf. The kept tokens are z >= thr with thr = max(thr_k, thr_p), the same
threshold as filter_threshold.py (every token tied with the cut stays):
  thr_k = the k-th largest z;  thr_p = the largest token value v with mass(z >= v) >= top_p * mass of
  the top-k survivors (the smallest nucleus; mass = sum exp(z)).
Passes over the row:
  1. max, argmax, smallest finite logit.
  2. ladder: F(c) = count (top-k) or mass (top-p) of z >= c at P pivots at once, inside a bracket
     [lo, hi) known to hold the threshold (F(lo) >= target > F(hi)). The first ladder is fixed
     (z from -30 to -0.13, quadratic: most nuclei end there), later ones split the bracket evenly.
     Repeated while the bracket holds more than CAP tokens (a flat row: one or two more passes). A
     bracket whose tokens all share one value (bf16 ties) is the answer itself.
  3. compaction: the bracket's tokens (at most CAP) go to a per-row scratch buffer with their race
     scores, and the race over the tokens above the bracket (all kept) runs in the same pass; the
     threshold is then found by bisection on the bits of |z| over the candidates in registers, and
     the draw is the best of the kept candidates against the best above the bracket.
So top-p alone or top-k alone: 3 passes; both: 5; temperature only: 2 (max, race). A bracket that
cannot be brought under CAP in ROUNDS ladders (pathological ties in fp32) takes an exact
bisection over the whole row (31 passes) and a race pass.

The draw is race_draw.py's: token = argmax over kept i of z_i - log(-log u_i), u from SplitMix64 of
(row key, i); the first index wins ties. A row with no finite max (all -inf, or +inf logits) takes
its argmax. Counts are summed in fp32 (exact below 2**24 tokens).
"""

from __future__ import annotations

import torch

from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "DrawParams", "fused_draw"]

CAP = 4096  # candidates per row held in registers for the final bisection
PIVOTS = 16  # pivots per ladder pass
ROUNDS = 8  # ladder passes per search before the whole-row bisection
_NEG_INF = float("-inf")


# Literal constants: a jitted function may not read module globals that are not constexpr.
# 2139095040 = 0x7F800000, the fp32 bits of +inf; 1.1920928955078125e-07 = 2^-23; 41 = 64 - 23.
def _z_of(x, m, t, log_min_p):
    """[BLOCK] logits (any float dtype) -> z fp32 as the torch path computes it."""
    x = x.to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    z = tl.math.div_rn(x - m, t)
    return tl.where(z < log_min_p, float("-inf"), z)


def _race_score(z, key, offs):
    h = key + (offs.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15  # uint64: wraps, >> is logical
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB
    h = h ^ (h >> 31)
    u = ((h >> 41).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return z - tl.log(-tl.log(u))


def _race_pass(base, vocab, m, t, log_min_p, thr, key, BLOCK: tl.constexpr):
    """argmax of the race score over z >= thr, first index on ties. Per-lane running bests, one
    reduction at the end (a block reduction per iteration would cost more than the loads)."""
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        mask = offs < vocab
        z = _z_of(tl.load(base + offs, mask=mask, other=float("-inf")), m, t, log_min_p)
        score = tl.where(mask & (z >= thr), _race_score(z, key, offs), float("-inf"))
        better = score > best  # strict: a lane's earlier index wins ties
        best_i = tl.where(better, offs.to(tl.int64), best_i)
        best = tl.where(better, score, best)
    token, _ = _first_argmax(best, best_i, vocab)
    return token


def _first_argmax(best, best_i, vocab):
    """The best of per-lane (score, index) pairs, the smallest index among equal scores."""
    bm = tl.max(best, axis=0)
    return tl.min(tl.where(best == bm, best_i, vocab), axis=0), bm


def _ladder(
    base,
    vocab,
    m,
    t,
    log_min_p,
    lo,
    hi,
    f_hi,
    target,
    p_scale,
    first,
    MASS: tl.constexpr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One pass: F at P pivots in [lo, hi), the new bracket, its token count, and whether the old
    bracket's tokens all share one value. Returns (lo, hi, f_hi, c_hi_count, n_in, target, tied, tie_value, ok)."""
    ar = tl.arange(0, P)
    arf = ar.to(tl.float32)
    # first ladder: pivot 0 = lo, then -30 * ((P - j) / (P - 1))^2 (clamped up to lo)
    fixed = -30.0 * ((P - arf) / (P - 1)) * ((P - arf) / (P - 1))
    top = tl.where(hi < float("inf"), hi, 1e-30)
    even = lo + (top - lo) * arf / P
    piv = tl.where(first, tl.maximum(fixed, lo), even)
    piv = tl.where(ar == 0, lo, piv)  # [P] ascending
    cols = tl.arange(0, BLOCK)
    # per-lane sums and extremes, reduced once after the pass
    cnt_l = tl.zeros([BLOCK, P], tl.float32)
    mass_l = tl.zeros([BLOCK, P], tl.float32)
    zmax_l = tl.full([BLOCK], float("-inf"), tl.float32)
    zmin_l = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        z = _z_of(tl.load(base + offs, mask=offs < vocab, other=float("-inf")), m, t, log_min_p)
        ge = z[:, None] >= piv[None, :]  # [BLOCK, P]
        cnt_l += ge.to(tl.float32)
        if MASS:
            mass_l += tl.where(ge, tl.exp(z)[:, None], 0.0)
        inb = (z >= lo) & (z < hi)
        zmax_l = tl.maximum(zmax_l, tl.where(inb, z, float("-inf")))
        zmin_l = tl.minimum(zmin_l, tl.where(inb, z, float("inf")))
    cnt = tl.sum(cnt_l, axis=0)  # [P]
    mass = tl.sum(mass_l, axis=0)
    zmax_in = tl.max(zmax_l, axis=0)
    zmin_in = tl.min(zmin_l, axis=0)
    f = mass if MASS else cnt
    f0 = tl.sum(tl.where(ar == 0, f, 0.0), axis=0)
    if MASS:
        target = tl.where(
            first, tl.maximum(p_scale * f0, 1e-30), target
        )  # 1e-30: a float32 literal (below 2**-126 Triton makes it float64)
    ok = f0 >= target  # False only when top_k exceeds the finite tokens
    good = f >= target  # a prefix of the pivots
    j = tl.max(tl.where(good, ar, 0), axis=0)
    has_next = j < P - 1
    new_lo = tl.sum(tl.where(ar == j, piv, 0.0), axis=0)
    new_hi = tl.where(has_next, tl.sum(tl.where(ar == j + 1, piv, 0.0), axis=0), hi)
    new_f_hi = tl.where(has_next, tl.sum(tl.where(ar == j + 1, f, 0.0), axis=0), f_hi)
    c_lo = tl.sum(tl.where(ar == j, cnt, 0.0), axis=0)
    c_next = tl.sum(tl.where(ar == j + 1, cnt, 0.0), axis=0)
    return new_lo, new_hi, new_f_hi, c_lo, c_next, has_next, target, zmin_in == zmax_in, zmax_in, ok


def _search(
    base,
    vocab,
    m,
    t,
    log_min_p,
    lo,
    target,
    p_scale,
    MASS: tl.constexpr,
    P: tl.constexpr,
    LBLOCK: tl.constexpr,
    ROUNDS: tl.constexpr,
    CAP: tl.constexpr,
):
    """Ladders until the bracket holds <= CAP tokens. Returns (lo, hi, f_hi, n_in, target, done, value, ok):
    done -> the threshold is `value` (a tie-only bracket); ok False -> no threshold (keep all)."""
    hi = tl.full((), float("inf"), tl.float32)
    f_hi = tl.full((), 0.0, tl.float32)
    c_hi = tl.full((), 0.0, tl.float32)
    n_in = tl.full((), 2.0**30, tl.float32)
    done = tl.full((), 0, tl.int1)
    ok = tl.full((), 1, tl.int1)
    value = tl.full((), float("-inf"), tl.float32)
    rounds = tl.full((), 0, tl.int32)  # tensors, not Python numbers: loop-carried values keep one type
    while (rounds < ROUNDS) & (n_in > CAP) & (~done) & ok:
        first = rounds == 0
        new_lo, new_hi, new_f_hi, c_lo, c_next, has_next, target, tied, tie_value, ok = _ladder(
            base, vocab, m, t, log_min_p, lo, hi, f_hi, target, p_scale, first, MASS, P, LBLOCK
        )
        done = tied  # the old bracket's tokens share one value: that is the answer
        value = tie_value
        c_hi = tl.where(has_next, c_next, c_hi)
        n_in = c_lo - c_hi
        lo, hi, f_hi = new_lo, new_hi, new_f_hi
        rounds += 1
    return lo, hi, f_hi, n_in, target, done, value, ok


def _bisect_row(base, vocab, m, t, log_min_p, floor, target, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest token value v >= floor with F(v) >= target, by bisection on bits(|z|) over the
    whole row (31 passes): the exact answer when the ladders could not shrink the bracket."""
    cols = tl.arange(0, BLOCK)
    lo_key = tl.full((), 0, tl.int32)
    hi_key = tl.full((), 2139095040, tl.int32)
    for _ in range(31):
        mid = lo_key + (hi_key - lo_key) // 2
        acc = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            z = _z_of(tl.load(base + offs, mask=offs < vocab, other=float("-inf")), m, t, log_min_p)
            keep = (tl.abs(z).to(tl.int32, bitcast=True) <= mid) & (z >= floor)
            if MASS:
                acc += tl.sum(tl.where(keep, tl.exp(z), 0.0), axis=0)
            else:
                acc += tl.sum(keep.to(tl.float32), axis=0)
        good = acc >= target
        hi_key = tl.where(good, mid, hi_key)
        lo_key = tl.where(good, lo_key, mid + 1)
    return -(lo_key.to(tl.float32, bitcast=True))


def _compact(base, vocab, m, t, log_min_p, lo, hi, key, sz_ptr, ss_ptr, si_ptr, BLOCK: tl.constexpr):
    """The tokens with lo <= z < hi to the scratch row (z, race score, index), in index order; and the
    race's best over z >= hi. Returns (best score above, its index)."""
    cols = tl.arange(0, BLOCK)
    n = tl.full((), 0, tl.int32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        mask = offs < vocab
        z = _z_of(tl.load(base + offs, mask=mask, other=float("-inf")), m, t, log_min_p)
        score = _race_score(z, key, offs)
        inb = mask & (z >= lo) & (z < hi)
        pos = n + tl.cumsum(inb.to(tl.int32), axis=0) - 1
        tl.store(sz_ptr + pos, z, mask=inb)
        tl.store(ss_ptr + pos, score, mask=inb)
        tl.store(si_ptr + pos, offs, mask=inb)
        n += tl.sum(inb.to(tl.int32), axis=0)
        above = tl.where(mask & (z >= hi), score, float("-inf"))
        better = above > best
        best_i = tl.where(better, offs.to(tl.int64), best_i)
        best = tl.where(better, above, best)
    best_i, best = _first_argmax(best, best_i, vocab)
    return best, best_i


def _bisect_candidates(cz, f_hi, target, MASS: tl.constexpr):
    """The largest candidate value v with f_hi + F_cand(v) >= target (cz [CAP], -inf past the end)."""
    ckey = tl.abs(cz).to(tl.int32, bitcast=True)
    w = tl.exp(cz) if MASS else tl.where(cz > float("-inf"), 1.0, 0.0)
    lo_key = tl.full((), 0, tl.int32)
    hi_key = tl.full((), 2139095040, tl.int32)
    for _ in range(31):
        mid = lo_key + (hi_key - lo_key) // 2
        good = f_hi + tl.sum(tl.where(ckey <= mid, w, 0.0), axis=0) >= target
        hi_key = tl.where(good, mid, hi_key)
        lo_key = tl.where(good, lo_key, mid + 1)
    return -(lo_key.to(tl.float32, bitcast=True))


def _fused_kernel(
    logits_ptr,
    row_ptr,
    stride,
    vocab,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    lminp_ptr,
    key_ptr,
    sz_ptr,
    ss_ptr,
    si_ptr,
    out_ptr,
    thr_ptr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    LBLOCK: tl.constexpr,
    ROUNDS: tl.constexpr,
    CAP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    base = logits_ptr + tl.load(row_ptr + r).to(tl.int64) * stride
    t = tl.load(temp_ptr + r)
    k = tl.load(topk_ptr + r)
    p = tl.load(topp_ptr + r)
    log_min_p = tl.load(lminp_ptr + r)
    key = tl.load(key_ptr + r).to(tl.uint64, bitcast=True)
    cols = tl.arange(0, BLOCK)
    # pass 1: max, argmax (first index), smallest finite logit
    mv = tl.full([BLOCK], float("-inf"), tl.float32)
    topv = tl.full([BLOCK], 0, tl.int64)
    mnv = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)
        better = x > mv
        topv = tl.where(better, offs.to(tl.int64), topv)
        mv = tl.where(better, x, mv)
        mnv = tl.minimum(mnv, tl.where(x > float("-inf"), x, float("inf")))
    top, m = _first_argmax(mv, topv, vocab)
    top = top.to(tl.int64)
    mn = tl.min(mnv, axis=0)
    token = top
    thr = tl.full((), float("-inf"), tl.float32)
    if (m > float("-inf")) & (m < float("inf")) & (t > 0):  # t <= 0: greedy, the argmax
        z_min = tl.math.div_rn(mn - m, t)
        scr = r * CAP
        ci = tl.arange(0, CAP)
        raced = tl.full((), 0, tl.int1)
        if k < vocab:
            lo, hi, f_hi, n_in, target, done, value, ok = _search(
                base, vocab, m, t, log_min_p, z_min, k.to(tl.float32), 1.0, False, P, LBLOCK, ROUNDS, CAP
            )
            if ok:
                if done:
                    thr = value
                elif n_in <= CAP:
                    race = p >= 1
                    best, best_i = _compact(
                        base,
                        vocab,
                        m,
                        t,
                        log_min_p,
                        lo,
                        hi,
                        key,
                        sz_ptr + scr,
                        ss_ptr + scr,
                        si_ptr + scr,
                        BLOCK,
                    )
                    cz = tl.load(sz_ptr + scr + ci, mask=ci < n_in, other=float("-inf"))
                    thr = _bisect_candidates(cz, f_hi, target, False)
                    if race:
                        cs = tl.load(ss_ptr + scr + ci, mask=(ci < n_in), other=float("-inf"))
                        cs = tl.where(cz >= thr, cs, float("-inf"))
                        cidx = tl.load(si_ptr + scr + ci, mask=ci < n_in, other=0)
                        cm = tl.max(cs, axis=0)
                        cb = tl.min(tl.where(cs == cm, cidx, vocab), axis=0).to(tl.int64)
                        take = (cm > best) | ((cm == best) & (cb < best_i))
                        token = tl.where(take, cb, best_i)
                        raced = tl.full((), 1, tl.int1)
                else:
                    thr = _bisect_row(
                        base, vocab, m, t, log_min_p, float("-inf"), k.to(tl.float32), False, BLOCK
                    )
        if p < 1:
            floor = tl.where(thr > float("-inf"), thr, z_min)
            lo, hi, f_hi, n_in, target, done, value, ok = _search(
                base,
                vocab,
                m,
                t,
                log_min_p,
                floor,
                tl.full((), 0.0, tl.float32),
                p,
                True,
                P,
                LBLOCK,
                ROUNDS,
                CAP,
            )
            if done:
                thr = value
            elif n_in <= CAP:
                best, best_i = _compact(
                    base, vocab, m, t, log_min_p, lo, hi, key, sz_ptr + scr, ss_ptr + scr, si_ptr + scr, BLOCK
                )
                cz = tl.load(sz_ptr + scr + ci, mask=ci < n_in, other=float("-inf"))
                thr = _bisect_candidates(cz, f_hi, target, True)
                cs = tl.load(ss_ptr + scr + ci, mask=(ci < n_in), other=float("-inf"))
                cs = tl.where(cz >= thr, cs, float("-inf"))
                cidx = tl.load(si_ptr + scr + ci, mask=ci < n_in, other=0)
                cm = tl.max(cs, axis=0)
                cb = tl.min(tl.where(cs == cm, cidx, vocab), axis=0).to(tl.int64)
                take = (cm > best) | ((cm == best) & (cb < best_i))
                token = tl.where(take, cb, best_i)
                raced = tl.full((), 1, tl.int1)
            else:
                thr = _bisect_row(base, vocab, m, t, log_min_p, floor, target, True, BLOCK)
        if raced == 0:
            token = _race_pass(base, vocab, m, t, log_min_p, thr, key, BLOCK)
    tl.store(out_ptr + r, token)
    tl.store(thr_ptr + r, thr)


_KERNEL = None


class Config:
    """Launch shape: BLOCK tokens a streaming pass step (max, race, compaction), LBLOCK a ladder step (its
    [LBLOCK, P] compares live in registers), P pivots a ladder, ROUNDS ladders before the whole-row
    bisection, CAP candidates, warps a program. benchmarks/sampler_bench.py times the choices. These
    defaults compile for sm_90 to 128 registers and no spills (ptxas -v), so two 8-warp programs share an
    SM; block 4096 takes 253 registers (one program an SM: half the loads in flight)."""

    block = 2048
    lblock = 256
    pivots = PIVOTS
    rounds = ROUNDS
    cap = CAP
    warps = 8


def _launch(
    grid: int, logits, rows, temperature, top_k, top_p, log_min_p, keys, scratch, out, thr, cfg
) -> None:
    vocab = logits.shape[-1]
    p2 = triton.next_power_of_2(vocab)
    sz, ss, si = scratch
    _jit_kernel()[(grid,)](
        logits,
        rows,
        logits.stride(0),
        vocab,
        temperature,
        top_k,
        top_p,
        log_min_p,
        keys,
        sz,
        ss,
        si,
        out,
        thr,
        P=cfg.pivots,
        BLOCK=min(cfg.block, p2),
        LBLOCK=min(cfg.lblock, p2),
        ROUNDS=cfg.rounds,
        CAP=cfg.cap,
        num_warps=cfg.warps,
    )


def _jit_kernel():
    """Jit the helpers, then the kernel (it finds them as this module's globals)."""
    global _KERNEL, _z_of, _race_score, _race_pass, _first_argmax, _ladder, _search, _bisect_row, _compact
    global _bisect_candidates
    if _KERNEL is None:
        _first_argmax = triton.jit(_first_argmax)
        _z_of = triton.jit(_z_of)
        _race_score = triton.jit(_race_score)
        _race_pass = triton.jit(_race_pass)
        _ladder = triton.jit(_ladder)
        _search = triton.jit(_search)
        _bisect_row = triton.jit(_bisect_row)
        _compact = triton.jit(_compact)
        _bisect_candidates = triton.jit(_bisect_candidates)
        _KERNEL = triton.jit(_fused_kernel)
    return _KERNEL


class DrawParams:
    """The draw's per-row parameters in static device buffers, for a draw captured in a CUDA graph (the
    decode graph): `write` fills them before replay (pinned host rows, one asynchronous copy per dtype),
    `draw` launches the kernel on them with every address fixed, writing `tokens` [capacity]. Rows past
    the batch and greedy rows have temperature 0 (the argmax). `write` waits for its previous copy
    before it reuses the pinned rows."""

    def __init__(self, capacity: int, device: torch.device, cap: int = CAP) -> None:
        self.capacity, self.cap = capacity, cap
        pinned = device.type == "cuda"
        self.host_f = torch.zeros(3, capacity, dtype=torch.float32, pin_memory=pinned)  # T, top_p, log_min_p
        self.host_i = torch.zeros(3, capacity, dtype=torch.int64, pin_memory=pinned)  # row, top_k, key
        self.dev_f = torch.zeros(3, capacity, dtype=torch.float32, device=device)
        self.dev_i = torch.zeros(3, capacity, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.thr = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.scratch = DrawScratch()
        self.scratch.get(capacity, cap, device)
        self._copied = torch.cuda.Event() if pinned else None

    def write(self, floats: torch.Tensor, ints: torch.Tensor) -> None:
        """floats [3, n] (temperature, top_p, log_min_p), ints [2, n] (top_k, key) for rows 0..n-1 of
        the logits; rows n.. are greedy."""
        n = floats.shape[1]
        if n > self.capacity:
            raise ValueError(f"{n} rows exceed the DrawParams capacity {self.capacity}: make it larger")
        if self._copied is not None:
            self._copied.synchronize()
        self.host_f[:, n:] = 0
        self.host_f[:, :n] = floats
        self.host_i[0] = torch.arange(self.capacity)
        self.host_i[1:, :n] = ints
        self.host_i[1:, n:] = 0
        self.dev_f.copy_(self.host_f, non_blocking=True)
        self.dev_i.copy_(self.host_i, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def draw(self, logits: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """tokens [rows] for logits [>= rows, V], rows <= capacity (default: capacity). Graph-capturable:
        no allocation and no sync; a graph captured for `rows` rows replays with whatever `write` put in
        the buffers since (its rows past the written batch are greedy)."""
        n = self.capacity if rows is None else rows
        if n > self.capacity:
            raise ValueError(f"{n} rows exceed the DrawParams capacity {self.capacity}: make it larger")
        if n:
            cfg = Config()
            cfg.cap = self.cap
            _launch(
                n,
                logits,
                self.dev_i[0],
                self.dev_f[0],
                self.dev_i[1],
                self.dev_f[1],
                self.dev_f[2],
                self.dev_i[2],
                self.scratch.get(self.capacity, self.cap, logits.device),
                self.tokens,
                self.thr,
                cfg,
            )
        return self.tokens[:n]


class DrawScratch:
    """The kernel's per-row candidate buffers ([rows, CAP] z, race score, index), grown on demand and
    kept: reused by every call (and a fixed address for a captured graph)."""

    def __init__(self) -> None:
        self.buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def get(self, rows: int, cap: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        b = self.buffers
        if b is None or b[0].shape[0] < rows or b[0].shape[1] != cap or b[0].device != device:
            n = max(rows, 1)
            b = self.buffers = (
                torch.empty(n, cap, dtype=torch.float32, device=device),
                torch.empty(n, cap, dtype=torch.float32, device=device),
                torch.empty(n, cap, dtype=torch.int32, device=device),
            )
        return b


_SCRATCH = DrawScratch()


def fused_draw(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor,
    keys: torch.Tensor,
    *,
    cfg: Config | None = None,
    scratch: DrawScratch | None = None,
    **overrides,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per entry of rows [W] (int64 row indices into logits [R, V], any float dtype,
    contiguous last dim): returns (tokens [W] int64, thresholds [W] fp32: keep z >= thr).

    Per entry: temperature [W] fp32 (<= 0: greedy, the argmax; else >= the sampler's MIN_TEMPERATURE),
    top_k [W] int64 (>= V: off), top_p [W] fp32 (>= 1: off), log_min_p [W] fp32 (-inf: off), keys [W]
    int64 (race_draw.row_key bits). `overrides` set Config fields (block=, cap=, ...; the tests use small
    ones). Nothing waits for the GPU; the scratch buffers are the module's unless one is given."""
    cfg = cfg or Config()
    if overrides:
        cfg = Config()
        for name, value in overrides.items():
            if not hasattr(Config, name):
                raise TypeError(
                    f"fused_draw: unknown launch setting {name!r} (Config has block, lblock, "
                    "pivots, rounds, cap, warps)"
                )
            setattr(cfg, name, value)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    w = rows.numel()
    out = torch.empty(w, dtype=torch.int64, device=logits.device)
    thr = torch.empty(w, dtype=torch.float32, device=logits.device)
    if w:
        buffers = (scratch or _SCRATCH).get(w, cfg.cap, logits.device)
        _launch(w, logits, rows, temperature, top_k, top_p, log_min_p, keys, buffers, out, thr, cfg)
    return out, thr
