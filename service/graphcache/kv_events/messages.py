"""The wire shapes of vLLM's KV cache events (vllm/distributed/kv_events.py, v0.28), encoded as vLLM encodes them.

msgspec structs, msgpack. A batch is array_like: [ts, [events...], data_parallel_rank]. Each event is a
tagged map: {"type": "BlockStored", "block_hashes": [...], ...}, its fields at their default left out
(omit_defaults), as vLLM's publisher sends them and vLLM's router decodes them (it refuses events in the
older array form: "KV event must be a tagged map"). Block hashes are unsigned 64-bit ints (vLLM's
default ExternalBlockHash form; the router takes ints or bytes). group_idx is 0: one KV cache group.
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The base of the three events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks that became findable in the prefix cache, in token order: block i holds
    token_ids[i * block_size : (i + 1) * block_size]; the first one follows parent_block_hash."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer findable (evicted for reuse, or dropped by a reset)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Nothing is cached any more: forget every block of this replica."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


MEDIUM_GPU = "GPU"  # vLLM names the device tier so; the CPU fallback's cache is the same tier here

_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
