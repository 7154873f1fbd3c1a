"""Paged KV bookkeeping: block pools, per-plane block tables, growth and swap. Torch-free.

LAST_EXITED keeps one plane per depth, SHARED one plane. A request owns one block table per
plane; every plane of a request has the same number of blocks, because a position needs a
slot in every plane (loop d writes plane d; the finalize copy of an early exit fills the
deeper planes). All planes come from one device pool. The runner owns the tensors; this
module only hands out block ids.

- Allocation is incremental: `allocate` covers the positions a request writes first (its
  prompt), `grow` extends every plane when a later position is about to be written.
  `kv_reservation=full` is the same calls with the worst case up front.
- Admission keeps a watermark of free blocks while other requests run (`can_admit`).
- Swap: `swap_out` moves a request's blocks (every plane) to a host pool and returns the
  (device, host) pairs for the runner to copy; `swap_in` the reverse. The copy lists are
  recorded in the order the scheduler makes them, so executing them in that order is safe
  even when a block freed by one move is reused by the next.
- Prefix caching (`PrefixCache`) may hold published pages; their unreferenced blocks count as
  free and are evicted (LRU) when the pool runs short.
- Prompt groups (`fork`): a follower's table shares the leader's full prompt blocks (cached
  pages gain a reference, other blocks a share count: the last holder frees them) and gets a
  fresh copy of the leader's partly written last block, in every plane. Shared blocks hold
  prompt positions only, behind every writer's frontier: no request writes them again.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from loopserve.contracts import TableUpdate
from loopserve.scheduler.prefix_cache import CachedPage, PageKey, PrefixCache

if TYPE_CHECKING:
    from loopserve.config import EngineConfig


class BlockPool:
    """A free list of block ids `[0, num_blocks)`, first in first out: the ids never handed
    out, in order, then freed ids in the order they were freed. The never-used ids are a
    counter rather than a list, so a pool costs nothing to create however many blocks it has
    (an engine's default 4 GiB host pool is about 84,000 tiny-model blocks, and building
    their list took 0.07 s per engine)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._fresh = 0  # ids [_fresh, num_blocks) were never handed out
        self._freed: deque[int] = deque()
        self._freed_set: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._fresh + len(self._freed)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free_blocks:
            raise MemoryError(f"asked for {count} blocks, {self.num_free_blocks} free")
        fresh = min(count, self.num_blocks - self._fresh)
        blocks = list(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        reused = [self._freed.popleft() for _ in range(count - fresh)]
        self._freed_set.difference_update(reused)
        return blocks + reused

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            assert 0 <= block < self.num_blocks, f"block id {block} out of range"
            assert not self.is_free(block), f"double free of block {block}"
            self._freed_set.add(block)
            self._freed.append(block)

    def is_free(self, block: int) -> bool:
        return block >= self._fresh or block in self._freed_set

    def check_invariants(self) -> None:
        """Constant time: ids enter the free list only through `free`, which checks their
        range and that they were handed out (a scan of the free set here cost the tests that
        check every step 13 ms a step over the default host pool)."""
        assert len(self._freed) == len(self._freed_set), "free list has duplicates"
        assert 0 <= self._fresh <= self.num_blocks, "never-used ids out of range"


class BlockMove(NamedTuple):
    """Copy block `src` to block `dst` (between the device and the host pool)."""

    src: int
    dst: int


Table = tuple[list[int], ...]


class KVCacheManager:
    """Per-request, per-plane block tables over one device `BlockPool` (and a host pool)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_planes: int,
        *,
        num_host_blocks: int = 0,
        watermark: float = 0.0,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)
        self.block_size = block_size
        self.num_planes = num_planes
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[str, Table] = {}
        # What the executor's copy of each table (`contracts.BlockTables`) lacks: request ->
        # the blocks per plane its copy keeps before the new ones (0: send the whole table).
        # `take_table_updates` turns it into the next output's `TableUpdate`s.
        self._changed: dict[str, int] = {}
        self._sent: dict[str, int] = {}  # request -> blocks per plane its executor copy holds
        self.host_tables: dict[str, Table] = {}  # swapped-out requests
        # Prompt groups: private (uncached) blocks held by more than one table -> how many
        # holders beyond the first (`fork`).
        self._shares: dict[int, int] = {}
        self.prefix_cache = prefix_cache
        # Prefix caching, per request: chained page keys of its prompt (computed once), and
        # how many leading pages of its table are cache entries (hit or published by it).
        self._page_keys: dict[str, list[PageKey]] = {}
        self.num_cached_pages: dict[str, int] = {}
        self._unscored: set[str] = set()  # requests whose pages are published unscored
        self.num_swapped_out_blocks = 0  # totals, for stats
        self.num_swapped_in_blocks = 0
        self.bytes_per_block = 0  # one block of one plane, when known (stats only)
        self.key_by_max_loops = False  # see `match_prefix`
        # Whether the executor keeps a score store (prompt rows' last-loop outputs per slot):
        # without one no page is published scored.
        self.score_store = True

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, num_planes: int, bytes_per_block: int
    ) -> KVCacheManager:
        """The engine's manager: `num_blocks` resolved; a host pool of `swap_space` bytes
        when preemption swaps (`bytes_per_block`: one block of one plane)."""
        cache = config.cache
        assert cache.num_blocks is not None, "resolve num_blocks first"
        swap = config.scheduler.preemption_mode == "swap"
        caching = cache.enable_prefix_caching
        if caching is None:
            caching = cache.layout == "last_exited"
        manager = cls(
            cache.num_blocks,
            cache.block_size,
            num_planes,
            num_host_blocks=cache.swap_space // bytes_per_block if swap else 0,
            watermark=cache.kv_watermark,
            prefix_cache=PrefixCache(cache.block_size, num_planes) if caching else None,
        )
        manager.bytes_per_block = bytes_per_block
        return manager

    # ---- sizes ----------------------------------------------------------------------------

    def blocks_per_plane(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def blocks_needed(self, num_positions: int) -> int:
        return self.blocks_per_plane(num_positions) * self.num_planes

    def can_ever_fit(self, num_positions: int) -> bool:
        return self.blocks_needed(num_positions) <= self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks plus cached blocks no request references (evicted on demand)."""
        evictable = self.prefix_cache.num_evictable_blocks if self.prefix_cache else 0
        return self.pool.num_free_blocks + evictable

    @property
    def num_blocks(self) -> int:
        """Blocks in the device pool, over all planes."""
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.pool.num_blocks

    def can_allocate(self, num_positions: int) -> bool:
        return self.blocks_needed(num_positions) <= self.num_free_blocks

    def can_admit(self, num_new_blocks: int, *, idle: bool) -> bool:
        """Admission test: an idle engine admits whatever fits; otherwise keep the watermark
        free so running requests can still grow."""
        if idle:
            return num_new_blocks <= self.num_free_blocks
        return num_new_blocks + self.watermark_blocks <= self.num_free_blocks

    def _take(self, count: int) -> list[int]:
        short = count - self.pool.num_free_blocks
        if short > 0:
            assert self.prefix_cache is not None, f"asked for {count} blocks, pool short"
            self.pool.free(self.prefix_cache.evict(short))
        return self.pool.allocate(count)

    # ---- allocation -------------------------------------------------------------------------

    def allocate(
        self, request_id: str, num_positions: int, prefix: list[CachedPage] | None = None
    ) -> Table:
        """A new table covering `num_positions`; the cached pages `prefix` (from
        `match_prefix`) supply its first blocks of every plane and gain a reference."""
        assert request_id not in self.tables, f"{request_id} already holds KV"
        prefix = prefix or []
        if prefix:
            assert self.prefix_cache is not None
            self.prefix_cache.acquire(prefix)  # before taking blocks: never evict our hits
        step = self.blocks_per_plane(num_positions) - len(prefix)
        fresh = self._take(step * self.num_planes)
        table = tuple(
            [page.blocks[p] for page in prefix] + fresh[p * step : (p + 1) * step]
            for p in range(self.num_planes)
        )
        self.tables[request_id] = table
        self._changed[request_id] = 0  # a new table: sent whole
        self._sent.pop(request_id, None)
        self.num_cached_pages[request_id] = len(prefix)
        return table

    def hold_table(self, request_id: str) -> None:
        """Do not send the request's new table to the executor yet (a reservation for a
        streamed KV import: the executor learns it at admission, `resend_table`)."""
        self._changed.pop(request_id, None)

    def resend_table(self, request_id: str) -> None:
        """Send the request's whole table with the next updates."""
        self._sent.pop(request_id, None)
        self._changed[request_id] = 0

    def take_table_updates(self) -> tuple[TableUpdate, ...]:
        """The tables changed since the last call, as updates of the executor's copy (each
        change is sent once; a request's new blocks, not its whole table)."""
        if not self._changed:
            return ()
        updates = []
        for request_id, keep in self._changed.items():
            table = self.tables[request_id]
            updates.append(TableUpdate(request_id, keep, tuple(tuple(p[keep:]) for p in table)))
            self._sent[request_id] = len(table[0])
        self._changed.clear()
        return tuple(updates)

    def _mark_changed(self, request_id: str, keep: int) -> None:
        """The request's table changed after its first `keep` blocks per plane."""
        before = self._changed.get(request_id, self._sent.get(request_id, 0))
        self._changed[request_id] = min(before, keep)

    # ---- prefix caching ---------------------------------------------------------------------

    def match_prefix(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        scored_only: bool = False,
        max_loops: int = 0,
    ) -> list[CachedPage]:
        """Cached pages that can serve the start of this prompt (not yet referenced); the
        last prompt position is always left to compute. `scored_only`: pages whose
        positions' last-loop outputs are in the score store (prompt logprobs). With
        `key_by_max_loops` (a family whose prompt K/V depends on the request's loop bound,
        like Huginn's coda), pages are shared only between requests of the same
        `max_loops`."""
        if self.prefix_cache is None:
            return []
        keys = self._page_keys.get(request_id)
        if keys is None:
            salt = f"/r{max_loops}".encode() if self.key_by_max_loops else b""
            keys = self.prefix_cache.page_keys(prompt_token_ids, salt)
            self._page_keys[request_id] = keys
        max_pages = (len(prompt_token_ids) - 1) // self.block_size
        return self.prefix_cache.match(keys, max_pages, scored_only=scored_only)

    def mark_unscored(self, request_id: str) -> None:
        """The request's blocks were filled by a copy (swap-in, KV import), not by its own
        prompt calls: the pages it publishes are not scored."""
        self._unscored.add(request_id)

    def admission_blocks(self, num_positions: int, hits: list[CachedPage]) -> int:
        """Free blocks an admission consumes: its new blocks, plus its hits that are
        unreferenced now (they count as free until acquired), so nothing is counted twice."""
        new = (self.blocks_per_plane(num_positions) - len(hits)) * self.num_planes
        idle_hits = sum(1 for page in hits if page.ref_count == 0)
        return new + idle_hits * self.num_planes

    def publish_prompt(self, request_id: str, num_complete_positions: int) -> None:
        """Publish the request's full prompt pages that are complete at every plane."""
        if self.prefix_cache is None:
            return
        keys = self._page_keys.get(request_id, [])
        table = self.tables[request_id]
        first = self.num_cached_pages[request_id]
        last = min(len(keys), num_complete_positions // self.block_size)
        scored = self.score_store and request_id not in self._unscored
        for i in range(first, last):
            blocks = tuple(plane[i] for plane in table)
            if blocks[0] in self._shares:
                break  # a forked page: its holders share it already
            if not self.prefix_cache.publish(*keys[i], blocks, scored=scored):
                break  # same content cached from another request: this copy stays private
            self.num_cached_pages[request_id] = i + 1

    def forget(self, request_id: str) -> None:
        """The request finished: drop its page keys."""
        self._page_keys.pop(request_id, None)
        self._unscored.discard(request_id)

    def blocks_to_grow(self, request_id: str, num_positions: int) -> int:
        have = len(self.tables[request_id][0])
        return max(0, self.blocks_per_plane(num_positions) - have) * self.num_planes

    def grow(self, request_id: str, num_positions: int) -> bool:
        """Extend every plane to cover `num_positions`; False (nothing changed) if short."""
        needed = self.blocks_to_grow(request_id, num_positions)
        if needed == 0:
            return True
        if needed > self.num_free_blocks:
            return False
        fresh = self._take(needed)
        step = needed // self.num_planes
        table = self.tables[request_id]
        self._mark_changed(request_id, len(table[0]))
        for p, plane in enumerate(table):
            plane.extend(fresh[p * step : (p + 1) * step])
        return True

    def shrink(self, request_id: str, num_positions: int) -> int:
        """Free the blocks of every plane beyond those covering `num_positions` (positions a
        speculative rollback dropped; never cached pages); returns the blocks freed."""
        keep = max(self.blocks_per_plane(num_positions), self.num_cached_pages[request_id])
        freed = 0
        if len(self.tables[request_id][0]) > keep:
            self._mark_changed(request_id, keep)
        for plane in self.tables[request_id]:
            if len(plane) > keep:
                self.pool.free(plane[keep:])
                freed += len(plane) - keep
                del plane[keep:]
        return freed

    def free(self, request_id: str) -> None:
        """Release the request's blocks (its executor drops its copy with the release:
        finished, preempted or swapped out)."""
        self._changed.pop(request_id, None)
        self._sent.pop(request_id, None)
        table = self.tables.pop(request_id, None)
        num_cached = self.num_cached_pages.pop(request_id, 0)
        if table is None:
            return
        if num_cached:
            assert self.prefix_cache is not None
            for block in table[0][:num_cached]:
                self.prefix_cache.release(block)
        shares = self._shares
        for plane_blocks in table:
            if not shares:
                self.pool.free(plane_blocks[num_cached:])
                continue
            for block in plane_blocks[num_cached:]:
                holders = shares.get(block, 0)
                if holders == 0:
                    self.pool.free([block])
                elif holders == 1:
                    del shares[block]
                else:
                    shares[block] = holders - 1

    # ---- prompt groups ----------------------------------------------------------------------

    def fork_blocks(self, num_positions: int, reserve_positions: int = 0) -> int:
        """New blocks a fork of a leader's `num_positions` written positions takes: its partly
        written last block and the blocks up to `reserve_positions` (full reservation), in
        every plane."""
        full = num_positions // self.block_size
        covered = max(
            self.blocks_per_plane(num_positions), self.blocks_per_plane(reserve_positions)
        )
        return (covered - full) * self.num_planes

    def fork(
        self, leader_id: str, follower_id: str, num_positions: int, reserve_positions: int = 0
    ) -> list[BlockMove]:
        """Give `follower_id` a table holding the leader's positions [0, num_positions): the
        full blocks shared, the partly written last one copied into a fresh block per plane
        (plus fresh blocks up to `reserve_positions`). Returns the (leader block, follower
        block) copies, which must run before either request writes that block again."""
        assert follower_id not in self.tables, f"{follower_id} already holds KV"
        leader = self.tables[leader_id]
        full = num_positions // self.block_size
        partial = num_positions % self.block_size != 0
        cached = min(self.num_cached_pages[leader_id], full)
        if cached:
            assert self.prefix_cache is not None
            page_of = self.prefix_cache.page_of_block
            self.prefix_cache.acquire([page_of[block] for block in leader[0][:cached]])
        step = self.fork_blocks(num_positions, reserve_positions) // self.num_planes
        fresh = self._take(step * self.num_planes)
        for plane in leader:
            for block in plane[cached:full]:
                self._shares[block] = self._shares.get(block, 0) + 1
        table = tuple(
            plane[:full] + fresh[p * step : (p + 1) * step] for p, plane in enumerate(leader)
        )
        self.tables[follower_id] = table
        self._changed[follower_id] = 0  # a new table: sent whole
        self._sent.pop(follower_id, None)
        self.num_cached_pages[follower_id] = cached
        if not partial:
            return []
        return [BlockMove(plane[full], fresh[p * step]) for p, plane in enumerate(leader)]

    # ---- swap -------------------------------------------------------------------------------

    def can_swap_out(self, request_id: str) -> bool:
        table = self.tables[request_id]
        return len(table[0]) * self.num_planes <= self.host_pool.num_free_blocks

    def swap_out(self, request_id: str) -> list[BlockMove]:
        """Move every plane of the request to the host pool; device blocks are freed."""
        table = self.tables[request_id]
        host = self.host_pool.allocate(len(table[0]) * self.num_planes)
        step = len(table[0])
        host_table = tuple(host[p * step : (p + 1) * step] for p in range(self.num_planes))
        moves = [
            BlockMove(d, h)
            for plane, hplane in zip(table, host_table)
            for d, h in zip(plane, hplane)
        ]
        self.free(request_id)
        self.host_tables[request_id] = host_table
        self.num_swapped_out_blocks += len(moves)
        return moves

    def swap_in_blocks(self, request_id: str) -> int:
        return len(self.host_tables[request_id][0]) * self.num_planes

    def swap_in(self, request_id: str) -> list[BlockMove]:
        """Bring a swapped-out request back into fresh device blocks; host blocks are freed."""
        host_table = self.host_tables.pop(request_id)
        table = self.allocate(request_id, len(host_table[0]) * self.block_size)
        moves = [
            BlockMove(h, d)
            for hplane, plane in zip(host_table, table)
            for h, d in zip(hplane, plane)
        ]
        for hplane in host_table:
            self.host_pool.free(hplane)
        self.mark_unscored(request_id)
        self.num_swapped_in_blocks += len(moves)
        return moves

    def drop_swapped(self, request_id: str) -> None:
        """A swapped-out request finished (aborted) while waiting."""
        host_table = self.host_tables.pop(request_id, None)
        for hplane in host_table or ():
            self.host_pool.free(hplane)

    # ---- checks -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.host_pool.check_invariants()
        owners: dict[int, int] = {}
        for request_id, table in self.tables.items():
            assert len(table) == self.num_planes, f"{request_id} has {len(table)} planes"
            lengths = {len(plane) for plane in table}
            assert len(lengths) == 1, f"{request_id} planes differ in length"
            for plane in table:
                for block in plane:
                    owners[block] = owners.get(block, 0) + 1
        cached = self.prefix_cache.check_invariants(owners) if self.prefix_cache else set()
        for request_id, table in self.tables.items():
            num_cached = self.num_cached_pages[request_id]
            assert all(b in cached for plane in table for b in plane[:num_cached])
        assert set(self.num_cached_pages) == set(self.tables)
        private = {b for b, n in owners.items() if b not in cached}
        for block in private:
            holders = 1 + self._shares.get(block, 0)
            assert owners[block] == holders, f"block {block} owned {owners[block]} times"
        assert set(self._shares) <= private, "a shared block is not held"
        held = private | cached
        assert not any(self.pool.is_free(b) for b in held), "a block is both held and free"
        assert len(held) + self.pool.num_free_blocks == self.pool.num_blocks, "blocks leaked"
        host_owned: set[int] = set()
        for request_id, table in self.host_tables.items():
            assert request_id not in self.tables, f"{request_id} is on device and host"
            for plane in table:
                assert not host_owned & set(plane), "host block owned twice"
                host_owned |= set(plane)
        assert len(host_owned) + self.host_pool.num_free_blocks == self.host_pool.num_blocks, (
            "host blocks leaked"
        )
