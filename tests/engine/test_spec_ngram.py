"""NgramProposer (engine/spec/ngram.py): vLLM's prompt-lookup rule, kept by an incremental index.

The rule (vllm/v1/spec_decode/ngram_proposer.py): the longest suffix n-gram, min <= n <= max, that occurred
earlier in prompt + output; its FIRST occurrence; the up-to-k tokens after it, cut where the context ends.
`reference` states it as the plainest search there is; the index must agree with it on every step of
random contexts, whether tokens arrive one at a time, in chunks or as one long prompt."""

from __future__ import annotations

import random

import pytest
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.spec import ngram
from graphcache.engine.spec.ngram import NgramIndex, NgramProposer


def reference(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """The longest n first; for it, the earliest end e <= L - 2 whose n-gram equals the suffix."""
    L = len(tokens)
    for n in range(min(high, L), low - 1, -1):
        suffix = tokens[L - n :]
        for e in range(n - 1, L - 1):
            if tokens[e - n + 1 : e + 1] == suffix:
                return tokens[e + 1 : min(e + 1 + k, L)]
    return []


def request(rid: str, prompt: list[int], output: list[int] | None = None) -> Sequence:
    seq = Sequence(rid, list(prompt), SamplingParams())
    seq.output_token_ids.extend(output or [])
    return seq


def test_vllms_example_and_the_earliest_occurrence():
    proposer = NgramProposer(4, 2, 3)
    assert proposer.propose([request("a", [1, 2, 3, 4, 2, 3])]) == [[4, 2, 3]]  # vLLM's docstring example
    # [1, 2] occurs at 0 and at 3: the first occurrence's continuation, as vLLM picks
    assert NgramProposer(2, 2, 2).propose([request("b", [1, 2, 9, 1, 2, 8, 1, 2])]) == [[9, 1]]
    # the longest n wins over an earlier shorter match: [7, 1, 2] only at 4..6
    assert NgramProposer(2, 2, 3).propose([request("c", [1, 2, 9, 7, 1, 2, 8, 7, 1, 2])]) == [[8, 7]]
    # an occurrence may overlap the suffix: [5, 5] first ends at 1, and two tokens follow it
    assert NgramProposer(3, 2, 2).propose([request("d", [5, 5, 5, 5])]) == [[5, 5]]
    assert NgramProposer(3, 2, 2).propose([request("e", [1, 2, 3, 4])]) == [[]]  # no match
    assert NgramProposer(3, 3, 3).propose([request("f", [1, 1])]) == [[]]  # shorter than min


@pytest.mark.parametrize("seed", range(3))
def test_the_index_agrees_with_the_plain_search_on_every_step(seed):
    rng = random.Random(seed)
    for _ in range(40):
        low = rng.randint(1, 4)
        high = rng.randint(low, 7)
        k = rng.randint(1, 8)
        vocab = rng.choice([2, 3, 5, 40])  # small vocabularies repeat, so matches of every length occur
        index, tokens = NgramIndex(low, high), []
        for _step in range(rng.randint(1, 80)):
            chunk = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 2, 7, 150]))]
            tokens += chunk
            index.extend(chunk)
            assert index.propose(k) == reference(tokens, low, high, k), (low, high, k, tokens[-12:])


def test_long_contexts_take_the_vectorised_build_and_stay_exact():
    rng = random.Random(7)
    base = [rng.randrange(1000) for _ in range(4000)]
    tokens = base + base[1000:1300] + [rng.randrange(1000) for _ in range(3000)]  # one long copy inside
    index = NgramIndex(2, 5)
    index.extend(tokens[:1500])  # a prompt: built in bulk
    assert index.frozen_len == 1500 and not index.tail
    for i in range(1500, len(tokens)):  # then decode, one token at a time, through two rebuilds
        index.extend([tokens[i]])
        if i % 151 == 0 or 1500 <= i < 1505 or 4000 <= i < 4310:
            assert index.propose(6) == reference(tokens[: i + 1], 2, 5, 6)
    assert index.frozen_len > 6000  # the tail was folded into the arrays twice (at 3001 and 6003)
    probe = tokens[:8000] + base[2000:2004]  # a suffix copied from the prompt: found, continued
    index = NgramIndex(2, 5)
    index.extend(probe)
    assert index.propose(6) == base[2004:2010] == reference(probe, 2, 5, 6)


def test_a_hash_collision_never_proposes_a_wrong_continuation():
    index = NgramIndex(3, 3)
    index.extend([1, 2, 3, 4, 5, 6, 7, 8])  # no earlier [6, 7, 8]
    assert index.propose(3) == []
    index.tail[index.suffix_keys[0]] = 3  # pretend [2, 3, 4] (ending at 3) hashed like [6, 7, 8]
    assert index.propose(3) == []  # the tokens are compared: no proposal rather than [5, 6, 7]


def test_requests_update_incrementally_and_are_forgotten(monkeypatch):
    proposer = NgramProposer(3, 2, 2)
    seq = request("r", [1, 2, 3, 1, 2])
    assert proposer.propose([seq]) == [[3, 1, 2]]
    builds = []
    monkeypatch.setattr(NgramIndex, "_reset", lambda self: builds.append(1) or real_reset(self))
    seq.output_token_ids.append(3)  # [.., 1, 2, 3]: [2, 3] first ends at 2
    assert proposer.propose([seq]) == [[1, 2, 3]]
    assert builds == [] and proposer.num_indexed == 1  # the same index, extended by one token
    other = request("s", [9, 9, 9])
    assert proposer.propose([seq, other]) == [[1, 2, 3], [9]]
    proposer.retain(["s"])
    assert proposer.num_indexed == 1
    proposer.remove("s")
    proposer.remove("never-seen")
    assert proposer.num_indexed == 0


real_reset = NgramIndex._reset


def test_drafts_stop_at_k_the_row_cap_and_max_model_len():
    seq = request("a", [1, 2, 3, 4, 5, 6, 7, 1, 2])
    assert NgramProposer(4, 2, 2).propose([seq]) == [[3, 4, 5, 6]]
    assert NgramProposer(4, 2, 2).propose([seq], max_draft_tokens=[2]) == [[3, 4]]
    assert NgramProposer(4, 2, 2, max_model_len=11).propose([seq]) == [[3, 4]]  # 9 tokens + 2 = 11
    full = NgramProposer(4, 2, 2, max_model_len=9)
    assert full.propose([seq]) == [[]] and full.num_indexed == 0  # no room: not even indexed
    off = NgramProposer(4, 2, 2)
    assert off.propose([seq], max_draft_tokens=[0]) == [[]] and off.num_indexed == 0


def test_memory_per_token_is_the_arrays_not_python_objects():
    index = NgramIndex(1, 5)
    index.extend(list(range(2000)) * 2)
    assert (len(index.frozen_keys) + len(index.frozen_ends)) * 8 <= 16 * 5 * 4000
    assert len(index.tail) == 0 and ngram.TAIL_MIN < 4000
