"""KVEventRecorder: what the block manager tells of its prefix cache, as vLLM's events, batched per step.

The block manager calls `stored` when a full block becomes findable, `removed` when it stops being
findable, `cleared` when nothing is; the engine calls `flush` after each step (and between steps), which
hands the step's events to the publisher as one KVEventBatch. Everything here runs on the engine thread
and costs a list append (plus one 8-byte hash per stored block); encoding and sending are the
publisher's thread's.

Block hashes: the block manager identifies a registered block by (block id, generation) and keys it by
(parent identity, its tokens). The events name a block by a content hash instead: blake2b-64 of the
parent's hash and the block's token ids, so the same prefix has the same hashes on every replica and
across restarts (vLLM's own hashes are also a chain over token ids; the router's kv_aware index keys
blocks by the token ids the events carry and uses these hashes to link a block to its parent and to
remove it).

LoRA: a block computed through an adapter holds other KV than the same tokens through the base model, so
its chain's first hash is seeded with the adapter's id and name (as vLLM puts the adapter in the first
block's extra keys), and its BlockStored events carry lora_id (the server's integer id of the adapter) and
lora_name, as vLLM's do; the base model's carry None in both.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from hashlib import blake2b
from typing import NamedTuple

from graphcache.kv_events.messages import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

# (block id, generation): the block manager's identity of one registered incarnation of a block.
Identity = tuple[int, int]


class LoraTag(NamedTuple):
    """The LoRA adapter a chain of blocks was computed through."""

    lora_id: int | None  # the server's integer id of the adapter (vLLM's lora_int_id); None: not known
    lora_name: str


def block_hash(parent: int | None, token_ids: Sequence[int], lora: LoraTag | None = None) -> int:
    """The block's content hash: an unsigned 64-bit int over the parent's hash (or, for a chain's first
    block, its adapter: None for the base model) and its token ids."""
    h = blake2b(digest_size=8)
    h.update((parent if parent is not None else 0).to_bytes(8, "little"))
    h.update(b"\x01" if parent is not None else b"\x00")
    if parent is None and lora is not None:
        name = lora.lora_name.encode()
        h.update(b"\x02" + (lora.lora_id or 0).to_bytes(8, "little") + len(name).to_bytes(4, "little") + name)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class KVEventRecorder:
    def __init__(self, block_size: int, publish: Callable[[KVEventBatch], None]) -> None:
        self.block_size = block_size
        self._publish = publish
        self._hashes: dict[Identity, int] = {}  # announced blocks still findable -> their hash
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    @property
    def num_announced(self) -> int:
        return len(self._hashes)

    def stored(
        self,
        identity: Identity,
        parent: Identity | None,
        token_ids: Sequence[int],
        lora: LoraTag | None = None,
    ) -> None:
        """A full block became findable under (parent, token_ids); parent None: the first block of a
        chain, computed through `lora` (None: the base model). A parent that is no longer findable makes
        the block unreachable by any prefix lookup: it is not announced (nor, later, removed)."""
        if parent is None:
            parent_hash = None
        else:
            parent_hash = self._hashes.get(parent)
            if parent_hash is None:
                return
        h = block_hash(parent_hash, token_ids, lora)
        self._hashes[identity] = h
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent_hash and parent_hash is not None:
            last.block_hashes.append(h)  # the next block of the same chain: one event, as vLLM sends
            last.token_ids.extend(token_ids)
            return
        lora_id, lora_name = lora if lora is not None else (None, None)
        self._pending.append(
            BlockStored(
                [h],
                parent_hash,
                list(token_ids),
                self.block_size,
                lora_id,
                MEDIUM_GPU,
                lora_name,
                group_idx=0,
            )
        )

    def removed(self, identity: Identity) -> None:
        h = self._hashes.pop(identity, None)
        if h is None:
            return
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(h)
        else:
            self._pending.append(BlockRemoved([h], MEDIUM_GPU, group_idx=0))

    def cleared(self) -> None:
        """Nothing is findable any more."""
        self._hashes.clear()
        self._pending.append(AllBlocksCleared())
        self.flush()

    def flush(self) -> None:
        """Hand what happened since the last flush to the publisher as one batch (none if nothing did)."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        self._publish(KVEventBatch(time.time(), events))
