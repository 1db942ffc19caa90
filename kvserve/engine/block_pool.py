"""BlockPool: accounting of the paged KV cache. Plain Python, no torch.

Every block is in exactly one of three states:
- in use: ref_cnt > 0 (held by one or more requests; shared prefix blocks have ref_cnt > 1);
- cached: ref_cnt == 0 but its content is registered under a prefix hash, so a later request
  with the same prefix can take it back without recomputing;
- free: ref_cnt == 0 and no content worth keeping.
Cached and free blocks wait together in one queue in LRU order: allocation takes from the front
(evicting a cached block's hash if it has one); a block whose last user lets go joins the back.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

NONE_HASH = b""


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of a full block: it names the block's tokens and every token before them."""
    return hashlib.blake2b(parent_hash + array("q", token_ids).tobytes(), digest_size=16).digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, parent: bytes = NONE_HASH) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` (chained from `parent`, the hash of the block before)."""
    hashes = []
    for begin in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[begin : begin + block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # prefix hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._num_cached_free = 0  # blocks with ref_cnt 0 whose content is still registered
        self.num_evictions_total = 0  # cached blocks whose content was dropped to be reused

    # ----- queries --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (free and cached)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks nobody uses whose content is kept for prefix-cache hits."""
        return self._num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    # ----- mutation -------------------------------------------------------------------------
    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks from the front of the queue (ref_cnt 1). Evicts cached content."""
        if num > len(self.free_queue):
            raise RuntimeError(f"allocate({num}) with only {len(self.free_queue)} blocks available")
        ids = []
        for _ in range(num):
            block_id, _ = self.free_queue.popitem(last=False)
            if self.block_hash[block_id] is not None:
                self._num_cached_free -= 1
                self._evict(block_id)
            self.ref_cnt[block_id] = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
                self._num_cached_free -= self.block_hash[block_id] is not None
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Blocks reaching zero join the back of the queue,
        last block first, so a request's tail (least likely to be shared) is evicted first."""
        for block_id in reversed(block_ids):
            assert self.ref_cnt[block_id] > 0, f"double free of block {block_id}"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None
                self._num_cached_free += self.block_hash[block_id] is not None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, computed block under its prefix hash (first writer wins)."""
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def find_cached_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest run of leading hashes that are cached (not touched)."""
        if not self.enable_prefix_caching:
            return []
        ids = []
        for block_hash in block_hashes:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            ids.append(block_id)
        return ids

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block_id] = None
            self.num_evictions_total += 1

    # ----- invariants -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert free + cached + in_use == total, and that the queue, ref counts and hash map agree."""
        in_use = sum(1 for c in self.ref_cnt if c > 0)
        cached = sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        assert cached == self._num_cached_free, (cached, self._num_cached_free)
        free = len(self.free_queue) - cached
        assert free + cached + in_use == self.num_blocks, (free, cached, in_use, self.num_blocks)
        assert all(c >= 0 for c in self.ref_cnt)
        assert all(self.ref_cnt[b] == 0 for b in self.free_queue)
        for block_hash, block_id in self.cached.items():
            assert self.block_hash[block_id] == block_hash
        assert sum(1 for h in self.block_hash if h is not None) == len(self.cached)
