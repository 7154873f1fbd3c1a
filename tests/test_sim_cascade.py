"""The simulator prices cascade attention as the runner runs it: a shared prefix read once."""

from __future__ import annotations

from loopserve.contracts import DecodeRow, SchedulerOutput, TableUpdate
from loopserve.sim.cost_model import OURO_1P4B, CostModel, ModelShape
from loopserve.sim.executor import SimExecutor
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.metrics import summarize
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import WorkloadSpec, build_workload
from tests.engine_utils import decode_rows

H100 = get_device_profile("h100")
# Ouro-1.4B K and V of one position in one plane, bf16: 2 * 24 layers * 16 heads * 128 * 2 B.
KV_BYTES_PER_POSITION = 2 * 24 * 16 * 128 * 2


def _decode(request_id: str, position: int, depth: int) -> DecodeRow:
    return DecodeRow(request_id, position, depth, 5, 0, False, 0.0, 1.0, 1.0)


def _execute(executor: SimExecutor, rows: list[DecodeRow], tables) -> None:
    """Loop 0 of each row's token first (plane 0: no shared blocks), then `rows`."""
    starts = [row._replace(depth=0) for row in rows]
    updates = tuple(
        TableUpdate(rid, 0, tuple(map(tuple, planes))) for rid, planes in tables.items()
    )
    executor.execute(SchedulerOutput(1, (), updates, decode=decode_rows(*starts)))
    executor.execute(SchedulerOutput(2, (), decode=decode_rows(*rows)))


def test_a_group_reads_its_shared_blocks_once():
    # r0 and r1 read plane 1, whose tables start with the same 3 blocks (48 positions); r2 is
    # at depth 2 (plane 2: other blocks); r3 shares only block 10 with them but sits at
    # position 70, so the group's prefix is the common run of all three: 1 block.
    tables = {
        "r0": ([1], [10, 11, 12, 100], [20], [30]),
        "r1": ([2], [10, 11, 12, 101], [21], [31]),
        "r2": ([3], [13], [22, 23, 24, 102], [32]),
    }
    rows = [_decode("r0", 50, 1), _decode("r1", 60, 1), _decode("r2", 55, 2)]
    stats = {}
    for cascade in (True, False):
        executor = SimExecutor(CostModel(ModelShape.from_config(OURO_1P4B), H100), cascade=cascade)
        _execute(executor, rows, tables)
        stats[cascade] = executor.stats
    saved = stats[False].decode_bytes - stats[True].decode_bytes
    assert saved == 48 * KV_BYTES_PER_POSITION  # (2 rows - 1) x 48 positions
    assert (stats[True].cascade_groups, stats[True].cascade_rows) == (1, 2)
    assert stats[False].cascade_groups == 0

    tables["r3"] = ([4], [10, 40, 41, 42, 103], [25], [33])
    rows.append(_decode("r3", 70, 1))
    executor = SimExecutor(CostModel(ModelShape.from_config(OURO_1P4B), H100), cascade=True)
    _execute(executor, rows, tables)
    assert executor.stats.cascade_saved_positions == 2 * 16  # 3 rows share one 16-position block


def _run(workload, **engine_args):
    sim = Simulator(OURO_1P4B, H100, {"max_num_seqs": 8, **engine_args})
    return sim, summarize(sim.run(workload))


def test_cascade_changes_nothing_without_a_shared_prefix_and_speeds_up_with_one():
    plain = build_workload(WorkloadSpec(num_requests=24, dataset="synthetic", output_len=48), 4)
    on, on_result = _run(plain, cascade_attention=True)
    off, off_result = _run(plain, cascade_attention=False)
    assert on.executor.stats.cascade_groups == 0
    assert on.executor.stats.model_time_s == off.executor.stats.model_time_s
    assert on_result.duration_s == off_result.duration_s

    spec = WorkloadSpec(num_requests=24, dataset="synthetic", output_len=48, shared_prefix_len=512)
    shared = build_workload(spec, 4)
    on, on_result = _run(shared)  # the default: cascade follows prefix caching (on)
    off, off_result = _run(shared, cascade_attention=False)
    assert on.executor.stats.cascade_groups > 0
    assert on_result.prefix_hit_tokens == off_result.prefix_hit_tokens > 0
    assert on.executor.stats.decode_bytes < off.executor.stats.decode_bytes
    assert on_result.num_output_tokens == off_result.num_output_tokens
