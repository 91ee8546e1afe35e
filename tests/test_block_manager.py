"""KV block manager: allocation grows with the sequence, frees return every block, nothing leaks."""

import pytest
from graphcache.engine.block_manager import BlockManager
from graphcache.engine.sequence import SamplingParams, Sequence


def seq(rid: str, n: int = 1) -> Sequence:
    return Sequence(rid, list(range(n)), SamplingParams())


def test_allocate_append_free_no_leaks():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 5)                  # 5 tokens -> 2 blocks
    assert len(a.block_table) == 2 and bm.num_free == 8
    bm.allocate(a, 8)                  # still fits in 2 blocks
    assert len(a.block_table) == 2
    assert bm.can_allocate(a, 9)
    bm.allocate(a, 9)                  # token 9 -> third block
    assert len(a.block_table) == 3
    bm.allocate(b, 16)
    assert bm.num_used == 7 and bm.usage == pytest.approx(0.7)
    assert set(a.block_table).isdisjoint(b.block_table)
    assert bm.free(a) == 3 and a.block_table == []
    bm.free(b)
    assert bm.num_free == bm.num_usable == 10


def test_can_allocate_refuses_and_allocate_raises_when_full():
    bm = BlockManager(num_blocks=3, block_size=2)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 4)
    assert bm.can_allocate(b, 2) and not bm.can_allocate(b, 3)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(b, 3)
    assert b.block_table == [] and bm.num_free == 1   # a failed allocation takes nothing


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq("a")
    bm.allocate(a, 2)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="freed by"):
        bm.free(a)


def test_needs_one_usable_block():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockManager(num_blocks=0, block_size=4)
