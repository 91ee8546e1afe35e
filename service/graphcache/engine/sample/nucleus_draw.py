"""Temperature, min_p and top-p sampling by rejection: three Triton launches, no threshold search.

Why: finding the top-p threshold first (a top-k prefix, then a bisection for flat rows) costs a
dozen launches and passes per step; drawing first and checking after costs two or three passes over
the row in one launch. The draw is race_draw.py's exponential race (token = argmax z_i - log E_i, E_i
from a counter hash of (key, i)), so a seeded row's tokens depend only on its seed and its logits.

z = (x - max) / T with NaN -> -inf, and z < log(min_p) -> -inf. The nucleus is the set
{i : mass(z_j > z_i) < top_p * mass(all)} (mass = sum exp(z)): the smallest top set reaching top_p,
with every token tied at the cut kept (the same set as filter_threshold.py's threshold). The top
token is always in it (its mass above is 0), whatever top_p is.

Per row:
  1. a pass for the max (the argmax too: greedy rows and rows with no finite max take it);
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

On CUDA passes 1 and 2 run split: each row's vocabulary in `slices` parts, one program each (a launch
per pass, partial maxima and partial race winners and masses in small buffers), so a batch of few rows
still fills the GPU and the hash-heavy race pass is spread over many SMs; a third launch, a program per
row, combines the partials (the first index among equal maxima or scores, as one pass would pick) and
runs step 3 and any further rounds.

The torch function is the CPU path and the kernel's reference; both take the same steps with the same
keys, so they draw the same tokens up to fp32 summation order at the nucleus' edge and the last ulp of
the logs.
"""

from __future__ import annotations

import torch

from graphcache.engine.sample.race_draw import GAMMA, MASK64, mix64, mix64_tensor, to_int64, uniforms
from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = [
    "HAVE_TRITON",
    "MAX_SLICES",
    "ROUNDS",
    "nucleus_draw",
    "nucleus_draw_torch",
    "round_key",
    "split",
    "step_keys",
]

ROUNDS = 32  # rejections before the exact threshold (a row reaching it: a flat row at a tiny top_p)
ROUND_GAMMA = 0xD1B54A32D192ED03  # odd, unrelated to GAMMA: keys of later rounds
_CHUNK = 32  # rows per torch step: bounds the [rows, V] temporaries
_NEG_INF = float("-inf")


def round_key(key: int, r: int) -> int:
    """The race key of rejection round r (round 0: the row's own key, so a row without top_p draws
    exactly race_draw's token)."""
    return key & MASK64 if r == 0 else mix64(key + r * ROUND_GAMMA)


# --- torch path (CPU, and the reference) ----------------------------------------------------------
def _round_keys(keys: torch.Tensor, r: int) -> torch.Tensor:
    """round_key on an int64 tensor of uint64 bits."""
    return keys if r == 0 else mix64_tensor(keys + to_int64((r * ROUND_GAMMA) & MASK64))


def _race(z: torch.Tensor, keep: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax over kept tokens of z - log(-log u): [R] int64 (the first index on ties)."""
    score = z - uniforms(keys, z.shape[-1]).log().neg().log()
    return score.masked_fill_(~keep, _NEG_INF).argmax(dim=-1)


def _exact_threshold(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[R] the largest v with mass(z >= v) >= target, by bisection on the fp32 bits of -z (z <= 0)."""
    bits = (-z).contiguous().view(torch.int32)  # ordered like -z; -inf -> 0x7F800000
    w = z.exp()
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
) -> torch.Tensor:
    """logits [R, V] (any float dtype); per row temperature [R] (<= 0: greedy), top_p [R] (>= 1: off),
    log_min_p [R] (-inf: off), keys [R] int64 (the race keys, uint64 bits) -> tokens [R] int64."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for a in range(0, logits.shape[0], _CHUNK):
        s = slice(a, a + _CHUNK)
        out[s] = _draw_chunk(logits[s], temperature[s], top_p[s], log_min_p[s], keys[s], rounds)
    return out


def _draw_chunk(x, temperature, top_p, log_min_p, keys, rounds):
    x = x.float().nan_to_num(nan=_NEG_INF, posinf=float("inf"), neginf=_NEG_INF)
    m, top = x.max(dim=-1)
    t = temperature.float().view(-1, 1)
    z = (x - m.view(-1, 1)) / t.clamp_min(1e-30)
    z.masked_fill_(z < log_min_p.float().view(-1, 1), _NEG_INF)
    w = z.exp()
    target = top_p.float() * w.sum(dim=-1)
    token = _race(z, z > _NEG_INF, keys)
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
        drawn = _race(z, z > zc, _round_keys(keys, r + 1))
        token = torch.where(pending, drawn, token)
    if bool(pending.any()):  # the exact threshold for rows that ran out of rounds
        thr = _exact_threshold(z, target)
        drawn = _race(z, z >= thr.view(-1, 1), _round_keys(keys, rounds + 1))
        token = torch.where(pending, drawn, token)
    random_row = (temperature > 0) & m.isfinite()
    return torch.where(random_row, token, top)


# --- Triton path -------------------------------------------------------------------------------------
# Literal constants: a jitted function may not read module globals that are not constexpr.
# 0x9E3779B97F4A7C15 = GAMMA; 1.1920928955078125e-07 = 2^-23; 41 = 64 - 23 (race_draw.py's uniforms).
def _z_block(base, offs, mask, m, t, lmp):
    x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    z = tl.math.div_rn(x - m, t)
    return tl.where(z < lmp, float("-inf"), z)


def _mix(h):
    """mix64 on uint64 values (they wrap; >> is logical)."""
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB
    return h ^ (h >> 31)


def _race_block(z, key, offs):
    h = _mix(key + (offs.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
    u = ((h >> 41).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return z - tl.log(-tl.log(u))


def _race_span(base, lo, hi, m, t, lmp, floor, key, STRICT: tl.constexpr, BLOCK: tl.constexpr):
    """Over the tokens lo <= i < hi: (the best race score over z > floor (STRICT) or z >= floor, its
    index, the first on ties; the mass of every kept token, sum exp(z), summed in the same pass)."""
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + cols
        mask = offs < hi
        z = _z_block(base, offs, mask, m, t, lmp)
        mass += tl.exp(z)
        if STRICT:
            kept = z > floor
        else:
            kept = z >= floor
        score = tl.where(kept, _race_block(z, key, offs), float("-inf"))
        better = score > best  # strict: a lane's earlier index wins ties
        best_i = tl.where(better, offs, best_i)
        best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, best_i, 2147483647), axis=0), tl.sum(mass, axis=0)


def _mass(base, vocab, m, t, lmp, floor, BLOCK: tl.constexpr):
    """sum exp(z) over z > floor."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        z = _z_block(base, offs, offs < vocab, m, t, lmp)
        acc += tl.where(z > floor, tl.exp(z), 0.0)
    return tl.sum(acc, axis=0)


def _mass_at_or_below_key(base, vocab, m, t, lmp, c, BLOCK: tl.constexpr):
    """sum exp(z) over the tokens whose key (the fp32 bits of -z) is <= c."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        z = _z_block(base, offs, offs < vocab, m, t, lmp)
        acc += tl.where((-z).to(tl.int32, bitcast=True) <= c, tl.exp(z), 0.0)
    return tl.sum(acc, axis=0)


def _round_key_of(key, r):
    return _mix(key + r.to(tl.uint64) * 0xD1B54A32D192ED03)


def _row_key(key_ptr, step_ptr, w):
    """Row w's race key: keys[w], or for a seeded row (step >= 0) race_draw.row_key's mix of it."""
    key = tl.load(key_ptr + w).to(tl.uint64, bitcast=True)
    step = tl.load(step_ptr + w)
    if step >= 0:
        key = _mix(key + (step + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
    return key


def _slice_max_kernel(x_ptr, rows_ptr, stride_x, vocab, slice_len, max_ptr, idx_ptr, BLOCK: tl.constexpr):
    # Pass 1 on program (w, s): the max of row w's slice s and its first index -> max/idx [w * S + s].
    w, sl, n = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    base = x_ptr + tl.load(rows_ptr + w) * stride_x
    lo = sl * slice_len
    hi = tl.minimum(lo + slice_len, vocab)
    cols = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    mi = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)
        better = x > mx
        mi = tl.where(better, offs, mi)
        mx = tl.where(better, x, mx)
    m = tl.max(mx, axis=0)
    tl.store(max_ptr + w * n + sl, m)
    tl.store(idx_ptr + w * n + sl, tl.min(tl.where(mx == m, mi, 2147483647), axis=0))


def _slice_race_kernel(
    x_ptr, rows_ptr, stride_x, vocab, slice_len, params_ptr, key_ptr, step_ptr, max_ptr,
    score_ptr, idx_ptr, mass_ptr, MAX_SLICES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Pass 2 on program (w, s): the race over row w's slice s with the row's max -> its best score, index
    # and mass at [w * S + s] (rows that take the argmax: -inf, int max, 0).
    w, sl, n = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    slices = tl.arange(0, MAX_SLICES)
    m = tl.max(tl.load(max_ptr + w * n + slices, mask=slices < n, other=float("-inf")), axis=0)
    t = tl.load(params_ptr + 3 * w)
    lmp = tl.load(params_ptr + 3 * w + 2)
    best, best_i, mass = float("-inf"), 2147483647, 0.0
    if (t > 0) & (m > float("-inf")) & (m < float("inf")):
        base = x_ptr + tl.load(rows_ptr + w) * stride_x
        lo = sl * slice_len
        best, best_i, mass = _race_span(
            base, lo, tl.minimum(lo + slice_len, vocab), m, t, lmp, float("-inf"),
            _row_key(key_ptr, step_ptr, w), True, BLOCK,
        )  # fmt: skip
    tl.store(score_ptr + w * n + sl, best)
    tl.store(idx_ptr + w * n + sl, best_i)
    tl.store(mass_ptr + w * n + sl, mass)


def _first_best(ptr, idx_ptr, w, n, MAX_SLICES: tl.constexpr):
    """(the largest of row w's n partials, the smallest index among the partials equal to it)."""
    slices = tl.arange(0, MAX_SLICES)
    v = tl.load(ptr + w * n + slices, mask=slices < n, other=float("-inf"))
    i = tl.load(idx_ptr + w * n + slices, mask=slices < n, other=2147483647)
    top = tl.max(v, axis=0)
    return top, tl.min(tl.where(v == top, i, 2147483647), axis=0)


def _finish_kernel(
    x_ptr, rows_ptr, stride_x, vocab, params_ptr, key_ptr, step_ptr, out_ptr, n_slices,
    max_ptr, max_idx_ptr, score_ptr, score_idx_ptr, mass_ptr,
    MAX_SLICES: tl.constexpr, BLOCK: tl.constexpr, ROUNDS: tl.constexpr,
):  # fmt: skip
    # A program per row: the partials of passes 1 and 2 combined, then (top_p < 1) step 3 and its rounds.
    w = tl.program_id(0)
    base = x_ptr + tl.load(rows_ptr + w) * stride_x
    t = tl.load(params_ptr + 3 * w)
    p = tl.load(params_ptr + 3 * w + 1)
    lmp = tl.load(params_ptr + 3 * w + 2)
    m, token = _first_best(max_ptr, max_idx_ptr, w, n_slices, MAX_SLICES)
    if (t > 0) & (m > float("-inf")) & (m < float("inf")):
        _, token = _first_best(score_ptr, score_idx_ptr, w, n_slices, MAX_SLICES)
        slices = tl.arange(0, MAX_SLICES)
        total = tl.sum(tl.load(mass_ptr + w * n_slices + slices, mask=slices < n_slices, other=0.0), axis=0)
        if p < 1:
            key = _row_key(key_ptr, step_ptr, w)
            target = p * total
            r = 0
            pending = 1
            while pending != 0:
                zc = tl.math.div_rn(tl.load(base + token).to(tl.float32) - m, t)
                above = _mass(base, vocab, m, t, lmp, zc, BLOCK)
                if (above < target) | (above == 0):
                    pending = 0
                elif r == ROUNDS:
                    # 3b. out of rounds: the exact threshold, then the race over z >= thr
                    lo = tl.full((), 0, tl.int32)
                    hi = tl.full((), 2139095040, tl.int32)  # the fp32 bits of +inf
                    for _ in range(31):
                        mid = lo + (hi - lo) // 2
                        good = _mass_at_or_below_key(base, vocab, m, t, lmp, mid, BLOCK) >= target
                        hi = tl.where(good, mid, hi)
                        lo = tl.where(good, lo, mid + 1)
                    thr = -(lo.to(tl.float32, bitcast=True))
                    _, token, _ = _race_span(
                        base, 0, vocab, m, t, lmp, thr, _round_key_of(key, r + 1), False, BLOCK
                    )
                    pending = 0
                else:
                    # 3a. c and all below it are outside the nucleus: draw again above it
                    r += 1
                    _, token, _ = _race_span(
                        base, 0, vocab, m, t, lmp, zc, _round_key_of(key, r), True, BLOCK
                    )
    tl.store(out_ptr + w, token.to(tl.int64))


MAX_SLICES = 128  # parts a row's vocabulary is split into, at most (a constexpr: no compile per batch)
_KERNELS: tuple | None = None


def _jit_kernels():
    """Jit the helpers, then the kernels (they find them as this module's globals)."""
    global _KERNELS, _mix, _z_block, _race_block, _race_span, _mass, _mass_at_or_below_key, _round_key_of
    global _row_key, _first_best
    if _KERNELS is None:
        _mix = triton.jit(_mix)
        _z_block = triton.jit(_z_block)
        _race_block = triton.jit(_race_block)
        _race_span = triton.jit(_race_span)
        _mass = triton.jit(_mass)
        _mass_at_or_below_key = triton.jit(_mass_at_or_below_key)
        _round_key_of = triton.jit(_round_key_of)
        _row_key = triton.jit(_row_key)
        _first_best = triton.jit(_first_best)
        # The slice length and count follow the batch's rows: not specialized on (no compile per batch).
        _KERNELS = (
            triton.jit(_slice_max_kernel, do_not_specialize=["slice_len"]),
            triton.jit(_slice_race_kernel, do_not_specialize=["slice_len"]),
            triton.jit(_finish_kernel, do_not_specialize=["n_slices"]),
        )
    return _KERNELS


def split(vocab: int, rows: int, block: int, programs: int) -> tuple[int, int]:
    """(slices, slice_len) for the split passes: about `programs` programs over the batch, each slice a
    whole number of blocks, at most MAX_SLICES a row, none empty."""
    want = max(1, min(MAX_SLICES, _cdiv(programs, max(rows, 1)), _cdiv(vocab, block)))
    slice_len = _cdiv(_cdiv(vocab, want), block) * block
    return _cdiv(vocab, slice_len), slice_len


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def nucleus_draw(
    logits: torch.Tensor,
    rows: torch.Tensor,
    params: torch.Tensor,
    keys: torch.Tensor,
    steps: torch.Tensor,
    *,
    rounds: int = ROUNDS,
    block: int = 4096,
    warps: int = 16,
    slice_block: int = 2048,
    slice_warps: int = 8,
    programs: int = 1024,
) -> torch.Tensor:
    """tokens [W] int64: one draw per entry of rows [W] (int64 indices into logits [R, V], any float
    dtype). Per entry: params [W, 3] fp32 (temperature, <= 0: greedy; top_p, >= 1: off; log(min_p),
    -inf: off), keys [W] int64 and steps [W] int64 (step_keys: the race key is keys itself where the
    step is < 0, else row_key's mix of keys = mix64(seed) and the step). On CUDA three launches (block,
    warps: the per-row launch; slice_block, slice_warps, programs: the split passes), no host sync, no
    allocation but the output and the partials (graph-capturable); elsewhere the torch path."""
    if not (logits.is_cuda and HAVE_TRITON):
        x, p = logits.index_select(0, rows), params.float()
        return nucleus_draw_torch(x, p[:, 0], p[:, 1], p[:, 2], step_keys(keys, steps), rounds)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, vocab = rows.numel(), logits.shape[-1]
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if not n:
        return out
    slice_max, slice_race, finish = _jit_kernels()
    params = params.contiguous()
    slice_block = min(slice_block, triton.next_power_of_2(vocab))
    slices, slice_len = split(vocab, n, slice_block, programs)
    part_f = torch.empty(3, n * slices, dtype=torch.float32, device=logits.device)  # max, score, mass
    part_i = torch.empty(2, n * slices, dtype=torch.int32, device=logits.device)  # their indices
    slice_max[(n, slices)](
        logits, rows, logits.stride(0), vocab, slice_len, part_f[0], part_i[0],
        BLOCK=slice_block, num_warps=slice_warps,
    )  # fmt: skip
    slice_race[(n, slices)](
        logits, rows, logits.stride(0), vocab, slice_len, params, keys, steps, part_f[0],
        part_f[1], part_i[1], part_f[2], MAX_SLICES=MAX_SLICES, BLOCK=slice_block, num_warps=slice_warps,
    )  # fmt: skip
    finish[(n,)](
        logits, rows, logits.stride(0), vocab, params, keys, steps, out, slices,
        part_f[0], part_i[0], part_f[1], part_i[1], part_f[2],
        MAX_SLICES=MAX_SLICES, BLOCK=min(block, triton.next_power_of_2(vocab)), ROUNDS=rounds, num_warps=warps,
    )  # fmt: skip
    return out


assert GAMMA == 0x9E3779B97F4A7C15  # the kernel's literal
