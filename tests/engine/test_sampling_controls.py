"""vLLM's sampling controls (controls.py, sampler.py, stopping.py, SamplingParams.validate): each control
against a plain per-token reference written here, on varied non-zero logits; greedy and random rows;
seeded rows independent of the batch; min_tokens, bad words, many stop strings and
include_stop_str_in_output."""

from __future__ import annotations

import math

import pytest
import torch
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.sample.controls import needs_history
from graphcache.engine.sample.sampler import probs_from_logits
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.stopping import check_stop
from helpers_sampling import SequenceSampler as Sampler
from helpers_stopping import feed as feed_tokens
from helpers_stopping import letters

V = 40
EOS = 5
NEG_INF = float("-inf")


def seq(rid="r", prompt=(7, 8, 9, 7), output=(), **params) -> Sequence:
    s = Sequence(rid, list(prompt), SamplingParams(**params))
    s.output_token_ids = list(output)
    return s


def varied_logits(rows: int, seed: int = 0) -> torch.Tensor:
    """[rows, V] logits of both signs, no ties, no zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g) * 3
    return torch.where(x.abs() < 0.05, x + 0.1, x)


def reference(row: torch.Tensor, s: Sequence, eos_ids=(EOS,)) -> torch.Tensor:
    """The controls of s applied to one row, token by token, in vLLM's order."""
    p, out = s.params, s.output_token_ids
    x = [float(v) for v in row]
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else NEG_INF for t, v in enumerate(x)]
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or out[len(out) - len(prefix) :] == prefix:
            x[word[-1]] = NEG_INF
    if len(out) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)):
            x[t] = NEG_INF
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in set(s.prompt_token_ids) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in out:
        x[t] -= p.frequency_penalty
    for t in set(out):
        x[t] -= p.presence_penalty
    return torch.tensor(x)


OUTPUT = (3, 11, 3, 20, 3, 11, 30)
CASES = {
    "none": {},
    "presence": dict(presence_penalty=1.5),
    "negative_presence": dict(presence_penalty=-0.7),
    "frequency": dict(frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.7),
    "repetition_below_one": dict(repetition_penalty=0.6),
    "logit_bias": dict(logit_bias={0: 5.0, 13: -100.0, 39: 2.5}),
    "allowed": dict(allowed_token_ids=[1, 3, 17, 25]),
    "bad_words": dict(bad_words_token_ids=[[4], [30, 12], [3, 11, 14], [9, 9, 16]]),
    "min_tokens": dict(min_tokens=10, stop_token_ids=[21]),
    "min_tokens_ignore_eos": dict(min_tokens=10, stop_token_ids=[21], ignore_eos=True),
    "min_tokens_reached": dict(min_tokens=7, stop_token_ids=[21]),
    "everything": dict(
        presence_penalty=0.4,
        frequency_penalty=-0.3,
        repetition_penalty=1.3,
        logit_bias={3: 1.0, 6: -2.0},
        min_tokens=9,
        stop_token_ids=[22],
        bad_words_token_ids=[[30, 8], [2]],
        allowed_token_ids=list(range(0, 40, 2)) + [3],
    ),
}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_control_matches_the_reference(case, device):
    logits = varied_logits(3, seed=len(case))
    seqs = [seq(f"r{i}", output=OUTPUT[: 7 - i], temperature=0, **CASES[case]) for i in range(3)]
    sampler = Sampler(eos_token_ids=[EOS])
    got = sampler.processed_logits(logits.to(device), seqs).cpu()
    want = torch.stack([reference(logits[i], s) for i, s in enumerate(seqs)])
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.allclose(got, want, atol=1e-5)
    assert (
        sampler.sample(logits.to(device), seqs) == want.argmax(dim=-1).tolist()
    )  # greedy: argmax of the processed


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_mixing_every_control_matches_the_reference(device):
    names = sorted(CASES) * 2
    logits = varied_logits(len(names), seed=11)
    g = torch.Generator().manual_seed(12)
    seqs = [
        seq(
            f"r{i}",
            output=torch.randint(0, V, (i % 9,), generator=g).tolist(),
            temperature=0 if i % 3 else 0.8,
            **CASES[name],
        )
        for i, name in enumerate(names)
    ]
    got = Sampler(eos_token_ids=[EOS]).processed_logits(logits.to(device), seqs).cpu()
    want = torch.stack([reference(logits[i], s) for i, s in enumerate(seqs)])
    assert torch.equal(got.isinf(), want.isinf()) and torch.allclose(got, want, atol=1e-5)


def test_the_controls_change_something():
    """The cases above are not vacuous: each control moves the logits it targets."""
    logits = varied_logits(1)
    for case, params in CASES.items():
        if case in ("none", "min_tokens_reached"):
            continue
        s = seq(output=OUTPUT, **params)
        assert not torch.equal(reference(logits[0], s), logits[0]), case


def test_greedy_with_penalties_moves_off_a_repeated_token():
    logits = torch.tensor([[0.5, 3.0, 2.6, -1.0, 0.2, -0.3]])
    s = seq(prompt=[0], output=[1, 1], temperature=0, frequency_penalty=0.3)
    assert Sampler().sample(logits, [s]) == [2]  # 3.0 - 2 * 0.3 = 2.4 < 2.6
    s = seq(prompt=[0], output=[1, 1], temperature=0, presence_penalty=0.3)
    assert Sampler().sample(logits, [s]) == [1]  # 2.7 > 2.6: presence counts once
    s = seq(prompt=[1], output=[], temperature=0, repetition_penalty=1.2)
    assert Sampler().sample(logits, [s]) == [2]  # the prompt counts: 3.0 / 1.2 = 2.5
    s = seq(prompt=[1], output=[], temperature=0, repetition_penalty=1.2, presence_penalty=1.0)
    assert Sampler().sample(logits, [s]) == [2]  # presence is over the output only


def test_rows_without_controls_keep_the_model_dtype_fast_path():
    logits = varied_logits(4, seed=3).to(torch.bfloat16)
    seqs = [
        seq("plain", temperature=0),
        seq("biased", temperature=0, logit_bias={0: 100.0}),
        seq("plain2", temperature=0),
        seq("random", temperature=1.0, seed=1, allowed_token_ids=[7]),
    ]
    tokens = Sampler().sample(logits, seqs)
    assert tokens[0] == logits[0].argmax().item() and tokens[2] == logits[2].argmax().item()
    assert tokens[1] == 0 and tokens[3] == 7


def test_a_row_with_every_token_banned_falls_back_to_its_raw_logits():
    logits = varied_logits(2, seed=4)
    seqs = [
        seq("g", temperature=0, allowed_token_ids=[EOS], min_tokens=3),
        seq("r", temperature=0.8, seed=3, allowed_token_ids=[4], bad_words_token_ids=[[4]]),
    ]
    tokens = Sampler(eos_token_ids=[EOS]).sample(logits, seqs)
    assert tokens[0] == logits[0].argmax().item()
    assert 0 <= tokens[1] < V


# --- random rows --------------------------------------------------------------------------------


def test_min_p_matches_the_reference():
    logits = varied_logits(3, seed=5)
    temperature, min_p = torch.tensor([1.0, 0.7, 1.6]), torch.tensor([0.05, 0.2, 0.0])
    got = probs_from_logits(
        logits,
        temperature=temperature,
        top_k=torch.zeros(3, dtype=torch.long),
        top_p=torch.ones(3),
        min_p=min_p,
    )
    for i in range(3):
        p = (logits[i] / temperature[i]).softmax(-1)
        p = torch.where(p >= min_p[i] * p.max(), p, torch.zeros_like(p))
        assert torch.allclose(got[i], p / p.sum(), atol=1e-6)
    assert (got[0] == 0).sum() > 5 and (got[2] > 0).all()  # min_p 0 is off
    # min_p, then top-k over what is left
    got = probs_from_logits(
        logits[:1],
        temperature=torch.ones(1),
        top_k=torch.tensor([3]),
        top_p=torch.ones(1),
        min_p=torch.tensor([0.05]),
    )
    assert (got > 0).sum() == min(3, int((logits[0].softmax(-1) >= 0.05 * logits[0].softmax(-1).max()).sum()))
    one = probs_from_logits(
        logits[:1],
        temperature=torch.ones(1),
        top_k=torch.tensor([0]),
        top_p=torch.ones(1),
        min_p=torch.ones(1),
    )
    assert one[0, logits[0].argmax()] == 1  # min_p 1 keeps only the top token


def test_random_rows_sample_only_what_the_controls_and_filters_allow():
    logits = varied_logits(1, seed=6).repeat(200, 1)
    allowed = [1, 3, 17, 25, 30]
    seqs = [
        seq(
            f"r{i}",
            output=[3, 9],
            temperature=1.5,
            allowed_token_ids=allowed,
            bad_words_token_ids=[[9, 17]],
            logit_bias={25: 4.0},
        )
        for i in range(200)
    ]
    tokens = Sampler(default_seed=0).sample(logits, seqs)
    assert set(tokens) <= {1, 3, 25, 30} and len(set(tokens)) > 1 and tokens.count(25) > 50
    ref = reference(logits[0], seqs[0]) / 1.5
    threshold = 0.3 * ref.softmax(-1).max()
    min_p_seqs = [seq(f"m{i}", temperature=1.5, logit_bias={25: 4.0}, min_p=0.3, seed=i) for i in range(100)]
    ref = (reference(logits[0], min_p_seqs[0]) / 1.5).softmax(-1)
    kept = {t for t in range(V) if ref[t] >= threshold}
    assert set(Sampler().sample(logits[:100], min_p_seqs)) <= kept


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_with_controls_do_not_depend_on_the_batch(device):
    """A seeded row's tokens over several steps (its penalties follow its own output) are the same
    alone and next to greedy, controlled, unseeded and other seeded rows."""
    logits = varied_logits(8, seed=7).to(device)

    def params(i):
        return (
            dict(
                temperature=1.2,
                seed=99,
                presence_penalty=0.5,
                frequency_penalty=0.4,
                repetition_penalty=1.2,
                logit_bias={2: 1.5},
                min_p=0.02,
                top_k=20,
                top_p=0.95,
                min_tokens=3,
                bad_words_token_ids=[[2, 2]],
            )
            if i == 0
            else [
                dict(temperature=0),
                dict(temperature=0, frequency_penalty=1.0),
                dict(temperature=0.9),
                dict(temperature=0.9, seed=5, presence_penalty=2.0),
                dict(temperature=1.0, allowed_token_ids=[1, 2]),
            ][i % 5]
        )

    def run(rows, steps=12):
        sampler = Sampler(default_seed=1, eos_token_ids=[EOS])
        seqs = [seq(f"r{j}", **params(j)) for j in range(len(rows))]
        for _ in range(steps):
            for s, t in zip(seqs, sampler.sample(logits[rows], seqs), strict=True):
                s.output_token_ids.append(t)
        return seqs[0].output_token_ids

    alone = run([4])
    assert run([4, 0, 1, 2, 3, 5]) == alone
    assert run([4, 7, 7]) == alone
    assert len(set(alone)) > 3 and EOS not in alone[:3]


# --- min_tokens ---------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.full((1, V), -1.0)
    logits[0, EOS], logits[0, 21], logits[0, 6] = 9.0, 8.0, 7.0
    sampler = Sampler(eos_token_ids=[EOS])
    s = seq(temperature=0, min_tokens=3, stop_token_ids=[21])
    picked = []
    for _ in range(4):
        picked.append(sampler.sample(logits, [s])[0])
        s.output_token_ids.append(picked[-1])
    assert picked == [6, 6, 6, EOS]
    s = seq(temperature=0, min_tokens=2, stop_token_ids=[21], ignore_eos=True)
    assert sampler.sample(logits, [s]) == [EOS]  # ignore_eos: EOS is an ordinary token, stop ids still masked
    s = seq(temperature=0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    assert sampler.sample(logits, [s]) == [21]
    # Random rows too, and a token of the step before still in flight counts (async scheduling).
    s = seq(temperature=1.0, seed=0, min_tokens=2)
    assert sampler.sample(logits, [s]) != [EOS]
    s = seq(temperature=0, min_tokens=2, output=[6])
    s.num_inflight = 2  # this step's token, plus one sampled by the step before, not appended yet
    assert sampler.sample(logits, [s]) == [EOS]


def test_min_tokens_stop_rules():
    s = seq(min_tokens=2, max_tokens=10, stop_token_ids=[21])
    s.output_token_ids.append(EOS)
    assert check_stop(s, EOS, eos_token_ids={EOS}, max_model_len=100) is None  # 1 output < min_tokens
    s.output_token_ids.append(21)
    assert check_stop(s, 21, eos_token_ids={EOS}, max_model_len=100) == "stop"


# --- bad words ----------------------------------------------------------------------------------


def test_bad_words_ban_the_last_token_only_after_the_rest():
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 9], logits[0, 4] = 5.0, 4.0, 3.0
    words = [[3, 7], [2, 6, 9], [11]]
    sampler = Sampler()

    def pick(output, word_list=words):
        return sampler.sample(logits, [seq(output=output, temperature=0, bad_words_token_ids=word_list)])[0]

    assert pick([]) == 7  # nothing of [3, 7] yet
    assert pick([1, 3]) == 9  # ...3 -> 7 would complete it
    assert pick([3, 1]) == 7
    assert pick([2, 6, 3]) == 9  # 7 banned, 9 allowed: [2, 6] is not the tail
    assert pick([1, 2, 6]) == 7  # 7 fine, [2, 6] -> 9 banned (7 wins anyway)
    assert pick([1, 2, 6], [[2, 6, 7], [2, 6, 9]]) == 4
    assert pick([6], [[2, 6, 7]]) == 7  # a partial prefix is not the prefix
    assert pick([], [[7]]) == 9  # a single-token bad word is always banned
    assert pick([], [[7], [9], [4]]) not in (7, 9, 4)


def test_needs_history():
    assert not needs_history(SamplingParams())
    assert not needs_history(
        SamplingParams(
            logit_bias={1: 2.0},
            allowed_token_ids=[1],
            min_p=0.5,
            bad_words_token_ids=[[3]],
            temperature=0.7,
            seed=1,
        )
    )
    for params in (
        dict(presence_penalty=0.1),
        dict(frequency_penalty=-0.1),
        dict(repetition_penalty=1.1),
        dict(min_tokens=1),
        dict(bad_words_token_ids=[[3], [4, 5]]),
    ):
        assert needs_history(SamplingParams(**params)), params


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "param,value",
    [
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {1: -100.5}),
        ("logit_bias", {-1: 1.0}),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [1, -2]),
        ("bad_words_token_ids", [[1], []]),
        ("bad_words_token_ids", [[1, "a"]]),
        ("stop_token_ids", [-3]),
        ("stop", [f"s{i}" for i in range(SamplingParams.MAX_STOP_STRINGS + 1)]),
    ],
)
def test_validate_names_the_bad_param(param, value):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(max_tokens=16, **{param: value}).validate()
    assert err.value.param == param


def test_validate_accepts_the_edges():
    SamplingParams(
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1e-3,
        logit_bias={0: -100, 5: 100},
        min_tokens=16,
        max_tokens=16,
        min_p=1,
        allowed_token_ids=[0],
        bad_words_token_ids=[[1, 2]],
        stop=[f"s{i}" for i in range(SamplingParams.MAX_STOP_STRINGS)],
    ).validate()
    SamplingParams(max_tokens=None, min_tokens=500).validate()  # max_tokens resolved later by the core


@pytest.mark.parametrize(
    "param,value",
    [
        ("logit_bias", {40: 1.0}),
        ("allowed_token_ids", [3, 40]),
        ("bad_words_token_ids", [[1, 40]]),
        ("stop_token_ids", [40]),
    ],
)
def test_validate_token_ids_against_the_vocabulary(param, value):
    SamplingParams(**{param: value}).validate_token_ids(41)
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{param: value}).validate_token_ids(40)
    assert err.value.param == param


# --- stop strings -------------------------------------------------------------------------------


def feed(s: Sequence, text: str) -> tuple[str, str | None]:
    return feed_tokens(s, letters(text))


def test_many_stop_strings():
    decoys = [f"q{chr(ord('a') + i % 26)}{'x' * (i % 7)}" for i in range(60)]
    s = seq(prompt=[0], stop=decoys + ["dcb", "cb"], max_tokens=50)
    assert feed(s, "abcdcbaa") == ("abc", "stop")  # both end at the same token: the earlier start wins
    s = seq(prompt=[0], stop=[*decoys, "bcd", "bc"], max_tokens=50, include_stop_str_in_output=True)
    assert feed(s, "abcdef") == ("abc", "stop")  # same start: the shorter one ends first
    assert s.detokenizer is None and s.output_text == "abc"


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_with_the_char_tokenizer(include):
    s = seq(prompt=[0], stop=["xyz", "ghi"], max_tokens=50, include_stop_str_in_output=include)
    streamed, reason = feed(s, "abxyghijk")
    assert reason == "stop" and streamed == ("abxyghi" if include else "abxy")


def test_stop_strings_wait_for_min_tokens():
    # "bc" completes at output 3 (<= min_tokens 3): ignored; the next "bc" ends at output 6: stops.
    s = seq(prompt=[0], stop=["bc"], max_tokens=50, min_tokens=3)
    assert feed(s, "abcabcab") == ("abca", "stop")
    # A stop string that started during min_tokens and ends after it counts.
    s = seq(prompt=[0], stop=["cd", "cdef"], max_tokens=50, min_tokens=3)
    assert feed(s, "abcdefg") == ("ab", "stop")
    s = seq(prompt=[0], stop=["bc", "bcd"], max_tokens=50, min_tokens=3)
    assert feed(s, "abcdefg") == ("a", "stop") and s.detokenizer is None


# --- through the engine, with the tiny model on the CPU -----------------------------------------


@pytest.mark.slow
def test_include_stop_str_in_output_through_the_engine():
    from graphcache.engine.loop.core import EngineCore
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import cpu_settings, prompt_ids, tiny_checkpoint

    settings = cpu_settings(tiny_checkpoint("qwen2"), max_num_seqs=4)
    core = EngineCore(ModelRunner(settings), settings)
    words = list(range(266, core.runner.vocab_size))  # whole-word tokens of the tiny vocabulary
    prompt = prompt_ids(6, seed=3)

    def run(**params) -> tuple[str, str]:
        """Seeded sampling with penalties (the tiny model repeats itself otherwise), streamed and not."""
        for name, stream in (("stream", True), ("final", False)):
            s = Sequence(
                name,
                list(prompt),
                SamplingParams(
                    max_tokens=40,
                    temperature=1.0,
                    seed=7,
                    ignore_eos=True,
                    presence_penalty=2.0,
                    frequency_penalty=2.0,
                    allowed_token_ids=words,
                    **params,
                ),
                stream=stream,
            )
            core.check(s)
            core.add_request(s)
        texts, reasons = {"stream": "", "final": ""}, {}
        while core.has_work():
            for out in core.step():
                texts[out.request_id] += out.text
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        if params.get("stop"):  # a stream without stop strings carries ids only (its consumer detokenizes)
            assert texts["stream"] == texts["final"] and reasons["stream"] == reasons["final"]
        return texts["final"], reasons["final"]

    full, reason = run()
    assert reason == "length" and len(full) > 60
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    cut = full.find(stop)
    assert 0 < cut < len(full) - len(stop)
    decoys = [f"never-{i}" for i in range(40)]
    assert run(stop=[*decoys, stop]) == (full[:cut], "stop")
    assert run(stop=[*decoys, stop], include_stop_str_in_output=True) == (full[: cut + len(stop)], "stop")
