"""Pricing a simulated step's core calls, and the run's executor totals.

`CallTally` is what a core call carries (rows, prelude rows and their context, KV positions
read, attention pairs, finalize copies); `CodaTally` is a step's coda work. `CallPricer`
turns a step's tallies (one per item depth count: an item with n depths runs in calls
0..n-1) into each call's rows and simulated seconds from the `CostModel`, with cascade
attention's shared prefixes read once per group, and adds them to `ExecutorStats` by call
kind (decode, prompt, mixed). `SimExecutor` (executor.py) builds the tallies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loopserve.runner.attention.prefix_groups import plan_prefix_groups
from loopserve.sim.cost_model import CostModel


@dataclass
class ExecutorStats:
    """Totals over a run; call kinds by the rows they carry."""

    num_steps: int = 0
    decode_calls: int = 0
    decode_rows: int = 0
    decode_bytes: float = 0.0  # HBM bytes of decode-only calls (weights + KV + embeddings)
    decode_time_s: float = 0.0
    prompt_calls: int = 0
    prompt_rows: int = 0
    prompt_time_s: float = 0.0
    mixed_calls: int = 0  # calls carrying both prompt and decode rows
    mixed_rows: int = 0
    mixed_time_s: float = 0.0
    core_time_s: float = 0.0
    prelude_time_s: float = 0.0  # of core time: the prelude (its layers, embedding reads)
    coda_time_s: float = 0.0
    sampling_time_s: float = 0.0
    coda_rows: int = 0
    num_early_exits: int = 0
    num_finalize_copies: int = 0
    swapped_blocks: int = 0  # blocks (of one plane) copied between device and host
    swap_time_s: float = 0.0  # those copies over the host link (serial with the step)
    streamed_write_s: float = 0.0  # streamed hand-offs' chunks written as they land
    max_copy_s: float = 0.0  # the longest copy one step or one landed chunk made wait
    cascade_groups: int = 0  # cascade attention: groups over all core calls
    cascade_rows: int = 0  # rows in those groups
    cascade_saved_positions: int = 0  # KV positions not read thanks to the groups

    @property
    def num_core_calls(self) -> int:
        return self.decode_calls + self.prompt_calls + self.mixed_calls

    @property
    def model_time_s(self) -> float:
        return self.core_time_s + self.coda_time_s + self.sampling_time_s + self.swap_time_s


class CallPricer:
    """Rows and simulated seconds of a step's core calls (see the module docstring)."""

    def __init__(self, cost: CostModel, stats: ExecutorStats, *, shared: bool,
                 block_size: int) -> None:  # fmt: skip
        """`shared`: one plane (SHARED layout), else a plane per depth (cascade groups
        compare the tables of the plane each row reads); `block_size` in positions."""
        self.cost = cost
        self.stats = stats
        self.shared = shared
        self.block_size = block_size

    def _cascade_saved(self, singles: list[tuple[str, int, int]], call_index: int,
                       block_tables) -> int:  # fmt: skip
        """KV positions cascade attention does not read in one core call: per group of
        one-row rows (request, depth, position) sharing `n` leading blocks of a plane,
        `(rows - 1) * n * block_size`."""
        tables = [
            block_tables[request_id][0 if self.shared else depth + call_index]
            for request_id, depth, _ in singles
        ]
        positions = [position for _, _, position in singles]
        saved = 0
        stats = self.stats
        for group in plan_prefix_groups(tables, positions, self.block_size):
            saved += (len(group.rows) - 1) * group.num_blocks * self.block_size
            stats.cascade_groups += 1
            stats.cascade_rows += len(group.rows)
        stats.cascade_saved_positions += saved
        return saved

    def price(self, tallies: list[CallTally], block_tables) -> tuple[tuple[int, ...], float]:
        """Rows and simulated seconds of each core call of the step (call k: items with more
        than k depths)."""
        stats = self.stats
        rows_per_call = []
        total_s = 0.0
        call = CallTally()
        for k in range(len(tallies) - 1, 0, -1):
            call.add(tallies[k])  # now: every item with >= k depths, i.e. call k - 1
            if not call.rows:  # a step of leave rows only: no core call
                continue
            prelude = call.prelude_rows if k == 1 else 0
            kv_read = call.kv_read
            if len(call.singles) > 1:
                kv_read -= self._cascade_saved(call.singles, k - 1, block_tables)
            cost = self.cost.core_call(
                rows=call.rows,
                prelude_rows=prelude,
                kv_read_positions=kv_read,
                attention_pairs=call.pairs,
                finalize_copies=call.finalize,
                prelude_kv_read=call.prelude_kv_read if k == 1 else 0,
                prelude_pairs=call.prelude_pairs if k == 1 else 0,
            )
            if prelude:  # the prelude's share of the call: the call priced without it
                bare = self.cost.core_call(
                    rows=call.rows, kv_read_positions=kv_read, attention_pairs=call.pairs,
                    finalize_copies=call.finalize,
                )  # fmt: skip
                stats.prelude_time_s += cost.time_s - bare.time_s
            rows_per_call.append(call.rows)
            total_s += cost.time_s
            if call.has_prompt and call.has_decode:
                stats.mixed_calls += 1
                stats.mixed_rows += call.rows
                stats.mixed_time_s += cost.time_s
            elif call.has_prompt:
                stats.prompt_calls += 1
                stats.prompt_rows += call.rows
                stats.prompt_time_s += cost.time_s
            else:
                stats.decode_calls += 1
                stats.decode_rows += call.rows
                stats.decode_bytes += cost.bytes_moved
                stats.decode_time_s += cost.time_s
        rows_per_call.reverse()
        return tuple(rows_per_call), total_s


@dataclass(slots=True)
class CodaTally:
    """A step's coda work: lm_head rows, coda-layer rows with their context, and the
    criterion checks' coda time (`coda_every_loop`)."""

    head_rows: int = 0
    layer_rows: int = 0
    kv_read: int = 0
    pairs: int = 0
    checks_s: float = 0.0

    def add(self, head_rows: int, layer_rows: int, kv_read: int, pairs: int) -> None:
        self.head_rows += head_rows
        self.layer_rows += layer_rows
        self.kv_read += kv_read
        self.pairs += pairs


@dataclass(slots=True)
class CallTally:
    """What one core call of a step carries (its rows, prelude rows, KV read, attention
    pairs, finalize copies); a step keeps one per item depth count and sums them per call."""

    rows: int = 0
    prelude_rows: int = 0
    prelude_kv_read: int = 0
    prelude_pairs: int = 0
    kv_read: int = 0
    pairs: int = 0
    finalize: int = 0
    has_prompt: bool = False
    has_decode: bool = False
    # One-row rows (request, depth, position), for cascade pricing only.
    singles: list[tuple[str, int, int]] = field(default_factory=list)

    def add(self, other: CallTally) -> None:
        self.singles += other.singles
        self.rows += other.rows
        self.prelude_rows += other.prelude_rows
        self.prelude_kv_read += other.prelude_kv_read
        self.prelude_pairs += other.prelude_pairs
        self.kv_read += other.kv_read
        self.pairs += other.pairs
        self.finalize += other.finalize
        self.has_prompt |= other.has_prompt
        self.has_decode |= other.has_decode
