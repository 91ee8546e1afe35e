"""Fixed-size KV cache blocks: who holds which block, and which full blocks can be shared (prefix caching).

The KV cache is `num_blocks` blocks of `block_size` token slots each (allocated by the runner).
A sequence's `block_table` lists its blocks in token order; token i lives in slot
block_table[i // block_size] * block_size + i % block_size.

Prefix caching (automatic, vLLM's APC; on unless `enable_prefix_caching=False`):
- A *full* block whose tokens are all computed is registered under a key: (identity of the block
  before it, its own token ids). The identity of a registered block is (block id, generation); the
  generation changes whenever the block leaves the cache, so a key naming an evicted parent can
  never be matched again. The key therefore chains the whole prefix: equal tokens after different
  prefixes are different keys. The dict that holds the keys hashes them (the hash of the tokens
  chained with the parent's identity) and compares them in full on a hit (the tokens are stored
  with the block, in the key), so a hash collision costs one dict probe and can never serve
  another prefix's KV. (Chaining the parent's *hash* instead and verifying only a block's own
  tokens would not be enough: two different prefixes with colliding hashes would share children.)
- Blocks are reference counted; any number of sequences may hold a registered block. A block is
  only ever written by the sequence that allocated it, at positions past its num_computed_tokens,
  and a registered block is full and computed, so nobody writes into a shared block.
- A block whose count drops to 0 is free. If it is registered it stays findable ("cached free")
  until reused. Reuse takes never-registered free blocks first, then the least recently freed
  cached block (LRU); its registration is dropped then. A sequence frees its blocks last block
  first, so a prefix's tail is evicted before its head (a tail is useless without its head).
- `num_free` counts cached-free blocks too (they are reclaimable at any time); `usage` is the share
  of blocks held by sequences.
- `prefix_cache_queries` / `prefix_cache_hits`: tokens looked up at admission / tokens found
  (plain ints; the metrics layer turns them into counters).

KV cache events (`events`, --kv-events-config): when set, every block that becomes findable, stops
being findable, or a reset that leaves nothing cached is told to the recorder (kv_events/recorder.py),
which the engine publishes after each step in vLLM's shapes for a KV-aware router. A LoRA adapter's
blocks go with its name and id (`lora_ids`: the server's integer id of an adapter name), as vLLM's do.

Without prefix caching: nothing is registered or looked up, free blocks are reused FIFO, and no
block is shared between sequences.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from graphcache.engine.sequence import Sequence
from graphcache.kv_events.recorder import KVEventRecorder, LoraTag

# (block id, generation) of a registered block; None stands for "before the first block".
BlockIdentity = tuple[int, int]
BlockKey = tuple[BlockIdentity | None, tuple[int, ...]]


@dataclass
class PrefixMatch:
    """The longest usable cached prefix of a sequence (see BlockManager.match_prefix)."""

    blocks: list[int] = field(default_factory=list)  # cached blocks, in token order
    next_key: BlockKey | None = None  # key of the first full block it could use but missed (None: none)
    stopped_on_fresh: bool = False  # the next block is cached but registered this step (written by it)


@dataclass
class _SeqChain:
    """Per-sequence registration state: the identity chain of its leading full blocks."""

    chain: list[BlockIdentity] = field(default_factory=list)  # identity of each registered level
    num_hit: int = 0  # leading blocks taken from the cache (not computed by this sequence)
    next_end: int = 0  # tokens that must be computed before another block can register


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"need at least one KV block, got num_blocks={num_blocks}; raise num_kv_blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks  # holders of each block
        self._key: list[BlockKey | None] = [None] * num_blocks  # registration key, None: not registered
        self._gen = [0] * num_blocks  # bumped whenever a block leaves the cache
        self._registered_step = [-1] * num_blocks  # step counter value when registered
        self._cache: dict[BlockKey, int] = {}  # key -> registered block
        # Free blocks never registered (FIFO: spreads writes; order does not matter for correctness),
        # then free registered blocks, least recently freed first.
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # Sequences holding blocks (identity-hashed; an entry lives from admission to free()).
        self._chains: dict[Sequence, _SeqChain] = {}
        self.step = 0  # advanced by the scheduler each schedule()
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache
        self.events: KVEventRecorder | None = None  # told of stores, removals and clears (KV cache events)
        self._adapter_roots: dict[str, BlockIdentity] = {}  # LoRA adapter -> the root of its chains
        self._root_tags: dict[BlockIdentity, LoraTag] = {}  # root -> its adapter, as the events name it
        self.lora_ids: Callable[[str], int | None] | None = None  # adapter name -> the server's id
        self._num_roots = 0

    # --- capacity -------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks nobody holds: never-registered ones plus cached-free ones (reclaimable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free(self) -> int:
        return len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def usage(self) -> float:
        """Share of usable blocks held by sequences, 0-1 (the kv_cache_usage_ratio gauge)."""
        return self.num_used / self.num_usable

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_tokens_capacity(self) -> int:
        """Most tokens one sequence could ever hold (all usable blocks)."""
        return self.num_usable * self.block_size

    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so its table covers `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Could `seq` grow to hold `num_tokens` tokens right now?"""
        return self.blocks_missing(seq, num_tokens) <= self.num_free

    def can_admit(self, cached: list[int], num_tokens: int) -> bool:
        """Could a sequence with no blocks take the cached prefix `cached` and grow to `num_tokens`?
        Cached blocks held by others cost nothing; cached-free ones leave the free pool, like new ones."""
        new = max(0, self.blocks_for(num_tokens) - len(cached))
        reclaimed = sum(1 for b in cached if self._ref[b] == 0)
        return new + reclaimed <= self.num_free

    # --- prefix lookup --------------------------------------------------------------------
    def _block_tokens(self, token_ids: list[int], level: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(token_ids[level * bs : (level + 1) * bs])

    def _root(self, seq: Sequence) -> BlockIdentity | None:
        """The parent of a sequence's first block: None for the base model; a LoRA adapter's KV differs
        from the base model's for the same tokens, so its chains start at a root of their own, (-n, 0),
        which no registered block's identity (block id >= 0) can equal."""
        name = seq.params.lora_name
        if name is None:
            return None
        root = self._adapter_roots.get(name)
        if root is None:
            self._num_roots += 1
            root = self._adapter_roots[name] = (-self._num_roots, 0)
            self._root_tags[root] = LoraTag(self.lora_ids(name) if self.lora_ids else None, name)
        return root

    def forget_adapter(self, name: str) -> None:
        """An adapter of that name was loaded anew: it must not find the blocks of the one before."""
        root = self._adapter_roots.pop(name, None)
        if root is not None:
            del self._root_tags[root]

    def match_prefix(self, seq: Sequence, max_blocks: int) -> PrefixMatch:
        """The longest run of cached full blocks equal to the start of seq.all_token_ids, at most
        `max_blocks`. Blocks registered in the current step are not matched (the step that writes
        them has not run; see the scheduler's in-flight sharing rule). Changes nothing."""
        match = PrefixMatch()
        if not self.enable_prefix_caching:
            return match
        ids = seq.all_token_ids
        parent: BlockIdentity | None = self._root(seq)
        num_full = len(ids) // self.block_size
        for level in range(min(num_full, max_blocks)):  # past max_blocks this sequence computes anyway
            key = (parent, self._block_tokens(ids, level))
            block = self._cache.get(key)
            if block is None or self._registered_step[block] == self.step:
                match.next_key = key
                match.stopped_on_fresh = block is not None
                break
            match.blocks.append(block)
            parent = (block, self._gen[block])
        return match

    def next_key(self, seq: Sequence) -> BlockKey | None:
        """Key of the next full block `seq` will register once computed, or None when its known
        tokens do not fill another block (or it has no registration state). For the in-flight rule."""
        state = self._chains.get(seq)
        if state is None:
            return None
        level, bs = len(state.chain), self.block_size
        if seq.num_tokens < (level + 1) * bs:  # cheap exit for decodes: no full block of known tokens
            return None
        return (
            state.chain[-1] if level else self._root(seq),
            tuple(seq.token_slice(level * bs, (level + 1) * bs)),
        )

    def is_cached(self, key: BlockKey) -> bool:
        return key in self._cache

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    def begin_step(self) -> None:
        """A new step is being scheduled: blocks registered before now are written by earlier steps."""
        self.step += 1

    # --- mutation -------------------------------------------------------------------------
    def take_cached(self, seq: Sequence, blocks: list[int]) -> None:
        """Start seq's (empty) block table with the cached blocks of a match: they gain a holder."""
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id} already holds blocks; take_cached only at admission")
        for block in blocks:
            if self._key[block] is None:
                raise RuntimeError(
                    f"block {block} is not cached (match_prefix and take_cached must be in one step)"
                )
            if self._ref[block] == 0:
                del self._free_cached[block]
            self._ref[block] += 1
            seq.block_table.append(block)
        if self.enable_prefix_caching:
            self._chains[seq] = _SeqChain(
                [(b, self._gen[b]) for b in blocks],
                num_hit=len(blocks),
                next_end=(len(blocks) + 1) * self.block_size,
            )

    def _pop_free(self) -> int:
        if self._free_plain:
            return self._free_plain.popleft()
        block, _ = self._free_cached.popitem(last=False)  # least recently freed cached block
        self._unregister(block)
        return block

    def _unregister(self, block: int) -> None:
        key = self._key[block]
        if key is not None:
            del self._cache[key]
            self._key[block] = None
            if self.events is not None:
                self.events.removed((block, self._gen[block]))
            self._gen[block] += 1  # identities naming this incarnation (its children's keys) go stale

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_tokens` tokens (a no-op if it already does)."""
        missing = self.blocks_missing(seq, num_tokens)
        if missing > self.num_free:
            raise RuntimeError(
                f"out of KV blocks: {seq.request_id} needs {missing}, {self.num_free} free "
                "(the scheduler must check can_allocate first)"
            )
        for _ in range(missing):
            block = self._pop_free()
            self._ref[block] = 1
            seq.block_table.append(block)

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Register seq's full blocks whose tokens are all computed and known: num_computed (the
        scheduler's commit, so possibly still being written by the step just scheduled) capped at
        the tokens known on the host (a token being sampled has no id yet). A block whose key is
        already registered (the same prefix computed twice) stays private; the chain continues
        through the registered one, so the blocks after it still extend the shared prefix."""
        if not self.enable_prefix_caching:
            return
        state = self._chains.get(seq)
        if state is not None and num_computed < state.next_end:
            return  # most calls (decodes inside a block) end here: this runs for every scheduled sequence
        bs = self.block_size
        num_full = min(num_computed, seq.num_tokens, len(seq.block_table) * bs) // bs
        if state is None:
            if num_full == 0:
                return
            state = self._chains[seq] = _SeqChain()
        if num_full <= len(state.chain):
            return
        ids = seq.all_token_ids
        root = self._root(seq)
        for level in range(len(state.chain), num_full):
            key = (state.chain[-1] if level else root, self._block_tokens(ids, level))
            existing = self._cache.get(key)
            if existing is None:
                block = seq.block_table[level]
                self._cache[key] = block
                self._key[block] = key
                self._registered_step[block] = self.step
                existing = block
                if self.events is not None:  # an adapter's root is no block: its first block starts a chain
                    lora = None if root is None else self._root_tags[root]
                    self.events.stored((block, self._gen[block]), key[0] if level else None, key[1], lora)
            state.chain.append((existing, self._gen[existing]))
        state.next_end = (len(state.chain) + 1) * bs

    def trim(self, seq: Sequence, num_blocks: int) -> int:
        """Give back seq's blocks past its first num_blocks (speculative decoding's rollback: blocks that
        held only rejected drafts). They are never registered: commit() registers only blocks of known
        tokens, and these hold none. Returns how many went back."""
        dropped = seq.block_table[num_blocks:]
        for block in dropped:
            if self._key[block] is not None or self._ref[block] != 1:
                raise RuntimeError(
                    f"block {block} of {seq.request_id} is shared or registered; cannot trim it"
                )
            self._ref[block] = 0
            self._free_plain.append(block)
        del seq.block_table[num_blocks:]
        return len(dropped)

    def free(self, seq: Sequence, keep_cached: bool = True) -> int:
        """Drop seq's hold on its blocks; returns how many it held. Its computed full blocks are
        registered first (keep_cached), so a finished or preempted sequence leaves its prefix
        findable. keep_cached=False (a request that failed): the blocks this sequence computed
        itself are unregistered, so KV of a step that may not have run is never served."""
        if keep_cached:
            self.commit(seq, seq.num_computed_tokens)
        elif (state := self._chains.get(seq)) is not None:
            for level in range(state.num_hit, len(seq.block_table)):
                self._unregister(seq.block_table[level])
        self._chains.pop(seq, None)
        order = reversed(seq.block_table) if self.enable_prefix_caching else seq.block_table
        for block in order:
            if self._ref[block] <= 0:
                raise RuntimeError(
                    f"block {block} freed by {seq.request_id} but nobody holds it (double free)"
                )
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._key[block] is not None:
                    self._free_cached[block] = None  # most recently freed: evicted last
                else:
                    self._free_plain.append(block)
        n = len(seq.block_table)
        seq.block_table = []
        return n

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block (held ones stay registered); returns how many were dropped."""
        n = len(self._free_cached)
        while self._free_cached:
            block, _ = self._free_cached.popitem(last=False)
            self._unregister(block)
            self._free_plain.append(block)
        if self.events is not None and not self._cache:
            self.events.cleared()
        return n
