"""The rejection sampler (engine/sample/nucleus_draw.py): its torch path against the sorted nucleus (the
distribution of many draws, the kept set on every row), its Triton kernel against the torch path (in
Triton's interpreter on the CPU, on bf16 logits of the served shape on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch
from graphcache.engine.sample import nucleus_draw as nd
from graphcache.engine.sample import race_draw as rd
from graphcache.engine.sample.sampler import filtered_logits
from helpers_sampling import NEG_INF, keys_of, rows_of, sort_threshold, z_of

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
needs_interpreter = pytest.mark.skipif(
    not (INTERPRET and nd.HAVE_TRITON), reason="needs triton's interpreter"
)
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and nd.HAVE_TRITON), reason="needs CUDA and triton"
)


def params(rows: int):
    p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.0, 0.8, 0.999, 1.0, 0.05, 0.7, 1.0, 0.3])[:rows]
    t = torch.tensor([0.8, 1.0, 0.5, 1.3, 0.8, 0.7, 1.0, 0.9, 2.0, 0.6, 1.0, 0.8])[:rows]
    lmp = torch.tensor([NEG_INF] * 9 + [-3.0, -1.0, NEG_INF])[:rows]
    return t, p, lmp


def nucleus_mask(logits, t, p, lmp) -> torch.Tensor:
    """[R, V] bool: the tokens of each row's nucleus, by sorting (helpers_sampling.sort_threshold)."""
    z = z_of(logits.float(), t, lmp)
    thr = sort_threshold(z, torch.full((z.shape[0],), z.shape[1]), p)
    return (z >= thr.view(-1, 1)) & (z > NEG_INF)


@pytest.mark.parametrize("name", ["normal", "flat", "peaked", "bf16_ties", "few_values", "minus_inf"])
def test_torch_draws_stay_inside_the_nucleus(name):
    logits = rows_of(name, 12, 300, seed=3)
    t, p, lmp = params(12)
    inside = nucleus_mask(logits, t, p, lmp)
    for step in range(20):
        tokens = nd.nucleus_draw_torch(logits, t, p, lmp, keys_of(range(12), step))
        assert inside.gather(1, tokens.view(-1, 1)).all(), (name, step)


def test_torch_draws_follow_the_nucleus_distribution():
    """4,000 draws per row (one key each) against softmax(z) over the nucleus: total variation small."""
    logits = rows_of("normal", 4, 64, seed=5) * 0.5
    t = torch.tensor([1.0, 0.7, 1.0, 1.5])
    p = torch.tensor([0.9, 0.5, 1.0, 0.2])
    lmp = torch.tensor([NEG_INF, NEG_INF, -2.0, NEG_INF])
    z = z_of(logits, t, lmp)
    want = z.masked_fill(~nucleus_mask(logits, t, p, lmp), NEG_INF).softmax(dim=-1)
    n = 4000
    counts = torch.zeros(4, 64)
    for s in range(n):
        tokens = nd.nucleus_draw_torch(logits, t, p, lmp, keys_of([s * 4 + r for r in range(4)]))
        counts[torch.arange(4), tokens] += 1
    tv = 0.5 * (counts / n - want).abs().sum(dim=-1)
    assert (tv < 0.05).all(), tv


def test_without_top_p_it_is_the_race():
    """A row without top_p draws race_draw's token from the threshold path's z (filtered_logits): the
    same token whichever path the batch sends the row down."""
    logits = rows_of("normal", 6, 500, seed=1)
    t = torch.tensor([0.8, 0.3, 1.0, 1.7, 0.8, 0.05])
    keys = keys_of(range(6), 4)
    lmp = torch.tensor([NEG_INF] * 4 + [-2.0, NEG_INF])
    tokens = nd.nucleus_draw_torch(logits, t, torch.ones(6), lmp, keys)
    z, _, _, _ = filtered_logits(logits, temperature=t, top_k=None, top_p=None, min_p=lmp.exp())
    assert torch.equal(tokens, rd.race_draw_torch(z, None, keys))


def test_degenerate_and_greedy_rows_take_the_argmax():
    x = torch.randn(4, 50)
    x[0] = NEG_INF
    x[1, 7] = float("inf")
    x[2, 3] = float("nan")
    t = torch.tensor([0.8, 0.8, 0.0, 0.8])
    tokens = nd.nucleus_draw_torch(x, t, torch.full((4,), 0.9), torch.full((4,), NEG_INF), keys_of(range(4)))
    assert tokens[1] == 7
    assert tokens[2] == x[2].nan_to_num(nan=NEG_INF).argmax()


def test_rows_out_of_rounds_take_the_exact_threshold():
    """Flat rows at a tiny top_p with no rejection rounds: every row goes to the bisection."""
    logits = rows_of("flat", 8, 400, seed=2)
    t, p, lmp = torch.full((8,), 1.0), torch.full((8,), 0.01), torch.full((8,), NEG_INF)
    inside = nucleus_mask(logits, t, p, lmp)
    for step in range(5):
        tokens = nd.nucleus_draw_torch(logits, t, p, lmp, keys_of(range(8), step), rounds=0)
        assert inside.gather(1, tokens.view(-1, 1)).all()


# --- top-k: one more floor on the kept tokens (the row's k-th largest logit: kth_logits on the torch path) --
TOP_K = torch.tensor([5, 8, 20, 1, 3, 50, 300, 10, 2, 40, 7, 0])  # 300 = the vocabulary, 0: both off


def filtered_mask(logits, t, p, lmp, k) -> torch.Tensor:
    """[R, V] bool: the tokens the threshold path keeps (filtered_logits: min_p, top-k, then top-p)."""
    z, thr, _, _ = filtered_logits(logits.float(), temperature=t, top_k=k, top_p=p, min_p=lmp.exp())
    return (z >= thr.view(-1, 1)) & (z > NEG_INF)


@pytest.mark.parametrize("name", ["normal", "flat", "peaked", "bf16_ties", "few_values", "minus_inf"])
def test_torch_top_k_draws_stay_inside_the_filtered_set(name):
    logits = rows_of(name, 12, 300, seed=3)
    t, p, lmp = params(12)
    inside = filtered_mask(logits, t, p, lmp, TOP_K)
    tk = nd.kth_logits(logits, TOP_K)
    for step in range(20):
        tokens = nd.nucleus_draw_torch(logits, t, p, lmp, keys_of(range(12), step), top_k_logit=tk)
        assert inside.gather(1, tokens.view(-1, 1)).all(), (name, step)
    one = logits[TOP_K == 1].float()  # top_k 1: the max (any token tied with it)
    assert (one.gather(1, tokens[TOP_K == 1].view(-1, 1)) == one.max(dim=-1, keepdim=True).values).all()


def test_kth_logits_is_the_kth_largest_with_nan_as_minus_inf():
    x = poisoned_rows()
    k = torch.tensor([3, 5, 4, 2, 6, 1, 3, 10])
    got = nd.kth_logits(x, k)
    x_ = x.nan_to_num(nan=NEG_INF, neginf=NEG_INF, posinf=float("inf"))
    want = x_.sort(dim=-1, descending=True).values.gather(1, (k - 1).view(-1, 1))
    assert torch.equal(got, want.view(-1))
    assert got[0].isfinite() and got[3] == NEG_INF and got[5] == 1.0  # torch.topk alone: NaN first
    bf = x.to(torch.bfloat16)
    assert torch.equal(nd.kth_logits(bf[[6, 0]], k[[6, 0]]), want.view(-1)[[6, 0]].bfloat16().float())
    off = nd.kth_logits(x, torch.tensor([0, 200, 201, -1, 1, 199, 0, 0]))  # on where 1 <= k < V
    assert (off[[0, 1, 2, 3, 6, 7]] == NEG_INF).all() and off[4] == x_[4].max() and off[5] == x_[5].min()


def test_torch_top_k_draws_follow_the_filtered_distribution():
    """4,000 draws per row (one key each) against softmax(z) over filtered_logits' kept set: top-k alone,
    with top_p, with min_p, with both."""
    logits = rows_of("normal", 5, 64, seed=5) * 0.5
    t = torch.tensor([1.0, 0.7, 1.0, 1.5, 0.9])
    p = torch.tensor([1.0, 0.8, 1.0, 0.9, 0.6])
    lmp = torch.tensor([NEG_INF, NEG_INF, -1.5, -2.0, NEG_INF])
    k = torch.tensor([6, 20, 12, 9, 30])
    z = z_of(logits, t, lmp)
    want = z.masked_fill(~filtered_mask(logits, t, p, lmp, k), NEG_INF).softmax(dim=-1)
    n = 4000
    rows = torch.arange(5).repeat(n)  # [5n]: copy s of row r at s * 5 + r
    tk = nd.kth_logits(logits, k)[rows]
    tokens = nd.nucleus_draw_torch(
        logits[rows], t[rows], p[rows], lmp[rows], keys_of(range(5 * n)), top_k_logit=tk
    )
    counts = torch.zeros(5, 64).index_put_((rows, tokens), torch.ones(5 * n), accumulate=True)
    tv = 0.5 * (counts / n - want).abs().sum(dim=-1)
    assert (tv < 0.05).all(), tv
    assert ((counts > 0).sum(dim=-1) <= (want > 0).sum(dim=-1)).all()


def test_top_k_keeps_every_token_tied_with_the_kth():
    """Ten tokens tied at the top and top_k 3: all ten are kept (the threshold path's tie rule)."""
    x = torch.zeros(1, 64)
    x[0, 10:20] = 2.0
    x[0, 30] = 1.9
    k = torch.tensor([3])
    assert filtered_mask(x, torch.ones(1), torch.ones(1), torch.full((1,), NEG_INF), k).sum() == 10
    rows = torch.zeros(600, dtype=torch.int64)
    tk = nd.kth_logits(x, k)[rows]
    one, off = torch.ones(600), torch.full((600,), NEG_INF)
    tokens = nd.nucleus_draw_torch(x[rows], one, one, off, keys_of(range(600)), top_k_logit=tk)
    assert set(tokens.tolist()) == set(range(10, 20))


def test_top_k_at_or_above_the_vocabulary_is_off():
    """A top-k floor at the row's smallest logit (what k = V would mean) keeps every token, and
    nucleus_draw takes k = 0 and k >= V as off: the draws are those without a top-k column."""
    logits = rows_of("normal", 6, 50, seed=9)
    t, p, lmp = params(6)
    smallest = logits.min(dim=-1).values
    for step in range(5):
        keys = keys_of(range(6), step)
        want = nd.nucleus_draw_torch(logits, t, p, lmp, keys)
        assert torch.equal(nd.nucleus_draw_torch(logits, t, p, lmp, keys, top_k_logit=smallest), want)
        assert torch.equal(
            nd.nucleus_draw_torch(logits, t, p, lmp, keys, top_k_logit=torch.full((6,), NEG_INF)), want
        )
        params_, keys_, steps = packed(t, p, lmp, keys, "cpu")
        k = torch.tensor([[0.0], [50.0], [51.0], [1e6], [0.0], [50.0]])
        assert torch.equal(
            nd.nucleus_draw(logits, torch.arange(6), torch.cat([params_, k], 1), keys_, steps), want
        )


def packed(t, p, lmp, keys, device):
    """nucleus_draw's per-row inputs: params [W, 3], keys [W], steps [W] (-1: the keys are the race keys)."""
    params = torch.stack([t.float(), p.float(), lmp.float()], dim=1).to(device)
    return params, keys.to(device), torch.full_like(keys, -1).to(device)


def run_kernel(logits, t, p, lmp, keys, k=None, **kw):
    """The kernel's draws (params [W, 4] with k, the top-k column; [W, 3] without)."""
    d = logits.device
    rows = torch.arange(logits.shape[0], dtype=torch.int64, device=d)
    params_, keys_, steps = packed(t, p, lmp, keys, d)
    if k is not None:
        params_ = torch.cat([params_, k.float().view(-1, 1).to(d)], dim=1)
    return nd.nucleus_draw_triton(logits, rows, params_, keys_, steps, **kw).cpu()


def test_seeded_keys_mix_the_step_as_row_key_does():
    seeds, steps = [0, 1, 2**63 + 5, 12345], [0, 7, 3, 1000]
    base = torch.tensor([rd.to_int64(rd.mix64(s)) for s in seeds])
    got = nd.step_keys(base, torch.tensor(steps))
    want = torch.tensor([rd.to_int64(rd.row_key(s, n)) for s, n in zip(seeds, steps, strict=True)])
    assert torch.equal(got, want)
    assert torch.equal(nd.step_keys(base, torch.full((4,), -1)), base)


def assert_same_draws(logits, t, p, lmp, keys, got, rounds=nd.ROUNDS, min_equal=0.9, k=None):
    """The kernel's tokens: always inside the nucleus (with top-k k: filtered_logits' kept set), and the
    torch path's token on most rows (they part only where fp32 summation order moves a token across the
    nucleus' edge)."""
    x = logits.cpu()
    tk = None if k is None else nd.kth_logits(x, k)
    want = nd.nucleus_draw_torch(x, t, p, lmp, keys, rounds, top_k_logit=tk)
    inside = nucleus_mask(x, t, p, lmp) if k is None else filtered_mask(x, t, p, lmp, k)
    assert inside.gather(1, got.view(-1, 1)).all()
    assert (got == want).float().mean() >= min_equal, (got, want)
    return want


@needs_interpreter
@pytest.mark.parametrize(
    ("name", "rounds"), [("normal", 32), ("bf16_ties", 32), ("minus_inf", 32), ("flat", 0)]
)
def test_kernel_matches_torch_in_the_interpreter(name, rounds):
    logits = rows_of(name, 12, 300, seed=7)
    t, p, lmp = params(12)
    if rounds == 0:
        p = torch.full((12,), 0.02)
    keys = keys_of(range(12), 2)
    got = run_kernel(logits, t, p, lmp, keys, rounds=rounds, block=64, warps=1)
    assert_same_draws(logits, t, p, lmp, keys, got, rounds)


@needs_interpreter
def test_kernel_mixes_seeded_keys_like_torch_in_the_interpreter():
    logits = rows_of("normal", 6, 200, seed=8)
    t, p, lmp = params(6)
    base = torch.tensor([rd.to_int64(rd.mix64(s)) for s in range(6)])
    steps = torch.tensor([0, 3, -1, 9, 1, -1])
    params_, _, _ = packed(t, p, lmp, base, "cpu")
    got = nd.nucleus_draw_triton(logits, torch.arange(6), params_, base, steps, block=64, warps=1)
    want = nd.nucleus_draw_torch(logits, t, p, lmp, nd.step_keys(base, steps))
    assert (got == want).float().mean() >= 0.8, (got, want)


# poisoned_rows' temperatures and log(min_p) (the last row drops tokens under e^-2 of its top's probability)
POISONED_T = torch.tensor([0.8, 1.0, 0.8, 0.8, 0.8, 0.7, 1.2, 0.5])
POISONED_LOG_MIN_P = torch.tensor([NEG_INF] * 7 + [-2.0])


def poisoned_rows(vocab: int = 200) -> torch.Tensor:
    """[8, vocab]: NaN and +-inf scattered in finite rows, and rows with no distribution."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(8, vocab, generator=g) * 3
    x[0, ::7] = float("nan")
    x[1, ::3] = NEG_INF
    x[2] = NEG_INF  # nothing finite: token 0, as torch's argmax
    x[3] = float("nan")
    x[4, 17] = float("inf")  # overflow: the argmax
    x[5, 1::2] = float("nan")
    x[5, ::2] = NEG_INF
    x[5, 10] = 1.0  # one finite token
    x[6, 5:] = x[6, :5].max() - 40  # a peak of five tokens over a far tail
    return x


@needs_interpreter
def test_kernel_matches_torch_on_poisoned_rows_in_the_interpreter():
    x = poisoned_rows()
    t = POISONED_T
    p = torch.tensor([0.9, 0.5, 0.9, 1.0, 0.9, 0.1, 0.999, 0.8])
    lmp = POISONED_LOG_MIN_P
    for step in range(3):
        keys = keys_of(range(8), step)
        got = run_kernel(x, t, p, lmp, keys, block=64, warps=1)
        assert torch.equal(got, nd.nucleus_draw_torch(x, t, p, lmp, keys)), step
        assert got[2] == 0 and got[3] == 0 and got[4] == 17 and got[5] == 10
        assert not x[0, got[0]].isnan() and x[1, got[1]] > NEG_INF and got[6] < 5


@needs_interpreter
@pytest.mark.parametrize("name", ["normal", "bf16_ties", "few_values", "minus_inf"])
def test_kernel_top_k_rows_match_torch_in_the_interpreter(name):
    """Top-k rows (alone, with top_p, with min_p) mixed with top-p-only, greedy and seeded rows; the
    kth_logits column as the sampler fills it; bf16 ties and few_values put the k-th inside a tie group."""
    logits = rows_of(name, 12, 300, seed=7)
    t, p, lmp = params(12)
    t[4] = 0.0  # a greedy row with top_k 3
    base = keys_of(range(12), 2)
    steps = torch.tensor([-1, 4, -1, 0, -1, 7, -1, -1, 2, -1, 1, -1])  # seeded rows mix (key, step)
    params_ = torch.stack([t, p, lmp, TOP_K.float()], dim=1)
    got = nd.nucleus_draw_triton(logits, torch.arange(12), params_, base, steps, block=64, warps=1)
    keys = nd.step_keys(base, steps)
    want = assert_same_draws(logits, t, p, lmp, keys, got, k=TOP_K)
    top_k_only = (TOP_K > 0) & (TOP_K < 300) & (p >= 1)
    assert torch.equal(got[top_k_only], want[top_k_only])  # round 0 only: the race, exactly
    assert got[4] == logits[4].float().argmax()  # greedy
    assert logits[3, got[3]] == logits[3].max()  # top_k 1: the max (a token tied with it, for ties)
    # the rows without top-k draw exactly what the kernel draws without the column
    no_k = (TOP_K == 0) | (TOP_K >= 300)
    without = nd.nucleus_draw_triton(logits, torch.arange(12), params_[:, :3], base, steps, block=64, warps=1)
    assert torch.equal(got[no_k], without[no_k])


@needs_interpreter
def test_kernel_without_top_k_code_draws_as_with_it_in_the_interpreter():
    """The sampler's params always have the top-k column; top_k=False (no row has top-k) compiles the
    kernel without the lanes' top three and the select: the same draws, greedy rows included."""
    logits = rows_of("normal", 12, 300, seed=5)
    t, p, lmp = params(12)
    t[[2, 7]] = 0.0  # greedy rows: the kernel's argmax
    params_ = torch.stack([t, p, lmp, torch.zeros(12)], dim=1)
    base, steps = keys_of(range(12), 3), torch.full((12,), -1)
    rows = torch.arange(12)
    off = nd.nucleus_draw_triton(logits, rows, params_, base, steps, block=64, warps=1, top_k=False)
    on = nd.nucleus_draw_triton(logits, rows, params_, base, steps, block=64, warps=1, top_k=True)
    three = nd.nucleus_draw_triton(logits, rows, params_[:, :3], base, steps, block=64, warps=1)
    assert torch.equal(off, on) and torch.equal(off, three)
    assert off[2] == logits[2].argmax() and off[7] == logits[7].argmax()


@needs_interpreter
def test_kernel_keeps_every_token_tied_with_the_kth_in_the_interpreter():
    x = torch.zeros(1, 64)
    x[0, 10:20] = 2.0
    x[0, 30] = 1.9
    rows = torch.zeros(120, dtype=torch.int64)
    one, off = torch.ones(120), torch.full((120,), NEG_INF)
    got = run_kernel(x[rows], one, one, off, keys_of(range(120)), k=torch.full((120,), 3), block=64, warps=1)
    assert set(got.tolist()) == set(range(10, 20))


@needs_interpreter
def test_kernel_top_k_on_poisoned_rows_matches_torch_in_the_interpreter():
    x = poisoned_rows()
    t = POISONED_T
    p = torch.tensor([0.9, 1.0, 0.9, 1.0, 0.9, 0.1, 0.999, 0.8])
    lmp = POISONED_LOG_MIN_P
    k = torch.tensor([3, 5, 4, 2, 6, 3, 10, 4])
    tk = nd.kth_logits(x, k)
    inside = filtered_mask(x, t, p, lmp, k)
    for step in range(3):
        keys = keys_of(range(8), step)
        got = run_kernel(x, t, p, lmp, keys, k=k, block=64, warps=1)
        assert torch.equal(got, nd.nucleus_draw_torch(x, t, p, lmp, keys, top_k_logit=tk)), step
        assert got[2] == 0 and got[3] == 0 and got[4] == 17 and got[5] == 10
        assert not x[0, got[0]].isnan() and x[1, got[1]] > NEG_INF and got[6] < 5
        ok = torch.tensor([0, 1, 6, 7])  # the rows with a distribution
        assert inside[ok].gather(1, got[ok].view(-1, 1)).all()


@needs_interpreter
def test_kernel_round_zero_is_the_race_kernel_in_the_interpreter():
    """A row without top_p: nucleus_draw's kernel draws the race kernel's token from filtered_logits' z."""
    logits = rows_of("normal", 6, 300, seed=4)
    t = torch.tensor([0.8, 0.3, 1.0, 1.7, 0.8, 0.05])
    lmp = torch.tensor([NEG_INF] * 4 + [-2.0, NEG_INF])
    keys = keys_of(range(6), 6)
    got = run_kernel(logits, t, torch.ones(6), lmp, keys, block=64, warps=1)
    z, _, _, _ = filtered_logits(logits, temperature=t, top_k=None, top_p=None, min_p=lmp.exp())
    assert torch.equal(got, rd.race_draw_triton(z, None, keys, block=64, warps=1))


@needs_interpreter
def test_kernel_draws_follow_the_nucleus_distribution_in_the_interpreter():
    """2,000 kernel draws per row (one launch, a key per copy) against softmax(z) over the nucleus."""
    logits = rows_of("normal", 3, 32, seed=6) * 0.5
    t = torch.tensor([1.0, 0.7, 1.5])
    p = torch.tensor([0.9, 0.5, 0.3])
    lmp = torch.full((3,), NEG_INF)
    z = z_of(logits, t, lmp)
    want = z.masked_fill(~nucleus_mask(logits, t, p, lmp), NEG_INF).softmax(dim=-1)
    n = 2000
    rows = torch.arange(3).repeat(n)  # [3n]: copy k of row r at k * 3 + r
    keys = keys_of(range(3 * n), 1)
    params, _, steps = packed(t[rows], p[rows], lmp[rows], keys, "cpu")
    # nucleus_draw, not nucleus_draw_triton: 6,000 programs take minutes in the interpreter, so on the
    # CPU this is the torch twin's distribution (the kernel == torch tests cover the kernel here)
    tokens = nd.nucleus_draw(logits, rows, params, keys, steps, block=32, warps=1)
    counts = torch.zeros(3, 32).index_put_((rows, tokens), torch.ones(3 * n), accumulate=True)
    tv = 0.5 * (counts / n - want).abs().sum(dim=-1)
    assert (tv < 0.06).all(), tv


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("scale", [3.0, 0.05])
def test_cuda_kernel_matches_torch_on_the_served_shape(scale):
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(48, 151936, generator=g) * scale).to(torch.bfloat16)
    t = torch.full((48,), 0.8)
    p = torch.tensor([0.95, 0.9, 1.0, 0.5] * 12)
    lmp = torch.full((48,), NEG_INF)
    keys = keys_of(range(48), 9)
    got = run_kernel(logits.cuda(), t, p, lmp, keys)
    assert_same_draws(logits, t, p, lmp, keys, got)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("scale", [3.0, 0.05])
def test_cuda_kernel_top_k_rows_match_torch_on_the_served_shape(scale):
    """256 rows x 151936 bf16, as a served decode step sends them (Qwen's top_k 20 + top_p 0.8, top_k 50
    alone, + min_p, top_p only, a wide k, k 1): the draws stay inside filtered_logits' kept set and
    match the torch path's (test_kth_select checks the select's values on this shape)."""
    g = torch.Generator().manual_seed(13)
    logits = (torch.randn(256, 151936, generator=g) * scale).to(torch.bfloat16)
    t = torch.tensor([0.7, 0.8, 1.0, 0.8] * 64)
    p = torch.tensor([0.8, 1.0, 0.95, 0.9] * 64)
    lmp = torch.tensor([NEG_INF, NEG_INF, -3.0, NEG_INF] * 64)
    k = torch.tensor([20, 50, 40, 0] * 63 + [20, 5000, 1, 0])
    keys = keys_of(range(256), 9)
    got = run_kernel(logits.cuda(), t, p, lmp, keys, k=k)
    assert_same_draws(logits, t, p, lmp, keys, got, k=k)


@pytest.mark.cuda
@needs_cuda
def test_cuda_kernel_replays_in_a_graph():
    """Captured once, replayed with new logits written into the same buffer: the torch path's tokens."""
    logits = torch.empty(16, 4096, device="cuda", dtype=torch.bfloat16).fill_(float("nan"))
    t, p, lmp = torch.full((16,), 0.9), torch.full((16,), 0.9), torch.full((16,), NEG_INF)
    keys = keys_of(range(16), 1)
    d = packed(t, p, lmp, keys, "cuda")
    rows = torch.arange(16, device="cuda")
    nd.nucleus_draw(logits, rows, *d)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nd.nucleus_draw(logits, rows, *d)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(16, 4096, generator=g) * 3).to(torch.bfloat16)
        logits.copy_(x)
        out.fill_(-1)
        graph.replay()
        assert_same_draws(x, t, p, lmp, keys, out.cpu())
