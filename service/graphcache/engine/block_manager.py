"""Fixed-size KV cache blocks: who holds which block.

The KV cache is `num_blocks` blocks of `block_size` token slots each (allocated by the runner).
A sequence's `block_table` lists its blocks in token order; token i lives in slot
block_table[i // block_size] * block_size + i % block_size.

No prefix sharing: each block has exactly one owner, so free() returns everything a sequence
held, and `num_free == num_usable` whenever no sequence holds blocks (tests assert that).
"""

from __future__ import annotations

from collections import deque

from graphcache.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"need at least one KV block, got num_blocks={num_blocks}; raise num_kv_blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO reuse spreads writes over the cache; order does not matter for correctness.
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}   # block -> request id; catches double frees and leaks

    # --- capacity -------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

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
        return self.blocks_missing(seq, num_tokens) <= len(self._free)

    # --- mutation -------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_tokens` tokens (a no-op if it already does)."""
        missing = self.blocks_missing(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"out of KV blocks: {seq.request_id} needs {missing}, {len(self._free)} free "
                               "(the scheduler must check can_allocate first)")
        for _ in range(missing):
            block = self._free.popleft()
            self._owner[block] = seq.request_id
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> int:
        """Return every block of `seq` to the pool; returns how many."""
        for block in seq.block_table:
            owner = self._owner.pop(block, None)
            if owner != seq.request_id:
                raise RuntimeError(f"block {block} freed by {seq.request_id} but owned by {owner}")
            self._free.append(block)
        n = len(seq.block_table)
        seq.block_table = []
        return n
