"""`EngineStats`: the engine core's public, read-only statistics snapshot.

Everything outside the engine core (the server's `/metrics` and load snapshot, the
benchmarks, tests) reads KV usage, queue lengths and step counters from this frozen snapshot
(`EngineCore.stats()`), never from the KV pool or scheduler fields. Counters accumulate from
construction or the last `EngineCore.reset_counters()`; gauges (KV blocks, running, waiting)
are read when the snapshot is taken. Torch-free.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Rows per call, by stage (`EngineStats.rows_per_call`): a step's prelude (the rows embedded
# at loop 0), each of its core calls, and its coda (the tokens sampled).
ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
STAGES = ("prelude", "core", "coda")


@dataclass(slots=True)
class RowsHistogram:
    """Counts of calls per `ROWS_BUCKETS` bucket (the last: above them) and their row sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(ROWS_BUCKETS) + 1))
    total: int = 0

    def observe(self, rows: int) -> None:
        self.counts[bisect.bisect_left(ROWS_BUCKETS, rows)] += 1
        self.total += rows


@dataclass(slots=True)
class StepCounters:
    """The engine core's mutable accumulators (private to `EngineCore`)."""

    num_steps: int = 0
    num_core_calls: int = 0
    num_rows: int = 0
    num_output_tokens: int = 0
    num_loops: int = 0
    num_early_exits: int = 0
    num_finalize_copies: int = 0
    num_scored_prompt_positions: int = 0
    num_scored_prompt_loops: int = 0
    num_prompt_row_loops: int = 0
    num_failed_steps: int = 0
    num_graph_calls: int = 0
    num_padded_rows: int = 0
    num_h2d_transfers: int = 0
    num_d2h_transfers: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    num_steps_scheduled_ahead: int = 0
    model_time_s: float = 0.0
    forward_time_s: float = 0.0
    schedule_time_s: float = 0.0
    execute_time_s: float = 0.0
    step_time_s: float = 0.0
    rows: dict[str, RowsHistogram] = field(
        default_factory=lambda: {stage: RowsHistogram() for stage in STAGES}
    )


@dataclass(frozen=True, slots=True)
class EngineStats:
    # Gauges at snapshot time.
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0  # over all planes
    block_size: int = 0
    num_planes: int = 0
    # Counters.
    num_steps: int = 0
    num_core_calls: int = 0
    num_rows: int = 0
    num_output_tokens: int = 0
    num_loops: int = 0  # sum of loops used over output tokens
    num_early_exits: int = 0  # output tokens that exited before the last loop
    num_finalize_copies: int = 0  # LAST_EXITED decode tokens copied into deeper planes
    # Prompt positions scored for prompt logprobs, and the sum of the loops that scored them
    # (the last loop, or the one the exit rule picked: `prompt_logprobs_loop`).
    num_scored_prompt_positions: int = 0
    num_scored_prompt_loops: int = 0
    # Prompt work executed: prompt rows times the loops each ran (a recomputed prompt counts
    # again); requests that forked a prompt group's leader instead of running their own.
    num_prompt_row_loops: int = 0
    num_forked_requests: int = 0
    num_failed_steps: int = 0  # steps whose execution raised (their requests failed)
    # Decode core calls run through the static, row-bucketed buffers (CUDA graph replays, or
    # their eager emulation), and the padding rows they added to reach their bucket.
    num_graph_calls: int = 0
    num_padded_rows: int = 0
    num_h2d_transfers: int = 0
    num_d2h_transfers: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    # Async scheduling: steps whose rows were chosen while the previous step still executed
    # (before its results were applied).
    num_steps_scheduled_ahead: int = 0
    # Memory management, since construction: prompt tokens looked up in / served by the
    # prefix cache at admission; preemptions by mode; KV bytes swapped (both directions).
    num_prefix_cache_queried_tokens: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_swapped_bytes: int = 0
    # Self-speculative decoding, since construction: drafts made, drafts the real token
    # confirmed, drafts it rejected, drafts a deeper loop replaced.
    num_spec_drafted: int = 0
    num_spec_accepted: int = 0
    num_spec_rejected: int = 0
    num_spec_redrafted: int = 0
    # Overload brownout (`scheduler/brownout.py`): its level now, and its changes so far.
    brownout_level: int = 0
    num_brownout_changes: int = 0
    # Coda batching in time (`scheduler/leave_batch.py`), since construction: leave batches
    # run, the held tokens they carried, and the steps those tokens were held (each
    # counting its leave's step: over the tokens, the mean wait a batch cost them).
    num_leave_batches: int = 0
    num_leave_rows: int = 0
    num_held_steps: int = 0
    # Rows per call by stage: (stage, counts per `ROWS_BUCKETS` bucket and above, row sum).
    rows_per_call: tuple[tuple[str, tuple[int, ...], int], ...] = ()
    model_time_s: float = 0.0  # the executor's whole `execute` (as it reports it)
    forward_time_s: float = 0.0  # inside model calls only (see `RunnerOutput`)
    # Host time of whole core steps (schedule, execute, update, observers, releases) on the
    # core's clock, and the parts of it spent in `schedule` and inside `execute`.
    step_time_s: float = 0.0
    schedule_time_s: float = 0.0
    execute_time_s: float = 0.0

    @property
    def update_time_s(self) -> float:
        """Step time outside `schedule` and `execute`: `update`, observers, counters."""
        return self.step_time_s - self.schedule_time_s - self.execute_time_s

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def kv_positions_per_request_max(self) -> int:
        """Positions one request could hold if it owned every block (all planes)."""
        return self.kv_blocks_total // self.num_planes * self.block_size if self.num_planes else 0

    @property
    def mean_rows_per_core_call(self) -> float:
        return self.num_rows / self.num_core_calls if self.num_core_calls else 0.0

    @property
    def mean_loops_per_token(self) -> float:
        return self.num_loops / self.num_output_tokens if self.num_output_tokens else 0.0

    @property
    def mean_loops_per_scored_position(self) -> float:
        positions = self.num_scored_prompt_positions
        return self.num_scored_prompt_loops / positions if positions else 0.0

    @property
    def host_overhead_share(self) -> float:
        """Share of step time outside the model forward: scheduling, engine bookkeeping, and the
        runner's tensor building, finalize copies and sampling."""
        return 1.0 - self.forward_time_s / self.step_time_s if self.step_time_s else 0.0

    @property
    def runner_host_share(self) -> float:
        """The part of `host_overhead_share` spent inside the runner around the forward."""
        runner_s = self.model_time_s - self.forward_time_s
        return runner_s / self.step_time_s if self.step_time_s else 0.0
