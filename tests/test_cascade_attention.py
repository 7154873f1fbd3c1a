"""Cascade (shared-prefix) attention: the grouping rule, exact attention, engine outputs."""

from __future__ import annotations

import pytest
import torch

from loopserve.config import EngineConfig, cascade_enabled
from loopserve.models.attention import attention_reference
from loopserve.runner.attention import cascade as cascade_module
from loopserve.runner.attention.prefix_groups import PrefixGroup, plan_prefix_groups
from loopserve.runner.attention.torch_paged import (
    PagedAttentionMetadata,
    RowSegment,
    TorchPagedAttention,
    Workspace,
)
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import make_engine, reference_for, run_steps


def test_rows_group_by_shared_leading_blocks_of_one_plane():
    tables = [
        [5, 6, 7, 20],  # 0: plane A, position 13 (3 full blocks before it)
        [5, 6, 7, 21],  # 1: plane A, position 14
        [5, 6, 9, 22],  # 2: plane A, diverges after 2 blocks
        [30, 31, 40],  # 3: plane B
        [30, 31, 41],  # 4: plane B, position 5: only one full block before it
        [50, 51],  # 5: alone
        [5, 60],  # 6: position 3, before its first full block: never groups
    ]
    positions = [13, 14, 12, 9, 5, 6, 3]
    groups = plan_prefix_groups(tables, positions, block_size=4)
    # By hand: rows 0,1,2 share blocks [5, 6]; rows 3,4 share [30] (row 4 at position 5 sees
    # positions 0..4, so only block 0 lies wholly before it); row 5 is alone; row 6 too early.
    assert groups == [PrefixGroup((0, 1, 2), 2), PrefixGroup((3, 4), 1)]
    assert plan_prefix_groups(tables[:1] + tables[5:], [13, 6, 3], block_size=4) == []


def _context_slots(seg: RowSegment, block_size: int) -> list[int]:
    end = seg.start + seg.count
    return [seg.block_table[p // block_size] * block_size + p % block_size for p in range(end)]


@pytest.mark.parametrize("kernel", ["fused", "matmul"])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_cascade_equals_plain_paged_attention_for_groups_at_two_planes(
    num_kv_heads, kernel, monkeypatch
):
    """Decode rows sharing a prefix at two planes (partial last blocks, a row that diverges
    early, an ungrouped row and a prompt chunk in the same call) give the attention of the
    dense reference and of plain paged attention, to float32 tolerance. `matmul`: the plain
    matmul path other devices take instead of the fused CPU kernel."""
    if kernel == "matmul":
        monkeypatch.setattr(cascade_module, "_CPU_FLASH_WITH_LSE", None)
    else:
        assert cascade_module._CPU_FLASH_WITH_LSE is not None  # this torch has the fused kernel
    gen = torch.Generator().manual_seed(7)
    block_size, heads, head_dim = 4, 4, 8
    cache = torch.randn(1, 2, 40 * block_size, num_kv_heads, head_dim, generator=gen)
    segments = [
        RowSegment([1, 2, 3, 10], 13, 1),  # plane 0 group: 3 shared blocks, suffix 13
        RowSegment([30, 31, 32], 9, 1),  # plane 1 group
        RowSegment([1, 2, 3, 11, 12], 18, 1),  # plane 0 group, suffix spans two blocks
        RowSegment([20, 21, 22], 5, 4),  # a prompt chunk (never grouped)
        RowSegment([30, 31, 33], 10, 1),  # plane 1 group
        RowSegment([1, 2, 13], 8, 1),  # plane 0: shares only 2 blocks, cuts the prefix to 2
        RowSegment([25, 26], 6, 1),  # alone
    ]
    rows = sum(seg.count for seg in segments)
    query = torch.randn(rows, heads, head_dim, generator=gen)
    key = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
    cascade_meta = PagedAttentionMetadata.build(segments, block_size, "cpu", cascade=True)
    plan = cascade_meta.cascade
    assert plan is not None and plan.num_groups == 2 and len(plan.suffixes) == 5
    assert plan.prefix_mask.sum().item() == (2 + 2) * block_size  # plane 0: 2 blocks, 1: 2
    plain_meta = PagedAttentionMetadata.build(segments, block_size, "cpu")
    assert plain_meta.cascade is None
    cascade_cache, plain_cache = cache.clone(), cache.clone()
    out = TorchPagedAttention(cascade_cache, cascade_meta, 0.4, Workspace()).attend(
        0, query, key, value
    )
    plain = TorchPagedAttention(plain_cache, plain_meta, 0.4, Workspace()).attend(
        0, query, key, value
    )
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cascade_cache, plain_cache, rtol=0, atol=0)
    row = 0
    for seg in segments:
        slots = _context_slots(seg, block_size)
        end = seg.start + seg.count
        allowed = torch.arange(end).unsqueeze(0) <= torch.arange(seg.start, end).unsqueeze(1)
        expected = attention_reference(
            query[row : row + seg.count],
            cascade_cache[0, 0, slots],
            cascade_cache[0, 1, slots],
            allowed,
            0.4,
        )
        torch.testing.assert_close(out[row : row + seg.count], expected, rtol=1e-5, atol=1e-6)
        row += seg.count


def test_cascade_defaults_to_prefix_caching():
    assert cascade_enabled(EngineConfig.from_engine_args())  # last_exited: caching on
    assert not cascade_enabled(EngineConfig.from_engine_args(layout="shared"))
    assert not cascade_enabled(EngineConfig.from_engine_args(enable_prefix_caching=False))
    config = EngineConfig.from_engine_args(enable_prefix_caching=False, cascade_attention=True)
    assert cascade_enabled(config)


SYSTEM = [11, 22, 33, 44, 55, 66, 77, 88, 99, 12, 13, 14, 15, 16, 17, 18, 19]  # 4 full pages


def _work(num_followers: int = 5):
    # r0 publishes the system prompt; the rest hit it and decode side by side.
    work = [("r0", SYSTEM + [1, 2], _params(0), 0)]
    work += [(f"r{i}", SYSTEM + [i, i + 3], _params(i), 22) for i in range(1, num_followers + 1)]
    return work


def _params(i: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=10,
        temperature=0.0 if i % 2 else 0.9,
        seed=500 + i,
        exit_threshold=(0.5, 0.8, 1.0)[i % 3],
        ignore_eos=True,
    )


@pytest.mark.parametrize(
    "layout,mode,extra",
    [
        ("last_exited", "refill", {}),
        ("last_exited", "no_refill", {}),
        ("last_exited", "refill", {"graph_mode": "emulate"}),
        ("shared", "refill", {}),
        ("shared", "no_refill", {}),
    ],
    ids=["last_exited-refill", "last_exited-no_refill", "graphs", "shared-refill", "shared-nr"],
)
def test_cascade_on_and_off_give_the_reference_outputs(tiny_dir, layout, mode, extra):
    args = dict(layout=layout, mode=mode, max_num_seqs=6, **extra)
    outputs, engines = {}, {}
    for cascade in (True, False):
        engine = make_engine(tiny_dir, cascade_attention=cascade, **args)
        finished = run_steps(engine, _work())
        outputs[cascade] = {r: (o.token_ids, o.exit_depths) for r, o in finished.items()}
        engines[cascade] = engine
    assert outputs[True] == outputs[False]
    for request_id, prompt, params, _ in _work():
        ref = reference_for(engines[True], prompt, params)
        assert outputs[True][request_id] == (ref.token_ids, ref.exit_depths), request_id
    assert any(depth < 4 for _, depths in outputs[True].values() for depth in depths)
    stats = engines[True].runner.attention.cascade_stats
    assert engines[False].runner.attention.cascade_stats.num_groups == 0
    if layout == "shared":
        # SHARED has no prefix caching: no two requests ever hold the same block, so no
        # group forms (cascade is legal there and simply never engages).
        assert engines[True].kv.prefix_cache is None
        assert stats.num_groups == 0
    else:
        hits = engines[True].kv.prefix_cache.stats.num_hit_tokens
        assert hits == 5 * 16  # r1..r5 each reuse the 4 full system pages
        assert stats.num_groups > 0 and stats.num_grouped_rows >= 2 * stats.num_groups
        assert stats.num_shared_positions == 16 * (stats.num_grouped_rows - stats.num_groups)


def test_replay_rows_after_preemption_group_with_decode_rows(tiny_dir):
    # 12 blocks per plane: the 4 shared system pages plus a few requests' own blocks, so
    # recompute preemption happens and replayed rows re-hit the cached system pages.
    engine = make_engine(tiny_dir, num_blocks=48, max_num_seqs=6, preemption_mode="recompute")
    stats = engine.runner.attention.cascade_stats
    grouped_replays = []

    def observe(scheduled, _output):
        singles = [i for i in scheduled.items if i.token_count == 1]
        own = engine.runner.block_tables.tables  # the runner's copy, as this step ran
        tables = [own[i.request_id][i.depth] for i in singles]
        groups = plan_prefix_groups(tables, [i.token_start for i in singles], 4)
        grouped = [singles[r] for group in groups for r in group.rows]
        grouped_replays.extend(i for i in grouped if i.kind.value == "replay")

    engine.core.add_observer(observe)
    finished = run_steps(engine, _work())
    assert engine.scheduler.memory_stats.num_preemptions_recompute > 0
    assert grouped_replays, "no replay row shared a prefix group"
    assert stats.num_groups > 0
    for request_id, prompt, params, _ in _work():
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
