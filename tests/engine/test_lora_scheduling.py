"""The scheduler under --max-loras (engine/sched/lora_gate.py): at most that many distinct adapters among
the running requests, base requests never wait for a slot, the first request waiting for a slot is the next
adapter admitted (no starvation by a stream for the running adapters), and the prefix cache never serves
one adapter's KV (or the base model's) to another."""

from graphcache.engine.sched.block_manager import BlockManager
from graphcache.engine.sched.scheduler import Scheduler
from graphcache.engine.sequence import SamplingParams, Sequence


def make(max_loras=1, max_num_seqs=8):
    sched = Scheduler(
        BlockManager(64, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=256
    )
    sched.max_loras = max_loras
    return sched


def seq(rid, lora=None, prompt=None):
    # distinct prompts unless given: a shared prompt would wait for the in-flight block (prefix caching)
    ids = list(prompt) if prompt else [(7 * i + 3 * len(rid) + ord(rid[-1])) % 50 + 1 for i in range(9)]
    return Sequence(rid, ids, SamplingParams(max_tokens=4, lora_name=lora))


def running_adapters(sched):
    return {s.params.lora_name for s in sched.running if s.params.lora_name}


def test_adapters_are_bounded_base_requests_pass_and_the_waiting_adapter_is_next():
    sched = make(max_loras=1)
    a1, b1, base1, a2, base2 = seq("a1", "a"), seq("b1", "b"), seq("base1"), seq("a2", "a"), seq("base2")
    for s in (a1, b1, base1, a2, base2):
        sched.add(s)
    sched.schedule()
    # b1 waits for a slot; a2 (a running adapter) waits behind it so `a` can drain; base requests pass
    assert [s.request_id for s in sched.running] == ["a1", "base1", "base2"]
    assert [s.request_id for s in sched.waiting] == ["b1", "a2"]
    sched.add(seq("a3", "a"))
    sched.schedule()
    assert running_adapters(sched) == {"a"} and [s.request_id for s in sched.waiting] == ["b1", "a2", "a3"]
    sched.finish(a1, "stop")
    sched.schedule()
    assert running_adapters(sched) == {"b"}
    assert [s.request_id for s in sched.waiting] == ["a2", "a3"]


def test_two_slots_admit_two_adapters():
    sched = make(max_loras=2)
    for s in (seq("a1", "a"), seq("b1", "b"), seq("c1", "c"), seq("b2", "b")):
        sched.add(s)
    sched.schedule()
    assert running_adapters(sched) == {"a", "b"}
    assert [s.request_id for s in sched.waiting] == ["c1", "b2"]


def test_prefix_cache_is_kept_apart_per_adapter():
    sched = make(max_loras=4)
    prompt = tuple(range(1, 18))
    first = seq("a1", "a", prompt)
    sched.add(first)
    sched.schedule()  # computes and registers a's blocks
    sched.finish(first, "stop")
    bm = sched.block_manager
    bm.begin_step()  # blocks registered in a step are matched from the next one on
    same_adapter, other_adapter, base = (
        seq("a2", "a", prompt),
        seq("b1", "b", prompt),
        seq("base", None, prompt),
    )
    assert len(bm.match_prefix(same_adapter, 8).blocks) == 4
    assert bm.match_prefix(other_adapter, 8).blocks == []
    assert bm.match_prefix(base, 8).blocks == []
    bm.forget_adapter("a")  # unloaded: a new adapter of that name must not find the old one's KV
    assert bm.match_prefix(seq("a3", "a", prompt), 8).blocks == []
