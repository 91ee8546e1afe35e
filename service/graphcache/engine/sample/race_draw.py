"""One categorical draw per row from counter-based randomness: the exponential race.

Why: a torch.Generator per seeded request means one torch.multinomial launch per row (28.6 ms for 256
seeded rows on the H200). Here every row of a batch draws in one
kernel, and a row's randomness is a pure function of its 64-bit key and the token index, so no state
lives between steps and nothing depends on which other rows share the batch.

The draw: token = argmax_i w_i / E_i over the kept tokens (z_i >= thr), with w_i = exp(z_i) and E_i ~
Exp(1) independent. P(token = i) = softmax(z)_i restricted to the kept tokens (the race of exponential
clocks E_i / w_i: the smallest wins with probability w_i / sum w; the same token as the Gumbel-max
argmax z_i - log E_i, without the second log). z is the sampler's z: logits minus the row max, scaled,
so the largest kept z is 0 and w = exp(z) neither overflows nor underflows where it matters (a token
whose w underflows to 0 has odds below 2^-126 against the top one and never wins).

E_i = -log u_i, u_i from a 32-bit counter hash of (key, i), one per token (hash32): the row's 64-bit
key splits into words k0 (low) and k1 (high) once per row; per token x = (i * 0x9E3779B9 + k0) ^ k1
(mod 2^32), then Wellons' triple32 finalizer (hash-prospector's [17 ed5ad4bb 11 ac4c1b51 15 31848bab
14]: three rounds of xorshift and odd multiply), so both key words pass through every multiply (xored in after
one multiply, keys one bit apart in k1 give streams with correlation -0.5; the two-multiply lowbias32
leaves such structure in the top bits too). For a fixed key, distinct tokens get distinct hashes
(every step is a bijection of 32-bit words). u = (top 23 bits of the hash + 0.5) /
2^23, built as the fp32 1.m (those 23 bits as the mantissa) minus (1 - 2^-24): exact, so u is in (0, 1)
on both ends (with 24 bits the largest, 1 - 2^-25, rounds to 1.0 and log 1 is 0), and the CPU and the
GPU compute the same u bit for bit. The resolution (2^-23) truncates Exp(1) at 16.6: an event of
probability 6e-8 per token, and then only a tie-break among the most unlikely clocks.

Why 32 bits: the hash runs once per token of every sampled row (152k per row, again on each rejection
round); a 64-bit multiply is several 32-bit multiplies on the GPU, so a 64-bit hash per token costs
about three times the integer work. The per-row keys (row_key, nucleus_draw's round keys) are 64-bit
SplitMix64: once per row. A seeded row's tokens are a pure function of (seed, step, its own logits)
for a given version of this hash; no document promises them across versions.

Two implementations with the same arithmetic: the torch one (the CPU path and the reference; 32-bit
words held in int64 tensors and masked after every multiply) and a Triton kernel (one program per row,
a loop over vocabulary blocks keeping each lane's best (w, E, index), compared as w_a E_b > w_b E_a so
no division runs per token; nothing [R, V] in memory), chosen when the logits are on CUDA and triton
imports. They agree up to the last ulp of exp and log and of the comparison (tests/engine/test_sampling_kernels.py).
The kernel shares nucleus_draw.py's block and warps, so both compare the same tokens in the same order and
a row nucleus_draw draws in round 0 gets race_draw's token even at a near tie.
"""

from __future__ import annotations

import torch

from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = [
    "BLOCK",
    "HAVE_TRITON",
    "LOG2E",
    "WARPS",
    "beats_tl",
    "clock_tl",
    "clocks",
    "hash32",
    "hash32_tensor",
    "jit_helpers",
    "key_words_tl",
    "mix64",
    "mix64_tensor",
    "race_draw",
    "race_draw_torch",
    "row_key",
    "shr64",
    "to_int64",
    "uniform_of_hash",
    "uniform_tl",
    "uniforms",
    "weight_tl",
    "weights",
    "winner_tl",
]

MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1
GAMMA = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: the SplitMix64 increment
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
STEP32 = 0x9E3779B9  # 2^32 / golden ratio, odd: the per-token counter step
H1 = 0xED5AD4BB  # triple32's multipliers (see the module docstring)
H2 = 0xAC4C1B51
H3 = 0x31848BAB
_U_BITS = 23  # see the module docstring
_ONE_BITS = 0x3F800000  # the fp32 bits of 1.0: OR in 23 mantissa bits for 1.m in [1, 2)
_U_OFFSET = 1.0 - 2.0**-24  # 1.m - this = (m + 0.5) / 2^23, exactly
LOG2E = 1.4426950408889634  # exp(z) = exp2(z * LOG2E): ex2 is one instruction on the GPU
BLOCK = 8192  # the kernels' vocabulary block and warps (nucleus_draw's defaults too: see the docstring); the
# fastest of the launch settings sampler_bench times on the H200 (BENCHMARKS.md §14)
WARPS = 32
_NEG_INF = float("-inf")
_CHUNK = 32  # rows per torch step


# --- host side: keys ---------------------------------------------------------------------------------
def mix64(x: int) -> int:
    """The SplitMix64 finalizer on a Python int (taken as 64 bits)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * MUL1) & MASK64
    x = ((x ^ (x >> 27)) * MUL2) & MASK64
    return x ^ (x >> 31)


def row_key(seed: int, step: int) -> int:
    """A seeded row's key for its `step`-th generated token: a function of (seed, step) only, so the
    token depends on nothing but the seed and the row's own logits (the seed is taken mod 2^64:
    negative int64 seeds are fine). Two mixes so that nearby seeds and steps give unrelated streams."""
    return mix64(mix64(seed) + (step + 1) * GAMMA)


def to_int64(key: int) -> int:
    """A uint64 key as the int64 with the same bits (what an int64 tensor can hold)."""
    key &= MASK64
    return key - (1 << 64) if key >> 63 else key


def hash32(key: int, i: int) -> int:
    """Token i's 32-bit hash under a 64-bit key (Python ints): the reference for the tensor and kernel forms."""
    k0, k1 = key & MASK32, (key >> 32) & MASK32
    x = ((i * STEP32 + k0) & MASK32) ^ k1
    x = ((x ^ (x >> 17)) * H1) & MASK32
    x = ((x ^ (x >> 11)) * H2) & MASK32
    x = ((x ^ (x >> 15)) * H3) & MASK32
    return x ^ (x >> 14)


# --- torch path (CPU, and the reference) ----------------------------------------------------------
def shr64(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic: mask off the copied sign bits)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64_tensor(h: torch.Tensor) -> torch.Tensor:
    """mix64 on an int64 tensor of uint64 bits (+ and * wrap like uint64)."""
    h = (h ^ shr64(h, 30)) * to_int64(MUL1)
    h = (h ^ shr64(h, 27)) * to_int64(MUL2)
    return h ^ shr64(h, 31)


def hash32_tensor(keys: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """keys [R] int64 (uint64 bits), token indices i [V] int64 -> [R, V] int64 in [0, 2^32):
    hash32(key_r, i_v). The words stay below 2^32, so >> is logical; a product of two of them wraps mod
    2^64 and its low 32 bits are kept."""
    k0 = (keys & MASK32).view(-1, 1)  # [R, 1]
    k1 = shr64(keys, 32).view(-1, 1)
    x = ((i * STEP32 + k0) & MASK32) ^ k1  # [R, V]
    x = ((x ^ (x >> 17)) * H1) & MASK32
    x = ((x ^ (x >> 11)) * H2) & MASK32
    x = ((x ^ (x >> 15)) * H3) & MASK32
    return x ^ (x >> 14)


def uniform_of_hash(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64 tensor) -> u fp32 in (0, 1): (h >> 9 + 0.5) / 2^23, as 1.m - (1 - 2^-24)."""
    return ((h >> (32 - _U_BITS)) | _ONE_BITS).to(torch.int32).view(torch.float32) - _U_OFFSET


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [R] int64 (uint64 bits) -> u [R, vocab] fp32 in (0, 1): u[r, i] = (hash32(key_r, i) >> 9 + 0.5) / 2^23."""
    return uniform_of_hash(hash32_tensor(keys, torch.arange(vocab, dtype=torch.int64, device=keys.device)))


def clocks(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] fp32: the race's exponential clocks E = -log u (in (0, 16.7))."""
    return uniforms(keys, vocab).log().neg_()


def weights(z: torch.Tensor) -> torch.Tensor:
    """exp(z) as the kernels compute it: exp2(z * LOG2E) (fp32)."""
    return torch.exp2(z * LOG2E)


def race_draw_torch(z: torch.Tensor, thr: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """z [R, V] fp32 (log-weights as the sampler makes them, largest kept value 0; -inf = never), thr [R]
    fp32 or None (keep z >= thr), keys [R] int64 -> [R] int64: argmax_i exp(z_i) / E_i over the kept
    tokens (the first index on ties). A row with nothing kept gets an arbitrary index (the caller
    replaces it)."""
    out = torch.empty(z.shape[0], dtype=torch.int64, device=z.device)
    for a in range(0, z.shape[0], _CHUNK):  # bounds the [rows, V] int64 temporaries (~40 MB each at 152k)
        zc = z[a : a + _CHUNK]
        w = weights(zc)
        if thr is not None:
            w.masked_fill_(zc < thr[a : a + _CHUNK].view(-1, 1), 0.0)
        out[a : a + _CHUNK] = (w / clocks(keys[a : a + _CHUNK], z.shape[-1])).argmax(dim=-1)
    return out


# --- Triton path -------------------------------------------------------------------------------------
# The *_tl helpers are jitted by jit_helpers (nucleus_draw.py's kernel calls them too).
# The constants are literals: a jitted function may not read module globals that are not constexpr.
# 0x9E3779B9 = STEP32, 0xED5AD4BB = H1, 0xAC4C1B51 = H2, 0x31848BAB = H3, 9 = 32 - _U_BITS, 0x3F800000 = _ONE_BITS,
# 0.999999940395355224609375 = _U_OFFSET (1 - 2^-24), 1.4426950408889634 = LOG2E.
def key_words_tl(key):
    """A row's int64 key -> its words (k0, k1) as uint32 scalars."""
    key = key.to(tl.uint64, bitcast=True)
    return key.to(tl.uint32), (key >> 32).to(tl.uint32)


def uniform_tl(k0, k1, offs):
    """u [BLOCK] fp32 of the tokens offs [BLOCK] int32: hash32 and uniform_of_hash (uint32 ops wrap)."""
    x = (offs.to(tl.uint32) * 0x9E3779B9 + k0) ^ k1
    x = (x ^ (x >> 17)) * 0xED5AD4BB
    x = (x ^ (x >> 11)) * 0xAC4C1B51
    x = (x ^ (x >> 15)) * 0x31848BAB
    x = x ^ (x >> 14)
    return ((x >> 9) | 0x3F800000).to(tl.float32, bitcast=True) - 0.999999940395355224609375


def clock_tl(k0, k1, offs):
    """E = -log u [BLOCK] fp32: the race's exponential clocks."""
    return -tl.log(uniform_tl(k0, k1, offs))


def weight_tl(z):
    """exp(z) [BLOCK] as exp2(z * LOG2E): ex2 alone (tl.exp adds a range fix for results below 2^-126)."""
    return tl.math.exp2(z * 1.4426950408889634)


def beats_tl(w, e, best_w, best_e):
    """[BLOCK] bool: w / e beats best_w / best_e, by cross products (no division per token)."""
    return w * best_e > best_w * e


def winner_tl(best_w, best_e, best_i):
    """The index of the largest best_w / best_e over the lanes, the first on ties; 0 where no lane has
    a positive weight (nothing kept)."""
    ratio = tl.math.div_rn(best_w, best_e)  # [BLOCK]: once per lane, not per token
    top = tl.max(ratio, axis=0)
    i = tl.min(tl.where(ratio == top, best_i, 2147483647), axis=0)
    return tl.where(top > 0, i, 0)


def _race_kernel(z_ptr, thr_ptr, key_ptr, out_ptr, stride_z, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k0, k1 = key_words_tl(tl.load(key_ptr + row))
    thr = tl.load(thr_ptr + row)
    cols = tl.arange(0, BLOCK)
    best_w = tl.zeros([BLOCK], tl.float32)  # each lane's best (w, E, index); (0, 1): nothing yet
    best_e = tl.full([BLOCK], 1.0, tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols  # [BLOCK]
        z = tl.load(z_ptr + row * stride_z + offs, mask=offs < vocab, other=float("-inf"))
        w = tl.where(z >= thr, weight_tl(z), 0.0)
        e = clock_tl(k0, k1, offs)
        better = beats_tl(w, e, best_w, best_e)  # strict: a lane's earlier index wins ties
        best_w = tl.where(better, w, best_w)
        best_e = tl.where(better, e, best_e)
        best_i = tl.where(better, offs, best_i)
    tl.store(out_ptr + row, winner_tl(best_w, best_e, best_i).to(tl.int64))


_KERNEL = None
_HELPERS: dict = {}


def jit_helpers() -> dict:
    """The race's helpers, jitted once, by name: nucleus_draw.py's kernel calls them too (a jitted
    function finds what it calls among its module's globals, so nucleus_draw copies them into its own)."""
    if not _HELPERS:
        for name in ("key_words_tl", "uniform_tl", "clock_tl", "weight_tl", "beats_tl", "winner_tl"):
            _HELPERS[name] = globals()[name] = triton.jit(globals()[name])
    return _HELPERS


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        jit_helpers()
        _KERNEL = triton.jit(_race_kernel)
    return _KERNEL


def race_draw_triton(
    z: torch.Tensor, thr: torch.Tensor | None, keys: torch.Tensor, block: int = BLOCK, warps: int = WARPS
) -> torch.Tensor:
    """race_draw_torch in one Triton launch (z [R, V] fp32 with a contiguous last dim)."""
    rows, vocab = z.shape
    if z.stride(1) != 1:
        z = z.contiguous()
    if thr is None:
        thr = torch.full((rows,), _NEG_INF, dtype=torch.float32, device=z.device)
    out = torch.empty(rows, dtype=torch.int64, device=z.device)
    if rows:
        _kernel()[(rows,)](
            z,
            thr.float().contiguous(),
            keys.contiguous(),
            out,
            z.stride(0),
            vocab,
            BLOCK=min(block, triton.next_power_of_2(vocab)),
            num_warps=warps,
        )
    return out


def race_draw(z: torch.Tensor, thr: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """[R] int64 tokens drawn from softmax(z) restricted to z >= thr (see race_draw_torch): the
    Triton kernel on CUDA, torch elsewhere."""
    if z.is_cuda and HAVE_TRITON:
        return race_draw_triton(z, thr, keys)
    return race_draw_torch(z, thr, keys)


# the kernel's literals
assert (STEP32, H1, H2, H3, _ONE_BITS) == (0x9E3779B9, 0xED5AD4BB, 0xAC4C1B51, 0x31848BAB, 0x3F800000)
assert _U_OFFSET == 0.999999940395355224609375
