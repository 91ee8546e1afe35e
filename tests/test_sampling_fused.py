"""The fused sampling kernel (engine/sample/fused_draw.py) against independent torch references: the
thresholds against a full sort with the tie rule (every token tied with the cut stays), the draw
against race_draw_torch with that threshold. CPU: Triton's interpreter on small shapes (small CAP and
few pivots, so the ladders, the compaction and the whole-row fallback all run); `cuda`: the served
shape, bf16 logits.
"""

from __future__ import annotations

import os

import pytest
import torch
from graphcache.engine.sample import fused_draw as fd
from graphcache.engine.sample import race_draw as rd

NEG_INF = float("-inf")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
needs_interpreter = pytest.mark.skipif(
    not (INTERPRET and fd.HAVE_TRITON), reason="needs triton's interpreter"
)
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and fd.HAVE_TRITON), reason="needs CUDA and triton"
)


def keys_of(seeds, step=0) -> torch.Tensor:
    return torch.tensor([rd.to_int64(rd.row_key(s, step)) for s in seeds], dtype=torch.int64)


def sort_threshold(z: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """thr [R] by sorting each row (independent of the kernels): the k-th largest value, then the top-p
    cut over the tokens >= it, both keeping every token tied with the cut; in float64 sums."""
    rows, vocab = z.shape
    out = torch.empty(rows)
    for r in range(rows):
        vals = z[r].double().sort(descending=True).values
        finite = vals[vals > NEG_INF]
        thr_k = NEG_INF
        if int(k[r]) < vocab and int(k[r]) <= finite.numel():
            thr_k = float(vals[int(k[r]) - 1])
        thr = thr_k
        if float(p[r]) < 1:
            kept = finite[finite >= thr_k]
            w = kept.exp()
            cum = w.cumsum(0)
            target = float(p[r]) * float(cum[-1])
            # the first position whose mass reaches the target, widened to its tie group
            j = int((cum < target).sum().clamp(max=kept.numel() - 1))
            thr = max(thr, float(kept[j]))
        out[r] = thr
    return out


def z_of(logits: torch.Tensor, t: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    x = logits.float().nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    z = (x - x.max(dim=-1, keepdim=True).values) / t.view(-1, 1)
    return z.masked_fill(z < log_min_p.view(-1, 1), NEG_INF)


def mass_of(z: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """Each row's probability mass kept by z >= thr (softmax over the whole row)."""
    return (z.softmax(dim=-1) * (z >= thr.view(-1, 1))).sum(dim=-1)


def rows_of(name: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if name == "normal":
        return torch.randn(rows, vocab, generator=g) * 3
    if name == "flat":
        return torch.randn(rows, vocab, generator=g) * 0.05
    if name == "peaked":
        return torch.randn(rows, vocab, generator=g) * 8
    if name == "bf16_ties":  # bf16 logits tie by the hundred at this vocabulary
        return (torch.randn(rows, vocab, generator=g) * 2 + 1).to(torch.bfloat16)
    if name == "few_values":  # five distinct values: every cut is inside a tie group
        return torch.randint(-2, 3, (rows, vocab), generator=g).float() + 0.5
    if name == "minus_inf":
        x = torch.randn(rows, vocab, generator=g) * 3
        x[torch.rand(rows, vocab, generator=g) < 0.6] = NEG_INF
        x[0, 1:] = NEG_INF
        x[0, 0] = 2.5
        return x
    raise KeyError(name)


def params(rows: int, vocab: int):
    k = torch.tensor([vocab, 1, 5, 40, vocab, 17, 3, vocab, 100, vocab, 60, 2])[:rows]
    p = torch.tensor([0.9, 1.0, 1.0, 0.95, 0.0, 0.8, 0.999, 1.0, 0.5, 0.7, 1.0, 0.3])[:rows]
    t = torch.tensor([0.8, 1.0, 0.5, 1.3, 0.8, 0.7, 1.0, 0.9, 2.0, 0.6, 1.0, 0.8])[:rows]
    lmp = torch.tensor([NEG_INF] * 9 + [-3.0, -1.0, NEG_INF])[:rows]
    return k, p, t, lmp


def run_fused(logits, k, p, t, lmp, keys, **kw):
    rows = torch.arange(logits.shape[0], dtype=torch.int64, device=logits.device)
    d = logits.device
    return fd.fused_draw(logits, rows, t.to(d), k.to(d), p.to(d), lmp.to(d), keys.to(d), **kw)


def check(logits, k, p, t, lmp, keys, tokens, thr, mass_tol=1e-5):
    """Thresholds: the sort's kept mass to fp32 noise on every row, the same value on most; tokens: the
    torch race with the kernel's threshold (up to an fp32-ulp near tie), always a kept token."""
    z = z_of(logits.cpu(), t, lmp)
    thr, tokens = thr.cpu(), tokens.cpu()
    want = sort_threshold(z, k, p)
    assert ((mass_of(z, thr) - mass_of(z, want)).abs() <= mass_tol).all(), (thr, want)
    assert (thr == want).float().mean() >= 0.9, (thr, want)
    valid = torch.isfinite(z.amax(dim=-1))
    assert (z.gather(1, tokens.view(-1, 1)).view(-1) >= thr)[valid].all()
    race = rd.race_draw_torch(z, thr, keys)
    scores = z - rd.uniforms(keys, z.shape[-1]).log().neg().log()
    for r in (tokens != race).nonzero().view(-1).tolist():
        a, b = scores[r, tokens[r]].item(), scores[r, race[r]].item()
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (r, a, b)


# cap 32 with 4 pivots: flat rows need several ladders; cap 8 and 2 rounds: some rows fall back to the
# whole-row bisection (31 passes: slow in the interpreter, so on two shapes only)
@needs_interpreter
@pytest.mark.parametrize(
    ("name", "seed", "cap", "rounds"),
    [
        ("normal", 0, 32, 8),
        ("normal", 1, 32, 8),
        ("flat", 0, 32, 8),
        ("peaked", 0, 32, 8),
        ("bf16_ties", 0, 32, 8),
        ("bf16_ties", 1, 32, 8),
        ("few_values", 0, 32, 8),
        ("minus_inf", 0, 32, 8),
        ("flat", 1, 8, 2),
        ("bf16_ties", 2, 8, 2),
    ],
)
def test_fused_matches_the_sort_and_the_race_in_the_interpreter(name, seed, cap, rounds):
    logits = rows_of(name, 12, 200, seed)
    k, p, t, lmp = params(12, 200)
    keys = keys_of(range(seed, seed + 12), step=3)
    tokens, thr = run_fused(logits, k, p, t, lmp, keys, cap=cap, pivots=4, rounds=rounds, block=64, lblock=32)
    check(logits, k, p, t, lmp, keys, tokens, thr)


@needs_interpreter
def test_fused_degenerate_rows_take_the_argmax():
    logits = torch.randn(4, 50) * 2
    logits[0] = NEG_INF  # no finite logit: argmax (0)
    logits[1, 7] = float("inf")  # +inf: argmax
    logits[2, ::3] = float("nan")  # NaN tokens are never drawn
    logits[3, 1:] = NEG_INF  # one finite token
    k, p, t, lmp = (
        torch.full((4,), 50),
        torch.full((4,), 0.9),
        torch.full((4,), 0.8),
        torch.full((4,), NEG_INF),
    )
    tokens, _ = run_fused(logits, k, p, t, lmp, keys_of(range(4)), cap=16, pivots=4, block=16)
    assert tokens[0] == 0 and tokens[1] == 7 and tokens[3] == 0
    assert tokens[2] % 3 != 0


@needs_interpreter
def test_fused_rows_indirection_and_batch_independence():
    """A row's token depends on its own logits, parameters and key only: alone or among others, by index."""
    logits = rows_of("normal", 12, 200, 4)
    k, p, t, lmp = params(12, 200)
    keys = keys_of(range(12), step=9)
    kw = dict(cap=32, pivots=4, block=64, lblock=32)
    all_tokens, _ = run_fused(logits, k, p, t, lmp, keys, **kw)
    pick = torch.tensor([7, 3], dtype=torch.int64)
    sub, _ = fd.fused_draw(logits, pick, t[pick], k[pick], p[pick], lmp[pick], keys[pick], **kw)
    assert sub.tolist() == all_tokens[pick].tolist()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("scale", [3.0, 0.3])
def test_cuda_fused_matches_the_sort_and_the_race(scale):
    g = torch.Generator().manual_seed(11)
    rows, vocab = 24, 151_936
    logits = (torch.randn(rows, vocab, generator=g) * scale).to(torch.bfloat16).cuda()
    k = torch.tensor([vocab, 50, 1, 2000, vocab, 5000, vocab, 20] * 3)
    p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.999, 0.9, 0.0, 0.8] * 3)
    t = torch.tensor([0.8, 1.0, 0.7, 1.2, 0.8, 0.6, 1.0, 0.9] * 3)
    lmp = torch.tensor([NEG_INF] * 7 + [-2.0]).repeat(3)
    keys = keys_of(range(rows), step=2)
    tokens, thr = run_fused(logits, k, p, t, lmp, keys)
    check(logits, k, p, t, lmp, keys, tokens, thr, mass_tol=2e-4)


@needs_interpreter
def test_static_draw_params_write_then_draw():
    """The graph-capturable form: parameters written into static buffers, the kernel launched on them;
    rows past the batch and greedy rows take the argmax; a second write changes the draw."""
    logits = rows_of("normal", 8, 120, 5)
    params_ = fd.DrawParams(capacity=8, device=logits.device, cap=32)
    k, p, t, lmp = params(6, 120)
    t = t.clone()
    t[1] = 0.0  # a greedy row among random ones
    keys = keys_of(range(6), step=1)
    params_.write(torch.stack([t, p, lmp]), torch.stack([k, keys]))
    first = params_.draw(logits).clone()
    want, _ = run_fused(logits[:6], k, p, t, lmp, keys, cap=32)
    assert first[:6].tolist() == want.tolist()
    assert first[1] == logits[1].argmax() and first[6:].tolist() == logits[6:].argmax(dim=-1).tolist()
    keys2 = keys_of(range(6), step=2)
    params_.write(torch.stack([t, p, lmp]), torch.stack([k, keys2]))
    want2, _ = run_fused(logits[:6], k, p, t, lmp, keys2, cap=32)
    assert params_.draw(logits)[:6].tolist() == want2.tolist()


@pytest.mark.cuda
@needs_cuda
def test_cuda_sampler_fused_matches_legacy():
    """Sampler(fused=True) against Sampler(fused=False) on the same keys: the same token on every row
    up to fp32 near ties in the race, for plain rows (drawn from the bf16 logits) and processed rows
    (penalties: drawn from the fp32 copy)."""
    from graphcache.engine.sample.sampler import Sampler
    from graphcache.engine.sequence import SamplingParams, Sequence

    g = torch.Generator().manual_seed(3)
    rows, vocab = 128, 151_936
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).cuda()
    kinds = [
        dict(temperature=0.8, top_p=0.95),
        dict(temperature=0.7, top_k=50),
        dict(temperature=1.0),
        dict(temperature=0.0),
        dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05),
    ]
    for extra in ({}, dict(frequency_penalty=0.4)):
        seqs = [
            Sequence(
                f"r{i}",
                [1, 2, 3],
                SamplingParams(**kinds[i % len(kinds)], **extra, seed=i if i % 3 == 0 else None),
            )
            for i in range(rows)
        ]
        for i, s in enumerate(seqs):
            s.output_token_ids.extend(range(i, i + 8))
        fused = Sampler(default_seed=1, fused=True).sample(logits, seqs)
        legacy = Sampler(default_seed=1, fused=False).sample(logits, seqs)
        assert sum(a != b for a, b in zip(fused, legacy, strict=True)) <= 3, (fused, legacy)


@pytest.mark.cuda
@needs_cuda
def test_cuda_draw_params_replay_in_a_graph():
    """DrawParams.draw captured in a CUDA graph, then written and replayed twice: each replay draws what
    the eager kernel draws with the parameters written before it."""
    g = torch.Generator().manual_seed(8)
    rows, vocab = 64, 151_936
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).cuda()
    dp = fd.DrawParams(capacity=rows, device=logits.device)
    k = torch.tensor([vocab, 50, vocab, 20] * 16)
    p = torch.tensor([0.95, 1.0, 1.0, 0.9] * 16)
    t = torch.tensor([0.8, 0.7, 0.0, 1.0] * 16)  # every fourth row greedy
    lmp = torch.full((rows,), NEG_INF)
    dp.write(torch.stack([t, p, lmp]), torch.stack([k, keys_of(range(rows))]))
    dp.draw(logits)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dp.draw(logits)
    for step in (1, 2):
        keys = keys_of(range(rows), step=step)
        dp.write(torch.stack([t, p, lmp]), torch.stack([k, keys]))
        graph.replay()
        want, _ = run_fused(logits, k, p, t, lmp, keys)
        assert dp.tokens.tolist() == want.tolist()
        assert dp.tokens[2::4].tolist() == logits[2::4].argmax(dim=-1).tolist()
