"""BlockPool with toy sizes and exact block ids."""

import pytest

from kvserve.engine.block_pool import BlockPool, hash_full_blocks


def test_allocate_takes_from_the_front_and_free_appends_tail_first():
    pool = BlockPool(num_blocks=6, block_size=4)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 5
    pool.free(a)  # tail first: 2, 1, 0 join the back after 5
    assert list(pool.free_queue) == [5, 2, 1, 0]
    assert pool.allocate(2) == [5, 2]
    pool.check_integrity()


def test_cached_blocks_are_reused_before_eviction_and_evicted_lru():
    pool = BlockPool(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = hash_full_blocks(tokens, 2)
    blocks = pool.allocate(3)
    for block_id, block_hash in zip(blocks, hashes, strict=True):
        pool.cache_block(block_id, block_hash)
    pool.free(blocks)
    assert pool.num_cached_blocks == 3 and pool.num_used_blocks == 0
    pool.check_integrity()
    # Same prefix: hit on all three, taken back from the queue without recomputation.
    hit = pool.find_cached_prefix(hashes)
    assert hit == [0, 1, 2]
    pool.touch(hit)
    assert pool.num_cached_blocks == 0 and pool.num_used_blocks == 3
    pool.free(hit)
    # Allocation prefers the never-used block 3, then evicts the least recently freed (tail) block 2.
    assert pool.allocate(2) == [3, 2]
    assert pool.find_cached_prefix(hashes) == [0, 1]  # block 2's hash is gone
    pool.check_integrity()


def test_shared_blocks_count_references():
    pool = BlockPool(num_blocks=3, block_size=2)
    blocks = pool.allocate(2)
    pool.touch(blocks)  # a second request shares them
    pool.free(blocks)
    assert pool.num_used_blocks == 2
    pool.free(blocks)
    assert pool.num_used_blocks == 0
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks)


def test_prefix_lookup_stops_at_first_miss_and_hashes_chain():
    pool = BlockPool(num_blocks=4, block_size=2)
    a = hash_full_blocks([1, 2, 3, 4], 2)
    b = hash_full_blocks([9, 9, 3, 4], 2)
    assert a[1] != b[1]  # same tokens in block 1, different prefix: different hash
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], a[0])
    pool.cache_block(blocks[1], a[1])
    assert pool.find_cached_prefix(b) == []
    assert pool.find_cached_prefix([a[0], b[1]]) == [0]


def test_first_writer_wins_for_duplicate_content():
    pool = BlockPool(num_blocks=3, block_size=2)
    h = hash_full_blocks([1, 2], 2)[0]
    x, y = pool.allocate(2)
    pool.cache_block(x, h)
    pool.cache_block(y, h)
    assert pool.cached == {h: x} and pool.block_hash[y] is None
    pool.free([x, y])
    assert pool.num_cached_blocks == 1
    pool.check_integrity()


def test_prefix_caching_disabled_caches_nothing():
    pool = BlockPool(num_blocks=2, block_size=2, enable_prefix_caching=False)
    h = hash_full_blocks([1, 2], 2)
    pool.cache_block(pool.allocate(1)[0], h[0])
    assert pool.find_cached_prefix(h) == [] and pool.cached == {}


def test_integrity_check_catches_corruption():
    pool = BlockPool(num_blocks=3, block_size=2)
    pool.allocate(1)
    pool.ref_cnt[1] = 1  # a block both free and in use
    with pytest.raises(AssertionError):
        pool.check_integrity()
