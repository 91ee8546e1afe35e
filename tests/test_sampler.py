"""Sampler and stop rules: greedy, top-k/top-p filtering, seeded reproducibility, stop ids, stop strings."""

import torch

from service.engine.sampler import Sampler, check_stop, probs_from_logits, sendable_text
from service.engine.sequence import SamplingParams, Sequence
from service.model.tokenizer import IncrementalDetokenizer


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
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))   # 0.5 < 0.7, 0.8 >= 0.7: two survive
    p = probs_from_logits(logits, temperature=one, top_k=torch.tensor([0]), top_p=torch.tensor([0.1]))
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0]]))         # the top token always survives
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
        seqs = [seq(f"r{i}", temperature=1.0, seed=1234 if i == 0 else None) for i in range(len(rows))]
        sampler = Sampler()
        return [sampler.sample(logits[rows], seqs)[0] for _ in range(n_steps)]

    alone = draw([3])
    assert draw([3, 0, 1, 2]) == alone
    assert draw([3, 7]) == alone
    assert len(set(alone)) > 1   # it is really sampling, not collapsing to argmax


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


class CharTokenizer:
    """Token id -> one letter; drives the real IncrementalDetokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def feed(s: Sequence, tokens: list[int]) -> tuple[str, str | None]:
    s.detokenizer = IncrementalDetokenizer(CharTokenizer(), s.prompt_token_ids, s.params.stop)
    streamed, reason = "", None
    for t in tokens:
        s.output_token_ids.append(t)
        reason = check_stop(s, t, eos_token_ids={25}, max_model_len=1000)
        streamed += sendable_text(s, reason is not None)
        if reason:
            break
    return streamed, reason


def test_stop_string_is_cut_from_output_and_never_streamed():
    s = seq(stop=["cde"], max_tokens=50)
    streamed, reason = feed(s, [0, 1, 2, 3, 4, 5])      # a b c d e f
    assert reason == "stop" and streamed == "ab" and s.output_text == "ab"


def test_stop_string_prefix_held_back_then_released():
    s = seq(stop=["xyz"], max_tokens=6)
    streamed, reason = feed(s, [0, 23, 24, 1, 2, 3])   # a x y b c d: "xy" looked like a stop, was not
    assert reason == "length" and streamed == "axybcd"


def test_stop_string_across_tokens_and_first_of_many():
    s = seq(stop=["ww", "bc"], max_tokens=50)
    streamed, reason = feed(s, [0, 1, 2, 22, 22])
    assert reason == "stop" and streamed == "a"


def test_eos_flushes_held_text_and_adds_none():
    s = seq(stop=["xyz"], max_tokens=50)
    streamed, reason = feed(s, [0, 23, 25])            # a x <eos>
    assert reason == "stop" and streamed == "ax"
