"""Scheduling behaviour: refill order, cohorts, finalize, capacity and input errors."""

from __future__ import annotations

import math

import pytest
import torch

from loopserve.errors import CapacityError, ConfigError, InvalidRequestError
from loopserve.models.attention import attention_reference
from loopserve.runner.attention.torch_paged import (
    PagedAttentionMetadata,
    RowSegment,
    TorchPagedAttention,
    Workspace,
)
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import make_engine, reference_for, run_steps, step_rows


def record_schedules(engine):
    """Every executed step's rows (`step_rows`: decode rows, then items), through the engine
    core's observer hook."""
    steps = []
    engine.core.add_observer(lambda scheduled, _output: steps.append(step_rows(scheduled)))
    return steps


def trace_params(trace, max_tokens=6):
    return SamplingParams(
        max_tokens=max_tokens, temperature=0, exit_trace=tuple(trace), ignore_eos=True
    )


def test_exit_after_one_loop_frees_row_for_refill_next_to_slow_token(tiny_dir):
    engine = make_engine(tiny_dir, exit_mode="trace", mode="refill")
    steps = record_schedules(engine)
    work = [("fast", [1, 2, 3], trace_params([1]), 0), ("slow", [4, 5, 6], trace_params([4]), 0)]
    run_steps(engine, work)
    shared_calls = [
        s for s in steps
        if {(i.request_id, i.depth) for i in s} >= {("fast", 0)}
        and any(i.request_id == "slow" and i.depth >= 1 for i in s)
    ]  # fmt: skip
    assert shared_calls, "a fast token's next token never rode with the slow token's later loops"
    for s in steps:
        assert all(i.kind == "decode" for i in s) or all(i.kind == "prompt" for i in s)


def test_no_refill_holds_exited_tokens_until_the_cohort_drains(tiny_dir):
    engine = make_engine(tiny_dir, exit_mode="trace", mode="no_refill")
    steps = record_schedules(engine)
    work = [("fast", [1, 2, 3], trace_params([1]), 0), ("slow", [4, 5, 6], trace_params([4]), 0)]
    finished = run_steps(engine, work)
    decode_steps = [s for s in steps if s and s[0].kind == "decode"]
    for s in decode_steps:
        depths = {i.request_id: i.depth for i in s}
        if depths.get("slow", 0) >= 1:
            assert "fast" not in depths, "fast token refilled before the cohort drained"
    assert finished["fast"].exit_depths == [1] * 6
    assert finished["slow"].exit_depths == [4] * 6


def test_decode_rows_at_different_depths_share_one_core_call(tiny_dir):
    engine = make_engine(tiny_dir, exit_mode="trace")
    steps = record_schedules(engine)
    work = [(f"r{i}", [i + 1, 7], trace_params([i + 1]), 0) for i in range(4)]
    run_steps(engine, work)
    depth_sets = [{i.depth for i in s} for s in steps if s and s[0].kind == "decode"]
    assert max(len(d) for d in depth_sets) >= 3


def test_stats_split_forward_runner_and_host_time(tiny_dir):
    engine = make_engine(tiny_dir, exit_mode="trace")
    work = [(f"r{i}", [i + 1, 7, 9], trace_params([i % 4 + 1]), 0) for i in range(4)]
    run_steps(engine, work)
    stats = engine.stats
    assert stats.num_output_tokens == 24 and stats.mean_loops_per_token == 2.5
    assert 0 < stats.forward_time_s < stats.model_time_s < stats.step_time_s
    assert 0 < stats.runner_host_share < stats.host_overhead_share < 1


def test_atomic_prompt_chunks_run_all_loops_and_pack_several_requests(tiny_dir):
    engine = make_engine(tiny_dir, max_num_batched_tokens=48, prefill_chunk_size=12)
    steps = record_schedules(engine)
    work = [
        (f"r{i}", list(range(1 + i, 31 + i)), SamplingParams(max_tokens=2, temperature=0), 0)
        for i in range(3)
    ]
    run_steps(engine, work)
    prompt_steps = [s for s in steps if s and s[0].kind == "prompt"]
    assert all(i.num_depths == 4 and i.depth == 0 for s in prompt_steps for i in s)
    assert all(s.num_rows <= 48 for s in steps)
    assert max(len({i.request_id for i in s}) for s in prompt_steps) >= 2
    chunks = sorted((i.request_id, i.token_start, i.token_count) for s in prompt_steps for i in s)
    assert [c for c in chunks if c[0] == "r0"] == [("r0", 0, 12), ("r0", 12, 12), ("r0", 24, 6)]


def test_prompt_and_decode_steps_alternate_when_both_are_ready(tiny_dir):
    engine = make_engine(tiny_dir, max_num_seqs=4, prefill_chunk_size=4, max_num_batched_tokens=8)
    steps = record_schedules(engine)
    work = [("early", [1, 2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), 0)]
    work += [("late", list(range(1, 40)), SamplingParams(max_tokens=2, temperature=0), 2)]
    run_steps(engine, work)
    late_prompt_steps = [
        i
        for i, s in enumerate(steps)
        if any(it.request_id == "late" and it.kind == "prompt" for it in s)
    ]
    early_decode_steps = {
        i
        for i, s in enumerate(steps)
        if any(it.request_id == "early" and it.kind == "decode" for it in s)
    }
    # Between two prompt steps of the long prompt, the running request decodes once.
    for a, b in zip(late_prompt_steps, late_prompt_steps[1:]):
        if any(a < d < b for d in early_decode_steps) or b - a == 1:
            continue
        pytest.fail(f"prompt steps {a} and {b} without decode in between")
    assert any(b - a == 2 for a, b in zip(late_prompt_steps, late_prompt_steps[1:]))


def test_finalize_copies_exit_depth_kv_into_deeper_planes_across_block_boundary(tiny_dir):
    block_size = 4
    engine = make_engine(tiny_dir, exit_mode="trace", block_size=block_size)
    # Prompt positions 0..2; output token k is fed back at position 3 + k: token 0 at position
    # 3 (last slot of block 0), token 1 at position 4 (first slot of block 1). Every decode
    # token exits after loop 2 (depth 1), so finalize copies plane 1 into planes 2 and 3, and
    # loops 3 and 4 never write those slots themselves. max_tokens=6 keeps the request running
    # well past the boundary.
    engine.add_request("a", [5, 6, 7], trace_params([2], max_tokens=6))
    checked: dict[int, int] = {}  # position -> outputs when its finalized KV was checked
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        request = engine.scheduler.requests.get("a")
        if request is None:
            break
        table = engine.kv.tables["a"]
        # Decode tokens that exited so far sit at positions 3 .. 3 + len(outputs) - 2.
        for position in range(3, 3 + len(request.output_token_ids) - 1):
            block, offset = divmod(position, block_size)
            slots = [table[plane][block] * block_size + offset for plane in range(4)]
            kv = engine.runner.kv_cache[:, :, slots]  # [layers, K/V, plane, kv_heads, head_dim]
            assert kv[:, :, 1].abs().sum() > 0, f"position {position}: loop 2 wrote nothing"
            assert not torch.equal(kv[:, :, 0], kv[:, :, 1]), "depths 0 and 1 should differ"
            for plane in (2, 3):
                assert torch.equal(kv[:, :, plane], kv[:, :, 1]), (position, plane)
            checked.setdefault(position, len(request.output_token_ids))
    assert divmod(4, block_size) == (1, 0)  # position 4 is the first slot of the next block
    assert 4 in checked and 3 in checked
    assert checked[4] < 6, "the request should still be running after position 4 exited"
    assert [(o.request_id, o.exit_depths) for o in finished] == [("a", [2] * 6)]


def _worked_example_cache(shared: bool):
    # One layer, one head, head_dim 1. Block size 2; plane 0 uses block 0, plane 1 block 1.
    cache = torch.zeros(1, 2, 4, 1, 1, dtype=torch.float64)
    if shared:
        cache[0, 0, 0], cache[0, 1, 0] = 2.0, 20.0  # A's loop 1 overwrote loop 0
    else:
        cache[0, 0, 0], cache[0, 1, 0] = 1.0, 10.0  # plane 0: A at loop 0
        cache[0, 0, 2], cache[0, 1, 2] = 2.0, 20.0  # plane 1: A at loop 1
    return cache


@pytest.mark.parametrize(
    "shared,expected",
    [(False, 20.0), (True, (math.e**2 * 20 + math.e * 30) / (math.e**2 + math.e))],
)
def test_worked_example_through_paged_attention(shared, expected):
    cache = _worked_example_cache(shared)
    meta = PagedAttentionMetadata.build([RowSegment([0], 1, 1)], block_size=2, device="cpu")
    one = torch.ones(1, 1, 1, dtype=torch.float64)
    out = TorchPagedAttention(cache, meta, scale=1.0).attend(
        0, one, one, torch.full((1, 1, 1), 30.0, dtype=torch.float64)
    )
    assert out.item() == pytest.approx(expected)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_paged_attention_matches_reference_for_mixed_items(num_kv_heads):
    """Decode rows and prompt chunks of different lengths and offsets in one call, in any
    order, equal the dense reference over each item's own context."""
    gen = torch.Generator().manual_seed(0)
    block_size, heads, head_dim = 4, 4, 8
    cache = torch.randn(1, 2, 16 * block_size, num_kv_heads, head_dim, generator=gen)
    segments = [
        RowSegment([3, 1, 4], 5, 7),  # prompt chunk: positions 5..11
        RowSegment([0, 5, 6], 9, 1),  # decode row at position 9
        RowSegment([2], 0, 4),  # first chunk of a prompt
        RowSegment([7, 8], 4, 1),  # decode row at a block's first position
        RowSegment([9, 10, 11], 8, 3),  # chunk ending mid-block
    ]
    rows = sum(seg.count for seg in segments)
    query = torch.randn(rows, heads, head_dim, generator=gen)
    key = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
    meta = PagedAttentionMetadata.build(segments, block_size, device="cpu")
    workspace = Workspace()  # shared with an earlier, larger call: reuse must not leak state
    wide = [RowSegment(list(range(12, 16)), 0, 16)]
    wide += [RowSegment(table, 13, 1) for table in ([0, 5, 6, 7], [1, 2, 3, 4], [8, 9, 10, 11])]
    wide_rows = torch.randn(19, heads, head_dim, generator=gen)
    wide_kv = torch.randn(19, num_kv_heads, head_dim, generator=gen)
    wide_meta = PagedAttentionMetadata.build(wide, block_size, device="cpu")
    TorchPagedAttention(cache.clone(), wide_meta, 0.4, workspace).attend(
        0, wide_rows, wide_kv, wide_kv
    )
    grown = workspace.num_bytes
    out = TorchPagedAttention(cache, meta, scale=0.4, workspace=workspace).attend(
        0, query, key, value
    )
    assert workspace.num_bytes == grown  # the smaller call reused the buffers
    row = 0
    for seg in segments:
        end = seg.start + seg.count
        slots = [seg.block_table[p // block_size] * block_size + p % block_size for p in range(end)]
        span = torch.arange(end)
        allowed = span.unsqueeze(0) <= torch.arange(seg.start, end).unsqueeze(1)
        expected = attention_reference(
            query[row : row + seg.count], cache[0, 0, slots], cache[0, 1, slots], allowed, 0.4
        )
        torch.testing.assert_close(out[row : row + seg.count], expected)
        torch.testing.assert_close(cache[0, 0, slots[seg.start :]], key[row : row + seg.count])
        row += seg.count


def test_request_that_can_never_fit_is_rejected_without_disturbing_others(tiny_dir):
    engine = make_engine(tiny_dir, num_blocks=40, block_size=4)
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(CapacityError, match=r"needs \d+ KV blocks .* has 40"):
        engine.add_request("huge", list(range(1, 60)), SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="max_loops"):
        engine.add_request("deep", [1], SamplingParams(max_loops=9))
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_request("bad", [1, 10**6], SamplingParams())
    with pytest.raises(InvalidRequestError):
        SamplingParams(temperature=-1)
    finished = run_steps(engine, [])
    assert (
        finished["ok"].token_ids
        == reference_for(engine, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0)).token_ids
    )
    assert engine.kv.num_free_blocks == 40


def test_requests_wait_for_kv_and_run_when_blocks_free_up(tiny_dir):
    # 4 prompt + 8 output - 1 = 11 positions -> 3 blocks x 4 planes = 12 blocks each.
    engine = make_engine(
        tiny_dir, num_blocks=20, block_size=4, max_num_seqs=4, kv_reservation="full"
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    work = [(f"r{i}", [i + 1, 2, 3, 4], params, 0) for i in range(3)]
    max_running = []
    finished = run_steps(
        engine, work, on_step=lambda e: max_running.append(e.scheduler.num_running)
    )
    assert max(max_running) == 1
    for request_id, prompt, p, _ in work:
        assert finished[request_id].token_ids == reference_for(engine, prompt, p).token_ids


def test_priority_orders_admission(tiny_dir):
    engine = make_engine(tiny_dir, max_num_seqs=1)
    engine.add_request("low", [1, 2], SamplingParams(max_tokens=2, temperature=0, priority=5))
    engine.add_request("high", [3, 4], SamplingParams(max_tokens=2, temperature=0, priority=-1))
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_invalid_config_names_values_and_fix(tiny_dir):
    with pytest.raises(
        ConfigError, match="prefill_chunk_size \\(64\\) must be <= max_num_batched_tokens \\(32\\)"
    ):
        make_engine(tiny_dir, prefill_chunk_size=64, max_num_batched_tokens=32)
    with pytest.raises(ConfigError, match="layout"):
        make_engine(tiny_dir, layout="paged")
    with pytest.raises(ConfigError, match="unknown engine argument 'max_seqs'"):
        make_engine(tiny_dir, max_seqs=3)


def test_failed_step_fails_only_its_requests_and_engine_keeps_serving(tiny_dir, monkeypatch):
    engine = make_engine(tiny_dir)
    engine.add_request("doomed", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def flaky(scheduled):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real_execute(scheduled)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("doomed", "abort")]
    assert "injected failure" in outputs[0].error
    engine.add_request("next", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    finished = run_steps(engine, [])
    assert (
        finished["next"].token_ids
        == reference_for(engine, [1, 2, 3], SamplingParams(max_tokens=3, temperature=0)).token_ids
    )
    assert engine.stats.kv_blocks_used == 0
