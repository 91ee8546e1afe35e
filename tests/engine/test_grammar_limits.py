"""The limits structured output compiles and runs under (engine/structured.py, grammar_bounds.py,
grammar_compiler.py, grammar_matcher.py): deep, unsatisfiable, bomb and over-limit constraints are
InvalidRequests naming their field, never cached; the cache is bounded by bytes and says so in its
metric; a request whose masks cost too much per token is ended with a reason. The crash itself (a
native stack overflow) is tested against a real server: tests/reliability/test_grammar_hardening.py."""

from __future__ import annotations

import gc
import json
import threading

import pytest
from graphcache.engine.errors import InvalidRequest, QueueFull
from graphcache.engine.sample.grammar_bounds import grammar_depth, json_nesting_depth, ref_chain_depth
from graphcache.engine.sample.grammar_compiler import CompileExecutor, GrammarLimits, heap_bytes
from graphcache.engine.sample.structured import StructuredOutput
from graphcache.engine.sequence import SamplingParams, Sequence, StructuredSpec
from graphcache.engine.stopping import grammar_accepts, grammar_done, grammar_failure
from graphcache.metrics import Metrics
from graphcache.model.tokenizer import Tokenizer
from helpers_model import tiny_checkpoint


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def rule_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def structured(tokenizer):
    return StructuredOutput(tokenizer)


def refused(structured: StructuredOutput, kind: str, value, param: str = "guided_x") -> InvalidRequest:
    before = (structured.cache_len, structured.cache_bytes)
    with pytest.raises(InvalidRequest) as info:
        structured.check(StructuredSpec(kind, value), param)
    assert info.value.param == param
    assert (structured.cache_len, structured.cache_bytes) == before  # nothing failed is cached
    return info.value


def test_depth_measures():
    assert json_nesting_depth({"a": [{"b": 1}]}) == 3 and json_nesting_depth(5) == 0
    assert ref_chain_depth(ref_chain(10)) == 11  # d0 .. d10 (the entry ref included)
    recursive = {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
    }
    assert ref_chain_depth(recursive) == 1  # recursion ends a chain
    assert grammar_depth(rule_chain(10)) == 12
    assert grammar_depth('start: "a" r\nr: /[a-z]+/ | "start"\n') == 2  # strings and regexes hold no refs
    assert grammar_depth("root ::= item+\nitem ::= [a-z]\n") == 2  # GBNF
    assert ref_chain_depth(ref_chain(100_000), limit=128) == 129  # stops at the limit


@pytest.mark.parametrize(
    "kind,value,what",
    [
        ("json_schema", json.dumps(ref_chain(1000)), "$ref chain"),
        ("grammar", rule_chain(5000), "grammar rule chain"),
        ("regex", "(" * 500 + "a" + ")" * 500, "regex group nesting"),
        (
            "grammar",
            'start: call\ncall: "x" args\nargs: %json ' + json.dumps(ref_chain(1000)) + "\n",
            "$ref chain",
        ),
    ],
)
def test_deep_constraints_are_refused_before_compiling(structured, kind, value, what):
    error = refused(structured, kind, value)
    assert what in error.message and "grammar_max_depth" in error.message


@pytest.mark.parametrize(
    "kind,value",
    [
        ("grammar", "start: start"),
        ("json_schema", json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})),
    ],
)
def test_unsatisfiable_constraints_are_refused(structured, kind, value):
    assert "can never be satisfied" in refused(structured, kind, value).message


@pytest.mark.parametrize("pattern", ["a{1000}{1000}", "x{100000}"])
def test_regex_bombs_are_refused_every_time_and_never_cached(structured, pattern):
    for _ in range(2):  # the same bomb again is refused again (no poisoned entry answers it)
        assert "limits" in refused(structured, "regex", pattern, "guided_regex").message


def test_refused_bombs_free_their_memory_when_refused(structured):
    """Issue 35 item 8: a refused compile's matcher (~15 MB of lexer states for a bomb) stayed alive in the
    frames of its exception's traceback, which sits in reference cycles only the cyclic GC frees: with the
    GC held off, 12 distinct bombs kept ~180 MB of C heap. Now it is freed as the compile is refused."""
    if heap_bytes() is None:
        pytest.skip("needs glibc's mallinfo2")
    refused(structured, "regex", "a{1000}{999}", "guided_regex")  # first compile: the library's own state
    gc.collect()
    before = heap_bytes()
    gc.disable()
    try:
        for i in range(12):  # distinct bombs: none could share anything with another
            pattern = f"a{{1000}}{{{1001 + i}}}" if i % 2 else f"x{{{100001 + i}}}"
            refused(structured, "regex", pattern, "guided_regex")
        grown = heap_bytes() - before
    finally:
        gc.enable()
    assert grown < 32 << 20, f"the C heap kept {grown / (1 << 20):.0f} MiB after 12 refused bombs"


def test_a_choice_past_the_parsers_row_limit_compiles_and_matches(structured, tokenizer):
    choices = tuple(f"item{i}" for i in range(2500))
    spec = StructuredSpec("choice", choices)
    seq = Sequence("c", [5], SamplingParams(structured=spec))
    seq.grammar = structured.new_matcher(spec, structured.check(spec, "guided_choice"))
    for token in tokenizer.encode("item2499", add_special_tokens=False):
        assert grammar_accepts(seq, token), grammar_failure(seq)
    assert grammar_done(seq) or seq.grammar.is_accepting()


def test_a_grammar_past_the_limits_mid_output_ends_with_the_reason(structured, tokenizer):
    # The row of 2,501 items is reached only after a free word and ";": the compile-time probe (one token) passes.
    prefix = "abcdefgh;"
    grammar = 'start: /[a-z]{1,30}/ ";" item\nitem: ' + " | ".join(f'"x{i}"' for i in range(2501)) + "\n"
    spec = StructuredSpec("grammar", grammar)
    seq = Sequence("g", [5], SamplingParams(structured=spec))
    seq.grammar = structured.new_matcher(spec, structured.check(spec, "guided_grammar"))
    ok = True
    for token in tokenizer.encode(prefix + "x1", add_special_tokens=False):
        structured.allowed_token_ids(seq)  # the engine masks before each token
        ok = grammar_accepts(seq, token)
        if not ok:
            break
    assert not ok and not grammar_done(seq)  # an error finish with the reason, never an empty "stop"
    assert "limits" in grammar_failure(seq) and "simplify" in grammar_failure(seq)


def test_the_cache_is_bounded_by_bytes_and_reports_them(tokenizer):
    metrics = Metrics()
    small = StructuredOutput(tokenizer, limits=GrammarLimits(cache_bytes=600_000), metrics=metrics)
    sizes = []
    for i in range(6):
        entry = small.check(
            StructuredSpec(
                "json_schema",
                json.dumps(
                    {"type": "object", "properties": {f"k{i}_{j}": {"type": "string"} for j in range(20)}}
                ),
            )
        )
        assert entry.nbytes > 0
        sizes.append(entry.nbytes)
        assert small.cache_bytes <= 600_000
        assert metrics.grammar_cache_bytes._value.get() == small.cache_bytes
    assert small.cache_len < 6 or sum(sizes) <= 600_000
    tiny = StructuredOutput(tokenizer, limits=GrammarLimits(cache_bytes=1))
    tiny.check(StructuredSpec("regex", "[a-z]+"))  # larger than the whole budget: served, not kept
    assert tiny.cache_len == 0 and tiny.cache_bytes == 0


def test_a_request_whose_masks_cost_too_much_is_ended(tokenizer):
    # A bound no mask can meet (1 ns): the first step's parallel call is over it, so the row is watched,
    # timed for `mask_window` tokens on its own, and then failed with its cost.
    slow = StructuredOutput(tokenizer, limits=GrammarLimits(mask_ms_per_token=1e-6, mask_window=3))
    spec = StructuredSpec("regex", "[a-z]{200}")
    seq = Sequence("s", [5], SamplingParams(structured=spec))
    seq.grammar = slow.new_matcher(spec)
    token = tokenizer.encode("a", add_special_tokens=False)[0]
    steps = 0
    while grammar_accepts(seq, token):
        slow.allowed_token_ids(seq)
        steps += 1
        assert steps < 10
    assert steps == 4  # one parallel step over the bound, then three timed ones
    assert "grammar_mask_ms_per_token" in grammar_failure(seq)
    # A cheap request under a sane bound is never watched for long and never failed.
    fast = StructuredOutput(tokenizer, limits=GrammarLimits(mask_ms_per_token=1000.0, mask_window=3))
    other = Sequence("f", [5], SamplingParams(structured=spec))
    other.grammar = fast.new_matcher(spec)
    for _ in range(20):
        fast.allowed_token_ids(other)
        assert grammar_accepts(other, token)


def test_compiles_run_on_big_stack_threads_and_the_queue_is_bounded():
    executor = CompileExecutor(threads=1, queue_limit=0, stack_mib=64)
    assert executor.run(threading.current_thread).name.startswith("grammar-compile")
    gate, started = threading.Event(), threading.Event()

    def block():
        started.set()
        gate.wait(10)

    worker = threading.Thread(target=executor.run, args=(block,))
    worker.start()
    started.wait(10)
    with pytest.raises(QueueFull):
        executor.run(lambda: None)  # one running, none may wait
    gate.set()
    worker.join(10)
    assert executor.run(lambda: 7) == 7


@pytest.mark.parametrize("stream", [False, True])
def test_a_too_costly_constraint_answers_400_not_500_over_http(tmp_path, stream):
    # The same bound no mask can meet, through the app: the request's own constraint is at fault, so a
    # non-streamed answer is a 400 naming the field that set it; a stream (200 sent) ends with that error.
    import asyncio

    from graphcache.config import Settings
    from helpers_api import serving

    settings = Settings(
        cache_dir=tmp_path,
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=128,
        warmup_decode_sizes=[1],
        capture_sizes=[1, 2, 4],
        grammar_mask_ms_per_token=1e-6,
        grammar_mask_window=3,
    )
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "stream": stream,
        "structured_outputs": {"regex": "[a-z]{200}"},
    }

    async def ask():
        async with serving(settings) as (client, _):
            return await client.post("/v1/chat/completions", json=body)

    r = asyncio.run(ask())
    if not stream:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    else:
        assert r.status_code == 200
        events = [
            json.loads(line[6:])
            for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        error = events[-1]["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "output_constraint_too_complex"
    assert error["param"] == "structured_outputs"
    assert "grammar_mask_ms_per_token" in error["message"]
