"""Block pool and KV manager: allocation per plane, freeing, capacity checks, invariants."""

from __future__ import annotations

import pytest

from loopserve.scheduler.kv_cache import BlockPool, KVCacheManager


def test_pool_hands_out_distinct_blocks_and_takes_them_back():
    pool = BlockPool(10)
    first, second = pool.allocate(4), pool.allocate(6)
    assert len(first) == 4 and len(second) == 6
    assert sorted(first + second) == list(range(10))  # every block once, all in range
    assert pool.num_free_blocks == 0
    pool.check_invariants()
    pool.free(first)
    assert pool.num_free_blocks == 4
    again = pool.allocate(4)
    assert sorted(again) == sorted(first)  # only the freed blocks are free
    pool.check_invariants()


def test_pool_hands_out_never_used_ids_in_order_then_freed_ids_in_freeing_order():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    pool.free([1, 0])
    assert pool.is_free(0) and pool.is_free(2) and pool.num_free_blocks == 6
    assert pool.allocate(5) == [2, 3, 4, 5, 1]
    assert pool.num_free_blocks == 1 and pool.is_free(0) and not pool.is_free(3)
    with pytest.raises(AssertionError, match="double free of block 0"):
        pool.free([0])
    pool.free([4])
    assert pool.allocate(2) == [0, 4]
    pool.check_invariants()


def test_pool_refuses_more_than_it_has_and_stays_intact():
    pool = BlockPool(5)
    pool.allocate(3)
    with pytest.raises(MemoryError, match="asked for 3 blocks, 2 free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2
    assert len(pool.allocate(2)) == 2
    pool.check_invariants()


def test_pool_detects_a_double_free():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks[:1])


def test_pool_invariants_catch_a_foreign_block():
    pool = BlockPool(4)
    with pytest.raises(AssertionError, match="block id 7 out of range"):
        pool.free([7])  # never belonged to this pool
    with pytest.raises(AssertionError, match="block id -1 out of range"):
        pool.free([-1])
    assert pool.num_free_blocks == 4
    pool.check_invariants()


# 11 positions with block_size 4 need ceil(11 / 4) = 3 blocks per plane; LAST_EXITED with
# D = 4 keeps 4 planes: 12 blocks. 12 positions still fit 3 per plane, 13 need 4.
@pytest.mark.parametrize(
    ("num_positions", "num_planes", "expected"),
    [(1, 4, 4), (4, 4, 4), (5, 4, 8), (11, 4, 12), (12, 4, 12), (13, 4, 16), (13, 1, 4)],
)
def test_blocks_needed_rounds_up_per_plane(num_positions, num_planes, expected):
    kv = KVCacheManager(num_blocks=100, block_size=4, num_planes=num_planes)
    assert kv.blocks_needed(num_positions) == expected


def test_allocation_gives_one_table_per_plane_sized_for_the_positions():
    kv = KVCacheManager(num_blocks=40, block_size=4, num_planes=4)
    table = kv.allocate("a", 11)
    assert len(table) == 4 and all(len(plane) == 3 for plane in table)
    blocks = [b for plane in table for b in plane]
    assert len(set(blocks)) == 12 and all(0 <= b < 40 for b in blocks)
    assert kv.tables["a"] == table
    assert kv.num_free_blocks == 40 - 12
    other = kv.allocate("b", 3)
    assert [len(plane) for plane in other] == [1, 1, 1, 1]
    assert not {b for plane in other for b in plane} & set(blocks)
    assert kv.num_free_blocks == 40 - 16
    kv.check_invariants()


def test_shared_layout_has_a_single_plane():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_planes=1)
    table = kv.allocate("a", 9)
    assert len(table) == 1 and len(table[0]) == 3
    assert kv.num_free_blocks == 5
    kv.check_invariants()


def test_freeing_a_request_returns_all_its_blocks_once():
    kv = KVCacheManager(num_blocks=20, block_size=4, num_planes=4)
    kv.allocate("a", 8)
    kv.allocate("b", 4)
    kv.free("a")
    assert "a" not in kv.tables and kv.num_free_blocks == 20 - 4
    kv.free("a")  # a second release of the same request gives nothing back twice
    assert kv.num_free_blocks == 20 - 4
    kv.check_invariants()
    kv.free("b")
    assert kv.num_free_blocks == 20 and kv.tables == {}
    kv.check_invariants()


def test_a_request_cannot_hold_two_tables():
    kv = KVCacheManager(num_blocks=20, block_size=4, num_planes=2)
    kv.allocate("a", 4)
    with pytest.raises(AssertionError, match="already holds KV"):
        kv.allocate("a", 4)


def test_can_ever_fit_counts_the_whole_pool_and_can_allocate_the_free_part():
    # 16 blocks, 4 planes of block_size 4: at most 4 blocks per plane, 16 positions.
    kv = KVCacheManager(num_blocks=16, block_size=4, num_planes=4)
    assert kv.can_ever_fit(16) and not kv.can_ever_fit(17)
    assert kv.can_allocate(16)
    kv.allocate("a", 8)  # 2 blocks x 4 planes, 8 left
    assert kv.can_ever_fit(16) and not kv.can_allocate(9) and kv.can_allocate(8)
    kv.allocate("b", 8)
    assert not kv.can_allocate(1) and kv.can_ever_fit(1)
    kv.free("a")
    assert kv.can_allocate(8) and not kv.can_allocate(9)


def test_freed_blocks_serve_the_next_request():
    kv = KVCacheManager(num_blocks=12, block_size=4, num_planes=4)
    kv.allocate("a", 12)
    assert not kv.can_allocate(1)
    kv.free("a")
    table = kv.allocate("b", 12)
    assert sorted(b for plane in table for b in plane) == list(range(12))
    kv.check_invariants()


def test_invariants_catch_a_block_owned_by_two_requests():
    kv = KVCacheManager(num_blocks=20, block_size=4, num_planes=2)
    a, b = kv.allocate("a", 4), kv.allocate("b", 4)
    kv.check_invariants()
    b[1][0] = a[0][0]  # corrupt b's plane-1 table to point into a's plane 0
    with pytest.raises(AssertionError):
        kv.check_invariants()


def test_invariants_catch_a_leaked_block():
    kv = KVCacheManager(num_blocks=20, block_size=4, num_planes=2)
    table = kv.allocate("a", 8)
    for plane in table:
        plane.pop()  # both planes lose their last block: owned by nobody, not free
    with pytest.raises(AssertionError, match="leaked"):
        kv.check_invariants()


def test_invariants_catch_planes_of_different_lengths():
    kv = KVCacheManager(num_blocks=20, block_size=4, num_planes=2)
    table = kv.allocate("a", 8)
    kv.pool.free([table[1].pop()])  # returned to the pool, so only the shape is wrong
    with pytest.raises(AssertionError, match="planes differ"):
        kv.check_invariants()


def test_invariants_catch_a_block_both_owned_and_free():
    kv = KVCacheManager(num_blocks=20, block_size=4, num_planes=2)
    table = kv.allocate("a", 4)
    kv.pool.free([table[0][0]])  # freed behind the manager's back while still in a table
    with pytest.raises(AssertionError):
        kv.check_invariants()
