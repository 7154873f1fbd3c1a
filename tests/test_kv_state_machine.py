"""A hypothesis state machine over the KV manager: allocate, grow, write, publish, hit,
evict, preempt, swap and free in any order, with the invariants checked after every rule."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
from tests.optional import require

require("hypothesis")

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loopserve.scheduler.kv_cache import KVCacheManager
from loopserve.scheduler.prefix_cache import PrefixCache

BLOCK_SIZE, NUM_PLANES, NUM_BLOCKS, NUM_HOST_BLOCKS = 2, 3, 30, 12
# Prompts from a two-letter alphabet share prefixes often.
prompts = st.lists(st.sampled_from([1, 2]), min_size=1, max_size=9)


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(
            NUM_BLOCKS,
            BLOCK_SIZE,
            NUM_PLANES,
            num_host_blocks=NUM_HOST_BLOCKS,
            prefix_cache=PrefixCache(BLOCK_SIZE, NUM_PLANES),
        )
        self.prompt: dict[str, list[int]] = {}
        self.complete: dict[str, int] = {}  # prompt positions complete at every plane
        self.covered: dict[str, int] = {}  # positions the table must cover
        self.swapped: set[str] = set()
        self.next_id = 0
        self.num_hits = 0

    def _running(self) -> list[str]:
        return sorted(self.kv.tables)

    @rule(prompt=prompts)
    def allocate(self, prompt):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        hits = self.kv.match_prefix(request_id, prompt)
        assert len(hits) <= (len(prompt) - 1) // BLOCK_SIZE  # the last position is computed
        needed = self.kv.admission_blocks(len(prompt), hits)
        if needed > self.kv.num_free_blocks:
            self.kv.forget(request_id)
            return
        # New blocks for the pages not hit, plus hits that were counted free (unreferenced).
        idle_hits = sum(page.ref_count == 0 for page in hits)
        assert needed == (-(-len(prompt) // BLOCK_SIZE) - len(hits) + idle_hits) * NUM_PLANES
        free_before = self.kv.num_free_blocks
        self.kv.allocate(request_id, len(prompt), prefix=hits)
        assert free_before - self.kv.num_free_blocks == needed
        self.num_hits += len(hits)
        self.prompt[request_id] = prompt
        self.complete[request_id] = len(hits) * BLOCK_SIZE
        self.covered[request_id] = len(prompt)

    @precondition(lambda self: self.kv.tables)
    @rule(data=st.data(), count=st.integers(1, 4))
    def run_prompt(self, data, count):
        """Some prompt positions complete at every plane; full pages get published."""
        request_id = data.draw(st.sampled_from(self._running()))
        prompt = self.prompt[request_id]
        start = self.complete[request_id]
        self._assert_writable(request_id, range(start, min(len(prompt), start + count)))
        self.complete[request_id] = min(len(prompt), start + count)
        self.kv.publish_prompt(request_id, self.complete[request_id])

    @precondition(lambda self: self.kv.tables)
    @rule(data=st.data(), extra=st.integers(1, 5))
    def grow(self, data, extra):
        """Decode positions after a complete prompt."""
        request_id = data.draw(st.sampled_from(self._running()))
        if self.complete[request_id] < len(self.prompt[request_id]):
            return
        target = self.covered[request_id] + extra
        free_before = self.kv.num_free_blocks
        needed = self.kv.blocks_to_grow(request_id, target)
        if self.kv.grow(request_id, target):
            self.covered[request_id] = target
            assert free_before - self.kv.num_free_blocks == needed
            self._assert_writable(request_id, range(len(self.prompt[request_id]), target))
        else:
            assert needed > free_before and self.kv.num_free_blocks == free_before

    @precondition(lambda self: self.kv.tables)
    @rule(data=st.data())
    def preempt_recompute(self, data):
        request_id = data.draw(st.sampled_from(self._running()))
        self.kv.free(request_id)
        self._forget(request_id)

    @precondition(lambda self: self.kv.tables)
    @rule(data=st.data())
    def swap_out(self, data):
        request_id = data.draw(st.sampled_from(self._running()))
        if not self.kv.can_swap_out(request_id):
            return
        num_blocks = len(self.kv.tables[request_id][0]) * NUM_PLANES
        moves = self.kv.swap_out(request_id)
        assert len(moves) == num_blocks and len({m.dst for m in moves}) == num_blocks
        self.swapped.add(request_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.kv.swap_in_blocks(request_id) > self.kv.num_free_blocks:
            return
        moves = self.kv.swap_in(request_id)
        assert all(not self.kv.prefix_cache.is_cached(m.dst) for m in moves)
        self.swapped.discard(request_id)

    @precondition(lambda self: self.kv.tables or self.swapped)
    @rule(data=st.data())
    def finish(self, data):
        request_id = data.draw(st.sampled_from(sorted({*self.kv.tables, *self.swapped})))
        self.kv.free(request_id)
        self.kv.drop_swapped(request_id)
        self.swapped.discard(request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.kv.forget(request_id)
        for state in (self.prompt, self.complete, self.covered):
            state.pop(request_id, None)

    def _assert_writable(self, request_id: str, positions) -> None:
        """A position about to be written is never in a cached (shareable) page."""
        table = self.kv.tables[request_id]
        for position in positions:
            for plane in table:
                assert not self.kv.prefix_cache.is_cached(plane[position // BLOCK_SIZE])

    @invariant()
    def consistent(self):
        self.kv.check_invariants()
        for request_id, table in self.kv.tables.items():
            if request_id in self.covered:
                assert len(table[0]) * BLOCK_SIZE >= self.covered[request_id]
                shared = self.kv.num_cached_pages[request_id] * BLOCK_SIZE
                assert shared <= self.complete[request_id]
        assert set(self.kv.host_tables) == self.swapped
        assert 0 <= self.kv.num_free_blocks <= NUM_BLOCKS

    def teardown(self):
        for request_id in list(self.kv.tables):
            self.kv.free(request_id)
        for request_id in list(self.swapped):
            self.kv.drop_swapped(request_id)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert self.kv.host_pool.num_free_blocks == NUM_HOST_BLOCKS


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVManagerStateMachine = KVMachine.TestCase


def test_state_machine_reaches_hits_evictions_and_swaps():
    """The machine's rules are reachable: a fixed run hits, evicts and swaps."""
    machine = KVMachine()
    for prompt in ([1, 2, 1, 2, 1], [2, 2, 2, 2, 2, 2, 2, 2, 1]):
        machine.allocate(prompt)
        request_id = f"r{machine.next_id - 1}"
        machine.complete[request_id] = len(prompt)
        machine.kv.publish_prompt(request_id, len(prompt))
        machine.kv.free(request_id)
        machine._forget(request_id)
    machine.allocate([1, 2, 1, 2, 2])  # hits the first prompt's two pages
    assert machine.num_hits == 2
    request_id = f"r{machine.next_id - 1}"
    machine.complete[request_id] = 5
    assert machine.kv.swap_out(request_id)
    machine.swapped.add(request_id)
    # Fill the pool: the cached pages of the second prompt must be evicted.
    machine.allocate([1] * 9)
    machine.allocate([2, 1] * 4)
    assert machine.kv.prefix_cache.stats.num_evicted_pages > 0
    machine.consistent()
    machine.teardown()
