"""Paged KV bookkeeping: a block pool and per-plane block tables. Torch-free.

LAST_EXITED keeps one plane per depth, SHARED one plane. A request owns one block table per
plane; all planes come from one pool. Admission reserves the worst case
(`prompt + max_tokens - 1` positions × planes) so a running request never runs out of KV.
The runner owns the tensors; this module only hands out block ids.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._free_set = set(self._free)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        self._free_set.difference_update(blocks)
        return blocks

    def is_free(self, block: int) -> bool:
        return block in self._free_set

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            assert block not in self._free_set, f"double free of block {block}"
            self._free_set.add(block)
            self._free.append(block)

    def check_invariants(self) -> None:
        assert len(self._free) == len(self._free_set), "free list has duplicates"
        assert all(0 <= b < self.num_blocks for b in self._free_set), "block id out of range"


class KVCacheManager:
    """Per-request, per-plane block tables over one `BlockPool`."""

    def __init__(self, num_blocks: int, block_size: int, num_planes: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.num_planes = num_planes
        self.tables: dict[str, tuple[list[int], ...]] = {}

    def blocks_needed(self, num_positions: int) -> int:
        per_plane = -(-num_positions // self.block_size)
        return per_plane * self.num_planes

    def can_ever_fit(self, num_positions: int) -> bool:
        return self.blocks_needed(num_positions) <= self.pool.num_blocks

    def can_allocate(self, num_positions: int) -> bool:
        return self.blocks_needed(num_positions) <= self.pool.num_free_blocks

    def allocate(self, request_id: str, num_positions: int) -> tuple[list[int], ...]:
        assert request_id not in self.tables, f"{request_id} already holds KV"
        per_plane = -(-num_positions // self.block_size)
        blocks = self.pool.allocate(per_plane * self.num_planes)
        table = tuple(blocks[i * per_plane : (i + 1) * per_plane] for i in range(self.num_planes))
        self.tables[request_id] = table
        return table

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            for plane_blocks in table:
                self.pool.free(plane_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, over all planes."""
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        owned: set[int] = set()
        for request_id, table in self.tables.items():
            assert len(table) == self.num_planes, f"{request_id} has {len(table)} planes"
            lengths = {len(plane) for plane in table}
            assert len(lengths) == 1, f"{request_id} planes differ in length"
            for plane in table:
                for block in plane:
                    assert block not in owned, f"block {block} owned twice"
                    owned.add(block)
        assert not any(self.pool.is_free(b) for b in owned), "a block is both owned and free"
        assert len(owned) + self.pool.num_free_blocks == self.pool.num_blocks, "blocks leaked"
