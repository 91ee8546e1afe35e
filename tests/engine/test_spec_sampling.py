"""The worker's verification of drafts (engine/worker/sampling.py verify_rows, engine/spec/match.py): a draw
at every fed position, the matching drafts kept. It keeps the target's distribution as the sampler builds
it (total variation over thousands of draws, against the sampler's own draws and against
probs_from_logits, for drafts the target likes and drafts it rejects, at the first and second position);
greedy rows emit the argmax run; a seeded row emits what plain decoding draws at each output position."""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.sample.sampler import Sampler, probs_from_logits
from graphcache.engine.sample.state import SamplingState
from graphcache.engine.sequence import SamplingParams
from graphcache.engine.spec.match import accept_matching, position_offsets
from graphcache.engine.worker.sampling import verify_rows

V = 12
N = 20_000
TV_BOUND = 0.02  # sampling error of N draws over V tokens is ~0.01 at most


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def hist(ids: torch.Tensor) -> torch.Tensor:
    return torch.bincount(ids, minlength=V).double() / ids.numel()


PARAMS = [
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.2, top_p=0.8),
    SamplingParams(temperature=0.8, min_p=0.1),
]


def target(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return probs_from_logits(
        row[None],
        temperature=torch.tensor([params.temperature]),
        top_k=torch.tensor([params.top_k]) if params.top_k else None,
        top_p=torch.tensor([params.top_p]) if params.top_p < 1 else None,
        min_p=torch.tensor([params.min_p]) if params.min_p else None,
    )[0].double()


@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("draft", [0, 5, 11])  # the likeliest token, a middling one, one filtered out or rare
def test_emitted_tokens_follow_the_samplers_distribution(params, draft):
    torch.manual_seed(0)
    rows = torch.randn(3, V) * 2
    rows[0, 0] += 2.0  # token 0 likeliest at the first position
    want0, want1 = target(rows[0], params), target(rows[1], params)
    sampler = Sampler(default_seed=1)
    states = [SamplingState(f"r{i}", params, [1]) for i in range(N)]
    own = sampler.sample_device(rows[0].expand(N, V).clone(), states)  # the distribution to keep
    assert tv(hist(own), want0) < TV_BOUND
    # Two drafts a row ([draft, 3]): positions 0, 1 and the bonus, packed.
    logits = rows.repeat(N, 1)
    tokens, accepted = verify_rows(sampler, [[draft, 3]] * N, logits, states)
    first = tokens[:, 0]
    assert (first >= 0).all() and ((tokens >= 0).sum(dim=1) == accepted + 1).all()
    assert tv(hist(first), want0) < TV_BOUND
    assert abs(float((accepted >= 1).double().mean()) - float(want0[draft])) < 0.02  # P(accept) = p(draft)
    # Where the draft was accepted, the second token follows the target at position 1.
    second = tokens[accepted >= 1, 1]
    if second.numel() > 2000:
        assert tv(hist(second), want1) < 2 * TV_BOUND


def test_greedy_rows_accept_the_argmax_run():
    row = torch.full((3, V), -1.0)
    row[0, 4] = row[1, 7] = row[2, 2] = 5.0  # argmax: 4, then 7, then (bonus position) 2
    sampler = Sampler()
    states = [SamplingState("g", SamplingParams(temperature=0.0), [1])]
    tokens, accepted = verify_rows(sampler, [[4, 7]], row, states)
    assert tokens.tolist() == [[4, 7, 2]] and accepted.tolist() == [2]
    tokens, accepted = verify_rows(sampler, [[4, 3]], row, states)
    assert tokens.tolist() == [[4, 7, -1]] and accepted.tolist() == [1]


def test_accept_matching_keeps_the_leading_matches_and_pads():
    # Rows: 2 drafts all matching (bonus 9), 3 drafts with the second wrong, no draft, 1 draft wrong.
    drafts = [[5, 6], [1, 2, 3], [], [4]]
    sampled = torch.tensor([5, 6, 9, 1, 7, 3, 8, 2, 0, 4])
    assert position_offsets(drafts) == [-2, -1, 0, -3, -2, -1, 0, 0, -1, 0]
    tokens, accepted = accept_matching(drafts, sampled)
    assert accepted.tolist() == [2, 1, 0, 0]
    assert tokens.tolist() == [[5, 6, 9, -1], [1, 7, -1, -1], [2, -1, -1, -1], [0, -1, -1, -1]]


def test_a_seeded_row_emits_what_plain_decoding_draws_at_each_position():
    """Plain decoding draws output position i of a seeded request with key (seed, i); so do the verify
    positions. With drafts equal to plain decoding's own tokens every draft is accepted and the run is
    plain decoding's; a wrong draft is replaced by plain decoding's token at that position."""
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    params = SamplingParams(temperature=1.0, seed=7)
    sampler = Sampler(default_seed=5)
    plain = []
    for i in range(4):  # plain decoding: one position a step, num_generated = i
        state = SamplingState("p", params, [1])
        state.num_generated = i
        plain.append(int(sampler.sample_device(logits[i : i + 1], [state])[0]))
    state = SamplingState("s", params, [1])
    state.num_generated = 3  # the verify row's last fed position samples output position 3
    tokens, accepted = verify_rows(sampler, [plain[:3]], logits, [state])
    assert tokens.tolist() == [plain] and accepted.tolist() == [3]
    wrong = [plain[0], (plain[1] + 1) % V, plain[2]]
    tokens, accepted = verify_rows(sampler, [wrong], logits, [state])
    assert tokens.tolist() == [[plain[0], plain[1], -1, -1]] and accepted.tolist() == [1]
