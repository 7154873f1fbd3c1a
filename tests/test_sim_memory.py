"""The simulator runs the same memory management: preemption, swap pricing, prefix caching."""

from __future__ import annotations

import pytest

from loopserve.sim.cost_model import OURO_1P4B
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.metrics import summarize
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import WorkloadSpec, build_workload

H100 = get_device_profile("h100")


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_clients_sending_large_max_tokens_preempt_and_still_finish_at_their_length(preemption):
    spec = WorkloadSpec(num_requests=40, dataset="synthetic", input_len=128, output_len=96)
    workload = build_workload(spec, 4)
    # 180 blocks of 16 positions (45 per plane): full reservation of 480 max_tokens fits one
    # request at a time, incremental allocation about three (prompt 64-192, output 48-144).
    args = {"num_blocks": 180, "max_num_seqs": 16, "preemption_mode": preemption}
    sim = Simulator(OURO_1P4B, H100, args, client_max_tokens=480)
    run = sim.run(workload, on_step=lambda s: s.check_invariants())
    result = summarize(run)
    assert result.num_finished == 40
    assert result.num_output_tokens == sum(r.output_len for r in workload)
    assert result.num_preemptions > 0
    if preemption == "swap":
        assert result.num_preemptions_swap > 0 and result.swap_time_share > 0
        assert sim.executor.stats.swapped_blocks > 0
    else:
        assert result.recompute_row_share > 0
    assert sim.kv.num_free_blocks == sim.kv.pool.num_blocks
    assert sim.kv.host_pool.num_free_blocks == sim.kv.host_pool.num_blocks
    full = Simulator(OURO_1P4B, H100, {**args, "kv_reservation": "full"}, client_max_tokens=480)
    full_result = summarize(full.run(workload))
    assert full_result.num_preemptions == 0
    assert full_result.num_output_tokens == result.num_output_tokens
    assert full_result.duration_s > result.duration_s  # one request at a time


def test_shared_system_prompt_hits_the_prefix_cache_in_the_simulator():
    spec = WorkloadSpec(
        num_requests=30, dataset="synthetic", input_len=64, output_len=32, shared_prefix_len=1024
    )
    workload = build_workload(spec, 4)
    assert all(r.prompt_len >= 1024 + 32 for r in workload)
    on = summarize(Simulator(OURO_1P4B, H100, {"max_num_seqs": 8}).run(workload))
    off_args = {"max_num_seqs": 8, "enable_prefix_caching": False}
    off = summarize(Simulator(OURO_1P4B, H100, off_args).run(workload))
    # Everything after the first request's prompt reuses the 64 full pages of 16 tokens
    # (requests admitted together before it finished do not).
    assert on.prefix_hit_tokens >= 20 * 1024
    assert off.prefix_hit_tokens == 0
    assert on.ttft.p50_s < off.ttft.p50_s
    assert on.num_output_tokens == off.num_output_tokens
