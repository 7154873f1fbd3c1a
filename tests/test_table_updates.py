"""Block tables travel as per-request updates (`TableUpdate`, as vLLM's `new_block_ids`), not
as the KV manager's whole live tables each step: the runner keeps its own copy
(`BlockTables`), equal to the KV manager's after every step (checked by `run_steps`), and
the blocks sent over a run are the blocks the pool handed out, each once."""

from __future__ import annotations

import pytest

from loopserve.contracts import BlockTables, KVTransfer, SchedulerOutput, SwapKind, TableUpdate
from tests.engine_utils import make_engine, random_workload, reference_for, run_steps


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_steps_send_each_new_block_once_and_the_copy_follows_preemption(tiny_dir, preemption):
    engine = make_engine(tiny_dir, preemption_mode=preemption, num_blocks=44,
                         swap_space=2048 * 40)  # fmt: skip
    handed_out = []
    allocate = engine.scheduler.kv.pool.allocate

    def counting(count):
        blocks = allocate(count)
        handed_out.extend(blocks)
        return blocks

    engine.scheduler.kv.pool.allocate = counting
    sent, steps = [], {"decode_only": 0, "silent": 0}

    def watch(scheduled, _output):
        for update in scheduled.table_updates:
            sent.extend(block for plane in update.new_blocks for block in plane)
        if scheduled.decode is not None and not scheduled.items:
            steps["decode_only"] += 1
            steps["silent"] += not scheduled.table_updates

    engine.core.add_observer(watch)
    work = random_workload(5, 9, engine.model.config.vocab_size, sampled=False)
    finished = run_steps(engine, work)
    stats = engine.scheduler.memory_stats
    assert stats.num_preemptions > 0
    # Every block sent was handed out by the pool, and none is sent twice while held: a
    # block comes back only after being freed and handed out again.
    assert sorted(sent) == sorted(handed_out)
    # Most decode steps grow no table and send none (four planes of 4-position blocks).
    assert steps["silent"] > steps["decode_only"] // 2
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths)
    assert engine.runner.block_tables.tables == {}  # every request released its copy


def test_an_update_truncates_appends_or_replaces_and_releases_drop_the_copy():
    copy = BlockTables()
    copy.apply(SchedulerOutput(1, (), (TableUpdate("a", 0, ((1, 2), (3, 4))),)))
    copy.apply(SchedulerOutput(2, (), (TableUpdate("a", 2, ((5,), (6,))),)))
    assert copy.tables["a"] == ([1, 2, 5], [3, 4, 6])
    copy.apply(SchedulerOutput(3, (), (TableUpdate("a", 1, ((7,), (8,))),)))  # a rollback
    assert copy.tables["a"] == ([1, 7], [3, 8])
    copy.apply(SchedulerOutput(4, (), (TableUpdate("a", 0, ((9,), (10,))),)))  # re-allocated
    assert copy.tables["a"] == ([9], [10])
    copy.apply(SchedulerOutput(5, (), kv_transfers=(KVTransfer(SwapKind.OUT, "a", ()),)))
    assert copy.tables == {}
    copy.apply(SchedulerOutput(6, (), (TableUpdate("b", 0, ((1,),)),)))
    # a request preempted and re-admitted in one output: dropped, then its new table
    copy.apply(SchedulerOutput(7, (), (TableUpdate("b", 0, ((2,),)),),
                               preempted_request_ids=("b",)))  # fmt: skip
    assert copy.tables == {"b": ([2],)}
    copy.apply(SchedulerOutput(8, (), finished_request_ids=("b",)))
    assert copy.tables == {}
