"""KV block manager: allocation grows with the sequence, frees return every block, nothing leaks."""

import pytest
from graphcache.engine.sched.block_manager import BlockManager
from graphcache.engine.sequence import SamplingParams, Sequence


def seq(rid: str, n: int = 1) -> Sequence:
    return Sequence(rid, list(range(n)), SamplingParams())


def test_allocate_append_free_no_leaks():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 5)  # 5 tokens -> 2 blocks
    assert len(a.block_table) == 2 and bm.num_free == 8
    bm.allocate(a, 8)  # still fits in 2 blocks
    assert len(a.block_table) == 2
    assert bm.can_allocate(a, 9)
    bm.allocate(a, 9)  # token 9 -> third block
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
    assert b.block_table == [] and bm.num_free == 1  # a failed allocation takes nothing


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


# --- prefix caching ---------------------------------------------------------------------------


def tok_seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams())


def computed(bm: BlockManager, s: Sequence, n: int | None = None) -> Sequence:
    """Give `s` blocks for its tokens and mark them computed (as the scheduler's commit does)."""
    n = s.num_tokens if n is None else n
    bm.allocate(s, n)
    s.num_computed_tokens = n
    bm.commit(s, n)
    return s


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """Take the cached prefix of `s` (next step, so nothing is fresh); returns the blocks matched."""
    bm.begin_step()
    match = bm.match_prefix(s, max_blocks=(s.num_tokens - 1) // bm.block_size)
    bm.take_cached(s, match.blocks)
    s.num_computed_tokens = len(match.blocks) * bm.block_size
    return match.blocks


def test_shared_blocks_are_reference_counted_and_freed_only_by_the_last_holder():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, tok_seq("a", list(range(1, 11))))  # 10 tokens: 2 full blocks + 1 partial
    b = tok_seq("b", list(range(1, 9)) + [50, 51, 52])
    assert admit(bm, b) == a.block_table[:2]  # the 2 full blocks, shared
    bm.allocate(b, b.num_tokens)
    assert bm.num_used == 4  # 3 of a + 1 private of b
    bm.free(a)
    assert bm.num_used == 3 and bm.num_cached_free == 0  # a's partial block is free; shared ones held
    bm.free(b)
    assert bm.num_free == bm.num_usable == 8 and bm.usage == 0
    assert bm.num_cached_free == 2  # the full blocks stay findable


def test_cached_free_blocks_are_found_again_after_their_holder_finished():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, tok_seq("a", list(range(1, 13))))
    table = list(a.block_table)
    bm.free(a)
    b = tok_seq("b", list(range(1, 13)) + [99])
    assert admit(bm, b) == table  # all 3 full blocks, from the free pool
    assert bm.num_cached_free == 0 and bm.num_used == 3
    assert bm.can_admit([], 4) and not bm.can_admit([], 4 * 6)  # 5 free left


def test_can_admit_counts_cached_free_blocks_that_leave_the_pool():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = computed(bm, tok_seq("a", [1, 2, 3, 4]))
    bm.free(a)  # 2 cached-free + 1 plain = 3 free
    b = tok_seq("b", [1, 2, 3, 4, 5, 6, 7])
    bm.begin_step()
    blocks = bm.match_prefix(b, max_blocks=3).blocks
    assert len(blocks) == 2
    assert bm.can_admit(blocks, 6) and not bm.can_admit(blocks, 7)  # 2 reclaimed + 2 new > 3
    c = computed(bm, tok_seq("c", [9, 9]))  # takes the plain block
    del c
    assert not bm.can_admit(blocks, 6)  # 2 reclaimed + 1 new > 2 free


def test_lru_reuses_plain_blocks_first_then_least_recently_freed_cached_tail_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    old = computed(bm, tok_seq("old", [1, 2, 3, 4]))
    new = computed(bm, tok_seq("new", [5, 6, 7, 8]))
    old_table, new_table = list(old.block_table), list(new.block_table)
    bm.free(old)
    bm.free(new)
    assert bm.num_free == 6 and bm.num_cached_free == 4
    grab = tok_seq("grab", [0] * 10)
    bm.allocate(grab, 4)  # the 2 never-cached blocks go first
    assert bm.num_cached_free == 4 and set(grab.block_table).isdisjoint(old_table + new_table)
    bm.allocate(grab, 6)  # then old's tail block (freed last-first)
    assert grab.block_table[-1] == old_table[1]
    probe = tok_seq("probe", [1, 2, 3, 4, 0])
    bm.begin_step()
    assert bm.match_prefix(probe, 2).blocks == [old_table[0]]  # old's head is still cached
    bm.allocate(grab, 8)
    assert grab.block_table[-1] == old_table[0]
    assert bm.match_prefix(probe, 2).blocks == []
    probe_new = tok_seq("probe", [5, 6, 7, 8, 0])
    assert bm.match_prefix(probe_new, 2).blocks == new_table  # the more recently freed one survived
    bm.free(grab)
    assert bm.num_free == bm.num_usable


def test_equal_tokens_after_a_different_prefix_do_not_match():
    bm = BlockManager(num_blocks=8, block_size=2)
    computed(bm, tok_seq("a", [1, 2, 3, 4, 5, 6]))
    bm.begin_step()
    assert len(bm.match_prefix(tok_seq("b", [1, 2, 3, 4, 5, 6, 0]), 3).blocks) == 3
    assert bm.match_prefix(tok_seq("c", [9, 9, 3, 4, 5, 6, 0]), 3).blocks == []  # block 1 equal, prefix not
    assert len(bm.match_prefix(tok_seq("d", [1, 2, 9, 9, 5, 6, 0]), 3).blocks) == 1


def test_a_hash_collision_never_serves_other_tokens():
    # CPython hashes ints modulo 2**61 - 1: these two blocks hash alike, as do their keys.
    same, other = [0, 1], [2**61 - 1, 1]
    assert hash(tuple(same)) == hash(tuple(other))
    bm = BlockManager(num_blocks=4, block_size=2)
    a = computed(bm, tok_seq("a", same + [7, 7]))
    bm.begin_step()
    assert bm.match_prefix(tok_seq("b", other + [7, 7, 0]), 2).blocks == []
    assert bm.match_prefix(tok_seq("c", same + [7, 7, 0]), 2).blocks == a.block_table


def test_evicting_a_parent_makes_its_children_unreachable_even_if_the_block_is_recached():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = computed(bm, tok_seq("a", [1, 2, 3, 4]))
    parent, child = a.block_table
    bm.free(a)
    # Reuse exhausts the plain block, then evicts the child (tail first), then the parent ...
    x = tok_seq("x", [5, 6, 0, 0, 0, 0])
    bm.allocate(x, 6)
    assert set(x.block_table) == {0, 1, 2}
    bm.free(x)
    # ... re-register [1, 2] in a different block: a stale key naming the old parent must not match.
    computed(bm, tok_seq("y", [1, 2]))
    bm.begin_step()
    assert len(bm.match_prefix(tok_seq("z", [1, 2, 3, 4, 0]), 2).blocks) == 1


def test_blocks_registered_this_step_are_not_matched_until_the_next():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.begin_step()
    a = computed(bm, tok_seq("a", [1, 2, 3, 4, 5]))
    m = bm.match_prefix(tok_seq("b", [1, 2, 3, 4, 5]), 2)
    assert m.blocks == [] and m.stopped_on_fresh and m.next_key == (None, (1, 2))
    bm.begin_step()
    m = bm.match_prefix(tok_seq("b", [1, 2, 3, 4, 5]), 2)
    assert m.blocks == a.block_table[:2] and m.next_key is None


def test_commit_registers_only_computed_blocks_of_known_tokens():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = tok_seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a, 6)
    bm.commit(a, 3)  # 1 full block computed
    assert bm.next_key(a) == ((a.block_table[0], 0), (3, 4))
    bm.commit(a, 6)  # 6 committed, 5 known (a token in flight)
    bm.begin_step()
    assert len(bm.match_prefix(tok_seq("p", [1, 2, 3, 4, 5, 6, 0]), 3).blocks) == 2
    a.output_token_ids.append(6)
    a.num_computed_tokens = 6
    bm.free(a)  # free registers what became known
    bm.begin_step()
    assert len(bm.match_prefix(tok_seq("p", [1, 2, 3, 4, 5, 6, 0]), 3).blocks) == 3


def test_free_without_keeping_drops_what_the_sequence_computed_but_not_what_it_found():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = computed(bm, tok_seq("a", [1, 2, 3, 4]))
    b = tok_seq("b", [1, 2, 3, 4, 5, 6, 7])
    assert admit(bm, b) == a.block_table
    computed(bm, b)
    b_own = b.block_table[2]
    bm.free(b, keep_cached=False)  # b's step failed
    bm.begin_step()
    assert bm.match_prefix(tok_seq("c", [1, 2, 3, 4, 5, 6, 0]), 3).blocks == a.block_table
    assert b_own not in bm._cache.values()
    bm.free(a)
    assert bm.num_free == bm.num_usable


def test_same_prefix_computed_twice_keeps_one_entry_and_the_chain_goes_on():
    bm = BlockManager(num_blocks=10, block_size=2)
    a = computed(bm, tok_seq("a", [1, 2, 3, 4]))
    b = computed(bm, tok_seq("b", [1, 2, 3, 4, 5, 6]))  # computed [1..4] again, privately
    bm.free(b)
    bm.begin_step()
    found = bm.match_prefix(tok_seq("c", [1, 2, 3, 4, 5, 6, 0]), 3).blocks
    assert found[:2] == a.block_table and len(found) == 3  # b's block 2 chains on a's blocks
    assert found[2] not in a.block_table
    bm.free(a)
    assert bm.num_free == bm.num_usable


def test_prefix_caching_off_registers_nothing_and_reuses_fifo():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = computed(bm, tok_seq("a", [1, 2, 3, 4]))
    table = list(a.block_table)
    bm.free(a)
    bm.begin_step()
    assert bm.match_prefix(tok_seq("b", [1, 2, 3, 4, 0]), 2).blocks == []
    assert bm.num_cached_free == 0 and list(bm._free_plain) == [2, 3] + table


def test_no_leaks_after_many_sharing_sequences_finish():
    bm = BlockManager(num_blocks=40, block_size=4)
    seqs = []
    for i in range(12):
        s = tok_seq(f"s{i}", list(range(1, 1 + 8 + (i % 3) * 4)) + [100 + i] * (i % 5))
        admit(bm, s)
        computed(bm, s)
        seqs.append(s)
        if i % 4 == 3:
            bm.free(seqs.pop(0))
    for s in seqs:
        bm.free(s)
    assert bm.num_free == bm.num_usable and all(r == 0 for r in bm._ref)
