"""One categorical draw per row from counter-based randomness: the exponential race.

Why: a torch.Generator per seeded request means one torch.multinomial launch per row (28.6 ms for 256
seeded rows on the H200). Here every row of a batch draws in one
kernel, and a row's randomness is a pure function of its 64-bit key and the token index, so no state
lives between steps and nothing depends on which other rows share the batch.

The draw: token = argmax_i (z_i - log E_i) over the kept tokens (z_i >= thr), with E_i ~ Exp(1)
independent. P(token = i) = softmax(z)_i restricted to the kept tokens (the race of exponential clocks
E_i / p_i: the smallest wins with probability p_i / sum p, i.e. the Gumbel-max trick, since
-log E is Gumbel). So z may be any shifted, scaled logits: no softmax is needed.

E_i = -log u_i, u_i from a SplitMix64 stream: h = mix64(key + (i + 1) * GAMMA) (Steele, Lea and
Flood's finalizer constants), u = (top 23 bits of h + 0.5) / 2^23. 23 bits, not 24: m + 0.5 with
m < 2^23 is exact in fp32, so u is in (0, 1) on both ends (with 24 bits the largest, 1 - 2^-25,
rounds to 1.0 and log(-log 1) is -inf), and the CPU and the GPU compute the same u bit for bit.
The resolution (2^-23) truncates Exp(1) at 16.6: an event of probability 6e-8 per token, and then
only a tie-break among the most unlikely clocks.

Two implementations with the same arithmetic: the torch one (the CPU path and the reference; int64
ops wrap like uint64 for + and *, and >> is arithmetic, hence the masks after every shift) and a
Triton kernel (one program per row, a loop over vocabulary blocks keeping the best (score, index),
nothing [R, V] in memory), chosen when the logits are on CUDA and triton imports. The two agree up
to the last ulp of the fp32 logs (tests/test_sampling_kernels.py).
"""

from __future__ import annotations

import torch

from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = [
    "HAVE_TRITON",
    "mix64",
    "mix64_tensor",
    "shr64",
    "race_draw",
    "race_draw_torch",
    "row_key",
    "to_int64",
    "uniforms",
]

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: the SplitMix64 increment
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
_U_BITS = 23  # see the module docstring
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


# --- torch path (CPU, and the reference) ----------------------------------------------------------
def shr64(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic: mask off the copied sign bits)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64_tensor(h: torch.Tensor) -> torch.Tensor:
    """mix64 on an int64 tensor of uint64 bits (+ and * wrap like uint64)."""
    h = (h ^ shr64(h, 30)) * to_int64(MUL1)
    h = (h ^ shr64(h, 27)) * to_int64(MUL2)
    return h ^ shr64(h, 31)


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [R] int64 (uint64 bits) -> u [R, vocab] fp32 in (0, 1): u[r, i] from mix64(key_r + (i+1) GAMMA)."""
    i = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)
    h = mix64_tensor(keys.view(-1, 1) + i * to_int64(GAMMA))  # [R, V] int64; wraps mod 2^64 like uint64
    return (shr64(h, 64 - _U_BITS).float() + 0.5) * (2.0**-_U_BITS)


def race_draw_torch(z: torch.Tensor, thr: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """z [R, V] fp32 (log-weights, -inf = never), thr [R] fp32 or None (keep z >= thr), keys [R] int64
    -> [R] int64: argmax_i (z_i - log(-log u_i)) over the kept tokens. A row with nothing kept gets an
    arbitrary index (the caller replaces it)."""
    out = torch.empty(z.shape[0], dtype=torch.int64, device=z.device)
    for a in range(0, z.shape[0], _CHUNK):  # bounds the [rows, V] int64 temporaries (~40 MB each at 152k)
        zc = z[a : a + _CHUNK]
        score = zc - uniforms(keys[a : a + _CHUNK], z.shape[-1]).log().neg().log()
        if thr is not None:
            score.masked_fill_(zc < thr[a : a + _CHUNK].view(-1, 1), _NEG_INF)
        out[a : a + _CHUNK] = score.argmax(dim=-1)
    return out


# --- Triton path -------------------------------------------------------------------------------------
# The constants are literals: a jitted function may not read module globals that are not constexpr.
# 1.1920928955078125e-07 = 2^-23; 41 = 64 - _U_BITS.
def _race_kernel(z_ptr, thr_ptr, key_ptr, out_ptr, stride_z, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    key = tl.load(key_ptr + row).to(tl.uint64, bitcast=True)
    thr = tl.load(thr_ptr + row)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int64)
    cols = tl.arange(0, BLOCK)
    for start in range(0, vocab, BLOCK):
        offs = start + cols  # [BLOCK]
        mask = offs < vocab
        z = tl.load(z_ptr + row * stride_z + offs, mask=mask, other=float("-inf"))
        h = key + (offs.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15  # uint64: wraps, >> is logical
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB
        h = h ^ (h >> 31)
        u = ((h >> 41).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        score = tl.where(mask & (z >= thr), z - tl.log(-tl.log(u)), float("-inf"))
        m = tl.max(score, axis=0)
        i = tl.argmax(score, axis=0)  # first index of the max
        better = m > best  # earlier blocks win ties
        best_i = tl.where(better, start + i.to(tl.int64), best_i)
        best = tl.where(better, m, best)
    tl.store(out_ptr + row, best_i)


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = triton.jit(_race_kernel)
    return _KERNEL


def race_draw_triton(
    z: torch.Tensor, thr: torch.Tensor | None, keys: torch.Tensor, block: int = 2048
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
            z, thr.float().contiguous(), keys.contiguous(), out, z.stride(0), vocab, BLOCK=block, num_warps=8
        )
    return out


def race_draw(z: torch.Tensor, thr: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """[R] int64 tokens drawn from softmax(z) restricted to z >= thr (see race_draw_torch): the
    Triton kernel on CUDA, torch elsewhere."""
    if z.is_cuda and HAVE_TRITON:
        return race_draw_triton(z, thr, keys)
    return race_draw_torch(z, thr, keys)
