"""The worker's verification of sampled rows (engine/worker/sampling.py verify_rows) keeps the target's
distribution as the sampler builds it: total variation over thousands of draws, against the sampler's own
draws and against probs_from_logits, for drafts the target likes and drafts it rejects."""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.sample.sampler import Sampler, probs_from_logits
from graphcache.engine.sample.state import SamplingState
from graphcache.engine.sequence import SamplingParams
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


@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("draft", [0, 5, 11])  # the likeliest token, a middling one, one filtered out or rare
def test_first_token_follows_the_samplers_distribution(params, draft):
    torch.manual_seed(0)
    row = torch.randn(V) * 2
    row[0] += 2.0  # token 0 likeliest
    want = probs_from_logits(
        row[None],
        temperature=torch.tensor([params.temperature]),
        top_k=torch.tensor([params.top_k]) if params.top_k else None,
        top_p=torch.tensor([params.top_p]) if params.top_p < 1 else None,
        min_p=torch.tensor([params.min_p]) if params.min_p else None,
    )[0].double()
    # The sampler's own draws: the distribution the verify step must keep.
    sampler = Sampler(default_seed=1)
    states = [SamplingState(f"r{i}", params, [1]) for i in range(N)]
    own = sampler.sample_device(row.expand(N, V).clone(), states)
    assert tv(hist(own), want) < TV_BOUND
    # Verify rows with one draft each: target rows [position 0, bonus position]; the first emitted token
    # is the accepted draft or the residual draw.
    logits = row.expand(2 * N, V).clone()
    bonus = sampler.sample_device(row.expand(N, V).clone(), states)
    tokens, accepted = verify_rows([[draft]] * N, logits, bonus, states)
    first = tokens[:, 0]
    assert (first >= 0).all()
    assert tv(hist(first), want) < TV_BOUND
    assert abs(float(accepted.double().mean()) - float(want[draft])) < 0.02  # P(accept) = p(draft)


def test_greedy_rows_accept_the_argmax_run():
    row = torch.full((3, V), -1.0)
    row[0, 4] = row[1, 7] = row[2, 2] = 5.0  # argmax: 4, then 7, then (bonus row) 2
    states = [SamplingState("g", SamplingParams(temperature=0.0), [1])]
    tokens, accepted = verify_rows([[4, 7]], row, torch.tensor([2]), states)
    assert tokens.tolist() == [[4, 7, 2]] and accepted.tolist() == [2]
    tokens, accepted = verify_rows([[4, 3]], row, torch.tensor([2]), states)
    assert tokens.tolist() == [[4, 7, -1]] and accepted.tolist() == [1]


def test_seeded_rows_repeat():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    params = SamplingParams(temperature=1.0, seed=7)
    runs = []
    for _ in range(2):
        states = [SamplingState("s", params, [1])]
        runs.append(
            [verify_rows([[1, 2, 3]], logits, torch.tensor([5]), states)[0].tolist() for _ in range(5)]
        )
    assert runs[0] == runs[1]
