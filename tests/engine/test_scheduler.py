"""Scheduler: continuous batching, chunked prefill, preemption by recompute, abort, budgets.

A tiny fake "model" checks the plans: it writes each fed token into the KV slots named by the
block table and, when logits are due, reads the whole sequence back from the slots. If the
scheduler or block manager ever fed a wrong slice, position or table, the readback differs.
"""

from graphcache.engine.sched.block_manager import BlockManager
from graphcache.engine.sched.scheduler import Scheduler
from graphcache.engine.sequence import SamplingParams, Sequence, SequenceStatus


def make(
    num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_step=32, max_model_len=256, prefix_caching=True
):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(
        bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens_step, max_model_len=max_model_len
    )


def seq(rid, n_prompt, max_tokens=8):
    return Sequence(
        rid, [(7 * i + len(rid)) % 50 + 1 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens)
    )


class FakeKV:
    """Reads only the step plans, as the worker does: the block tables it holds come from the plans' new
    requests and grown blocks, and a request it was told to drop is gone."""

    def __init__(self, sched):
        self.bs = sched.block_manager.block_size
        self.slots = {}
        self.tables = {}  # key -> block table, from the plans alone

    def run(self, out):
        plan = out.plan
        if plan is None:  # nothing scheduled
            return None
        for key in plan.finished:
            self.tables.pop(key, None)
        for new in plan.new:
            self.tables[new.key] = list(new.block_table)
        for key, blocks in plan.grown:
            self.tables[key] += blocks
        for i, (s, key) in enumerate(zip(out.seqs, plan.keys, strict=True)):
            assert key == s.key
            table, start, fed = self.tables[key], plan.starts[i], plan.fed(i)
            assert fed is not None  # no token in flight: postprocess ran before this step was scheduled
            for j, tok in enumerate(fed):
                pos = start + j
                self.slots[table[pos // self.bs] * self.bs + pos % self.bs] = tok
            if plan.need_logits is None or plan.need_logits[i]:
                end = start + len(fed)
                seen = [self.slots[table[p // self.bs] * self.bs + p % self.bs] for p in range(end)]
                assert seen == s.all_token_ids, f"KV readback differs for {s.request_id}"
        return plan


def step(sched, kv):
    """Schedule, 'run', then let the scheduler's own postprocess append a token to each sampled
    sequence and finish it at max_tokens (the same bookkeeping the engine core uses)."""
    plan = sched.schedule()
    assert plan.num_tokens <= sched.max_num_batched_tokens
    assert len(plan.scheduled) <= sched.max_num_seqs
    kv.run(plan)
    tokens = [s.seq.num_tokens % 50 + 1 for s in plan.scheduled if s.need_logits]
    sched.postprocess(plan, tokens, now=0.0)
    return plan


def run_all(sched, seqs, max_steps=10_000, kv=None):
    kv = kv or FakeKV(sched)  # pass the same one to later runs: their cache hits read its slots
    for s in seqs:
        sched.add(s)
    plans = []
    for _ in range(max_steps):
        if not sched.has_work():
            break
        plans.append(step(sched, kv))
    assert not sched.has_work(), "scheduler did not finish (deadlock?)"
    assert sched.block_manager.num_free == sched.block_manager.num_usable, "leaked KV blocks"
    return plans


def test_continuous_batching_admits_as_others_finish():
    sched = make(max_num_seqs=2)
    seqs = [seq("a", 3, max_tokens=2), seq("b", 3, max_tokens=6), seq("c", 3, max_tokens=2)]
    plans = run_all(sched, seqs)
    # c joins while b is still running, as soon as a finished (not after the whole batch drains)
    ids = [{s.seq.request_id for s in p.scheduled} for p in plans]
    first_c = next(i for i, x in enumerate(ids) if "c" in x)
    assert "b" in ids[first_c]
    assert all(len(x) <= 2 for x in ids)
    assert all(s.finish_reason == "length" and s.num_output_tokens == s.params.max_tokens for s in seqs)


def test_chunked_prefill_of_a_long_prompt():
    sched = make(max_tokens_step=16, num_blocks=64)
    long = seq("long", 40, max_tokens=3)
    plans = run_all(sched, [long])
    prefill = [p.scheduled[0] for p in plans[:3]]
    assert [s.num_tokens for s in prefill] == [16, 16, 8]
    assert [s.need_logits for s in prefill] == [False, False, True]
    assert all(len(p.scheduled[0].seq.token_slice(0, 1)) == 1 for p in plans)
    assert long.num_output_tokens == 3


def test_decodes_first_then_prefill_chunks_in_leftover_budget():
    sched = make(max_tokens_step=16)
    kv = FakeKV(sched)
    a = seq("a", 4)
    sched.add(a)
    step(sched, kv)  # a prefilled, now decoding
    b = seq("b", 40)
    sched.add(b)
    plan = step(sched, kv)
    assert [(s.seq.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 1), ("b", 15)]
    assert not plan.plan.uniform_decode


def test_budgets_respected_with_many_requests():
    sched = make(max_num_seqs=3, max_tokens_step=10, num_blocks=200)
    seqs = [seq(f"r{i}", 5 + 3 * i, max_tokens=4) for i in range(10)]
    run_all(sched, seqs)  # step() asserts both budgets every step
    assert all(s.num_output_tokens == 4 for s in seqs)


def test_preemption_by_recompute_resumes_with_outputs_kept():
    # 6 blocks x 4 tokens = 24 slots; three sequences that grow to 12 tokens each cannot all fit.
    sched = make(num_blocks=6, block_size=4, max_tokens_step=64)
    seqs = [seq(f"s{i}", 4, max_tokens=8) for i in range(3)]
    kv = FakeKV(sched)
    for s in seqs:
        sched.add(s)
    preempted = []
    for _ in range(200):
        if not sched.has_work():
            break
        plan = step(sched, kv)
        preempted += plan.preempted
        for p in plan.preempted:  # the newest running one goes back, blocks freed, outputs kept
            assert p.status is SequenceStatus.WAITING and p.block_table == [] and p.num_computed_tokens == 0
            assert sched.waiting[0] is p or p in sched.waiting
    assert preempted and preempted[0] is seqs[2]
    assert sched.num_preemptions == len(preempted)
    assert all(s.num_output_tokens == 8 and s.finish_reason == "length" for s in seqs)
    assert sched.block_manager.num_free == sched.block_manager.num_usable


def test_resumed_sequence_reprefills_prompt_plus_outputs():
    # Without prefix caching the whole prompt + outputs is recomputed (with it, see
    # test_prefix_caching.py: the resumed sequence finds its own blocks again).
    sched = make(num_blocks=3, block_size=4, max_tokens_step=64, prefix_caching=False)
    a, b = seq("a", 4, max_tokens=6), seq("b", 4, max_tokens=6)
    kv = FakeKV(sched)
    sched.add(a)
    sched.add(b)
    while not any(p is b for p in step(sched, kv).preempted):
        pass
    n_out = b.num_output_tokens
    assert sched.num_recomputed_tokens == 0
    while b.status is SequenceStatus.WAITING:
        plan = step(sched, kv)
    resumed = next(s for s in plan.scheduled if s.seq is b)
    assert resumed.num_tokens == 4 + n_out and resumed.need_logits  # FakeKV verified the readback
    # vllm:prompt_tokens_recomputed: the KV preemption freed (all but the newest, unfed token) is
    # computed again; nothing came from a prefix cache.
    assert sched.num_recomputed_tokens == 4 + n_out - 1 and b.num_freed_computed == 0
    while sched.has_work():
        step(sched, kv)
    assert b.num_output_tokens == 6


def test_sequence_that_can_never_fit_fails_instead_of_spinning():
    sched = make(num_blocks=2, block_size=4, max_tokens_step=64)
    big = seq("big", 6, max_tokens=10)  # needs 4 blocks eventually, the cache has 2
    small = seq("small", 2, max_tokens=2)
    plans = run_all(sched, [big, small])
    assert big.finish_reason == "error" and "num_kv_blocks" in big.error
    assert any(big in p.failed for p in plans)
    assert small.finish_reason == "length"

    sched = make(num_blocks=2, block_size=4)
    huge = seq("huge", 20)  # prompt alone does not fit: failed at admission
    run_all(sched, [huge])
    assert huge.finish_reason == "error"


def test_abort_frees_blocks_at_once():
    sched = make()
    kv = FakeKV(sched)
    a, b = seq("a", 9), seq("b", 5)
    sched.add(a)
    sched.add(b)
    step(sched, kv)
    assert sched.block_manager.num_used > 0
    sched.finish(a, "abort")
    assert a.finish_reason == "abort" and a.block_table == []
    sched.finish(b, "abort")
    assert sched.block_manager.num_used == 0 and not sched.has_work()
    c = seq("c", 3)
    sched.add(c)
    sched.finish(c, "abort")  # aborting while still waiting works too
    assert c.finish_reason == "abort" and not sched.waiting


# --- prefix caching (FakeKV checks every readback, so a wrongly shared block fails there) ---------


def tseq(rid, tokens, max_tokens=4, **params):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **params))


def first_slice(plans, s):
    return next(x for p in plans for x in p.scheduled if x.seq is s)


def test_cached_prefix_skips_compute_and_reports_cached_tokens():
    sched = make(block_size=4)
    kv = FakeKV(sched)
    shared = list(range(1, 13))  # 3 full blocks
    a = tseq("a", shared + [40, 41])
    run_all(sched, kv=kv, seqs=[a])
    b = tseq("b", shared + [42, 43, 44])
    plans = run_all(sched, kv=kv, seqs=[b])
    first = first_slice(plans, b)
    assert (first.start, first.num_tokens, first.need_logits) == (12, 3, True)
    assert b.num_cached_tokens == 12 and b.num_output_tokens == 4
    bm = sched.block_manager
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (14 + 15, 12)


def test_a_fully_cached_prompt_still_computes_its_last_block():
    sched = make(block_size=4)
    kv = FakeKV(sched)
    prompt = list(range(1, 13))  # exactly 3 blocks
    run_all(sched, kv=kv, seqs=[tseq("a", prompt)])
    b = tseq("b", prompt)
    first = first_slice(run_all(sched, kv=kv, seqs=[b]), b)
    # The last block is recomputed into a private block: logits exist and no shared block is written.
    assert (first.start, first.num_tokens, first.need_logits) == (8, 4, True)
    c = tseq("c", prompt[:9])  # 2 full blocks + 1 token
    first = first_slice(run_all(sched, kv=kv, seqs=[c]), c)
    assert (first.start, first.num_tokens) == (8, 1)


def test_prompt_logprobs_requests_do_not_use_the_cache():
    sched = make(block_size=4)
    kv = FakeKV(sched)
    prompt = list(range(1, 15))
    run_all(sched, kv=kv, seqs=[tseq("a", prompt)])
    b = tseq("b", prompt, prompt_logprobs=0)
    first = first_slice(run_all(sched, kv=kv, seqs=[b]), b)
    assert (first.start, first.num_tokens) == (0, 14) and b.num_cached_tokens == 0


def test_identical_prompts_submitted_together_compute_shared_blocks_once():
    sched = make(block_size=4, max_tokens_step=64)
    kv = FakeKV(sched)
    prompt = list(range(1, 15))  # 3 full blocks + 2 tokens
    seqs = [tseq(f"n{i}", prompt) for i in range(4)]
    plans = run_all(sched, seqs, kv=kv)
    # Step 1: only the first (the others' next block is being computed); step 2: the rest, 2 tokens each.
    assert [(x.seq.request_id, x.start, x.num_tokens) for x in plans[0].scheduled] == [("n0", 0, 14)]
    assert [(x.seq.request_id, x.start, x.num_tokens) for x in plans[1].scheduled][1:] == [
        ("n1", 12, 2),
        ("n2", 12, 2),
        ("n3", 12, 2),
    ]
    prefill = sum(x.num_tokens for p in plans for x in p.scheduled if x.start < 14)
    assert prefill == 14 + 3 * 2
    assert all(s.num_output_tokens == 4 for s in seqs)


def test_a_waiting_sequence_waits_for_a_chunked_prefill_computing_its_blocks_fcfs():
    sched = make(block_size=4, max_tokens_step=8)
    kv = FakeKV(sched)
    prompt = list(range(1, 31))  # 30 tokens: 4 chunks of 8
    a, b = tseq("a", prompt), tseq("b", prompt[:28] + [49])
    other = tseq("other", [33, 34, 35])  # unrelated, behind b: FCFS keeps it behind
    plans = run_all(sched, kv=kv, seqs=[a, b, other])
    b_first, other_first = first_slice(plans, b), first_slice(plans, other)
    step_of = {id(x): i for i, p in enumerate(plans) for x in p.scheduled}
    a_last_prefill = max(i for i, p in enumerate(plans) for x in p.scheduled if x.seq is a and x.start < 30)
    assert step_of[id(b_first)] > a_last_prefill  # b waited for a's prefill to land
    assert (b_first.start, b_first.num_tokens) == (28, 1)  # and then found all 7 of its full blocks
    assert step_of[id(other_first)] >= step_of[id(b_first)]


def test_preempted_sequence_finds_its_own_blocks_and_shared_blocks_survive_preemption():
    # 7 blocks of 4: three sequences sharing a 2-block prefix grow until someone is preempted.
    sched = make(num_blocks=7, block_size=4, max_tokens_step=64)
    prefix = list(range(1, 9))
    seqs = [tseq(f"p{i}", prefix + [20 + i], max_tokens=10) for i in range(3)]
    kv = FakeKV(sched)
    for s in seqs:
        sched.add(s)
    resumed = []
    for _ in range(500):
        if not sched.has_work():
            break
        waiting_before = [s for s in sched.waiting if s.num_preemptions]
        plan = step(sched, kv)
        resumed += [x for x in plan.scheduled if x.seq in waiting_before]
    assert not sched.has_work() and sched.num_preemptions > 0
    assert any(x.start > 0 for x in resumed)  # re-prefill started after cached blocks
    assert all(s.num_output_tokens == 10 and s.finish_reason == "length" for s in seqs)
    assert sched.block_manager.num_free == sched.block_manager.num_usable


def test_prefix_caching_off_computes_everything():
    sched = make(block_size=4, max_tokens_step=64, prefix_caching=False)
    kv = FakeKV(sched)
    prompt = list(range(1, 15))
    run_all(sched, kv=kv, seqs=[tseq("a", prompt)])
    seqs = [tseq(f"b{i}", prompt) for i in range(3)]
    plans = run_all(sched, seqs, kv=kv)
    assert [(x.start, x.num_tokens) for x in plans[0].scheduled] == [(0, 14)] * 3
    bm = sched.block_manager
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == 0 and all(
        s.num_cached_tokens == 0 for s in seqs
    )


def test_an_error_finish_forgets_the_blocks_it_computed():
    sched = make(block_size=4)
    kv = FakeKV(sched)
    a = tseq("a", list(range(1, 15)))
    sched.add(a)
    step(sched, kv)
    sched.finish(a, "error", "step failed")  # as EngineCore._step_failed does
    b = tseq("b", list(range(1, 15)))
    first = first_slice(run_all(sched, kv=kv, seqs=[b]), b)
    assert first.start == 0
