"""rejection_sample (engine/spec/rejection.py): speculative sampling keeps the target's tokens.

(a) greedy rows emit exactly what plain greedy decoding emits, in a decode loop with the n-gram proposer;
(b) sampled rows: the emitted tokens are distributed as the target's, for drawn drafts (full q) and for
    host drafts (one-hot q), by a total-variation bound (TV_BOUND below);
(c) seeded rows repeat run to run and do not depend on the rows beside them;
(d) rows without drafts are plain sampling (the bonus row's distribution, or the sampler's own bonus).

TV_BOUND, for N draws of a distribution over V tokens: E[TV(empirical, p)] <= 1/2 sum_i sqrt(p_i / N)
<= 1/2 sqrt(V / N) (Cauchy-Schwarz), and one draw moves TV by at most 1/N, so by McDiarmid
P(TV >= E[TV] + t) <= exp(-2 N t^2); t = sqrt(ln(1e6) / (2N)) makes a false failure a one-in-a-million
event. The draws are seeded, so each run is the same run; the bound says why its threshold is not
tuned to it. At N = 40,000 and V = 12 it is 0.0087 + 0.0131 = 0.022, against a TV of 0.3 or more between
each target and its draft distribution (checked): a sampler that kept the drafts would fail by far.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.spec.ngram import NgramProposer
from graphcache.engine.spec.rejection import PLACEHOLDER, rejection_sample, uniforms

V, K, N = 12, 3, 40_000


def tv_bound(n: int, v: int = V) -> float:
    return 0.5 * math.sqrt(v / n) + math.sqrt(math.log(1e6) / (2 * n))


def tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    empirical = torch.bincount(samples, minlength=p.numel()).double() / samples.numel()
    return 0.5 * (empirical - p.double()).abs().sum().item()


def random_dist(g: torch.Generator, zeros: int = 0) -> torch.Tensor:
    """[V]: a random distribution; `zeros` of its tokens have probability 0 (a top-k / top-p cut)."""
    w = torch.rand(V, generator=g) ** 3
    w[torch.randperm(V, generator=g)[:zeros]] = 0
    return w / w.sum()


def pack(target: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """target [K + 1, V] (the same rows for every request) -> packed [sum(n + 1), V]."""
    index = torch.cat([torch.arange(int(m) + 1) for m in n])
    return target[index]


@pytest.mark.parametrize("full_q", [True, False], ids=["drawn drafts", "host drafts (one-hot q)"])
def test_sampled_rows_keep_the_targets_distribution(full_q):
    g = torch.Generator().manual_seed(1 if full_q else 2)
    target = torch.stack([random_dist(g, zeros=3) for _ in range(K + 1)])  # [K + 1, V]: p_0 .. p_K
    q = torch.stack([random_dist(g) for _ in range(K)])  # [K, V]: the drafts' distributions
    for j in range(K):
        assert 0.5 * (target[j] - q[j]).abs().sum() > 0.3  # the test has power: q is far from p
    n = torch.randint(0, K + 1, (N,), generator=g)  # [N]: every row's draft count, 0 .. K mixed
    # Drafts drawn from q. Full q: as a draft model samples. One-hot: a host proposer's drafts are fixed
    # tokens (here q's draws, not uniform: a wrong residual would cancel out over uniform drafts), some
    # of them tokens the target gives probability 0.
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], 1)
    draft_probs = q.expand(N, K, V) if full_q else None
    u_accept, u_draw = torch.rand(N, K, generator=g), torch.rand(N, generator=g)
    out = rejection_sample(
        draft_token_ids=drafts,
        num_draft_tokens=n,
        greedy=torch.zeros(N, dtype=torch.bool),
        target_probs=pack(target, n),
        draft_probs=draft_probs,
        accept_uniforms=u_accept,
        draw_uniforms=u_draw,
    )
    first = out.token_ids[:, 0]
    assert tv(first, target[0]) < tv_bound(N)
    for m in range(K + 1):  # whatever the number of drafts
        rows = n == m
        assert tv(first[rows], target[0]) < tv_bound(int(rows.sum()))
    second_rows = out.num_accepted >= 1  # the first draft accepted: the next token is p_1's
    assert tv(out.token_ids[second_rows, 1], target[1]) < tv_bound(int(second_rows.sum()))
    assert target[0][first].min() > 0  # never a token the target rules out
    # acceptance of the first draft: sum_x min(p, q) (full q); E_q p(d) (one-hot: p(d) for each draft d)
    has_draft = n >= 1
    accepted = (out.num_accepted[has_draft] >= 1).double().mean().item()
    expected = torch.minimum(target[0], q[0]).sum() if full_q else (q[0] * target[0]).sum()
    assert abs(accepted - expected.item()) < tv_bound(int(has_draft.sum()))


def test_rows_without_drafts_are_plain_sampling():
    g = torch.Generator().manual_seed(3)
    p = random_dist(g, zeros=4)
    out = rejection_sample(
        draft_token_ids=torch.zeros(N, 0, dtype=torch.int64),
        num_draft_tokens=torch.zeros(N, dtype=torch.int64),
        greedy=torch.zeros(N, dtype=torch.bool),
        target_probs=p.expand(N, V),
        accept_uniforms=torch.rand(N, 0, generator=g),
        draw_uniforms=torch.rand(N, generator=g),
    )
    assert out.token_ids.shape == (N, 1) and int(out.num_accepted.sum()) == 0
    assert tv(out.token_ids[:, 0], p) < tv_bound(N)
    # with the plain sampler's own bonus, a row without drafts (or with every draft accepted) emits it
    bonus = torch.tensor([5, 7, 9])
    probs = torch.eye(V)[[3, 3, 6, 4, 6, 2]]  # packed rows: r0 (p_0, bonus), r1 (bonus), r2 (p_0, p_1, bonus)
    out = rejection_sample(
        draft_token_ids=torch.tensor([[3, 0], [0, 0], [4, 6]]),
        num_draft_tokens=torch.tensor([1, 0, 2]),
        greedy=torch.tensor([False, False, False]),
        target_probs=probs,
        accept_uniforms=torch.full((3, 2), 0.5),
        draw_uniforms=torch.full((3,), 0.5),
        bonus_token_ids=bonus,
    )
    assert out.token_ids.tolist() == [[3, 5, PLACEHOLDER], [7, PLACEHOLDER, PLACEHOLDER], [4, 6, 9]]


def test_greedy_rows_accept_the_argmax_prefix_and_emit_the_argmax():
    g = torch.Generator().manual_seed(4)
    B = 64
    n = torch.randint(0, K + 1, (B,), generator=g)
    logits = torch.randn(int((n + 1).sum()), V, generator=g)
    argmax = logits.argmax(-1)
    start = torch.cumsum(n + 1, 0) - (n + 1)
    agree = torch.randint(0, K + 1, (B,), generator=g)  # drafts equal the argmax for this many positions
    drafts = torch.zeros(B, K, dtype=torch.int64)
    for b in range(B):
        for j in range(int(n[b])):
            top = int(argmax[start[b] + j])
            drafts[b, j] = top if j < agree[b] else (top + 1) % V
    greedy = torch.ones(B, dtype=torch.bool)
    out = rejection_sample(draft_token_ids=drafts, num_draft_tokens=n, greedy=greedy, target_argmax=argmax)
    for b in range(B):
        m = min(int(agree[b]), int(n[b]))
        assert int(out.num_accepted[b]) == m
        expected = argmax[start[b] : start[b] + m + 1].tolist() + [PLACEHOLDER] * (K - m)
        assert out.token_ids[b].tolist() == expected
    # with probabilities too (sampled rows beside them), greedy rows take target_argmax, not the probs
    mixed = rejection_sample(
        draft_token_ids=drafts,
        num_draft_tokens=n,
        greedy=torch.ones(B, dtype=torch.bool),
        target_probs=torch.softmax(logits, -1),
        target_argmax=argmax,
        accept_uniforms=torch.rand(B, K, generator=g),
        draw_uniforms=torch.rand(B, generator=g),
    )
    assert torch.equal(mixed.token_ids, out.token_ids)


def test_a_draft_its_proposer_could_not_draw_is_rejected():
    p = torch.eye(V)[[2, 5]]  # the target is sure of 2, then 5
    q = torch.zeros(1, 1, V)
    q[0, 0, 7] = 1.0  # q(2) = 0: a draft of 2 did not come from q
    out = rejection_sample(
        draft_token_ids=torch.tensor([[2]]),
        num_draft_tokens=torch.tensor([1]),
        greedy=torch.tensor([False]),
        target_probs=p,
        draft_probs=q,
        accept_uniforms=torch.zeros(1, 1),
        draw_uniforms=torch.tensor([0.3]),
    )
    assert out.num_accepted.tolist() == [0] and out.token_ids.tolist() == [[2, PLACEHOLDER]]  # the residual
    # a host draft the target rules out is never accepted, even by a uniform of exactly 0
    out = rejection_sample(
        draft_token_ids=torch.tensor([[7]]),
        num_draft_tokens=torch.tensor([1]),
        greedy=torch.tensor([False]),
        target_probs=p,
        accept_uniforms=torch.zeros(1, 1),
        draw_uniforms=torch.tensor([0.0]),
    )
    assert out.num_accepted.tolist() == [0] and out.token_ids.tolist() == [[2, PLACEHOLDER]]


# --------------------------------------------------------------------------- a decode loop on a toy target


class ToyTarget:
    """A deterministic 'model': the logits after a context are a fixed random row chosen by its last two
    tokens, so greedy decoding falls into loops the n-gram proposer can predict."""

    def __init__(self, vocab: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.table = torch.randn(vocab * vocab, vocab, generator=g) * 2

    def logits(self, context: list[int]) -> torch.Tensor:
        return self.table[context[-2] * self.vocab + context[-1]]


def plain_decode(
    model: ToyTarget, prompt: list[int], steps: int, generator: torch.Generator | None
) -> list[int]:
    out = list(prompt)
    for _ in range(steps):
        logits = model.logits(out)
        if generator is None:
            out.append(int(logits.argmax()))
        else:
            out.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
    return out[len(prompt) :]


def spec_decode(
    model: ToyTarget, prompts: list[list[int]], steps: int, seeds: list[int | None] | None = None, k: int = 4
) -> tuple[list[list[int]], int]:
    """Every request decodes `steps` tokens with n-gram drafts verified by rejection_sample, all requests
    in one batch per step. seeds None: greedy. -> (outputs, drafts accepted in all)."""
    seqs = [Sequence(f"r{i}", list(p), SamplingParams()) for i, p in enumerate(prompts)]
    proposer = NgramProposer(k, 1, 3)
    greedy = seeds is None
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * len(prompts))]
    accepted_total = 0
    while any(len(s.output_token_ids) < steps for s in seqs):
        live = [s for s in seqs if len(s.output_token_ids) < steps]
        room = [steps - len(s.output_token_ids) - 1 for s in live]  # never draft past the end
        drafts = proposer.propose(live, max_draft_tokens=room)
        rows = []  # the verify step: the target's row after the context and each draft prefix
        for seq, draft in zip(live, drafts, strict=True):
            context = seq.prompt_token_ids + seq.output_token_ids
            rows += [model.logits(context + draft[:j]) for j in range(len(draft) + 1)]
        logits = torch.stack(rows)
        padded = torch.zeros(len(live), k, dtype=torch.int64)
        for b, draft in enumerate(drafts):
            padded[b, : len(draft)] = torch.tensor(draft, dtype=torch.int64)
        u_accept, u_draw = uniforms([gens[int(s.request_id[1:])] for s in live], k, "cpu")
        out = rejection_sample(
            draft_token_ids=padded,
            num_draft_tokens=torch.tensor([len(d) for d in drafts]),
            greedy=torch.full((len(live),), greedy),
            target_probs=None if greedy else torch.softmax(logits, -1),
            target_argmax=logits.argmax(-1),
            accept_uniforms=u_accept,
            draw_uniforms=u_draw,
        )
        for seq, tokens, a in zip(live, out.token_ids.tolist(), out.num_accepted.tolist(), strict=True):
            seq.output_token_ids.extend(tokens[: a + 1])  # the engine's append; nothing to roll back here
            accepted_total += a
    return [s.output_token_ids for s in seqs], accepted_total


def test_greedy_speculation_emits_exactly_plain_greedy():
    model = ToyTarget(seed=5)
    rng = random.Random(5)
    prompts = [[rng.randrange(16) for _ in range(rng.randint(2, 30))] for _ in range(16)]
    outputs, accepted = spec_decode(model, prompts, steps=60)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == plain_decode(model, prompt, 60, None)
    assert accepted > 16 * 20  # the loops were predicted: most tokens came from accepted drafts


def test_seeded_rows_repeat_and_ignore_their_neighbours():
    model = ToyTarget(vocab=8, seed=6)
    rng = random.Random(6)
    prompts = [[rng.randrange(8) for _ in range(12)] for _ in range(6)]
    seeds: list[int | None] = [11, 12, 13, 14, 15, None]
    first, _ = spec_decode(model, prompts, 40, seeds)
    again, _ = spec_decode(model, prompts, 40, seeds)
    assert first[:5] == again[:5]  # seeded: the same tokens run to run
    alone, _ = spec_decode(model, [prompts[2]], 40, [13])
    assert alone[0] == first[2]  # and the same without the other rows of the batch
    other, _ = spec_decode(model, [prompts[2]], 40, [99])
    assert other[0] != first[2]  # the seed decides them


def test_uniforms_take_k_plus_one_per_row_from_each_seeded_generator():
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    u_accept, u_draw = uniforms([a, None], 3, "cpu", default=torch.Generator().manual_seed(0))
    assert u_accept.shape == (2, 3) and u_draw.shape == (2,)
    assert torch.equal(torch.cat([u_accept[0], u_draw[:1]]), torch.rand(4, generator=b))
    assert ((u_accept >= 0) & (u_accept < 1)).all()


@pytest.mark.cuda
def test_the_device_agrees_with_the_cpu():
    g = torch.Generator().manual_seed(8)
    B = 256
    n = torch.randint(0, K + 1, (B,), generator=g)
    probs = torch.softmax(torch.randn(int((n + 1).sum()), 1000, generator=g), -1)
    args = dict(
        draft_token_ids=torch.randint(0, 1000, (B, K), generator=g),
        num_draft_tokens=n,
        greedy=torch.rand(B, generator=g) < 0.5,
        target_probs=probs,
        accept_uniforms=torch.rand(B, K, generator=g),
        draw_uniforms=torch.rand(B, generator=g),
    )
    cpu = rejection_sample(**args)
    gpu = rejection_sample(**{k: v.cuda() for k, v in args.items()})
    assert torch.equal(gpu.num_accepted.cpu(), cpu.num_accepted)
    assert (gpu.token_ids.cpu() != cpu.token_ids).sum() <= 1  # a float64 prefix sum may round apart once
