"""Sampler and stop rules: greedy, top-k/top-p filtering, seeded reproducibility, stop ids, stop strings."""

import torch
from graphcache.engine.sample.sampler import probs_from_logits
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.stopping import check_stop
from helpers_sampling import SequenceSampler as Sampler
from helpers_stopping import feed


def seq(rid="r", **params) -> Sequence:
    return Sequence(rid, [1, 2, 3], SamplingParams(**params))


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert Sampler().sample(logits, [seq(temperature=0), seq(temperature=0)]) == [1, 0]


def test_top_k_and_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = torch.ones(1)
    p = probs_from_logits(logits, temperature=one, top_k=torch.tensor([2]), top_p=one)
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = probs_from_logits(logits, temperature=one, top_k=torch.tensor([0]), top_p=torch.tensor([0.7]))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))  # 0.5 < 0.7, 0.8 >= 0.7: two survive
    p = probs_from_logits(logits, temperature=one, top_k=torch.tensor([0]), top_p=torch.tensor([0.1]))
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0]]))  # the top token always survives
    p = probs_from_logits(logits, temperature=one, top_k=torch.tensor([0]), top_p=one)
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def test_sampled_tokens_stay_inside_the_filter():
    torch.manual_seed(0)
    logits = torch.randn(1, 100).repeat(64, 1)
    allowed = set(logits[0].topk(3).indices.tolist())
    tokens = Sampler(default_seed=0).sample(logits, [seq(f"r{i}", top_k=3) for i in range(64)])
    assert set(tokens) <= allowed and len(set(tokens)) > 1


def test_seeded_sampling_reproducible_regardless_of_batch():
    torch.manual_seed(1)
    logits = torch.randn(8, 50)

    def draw(rows, n_steps=5):
        # A seeded row's draw is a function of (seed, tokens generated so far): append each token, as
        # the engine does (sampling the same step again gives the same token, see below).
        seqs = [seq(f"r{i}", temperature=1.0, seed=1234 if i == 0 else None) for i in range(len(rows))]
        sampler = Sampler()
        for _ in range(n_steps):
            for s, t in zip(seqs, sampler.sample(logits[rows], seqs), strict=True):
                s.output_token_ids.append(t)
        return seqs[0].output_token_ids

    alone = draw([3])
    assert draw([3, 0, 1, 2]) == alone
    assert draw([3, 7]) == alone
    assert len(set(alone)) > 1  # it is really sampling, not collapsing to argmax
    # No state between calls: the same step sampled again (a retried or recomputed step) is the same token.
    s = seq("again", temperature=1.0, seed=1234)
    assert len({Sampler().sample(logits[[3]], [s])[0] for _ in range(3)}) == 1
    assert Sampler().sample(logits[[3]], [s])[0] == alone[0]


def test_stop_token_ids_and_eos():
    s = seq(stop_token_ids=[9])
    s.output_token_ids.append(9)
    assert check_stop(s, 9, eos_token_ids={2}, max_model_len=100) == "stop"
    s = seq()
    s.output_token_ids.append(2)
    assert check_stop(s, 2, eos_token_ids={2}, max_model_len=100) == "stop"
    s = seq(ignore_eos=True, max_tokens=5)
    s.output_token_ids.append(2)
    assert check_stop(s, 2, eos_token_ids={2}, max_model_len=100) is None


def test_max_tokens_and_max_model_len():
    s = seq(max_tokens=2)
    s.output_token_ids += [5, 6]
    assert check_stop(s, 6, eos_token_ids=set(), max_model_len=100) == "length"
    s = seq(max_tokens=50)
    s.output_token_ids += [5, 6]
    assert check_stop(s, 6, eos_token_ids=set(), max_model_len=5) == "length"


def test_stop_string_is_cut_from_output_and_never_streamed():
    s = seq(stop=["cde"], max_tokens=50)
    streamed, reason = feed(s, [0, 1, 2, 3, 4, 5])  # a b c d e f
    assert reason == "stop" and streamed == "ab" and s.output_text == "ab"


def test_stop_string_prefix_held_back_then_released():
    s = seq(stop=["xyz"], max_tokens=6)
    streamed, reason = feed(s, [0, 23, 24, 1, 2, 3])  # a x y b c d: "xy" looked like a stop, was not
    assert reason == "length" and streamed == "axybcd"


def test_stop_string_across_tokens_and_first_of_many():
    s = seq(stop=["ww", "bc"], max_tokens=50)
    streamed, reason = feed(s, [0, 1, 2, 22, 22])
    assert reason == "stop" and streamed == "a"


def test_eos_flushes_held_text_and_adds_none():
    s = seq(stop=["xyz"], max_tokens=50)
    streamed, reason = feed(s, [0, 23, 25])  # a x <eos>
    assert reason == "stop" and streamed == "ax"


# --- parameters at the edge of float precision: never NaN, never a raise ------------------------


def assert_distribution(p: torch.Tensor) -> None:
    assert torch.isfinite(p).all() and (p >= 0).all(), p
    assert torch.allclose(p.sum(dim=-1), torch.ones(p.shape[0])), p.sum(dim=-1)


def test_tiny_top_p_keeps_the_top_token():
    # 1e-300 (and the denormal 5e-324) is > 0 as a Python float, 0.0 once in a float32 tensor.
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    one = torch.ones(4)
    for top_p in (1e-300, 5e-324, 1e-46, 0.0):
        p = probs_from_logits(
            logits, temperature=one, top_k=torch.zeros(4, dtype=torch.long), top_p=torch.tensor([top_p] * 4)
        )
        assert_distribution(p)
        assert torch.equal(p.argmax(dim=-1), logits.argmax(dim=-1)) and (p.max(dim=-1).values == 1).all()
    tokens = Sampler(default_seed=0).sample(logits, [seq(f"r{i}", top_p=1e-300) for i in range(4)])
    assert tokens == logits.argmax(dim=-1).tolist()
    tokens = Sampler().sample(logits, [seq(f"r{i}", top_p=5e-324, seed=i) for i in range(4)])  # seeded path
    assert tokens == logits.argmax(dim=-1).tolist()


def test_tiny_temperature_is_greedy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 30
    for t in (1e-300, 5e-324, 1e-9):
        tokens = Sampler(default_seed=0).sample(logits, [seq(f"r{i}", temperature=t) for i in range(3)])
        assert tokens == logits.argmax(dim=-1).tolist(), t
    # probs_from_logits itself: no overflow to inf (hence NaN) whatever T, even with huge logits.
    huge = torch.tensor([[3e38, 1e38, -3e38, 0.0]])
    for t in (1e-300, 1e-5, 1.0, 2.0):
        p = probs_from_logits(
            huge, temperature=torch.tensor([t]), top_k=torch.tensor([0]), top_p=torch.ones(1)
        )
        assert_distribution(p)
        assert p.argmax().item() == 0


def test_top_k_one_is_the_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    p = probs_from_logits(
        logits, temperature=torch.ones(8), top_k=torch.ones(8, dtype=torch.long), top_p=torch.ones(8)
    )
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(dim=-1), 100).float())
    tokens = Sampler(default_seed=0).sample(
        logits, [seq(f"r{i}", top_k=1, temperature=2.0) for i in range(8)]
    )
    assert tokens == logits.argmax(dim=-1).tolist()


def test_huge_top_k_is_off_and_does_not_overflow():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    tokens = Sampler(default_seed=0).sample(logits, [seq("a", top_k=10**30), seq("b", top_k=2**63)])
    assert all(0 <= t < 20 for t in tokens)


def test_rows_with_minus_inf_logits():
    inf = float("inf")
    logits = torch.tensor(
        [
            [-inf, 2.0, -inf, 1.0],  # masked tokens (e.g. a grammar or a banned-token bias)
            [-inf, -inf, -inf, -inf],  # nothing allowed: no distribution at all
            [0.5, -inf, inf, 0.0],  # +inf overflow
            [float("nan"), 1.0, 0.0, 3.0],  # NaN from a broken kernel
        ]
    )
    n = logits.shape[0]
    for top_p in (1.0, 0.5, 1e-300):
        for top_k in (0, 1, 3):
            p = probs_from_logits(
                logits,
                temperature=torch.full((n,), 0.7),
                top_k=torch.full((n,), top_k),
                top_p=torch.full((n,), top_p),
            )
            assert_distribution(p)
            assert p[0, 0] == 0 and p[0, 2] == 0 and p[0, 1] > 0  # a -inf token is never drawn
            assert p[2, 2] == 1 and p[3, 3] > 0 and p[3, 0] == 0
    seqs = [seq(f"r{i}", temperature=1.0, top_p=tp) for i, tp in enumerate((1.0, 0.9, 1e-300, 1.0))]
    for sampler in (Sampler(), Sampler(default_seed=0)):
        for _ in range(20):
            tokens = sampler.sample(logits, seqs)
            assert tokens[0] in (1, 3) and tokens[2] == 2 and tokens[3] != 0 and 0 <= tokens[1] < 4
    seeded = [seq(f"s{i}", seed=7) for i in range(n)]
    tokens = Sampler().sample(logits, seeded)
    assert tokens[0] in (1, 3) and tokens[2] == 2


def test_top_p_one_keeps_every_token():
    logits = torch.zeros(1, 1000)  # a uniform row: cumsum rounding must not cut the tail at top_p=1
    p = probs_from_logits(logits, temperature=torch.ones(1), top_k=torch.tensor([0]), top_p=torch.ones(1))
    assert (p > 0).all()


def test_unfiltered_rows_skip_the_sort_and_match_the_filtered_path():
    """top_k/top_p None (no row filters): the same distribution as top_k 0 / top_p 1, without sorting
    the vocabulary; rows with no finite logit are one-hot on their argmax either way."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=g) * 4
    logits[3] = float("-inf")
    logits[4, 7] = float("inf")
    t = torch.tensor([0.3, 1.0, 2.5, 1.0, 0.7])
    off = dict(top_k=torch.zeros(5, dtype=torch.long), top_p=torch.ones(5))
    for min_p in (None, torch.full((5,), 0.05)):
        fast = probs_from_logits(logits, temperature=t, top_k=None, top_p=None, min_p=min_p)
        slow = probs_from_logits(logits, temperature=t, min_p=min_p, **off)
        assert torch.allclose(fast, slow, atol=1e-6), (fast - slow).abs().max()
        assert torch.allclose(fast.sum(-1), torch.ones(5))
        assert fast[3].argmax() == logits[3].argmax() and fast[3].max() == 1


def test_top_k_rows_take_the_nucleus_sampler_and_match_the_threshold_path(monkeypatch):
    """A batch of top-k rows (alone, with top_p, with min_p, with a logits control, Qwen's top_k 20 +
    top_p 0.8) beside a top-p-only and a greedy row: nucleus_draw draws every random row, the top-k ones
    with k in params' 4th column (0 for the others), and each row's tokens follow the same
    distribution as the threshold path's (Sampler(nucleus=False)) and filtered_logits' softmax."""
    from graphcache.engine.sample import sampler as sampler_mod
    from graphcache.engine.sample.sampler import filtered_logits

    vocab, n = 48, 3000
    base = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4)) * 1.5
    kinds = [
        dict(temperature=1.0, top_k=5),
        dict(temperature=0.7, top_k=20, top_p=0.8),
        dict(temperature=1.2, top_k=12, min_p=0.1),
        dict(temperature=0.9, top_k=8, top_p=0.9, logit_bias={int(base.argmin()): 8.0}),  # processed
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=0.0),
    ]
    seqs = [seq(f"r{i}", **kinds[i % len(kinds)]) for i in range(n * len(kinds))]
    logits = base.repeat(len(seqs), 1)
    seen = []
    real = sampler_mod.nucleus_draw

    def spy(logits_, rows, params, keys, steps, **kw):
        seen.append(params.clone())
        return real(logits_, rows, params, keys, steps, **kw)

    monkeypatch.setattr(sampler_mod, "nucleus_draw", spy)
    got = torch.tensor(Sampler(default_seed=0).sample(logits, seqs)).view(n, len(kinds))
    (params,) = seen  # one launch: controls or not, top-k or not
    assert params.shape == (len(seqs) - n, 4)  # every random row, a top-k column
    k = params[:, 3].view(n, len(kinds) - 1)  # k itself: the kernel finds the k-th largest logit
    assert (k == torch.tensor([5.0, 20.0, 12.0, 8.0, 0.0])).all()
    monkeypatch.undo()
    ref = torch.tensor(Sampler(default_seed=1, nucleus=False).sample(logits, seqs)).view(n, len(kinds))
    assert (got[:, 5] == base.argmax()).all() and (ref[:, 5] == base.argmax()).all()
    for j, kind in enumerate(kinds[:5]):
        x = base.clone()
        for token, bias in kind.get("logit_bias", {}).items():
            x[0, token] += bias
        z, thr, _, _ = filtered_logits(
            x,
            temperature=torch.tensor([kind["temperature"]]),
            top_k=torch.tensor([kind.get("top_k", 0)]),
            top_p=torch.tensor([kind.get("top_p", 1.0)]),
            min_p=torch.tensor([kind.get("min_p", 0.0)]),
        )
        want = z.masked_fill(z < thr.view(-1, 1), float("-inf")).softmax(dim=-1)[0]
        for tokens in (got[:, j], ref[:, j]):
            freq = torch.bincount(tokens, minlength=vocab) / n
            assert (freq[want == 0] == 0).all(), (j, kind)  # never outside the kept set
            assert 0.5 * (freq - want).abs().sum() < 0.06, (j, kind)
