"""KV cache events (--kv-events-config) decoded as a vLLM subscriber decodes them, checked against the
block manager's real stores and evictions on the tiny model with a tiny KV cache: every published batch,
applied in order, leaves the subscriber knowing exactly the prefixes the block manager can still match;
pressure evicts (BlockRemoved), a reset clears (AllBlocksCleared), and the replay socket gives back what a
subscriber missed."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import msgspec
import pytest
import zmq
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.loop.lora_admin import load_adapter, unload_adapter
from graphcache.engine.lora_modules import LoraModule
from graphcache.engine.sched.block_manager import BlockManager
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.worker.runner import ModelRunner
from graphcache.kv_events.config import KVEventsConfig, parse_kv_events_config
from graphcache.kv_events.messages import KVEventBatch as OurBatch
from graphcache.kv_events.messages import encode_batch
from graphcache.kv_events.publisher import ZmqEventPublisher
from graphcache.kv_events.recorder import KVEventRecorder
from helpers_model import cpu_settings, prompt_ids, tiny_checkpoint


# --- vLLM's message shapes (vllm/distributed/kv_events.py, v0.28), not the package's own -------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Index:
    """A router's view of one replica: hash -> (parent hash, its tokens), from the events alone."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                parent = ev.parent_block_hash
                assert parent is None or parent in self.blocks, "a stored block names an unknown parent"
                for i, h in enumerate(ev.block_hashes):
                    assert isinstance(h, int) and 0 <= h < 2**64
                    tokens = tuple(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                    self.blocks[h] = (parent, tokens)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in self.blocks, "a removed block was never stored"
                    del self.blocks[h]
            else:
                self.blocks.clear()

    def prefixes(self) -> set[tuple[int, ...]]:
        out = set()
        for h in self.blocks:
            tokens: tuple[int, ...] = ()
            cur: int | None = h
            while cur is not None:
                if cur not in self.blocks:  # its parent is gone: no lookup can reach it
                    break
                parent, own = self.blocks[cur]
                tokens = own + tokens
                cur = parent
            else:
                out.add(tokens)
        return out


def findable_prefixes(bm: BlockManager) -> set[tuple[int, ...]]:
    """Every token prefix the block manager's lookup can match: a registered block whose whole chain of
    parents is still registered (the same incarnations), with the tokens of that chain."""
    out = set()
    for key, _block in bm._cache.items():
        tokens: tuple[int, ...] = ()
        parent, own = key
        tokens = own
        ok = True
        while parent is not None:
            pblock, gen = parent
            pkey = bm._key[pblock]
            if pkey is None or bm._gen[pblock] != gen:
                ok = False
                break
            parent, own = pkey
            tokens = own + tokens
        if ok:
            out.add(tokens)
    return out


def events_config(port: int, replay: int | None = None, **extra) -> str:
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv", **extra}
    if replay is not None:
        cfg["replay_endpoint"] = f"tcp://*:{replay}"
    return msgspec.json.encode(cfg).decode()


def replay_all(port: int, start: int = 0) -> list[tuple[int, bytes]]:
    """The router's replay client: a DEALER sends (b"", start) and reads (b"", seq, payload) until END_SEQ.
    (vLLM's example uses REQ, which reads only the first answer of several.)"""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return out
            out.append((seq, payload))
    finally:
        dealer.close(0)


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("llama")


def test_the_stream_matches_the_block_managers_stores_evictions_and_clear(path):
    port, replay_port = free_port(), free_port()
    settings = cpu_settings(
        path, num_kv_blocks=24, max_num_batched_tokens=64, async_scheduling="off",
        kv_events_config=events_config(port, replay_port),
    )  # fmt: skip
    core = EngineCore(ModelRunner(settings), settings)
    bm = core.block_manager
    recorder = bm.events
    assert isinstance(recorder, KVEventRecorder)
    # What the block manager could match when each batch went out (flush is at the end of a step).
    snapshots: list[set[tuple[int, ...]]] = []
    publish = recorder._publish

    def publish_and_snapshot(batch):
        snapshots.append(findable_prefixes(bm))
        publish(batch)

    recorder._publish = publish_and_snapshot
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # the subscription reaches the PUB socket (a late joiner replays the rest)
    try:
        # A few dozen system prompts of 3-5 blocks, each with a user turn: 24 blocks of 4 hold two at most.
        systems = [prompt_ids(12 + 4 * (i % 3), seed=200 + i) for i in range(6)]
        greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        n = 0
        for _turn in range(3):
            for i, system in enumerate(systems):
                seq = Sequence(f"r{n}", system + prompt_ids(5, seed=300 + n), SamplingParams(**vars(greedy)))
                n += 1
                core.check(seq)
                core.add_request(seq)
                if i % 2 == 1:  # two at a time
                    while core.has_work():
                        core.step()
        before_reset = len(snapshots)
        assert bm.reset_prefix_cache() > 0
        core.flush_kv_events()
        assert findable_prefixes(bm) == set()
        deadline = time.monotonic() + 10
        live: list[tuple[int, bytes]] = []
        while len(live) < len(snapshots) and time.monotonic() < deadline:
            if sub.poll(100):
                topic, seq_bytes, payload = sub.recv_multipart()
                assert topic == b"kv"
                live.append((int.from_bytes(seq_bytes, "big"), payload))
        replayed = replay_all(replay_port)
    finally:
        sub.close(0)
        core.close()
    # Every batch, in order, from 0; the live stream is the same bytes (a late joiner misses a head).
    assert [s for s, _ in replayed] == list(range(len(snapshots)))
    assert live and live == replayed[len(replayed) - len(live) :]
    index = Index()
    kinds = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    for (_, payload), expected in zip(replayed, snapshots, strict=True):
        batch = DECODER.decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for ev in batch.events:
            kinds[type(ev).__name__] += 1
        index.apply(batch)
        assert index.prefixes() == expected
    assert kinds["BlockStored"] > 0 and kinds["BlockRemoved"] > 0, kinds  # stores, and pressure evicts
    last = DECODER.decode(replayed[-1][1])
    assert len(snapshots) > before_reset and isinstance(last.events[-1], AllBlocksCleared)
    assert index.blocks == {}
    stored = [ev for _, p in replayed for ev in DECODER.decode(p).events if isinstance(ev, BlockStored)]
    assert all(ev.block_size == 4 and ev.medium == "GPU" and ev.lora_id is None for ev in stored)
    assert all(ev.group_idx == 0 for ev in stored)
    # Events are tagged maps inside an array batch, as vLLM's router requires.
    raw = msgspec.msgpack.decode(replayed[0][1])
    assert isinstance(raw, list) and isinstance(raw[1][0], dict) and raw[1][0]["type"] == "BlockStored"


def test_the_same_prefix_has_the_same_hashes_on_two_replicas():
    batches: list[list[OurBatch]] = [[], []]
    for i in range(2):
        bm = BlockManager(16, 4)
        bm.events = KVEventRecorder(4, batches[i].append)
        seq = Sequence(f"s{i}", list(range(10, 23)), SamplingParams(max_tokens=1))
        bm.allocate(seq, 13)
        bm.commit(seq, 13)
        bm.events.flush()
    a, b = (msgspec.msgpack.encode(x[0].events) for x in batches)
    assert a == b
    (ev,) = batches[0][0].events
    assert len(ev.block_hashes) == 3 and ev.parent_block_hash is None and ev.token_ids == list(range(10, 22))


def test_a_full_queue_drops_and_counts_and_never_blocks():
    port = free_port()
    pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", f"tcp://*:{port}", max_queue_size=1))
    release, sending = threading.Event(), threading.Event()
    real_send = pub._send

    def slow_send(batch):
        sending.set()
        release.wait(5)
        real_send(batch)

    pub._send = slow_send
    try:
        pub.publish(OurBatch(1.0, []))
        assert sending.wait(5)  # the thread holds the first batch
        t0 = time.monotonic()
        for _ in range(5):
            pub.publish(OurBatch(2.0, []))
        assert time.monotonic() - t0 < 0.5
        assert pub.dropped == 4  # one waits in the queue of one
    finally:
        release.set()
        pub.close()
    assert pub.published == 2


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        ("[1]", "not an object"),
        ("{", "not JSON"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "is not one of"),
        ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "not a ZeroMQ address"),
        ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "positive integer"),
    ],
)
def test_bad_configs_are_refused_with_the_fix(text, fix):
    with pytest.raises(ValueError, match=fix):
        parse_kv_events_config(text)


def test_config_defaults_are_vllms():
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert cfg is not None and cfg.publishes and cfg.endpoint == "tcp://*:5557" and cfg.topic == ""
    off = parse_kv_events_config('{"publisher": "zmq"}')
    assert off is not None and not off.publishes
    assert parse_kv_events_config(None) is None


# --- LoRA: the adapter's blocks are its own, and their events name it -------------------------------


def _stored(batches: list[OurBatch]) -> list[BlockStored]:
    """The stored events of our batches, as vLLM's decoder reads them off the wire."""
    return [
        ev for b in batches for ev in DECODER.decode(encode_batch(b)).events if isinstance(ev, BlockStored)
    ]


def test_an_adapters_chain_carries_its_id_and_name_and_hashes_apart_from_the_base_models():
    batches: list[OurBatch] = []
    bm = BlockManager(32, 4)
    bm.events = KVEventRecorder(4, batches.append)
    bm.lora_ids = {"a": 1, "b": 2}.get
    tokens = list(range(10, 23))  # 3 full blocks
    for i, lora in enumerate((None, "a", "b")):
        seq = Sequence(f"s{i}", list(tokens), SamplingParams(max_tokens=1, lora_name=lora))
        bm.allocate(seq, 13)
        bm.commit(seq, 13)
    bm.events.flush()
    base, a, b = _stored(batches)
    assert (base.lora_id, base.lora_name) == (None, None)
    assert (a.lora_id, a.lora_name) == (1, "a") and (b.lora_id, b.lora_name) == (2, "b")
    for ev in (base, a, b):  # each chain starts at the root; the adapter is in its first hash
        assert ev.parent_block_hash is None and ev.token_ids == tokens[:12] and len(ev.block_hashes) == 3
    assert len({h for ev in (base, a, b) for h in ev.block_hashes}) == 9
    # The two fields are always on the wire (vLLM's router requires them), nil for the base model.
    raw = msgspec.msgpack.decode(encode_batch(batches[0]))[1]
    assert [(e["lora_id"], e["lora_name"]) for e in raw] == [(None, None), (1, "a"), (2, "b")]


@pytest.fixture(scope="module")
def adapters(path):
    pytest.importorskip("peft")
    from helpers_lora import peft_adapter

    return {
        "a": peft_adapter(path, r=4, alpha=8, seed=11)[0],
        "b": peft_adapter(path, r=4, alpha=8, seed=12)[0],
    }


def test_lora_requests_hit_only_their_adapters_blocks_and_their_events_carry_its_id(path, adapters):
    """Through the real engine: the same prompt through the base model, adapter a, adapter b and a again;
    each finds only its own model's blocks, and each chain's events name its adapter (a reload of a gets a
    new id and new hashes)."""
    settings = cpu_settings(
        path, async_scheduling="off", kv_events_config=events_config(free_port()),
        enable_lora=True, lora_modules=[f"{n}={p}" for n, p in adapters.items()], max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    core = EngineCore(ModelRunner(settings), settings)
    batches: list[OurBatch] = []
    recorder = core.block_manager.events
    assert isinstance(recorder, KVEventRecorder)
    recorder._publish = batches.append
    prompt = prompt_ids(18, seed=500)  # 4 full blocks of 4, then 2 tokens

    def run(lora: str | None) -> tuple[int, list[BlockStored]]:
        """(prompt tokens found in the prefix cache, the blocks the run stored)."""
        seq = Sequence(f"r{len(batches)}-{lora}", list(prompt), SamplingParams(max_tokens=2, temperature=0, lora_name=lora))  # fmt: skip
        core.check(seq)
        core.add_request(seq)
        while core.has_work():
            core.step()
        core.flush_kv_events()
        stored = _stored(batches)
        batches.clear()
        return seq.num_cached_tokens, stored

    try:
        modules = core.runner.lora.modules
        assert (modules.lora_id("a"), modules.lora_id("b")) == (1, 2)  # --lora-modules order, from 1
        chains: dict[str, list[BlockStored]] = {}
        cached, chains["base"] = run(None)
        assert cached == 0 and all((e.lora_id, e.lora_name) == (None, None) for e in chains["base"])
        for name in ("a", "b"):  # the base model's blocks (and the other adapter's) hold other KV: no hit
            cached, chains[name] = run(name)
            assert cached == 0
            assert all((e.lora_id, e.lora_name) == (modules.lora_id(name), name) for e in chains[name])
        assert run("a") == (16, [])  # its own 4 blocks; nothing new to announce
        assert run(None) == (16, [])
        # Unload and load a again (other weights may be behind the name): a new id, its own blocks.
        assert unload_adapter(core.runner.lora, core.scheduler, "a")[0] == 200
        again = LoraModule("a", str(adapters["a"]))
        image = core.runner.lora.read_checked(again)  # off the engine thread in the engine (admin_calls.py)
        assert load_adapter(core.runner.lora, core.scheduler, again, image)[0] == 200
        assert modules.lora_id("a") == 3
        cached, chains["a again"] = run("a")
        assert cached == 0 and all((e.lora_id, e.lora_name) == (3, "a") for e in chains["a again"])
    finally:
        core.close()
    hashes = {name: [h for e in stored for h in e.block_hashes] for name, stored in chains.items()}
    assert all(len(h) == 4 for h in hashes.values()), hashes  # 18 tokens: 4 full blocks each
    assert len({h for hs in hashes.values() for h in hs}) == 16  # four chains, no hash shared
    assert all(stored[0].parent_block_hash is None for stored in chains.values())
