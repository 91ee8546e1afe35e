"""A request's token-id lists are checked once, not once per choice: the API hands every choice one
immutable TokenIds, and the engine's per-choice check trusts it instead of walking it again."""

from __future__ import annotations

import pickle

import pytest
from graphcache.api.openai import sampling, token_ids
from graphcache.api.server.errors import APIError
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.loop.request_check import EngineLimits, RequestChecker
from graphcache.engine.sequence import SamplingParams, Sequence, TokenIds

VOCAB = 5000
N = 64


@pytest.fixture
def walks(monkeypatch):
    """How many times any TokenIds was iterated (every walk of its ids: loops, sorted, set, min/max)."""
    count = [0]
    original = tuple.__iter__

    def counting_iter(self):
        count[0] += 1
        return original(self)

    monkeypatch.setattr(TokenIds, "__iter__", counting_iter)
    return count


def checker() -> RequestChecker:
    return RequestChecker(
        EngineLimits(vocab_size=VOCAB, max_model_len=4096, block_size=16, num_usable_blocks=1024),
        tokenizer=None,
    )


def test_every_choice_shares_one_checked_list_and_the_engine_never_walks_it(walks, monkeypatch):
    built = [0]
    original_new = TokenIds.__new__

    def counting_new(cls, *args, **kwargs):
        built[0] += 1
        return original_new(cls, *args, **kwargs)

    monkeypatch.setattr(TokenIds, "__new__", counting_new)
    allowed = token_ids.unique_token_ids(list(range(VOCAB)) * 2, VOCAB)  # repeats: deduplicated
    prompt = token_ids.shared_prompt_ids([7, 8, 9], VOCAB)
    assert built[0] == 2 and len(allowed) == VOCAB and isinstance(prompt, TokenIds)
    base = SamplingParams(max_tokens=4, allowed_token_ids=allowed)
    plan = sampling.ChoicePlan(n=N, samples=N, client_logprobs=False)
    check = checker()
    walks[0] = 0
    params = [sampling.choice_params(base, i, plan) for i in range(N)]
    for i, p in enumerate(params):
        check.check(Sequence(f"r-{i}", [7, 8, 9], p), prompt_checked=prompt.checked_for(VOCAB))
    assert walks[0] == 0  # no choice walked the 5000 ids again
    assert all(p.allowed_token_ids is allowed for p in params)
    assert built[0] == 2  # checked once per request, not once per choice


def test_direct_callers_with_plain_lists_are_still_checked():
    check = checker()
    with pytest.raises(InvalidRequest) as info:
        check.check(Sequence("r", [1], SamplingParams(allowed_token_ids=[1, VOCAB])))
    assert info.value.param == "allowed_token_ids"
    with pytest.raises(InvalidRequest):
        check.check(Sequence("r", [1], SamplingParams(allowed_token_ids=[1, -2])))
    with pytest.raises(InvalidRequest) as info:
        check.check(Sequence("r", [1, VOCAB], SamplingParams()))
    assert info.value.param == "prompt"
    check.check(Sequence("r", [1], SamplingParams(allowed_token_ids=[1, 2])))


def test_ids_checked_against_a_larger_vocabulary_are_checked_again(walks):
    wide = TokenIds([1, VOCAB + 10], VOCAB + 100)
    assert not wide.checked_for(VOCAB) and wide.checked_for(VOCAB + 100)
    with pytest.raises(InvalidRequest):
        checker().check(Sequence("r", [1], SamplingParams(allowed_token_ids=wide)))
    assert walks[0] > 0


def test_token_ids_refuse_what_is_not_an_id_and_survive_pickling():
    with pytest.raises(InvalidRequest):
        TokenIds([1, 2.5], VOCAB)
    with pytest.raises(InvalidRequest):
        TokenIds([VOCAB], VOCAB)
    with pytest.raises(APIError):
        token_ids.unique_token_ids([VOCAB], VOCAB)
    assert isinstance(token_ids.shared_prompt_ids([VOCAB], VOCAB), list)  # the engine refuses it
    ids = TokenIds([3, 1], VOCAB)
    back = pickle.loads(pickle.dumps(ids))
    assert back == (3, 1) and isinstance(back, TokenIds) and back.vocab_size == VOCAB
