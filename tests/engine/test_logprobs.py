"""Log probabilities (engine/sample/logprobs.py, EngineCore): sampled tokens' and prompt tokens' raw
logprobs, ranks and top-k against an independent reference, Hugging Face transformers' forward of the
same tiny checkpoint (log_softmax of its fp32 logits). Also: batch composition and async scheduling
change nothing, chunked prefill and preemption record each prompt entry exactly once, and a request
whose sampling reads its history on the host is never overlapped with the step in flight."""

from __future__ import annotations

import pytest
import torch
from graphcache.config import Settings
from graphcache.engine.loop.core import EngineCore, _needs_host_history
from graphcache.engine.sched.scheduler import SchedulerOutput
from graphcache.engine.sequence import SamplingParams, Sequence, StructuredSpec
from graphcache.engine.worker.runner import ModelRunner
from helpers_model import cpu_settings, hf_logits, prompt_ids, tiny_checkpoint
from test_engine import FakeRunner

ATOL = 1e-4  # fp32 on both sides; observed differences ~1e-6


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("llama")  # random weights: flat distributions, ranks well above 1


def make_core(path, **overrides) -> EngineCore:
    settings = cpu_settings(path, **overrides)
    return EngineCore(ModelRunner(settings), settings)


def run(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]], between=None):
    """Add every request (streaming), step until done; per request the concatenated outputs:
    {"ids", "logprobs", "prompt_logprobs" (list of what each output carried), "seq"}."""
    got = {}
    for rid, prompt, params in requests:
        seq = Sequence(rid, list(prompt), SamplingParams(**vars(params)))
        core.check(seq)
        core.add_request(seq)
        got[rid] = {"ids": [], "logprobs": [], "prompt_logprobs": [], "seq": seq}
    for step in range(10_000):
        if not core.has_work():
            break
        if between is not None:
            between(step, core)
        for out in core.step() + core.stream_outputs():
            g = got[out.request_id]
            g["ids"] += out.token_ids
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.token_ids), "logprobs not aligned with token_ids"
                g["logprobs"] += out.logprobs
            g["prompt_logprobs"].append(out.prompt_logprobs)
    assert not core.has_work()
    return got


def ref_logprobs(path, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] fp32: log p(next token | ids[:i + 1]) from transformers."""
    return hf_logits(path, ids).log_softmax(dim=-1)


def check_entry(entry, token: int, ref_row: torch.Tensor, k: int) -> None:
    """One TokenLogprob against a reference row of log probabilities."""
    assert entry.token_id == token
    assert abs(entry.logprob - ref_row[token].item()) < ATOL
    # rank = 1 + tokens strictly more likely; a token within ATOL of the chosen one may go either way
    surely_above = int((ref_row > ref_row[token] + ATOL).sum())
    maybe_above = int((ref_row > ref_row[token] - ATOL).sum()) - 1
    assert surely_above + 1 <= entry.rank <= maybe_above + 1
    assert len(entry.top) == k
    values = [lp for _, lp in entry.top]
    assert values == sorted(values, reverse=True)
    ref_top = ref_row.topk(k)
    assert all(abs(a - b) < ATOL for a, b in zip(values, ref_top.values.tolist(), strict=True))
    for tid, lp in entry.top:
        assert abs(ref_row[tid].item() - lp) < ATOL
    if entry.rank <= k:
        assert token in [tid for tid, _ in entry.top]


def test_sampled_logprobs_equal_hf_for_greedy(path):
    prompt = prompt_ids(11, seed=4)
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=5)
    g = run(make_core(path), [("g", prompt, params)])["g"]
    ids, lps = g["ids"], g["logprobs"]
    assert len(ids) == len(lps) == 9
    ref = ref_logprobs(path, prompt + ids)
    for j, (token, entry) in enumerate(zip(ids, lps, strict=True)):
        check_entry(entry, token, ref[len(prompt) - 1 + j], 5)
        assert entry.rank == 1 and entry.top[0][0] == token  # greedy: the most likely token
    seq = g["seq"]
    assert seq.output_logprobs == lps
    assert seq.cumulative_logprob == pytest.approx(sum(e.logprob for e in lps))
    assert g["prompt_logprobs"] == [None] * len(g["prompt_logprobs"])  # not asked for


def test_random_sampling_logprobs_are_raw_and_ranked(path):
    """A sampled (not argmax) token: its raw logprob (no temperature), its true rank, and the top k
    holding it exactly when its rank is within k. logprobs=0: no alternatives."""
    prompt = prompt_ids(7, seed=5)
    reqs = [
        ("hot", prompt, SamplingParams(max_tokens=12, temperature=3.0, seed=7, ignore_eos=True, logprobs=4)),
        ("zero", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)),
    ]
    got = run(make_core(path), reqs)
    hot = got["hot"]
    ref = ref_logprobs(path, prompt + hot["ids"])
    for j, (token, entry) in enumerate(zip(hot["ids"], hot["logprobs"], strict=True)):
        check_entry(entry, token, ref[len(prompt) - 1 + j], 4)
    assert any(e.rank > 1 for e in hot["logprobs"]), "temperature 3 should sample some non-argmax tokens"
    assert [e.top for e in got["zero"]["logprobs"]] == [[]] * 3


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_prompt_logprobs_equal_hf_with_chunked_prefill(path, async_scheduling):
    """Two prompts, one 45 tokens long with a 16-token step budget (prefilled in 3 chunks): entry 0
    None, entry i = log p(prompt[i] | prompt[:i]), delivered once, in the first output."""
    short, long = prompt_ids(6, seed=8), prompt_ids(45, seed=9)
    reqs = [
        ("short", short, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)),
        (
            "long",
            long,
            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3, logprobs=1),
        ),
    ]
    got = run(make_core(path, max_num_batched_tokens=16, async_scheduling=async_scheduling), reqs)
    for rid, prompt, params in reqs:
        outputs = got[rid]["prompt_logprobs"]
        assert outputs[0] is not None and all(o is None for o in outputs[1:])
        entries = outputs[0]
        assert len(entries) == len(prompt) and entries[0] is None
        ref = ref_logprobs(path, prompt)
        for i in range(1, len(prompt)):
            check_entry(entries[i], prompt[i], ref[i - 1], params.prompt_logprobs)
    ref = ref_logprobs(path, long + got["long"]["ids"])
    check_entry(got["long"]["logprobs"][0], got["long"]["ids"][0], ref[len(long) - 1], 1)


def test_logprobs_do_not_depend_on_batch_composition(path):
    target = (
        "t",
        prompt_ids(13, seed=10),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    )
    others = [
        (
            f"o{i}",
            prompt_ids(5 + 7 * i, seed=20 + i),
            SamplingParams(
                max_tokens=4 + i,
                temperature=0,
                ignore_eos=True,
                logprobs=[None, 2, 0][i % 3],
                prompt_logprobs=[1, None][i % 2],
            ),
        )
        for i in range(5)
    ]
    alone = run(make_core(path, max_num_batched_tokens=24), [target])["t"]
    together = run(make_core(path, max_num_batched_tokens=24), others[:3] + [target] + others[3:])["t"]
    assert together["ids"] == alone["ids"]
    assert_close(together["logprobs"], alone["logprobs"])
    assert_close(together["prompt_logprobs"][0][1:], alone["prompt_logprobs"][0][1:])


def assert_close(a, b, tol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.token_id, x.rank, [t for t, _ in x.top]) == (y.token_id, y.rank, [t for t, _ in y.top])
        assert abs(x.logprob - y.logprob) < tol
        assert all(abs(p - q) < tol for (_, p), (_, q) in zip(x.top, y.top, strict=True))


def test_async_scheduling_gives_the_same_logprobs(path):
    reqs = [
        (
            f"r{i}",
            prompt_ids(4 + 5 * i, seed=30 + i),
            SamplingParams(
                max_tokens=5 + 2 * i,
                temperature=0,
                ignore_eos=True,
                logprobs=2,
                prompt_logprobs=1 if i % 2 else None,
            ),
        )
        for i in range(5)
    ]
    results = [
        run(make_core(path, max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=mode), reqs)
        for mode in ("off", "on")
    ]
    for rid, _, params in reqs:
        off, on = results[0][rid], results[1][rid]
        assert on["ids"] == off["ids"]
        assert_close(on["logprobs"], off["logprobs"])
        if params.prompt_logprobs is not None:
            assert_close(on["prompt_logprobs"][0][1:], off["prompt_logprobs"][0][1:])


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_preempted_prefill_records_each_prompt_entry_once(path, async_scheduling):
    """A request preempted between chunks of its prompt re-prefills from position 0, here in bigger
    chunks (24 tokens, not 16): positions already recorded are not computed again; with async
    scheduling the chunk in flight (positions 16..31) and the recompute (0..23) both compute entries
    17..24, which are appended once."""
    prompt = prompt_ids(40, seed=40)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    preempt_at = 1 if async_scheduling == "off" else 2  # once the first chunk's entries are recorded
    spans = []

    def preempt_after_first_chunk(step, core):
        seq = core.requests["p"]
        if step == preempt_at:
            assert len(seq.prompt_logprobs) == 17, (
                "the first chunk (positions 0..15) should be recorded by now"
            )
            core.scheduler._preempt(seq, SchedulerOutput())
            core.scheduler.max_num_batched_tokens = 24
        if core._pending is not None and core._pending.plan.plan.prompt_logits:
            spans.append([(s.first_entry, len(s.targets)) for s in core._prompt_spans(core._pending.plan)])

    core = make_core(path, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    g = run(core, [("p", prompt, params)], between=preempt_after_first_chunk)["p"]
    assert g["seq"].num_preemptions == 1
    entries = g["prompt_logprobs"][0]
    assert len(entries) == len(prompt) and entries[0] is None
    ref = ref_logprobs(path, prompt)
    for i in range(1, len(prompt)):
        check_entry(entries[i], prompt[i], ref[i - 1], 2)
    if async_scheduling == "on":
        assert [(17, 16)] in spans and [(17, 8)] in spans, spans  # the overlap did happen


def test_prompt_logprobs_under_cache_pressure(path):
    """A KV cache too small for the batch: the scheduler preempts by recompute; every request still
    gets each prompt entry once and a logprob per output token."""
    reqs = [
        (
            f"c{i}",
            prompt_ids(18 + 3 * i, seed=50 + i),
            SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1),
        )
        for i in range(4)
    ]
    core = make_core(path, num_kv_blocks=24, max_num_batched_tokens=16)
    got = run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    for rid, prompt, _ in reqs:
        g = got[rid]
        assert len(g["ids"]) == len(g["logprobs"]) == 14
        entries = g["prompt_logprobs"][0]
        assert len(entries) == len(prompt)
        ref = ref_logprobs(path, prompt + g["ids"])
        for i in range(1, len(prompt)):
            check_entry(entries[i], prompt[i], ref[i - 1], 1)
        for j, (token, entry) in enumerate(zip(g["ids"], g["logprobs"], strict=True)):
            check_entry(entry, token, ref[len(prompt) - 1 + j], 1)


# --- the overlap rule ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", -0.1),
        ("repetition_penalty", 1.2),
        ("min_tokens", 2),
        ("bad_words_token_ids", [[3, 4]]),
        ("structured", StructuredSpec("json")),
    ],
)
def test_needs_host_history(field, value):
    assert not _needs_host_history(SamplingParams())
    assert not _needs_host_history(SamplingParams(logprobs=5, temperature=0.7, top_k=3, logit_bias={1: 2.0}))
    assert _needs_host_history(SamplingParams(**{field: value}))


def test_history_dependent_request_is_not_overlapped():
    """Async scheduling on: plain decodes are fed the in-flight step's token (placeholders); while a
    request with a penalty runs, every step completes the one in flight first (no placeholders)."""

    def placeholders(params):
        settings = Settings(max_num_seqs=4, max_num_batched_tokens=16, async_scheduling="on")
        core = EngineCore(FakeRunner(settings), settings)
        got = run(
            core, [("a", [1, 2, 3], params), ("b", [4, 5], SamplingParams(max_tokens=8, temperature=0))]
        )
        assert len(got["a"]["ids"]) == 10
        return sum(p.num_reqs if p.tokens is None else p.tokens.count(None) for p in core.runner.plans)

    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert placeholders(plain) > 5
    assert (
        placeholders(SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=0.5)) == 0
    )


def test_runner_returns_every_position_for_prompt_logits_seqs(path):
    """A batch mixing a decode, a flagged chunk and an unflagged prefill: prompt_logits holds the
    flagged chunk's logits at each of its positions (HF's), and the usual logits rows are unchanged."""
    from graphcache.engine.plan import StepPlan, StepSeq
    from helpers_model import Blocks

    runner = ModelRunner(cpu_settings(path))
    blocks = Blocks(runner.block_size)
    a, b, c = prompt_ids(9, seed=60), prompt_ids(14, seed=61), prompt_ids(6, seed=62)
    ta, tb, tc = blocks.table(len(a)), blocks.table(len(b)), blocks.table(len(c))
    runner.execute(StepPlan.standalone([StepSeq(a[:8], 0, ta, False), StepSeq(b[:5], 0, tb, False)]))

    def batch(flag: bool) -> StepPlan:
        return StepPlan.standalone(
            [
                StepSeq(b[5:], 5, tb, True, prompt_logits=flag),
                StepSeq([a[8]], 8, ta, True),
                StepSeq(c, 0, tc, True),
            ]
        )

    plain = runner.execute(batch(False))
    assert plain.prompt_logits is None
    plain_logits = plain.logits.clone()
    flagged = runner.execute(batch(True))
    assert flagged.mode == "eager" and flagged.prompt_logits.shape == (len(b) - 5, runner.vocab_size)
    assert (flagged.logits - plain_logits).abs().max().item() < ATOL
    assert (flagged.prompt_logits - hf_logits(path, b)[5:]).abs().max().item() < ATOL
