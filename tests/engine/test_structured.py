"""Structured output (engine/sample/structured.py): the tiny random-weight model, driven step by step here
(run -> mask -> seeded sample at temperature 1 -> accept), must produce output that parses and
validates against the spec; invalid specs are client errors; the mask is batched, in place, and
covers the model's padding ids."""

from __future__ import annotations

import json
import re

import pytest
import torch
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.sample.structured import StructuredOutput, accept, is_done
from graphcache.engine.sequence import SamplingParams, Sequence, StructuredSpec
from graphcache.engine.stopping import grammar_failure
from graphcache.engine.worker.runner import ModelRunner
from helpers_model import Blocks, cpu_settings, prompt_ids, tiny_checkpoint
from helpers_sampling import SequenceSampler as Sampler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "level": {"type": "integer", "enum": [1, 2, 3]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "level", "tags"],
    "additionalProperties": False,
}


def validate(obj, schema) -> None:
    try:
        import jsonschema
    except ImportError:  # by hand: the fields SCHEMA defines
        assert set(obj) == {"name", "level", "tags"}
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
        assert obj["level"] in (1, 2, 3) and not isinstance(obj["level"], bool)
        assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
        assert all(isinstance(t, str) and len(t) <= 6 for t in obj["tags"])
        return
    jsonschema.validate(obj, schema)


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(cpu_settings(tiny_checkpoint("llama")))


@pytest.fixture(scope="module")
def structured(runner):
    return StructuredOutput(runner.tokenizer, runner.vocab_size)


def generate(
    runner,
    structured: StructuredOutput,
    spec: StructuredSpec,
    seed: int,
    max_tokens: int = 160,
    prompt: list[int] | None = None,
) -> tuple[str, Sequence]:
    """Drive the model by hand as the engine will: execute, mask, sample (temperature 1, seeded),
    accept; stop on EOS or when the grammar is complete."""
    prompt = prompt or prompt_ids(12, seed=seed)
    seq = Sequence(
        f"r{seed}", prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured=spec)
    )
    seq.grammar = structured.new_matcher(spec)
    table = Blocks(runner.block_size).table(len(prompt) + max_tokens + 1)
    sampler, eos = Sampler(), set(runner.tokenizer.eos_token_ids)
    feed, pos = prompt, 0
    for _ in range(max_tokens):
        logits = runner.execute(StepPlan.standalone([StepSeq(feed, pos, table, need_logits=True)])).logits[:1]
        pos += len(feed)
        structured.apply(logits, [seq])
        token = int(sampler.sample_device(logits, [seq])[0])
        assert accept(seq, token), f"the mask allowed token {token}, which the grammar rejects"
        if token in eos:
            break
        seq.output_token_ids.append(token)
        if is_done(seq):
            break
        feed = [token]
    else:
        pytest.fail(
            f"no complete output in {max_tokens} tokens: {runner.tokenizer.decode(seq.output_token_ids)!r}"
        )
    assert seq.grammar.is_accepting()
    return runner.tokenizer.decode(seq.output_token_ids), seq


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_output_validates(runner, structured, seed):
    text, _ = generate(runner, structured, StructuredSpec("json_schema", json.dumps(SCHEMA)), seed)
    validate(json.loads(text), SCHEMA)


def test_json_object_output_parses(runner, structured):
    # seed 6: a random walk that closes the object within 200 tokens (most seeds do not, on this model)
    text, _ = generate(runner, structured, StructuredSpec("json"), seed=6, max_tokens=200)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choice_output_is_one_of_the_choices(runner, structured, seed):
    choices = ("positive", "negative", "neutral", "mixed feelings")
    text, _ = generate(runner, structured, StructuredSpec("choice", choices), seed)
    assert text in choices


@pytest.mark.parametrize("seed", [0, 1])
def test_regex_output_matches(runner, structured, seed):
    pattern = r"[A-Z][a-z]{2,5}-\d{3}( (ok|fail))?"
    text, _ = generate(runner, structured, StructuredSpec("regex", pattern), seed)
    assert re.fullmatch(pattern, text), text


def test_lark_grammar_output_matches(runner, structured):
    grammar = 'start: expr\nexpr: NUM | "(" expr "+" expr ")"\nNUM: /[0-9]{1,2}/\n'
    text, _ = generate(runner, structured, StructuredSpec("grammar", grammar), seed=5)
    assert re.fullmatch(r"[0-9()+]+", text) and text.count("(") == text.count(")"), text


def test_unconstrained_output_is_not_json(runner, structured):
    """The reference: without the mask the random model does not write valid JSON by itself."""
    seq = Sequence("free", prompt_ids(12), SamplingParams(temperature=1.0, seed=0))
    logits = runner.execute(
        StepPlan.standalone(
            [StepSeq(seq.prompt_token_ids, 0, Blocks(runner.block_size).table(16), need_logits=True)]
        )
    ).logits[:1]
    first = runner.tokenizer.decode([int(Sampler().sample_device(logits, [seq])[0])])
    assert not first.lstrip().startswith("{")


@pytest.mark.parametrize(
    "spec, param",
    [
        (StructuredSpec("json_schema", '{"type": "objekt"}'), "response_format"),
        (StructuredSpec("json_schema", "{not json"), "response_format"),
        (StructuredSpec("json_schema", "[1, 2]"), "response_format"),
        (StructuredSpec("regex", "a(b"), "structured_outputs"),
        (StructuredSpec("regex", ""), "structured_outputs"),
        (StructuredSpec("choice", ()), "structured_outputs"),
        (StructuredSpec("choice", ("a", 3)), "structured_outputs"),
        (StructuredSpec("grammar", "start: undefined_rule"), "structured_outputs"),
        (StructuredSpec("structural_tag", "{}"), "structured_outputs"),
    ],
)
def test_invalid_specs_are_client_errors(structured, spec, param):
    with pytest.raises(InvalidRequest) as info:
        structured.check(spec)
    assert info.value.param == param and info.value.message
    with pytest.raises(InvalidRequest) as info:
        structured.check(spec, param="guided_json")
    assert info.value.param == "guided_json"


def test_compiled_grammars_are_cached_lru(runner):
    so = StructuredOutput(runner.tokenizer, runner.vocab_size, cache_size=2)
    a, b, c = (StructuredSpec("regex", p) for p in ("a+", "b+", "c+"))
    first = so.compiled(a)
    assert so.compiled(a) is first and so.cache_len == 1
    so.compiled(b)
    so.compiled(a)  # a is now the most recent
    so.compiled(c)  # evicts b
    assert so.cache_len == 2 and so.compiled(a) is first
    # A dict schema and its JSON text are distinct keys but compile the same; matchers are independent.
    m1, m2 = so.new_matcher(a), so.new_matcher(a)
    assert m1 is not m2 and m1 is not first


def test_apply_masks_only_grammar_rows_in_place_and_padding_ids(runner):
    tok = runner.tokenizer
    padded = tok.vocab_size + 70  # a model vocab wider than the tokenizer's (padded embedding)
    so = StructuredOutput(tok, padded)
    spec = StructuredSpec("choice", ("hello", "help"))
    seqs = [Sequence(str(i), [5], SamplingParams(structured=spec if i != 1 else None)) for i in range(3)]
    for s in seqs:
        s.grammar = so.new_matcher(s.params.structured) if s.params.structured else None
    logits = torch.randn(3, padded, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    so.apply(logits, seqs)
    assert torch.equal(logits[1], before[1])  # no grammar: untouched
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    pieces = [tok.decode([i]) for i in allowed]
    assert pieces and all(p and ("hello".startswith(p) or "help".startswith(p)) for p in pieces), pieces
    assert torch.equal(torch.isfinite(logits[0]), torch.isfinite(logits[2]))  # same grammar, same mask
    assert torch.isinf(logits[0, tok.vocab_size :]).all()  # padding ids are never allowed
    assert torch.equal(logits[0][torch.isfinite(logits[0])], before[0][torch.isfinite(logits[0])])
    # Same result when every row has a grammar (the whole-tensor path).
    both = before[[0, 2]].clone()
    so.apply(both, [seqs[0], seqs[2]])
    assert torch.equal(both[0], logits[0])


def test_eos_only_when_complete_and_done_when_nothing_can_follow(runner, structured):
    tok = runner.tokenizer
    spec = StructuredSpec("choice", ("yes", "yesterday"))
    seq = Sequence("r", [5], SamplingParams(structured=spec))
    seq.grammar = structured.new_matcher(spec)
    eos = set(tok.eos_token_ids)
    assert not eos & set(structured.allowed_token_ids(seq))
    for t in tok.encode("yes", add_special_tokens=False):
        assert accept(seq, t)
    assert eos <= set(structured.allowed_token_ids(seq))  # "yes" is complete: EOS allowed
    assert not is_done(seq)  # ... but "yesterday" may still follow
    for t in tok.encode("terday", add_special_tokens=False):
        assert accept(seq, t)
    assert is_done(seq) and set(structured.allowed_token_ids(seq)) <= eos
    # A token the grammar rejects breaks it: the engine ends that request with an error (never a "stop").
    other = Sequence("s", [5], SamplingParams(structured=spec))
    other.grammar = structured.new_matcher(spec)
    assert not accept(other, tok.encode("no", add_special_tokens=False)[0])
    assert not is_done(other) and "broke the output's grammar" in grammar_failure(other)
    assert accept(Sequence("plain", [5], SamplingParams()), 7)  # no grammar: always accepted


@pytest.mark.cuda
def test_apply_on_cuda_matches_cpu(runner, structured):
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    seqs = [Sequence(str(i), [5], SamplingParams(structured=spec)) for i in range(4)]
    for s in seqs:
        s.grammar = structured.new_matcher(spec)
    logits = torch.randn(4, runner.vocab_size)
    on_gpu = logits.cuda()
    structured.apply(logits, seqs)
    structured.apply(on_gpu, seqs)
    assert torch.equal(on_gpu.cpu(), logits)


def _engine_integrated() -> bool:
    from graphcache.engine.loop.core import EngineCore

    return hasattr(EngineCore, "structured")


@pytest.mark.skipif(
    not _engine_integrated(), reason="EngineCore does not call engine/sample/structured.py yet"
)
def test_engine_serves_constrained_requests_alike_with_and_without_async_scheduling():
    """Through EngineCore: constrained requests next to a free one end with "stop" and valid output,
    and async scheduling (which must not overlap grammar steps) changes nothing."""
    from graphcache.engine.loop.core import EngineCore
    from test_async_scheduling import drive

    path = tiny_checkpoint("llama")
    pattern = r"[0-9]{3}-[a-z]{2}"
    reqs = [
        (
            "j",
            prompt_ids(8, seed=1),
            SamplingParams(
                max_tokens=150, seed=1, structured=StructuredSpec("json_schema", json.dumps(SCHEMA))
            ),
        ),
        (
            "c",
            prompt_ids(5, seed=2),
            SamplingParams(
                max_tokens=20, seed=2, structured=StructuredSpec("choice", ("alpha", "beta gamma"))
            ),
        ),
        (
            "r",
            prompt_ids(6, seed=3),
            SamplingParams(max_tokens=30, seed=3, structured=StructuredSpec("regex", pattern)),
        ),
        ("free", prompt_ids(7, seed=4), SamplingParams(max_tokens=12, seed=4, ignore_eos=True)),
    ]
    results = []
    for mode in ("off", "on"):
        settings = cpu_settings(path, async_scheduling=mode)
        core = EngineCore(ModelRunner(settings), settings)
        results.append(drive(core, reqs))
    assert results[0] == results[1]
    decode = core.runner.tokenizer.decode
    text = {rid: decode(ids) for rid, (ids, _) in results[0].items()}
    assert {rid: reason for rid, (_, reason) in results[0].items()} == {
        "j": "stop",
        "c": "stop",
        "r": "stop",
        "free": "length",
    }
    validate(json.loads(text["j"]), SCHEMA)
    assert text["c"] in ("alpha", "beta gamma") and re.fullmatch(pattern, text["r"])
