"""Simulated clusters: colocated replicas and prefill/decode (PD) disaggregation on one
virtual clock, and the scheduler entry point a decode replica admits hand-offs with.

Expected values are derived by hand: Ouro-1.4B holds 2 x 24 layers x 16 KV heads x 128 x 2
bytes = 196,608 KV bytes per token per depth in BF16, and keeps 4 planes (one per loop)."""

from __future__ import annotations

import pytest

from loopserve.config import EngineConfig
from loopserve.errors import InvalidRequestError
from loopserve.sampling_params import SamplingParams
from loopserve.scheduler.kv_cache import KVCacheManager
from loopserve.scheduler.request import Request
from loopserve.scheduler.scheduler import Scheduler
from loopserve.sim.cluster import IB_NDR_BYTES_PER_S, Cluster
from loopserve.sim.cost_model import OURO_1P4B
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.pd_scenario import cluster_stats
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import SimRequest

H200 = get_device_profile("h200")
ENGINE_ARGS = {"max_num_seqs": 16}


def _workload() -> list[SimRequest]:
    """Twelve requests 5 ms apart; prompts 40..480 tokens (two of 3000), outputs 3..14."""
    work = []
    for i in range(12):
        prompt = 3000 if i in (3, 8) else 40 * (i + 1)
        output = 3 + i
        trace = tuple(1 + (i + j) % 4 for j in range(output))
        work.append(SimRequest(f"r{i}", 0.005 * i, prompt, output, trace))
    return work


# ---- scheduler entry point -------------------------------------------------------------


def _prefilled(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, exit_trace=(2,)
    ).resolve_loops(4)
    request = Request(
        request_id, [5] * prompt_len, params, arrival_order=0, eos_token_ids=frozenset()
    )
    request.append_token(9, 4, 0.0)
    return request


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_prefilled_request_decodes_from_its_second_token_without_prompt_work(prefix_caching):
    config = EngineConfig.from_engine_args(
        exit_mode="trace", block_size=4, num_blocks=64, enable_prefix_caching=prefix_caching
    )
    kv = KVCacheManager.from_config(config, num_planes=4, bytes_per_block=1)
    assert (kv.prefix_cache is not None) is prefix_caching
    scheduler = Scheduler(config, num_loops=4, kv=kv)
    request = _prefilled("a", prompt_len=10, max_tokens=3)
    scheduler.add_imported(request)
    scheduled = scheduler.schedule()
    # Admitted straight into decode: the token in flight sits at position 10 (after the
    # prompt), fed with the imported first token; prompt + 1 = 11 positions -> 3 blocks/plane.
    assert scheduled.items == ()
    (row,) = scheduled.decode.rows()
    assert (row.request_id, row.position, row.depth, row.token_id) == ("a", 10, 0, 9)
    assert [len(t) for t in scheduler.kv.tables["a"]] == [3, 3, 3, 3]
    assert request.num_prefilled_tokens == 10  # admission kept the imported prompt
    scheduler.check_invariants()


def test_handed_off_request_must_carry_a_sampled_token():
    config = EngineConfig.from_engine_args(exit_mode="trace", block_size=4)
    scheduler = Scheduler(config, num_loops=4, kv=KVCacheManager(64, 4, 4))
    request = _prefilled("a", prompt_len=10, max_tokens=3)
    request.output_token_ids.clear()
    with pytest.raises(InvalidRequestError):
        scheduler.add_imported(request)


# ---- the cluster -------------------------------------------------------------------------


def test_pd_handoff_conserves_requests_and_tokens():
    work = _workload()
    cluster = Cluster(OURO_1P4B, H200, ENGINE_ARGS, num_prefill=2, num_decode=2)
    run = cluster.run(work)
    by_id = {r.request_id: r for r in run.records}
    for sim in work:
        record = by_id[sim.request_id]
        assert record.finished_s is not None
        assert len(record.token_times_s) == sim.output_len
        assert record.exit_depths[1:] == list(sim.exit_trace[1:])
        (prefill, decode) = run.produced[sim.request_id]
        # One first token on a prefill replica, every other token on one decode replica.
        assert prefill[0] == "prefill" and prefill[2] == 1
        assert decode[0] == "decode" and decode[2] == sim.output_len - 1
    # Decode replicas never ran prompt work; prefill replicas never decoded.
    for replica in cluster.decode:
        stats = replica.sim.executor.stats
        assert stats.prompt_calls == 0 and stats.mixed_calls == 0 and stats.decode_calls > 0
        assert replica.sim.kv.num_free_blocks == replica.sim.kv.num_blocks
    for replica in cluster.prefill:
        assert replica.sim.executor.stats.decode_calls == 0
    assert {t.dst for t in run.transfers} == {0, 1}
    assert len(run.transfers) == len(work)


def test_hand_offs_take_bytes_over_the_link_one_after_another():
    """Each hand-off takes its bytes over the link's bandwidth, starting at its first token
    or when the link finishes the hand-off before it, whichever is later: one prefill
    replica's link and one decode replica's are shared by their hand-offs, first come,
    first served (here the two 3,000-token K/Vs, 47.2 ms each, make later ones wait)."""
    work = _workload()
    cluster = Cluster(
        OURO_1P4B,
        H200,
        ENGINE_ARGS,
        num_prefill=1,
        num_decode=1,
        link_bytes_per_s=IB_NDR_BYTES_PER_S,
    )
    run = cluster.run(work)
    prompts = {s.request_id: s.prompt_len for s in work}
    by_id = {r.request_id: r for r in run.records}
    link_free_s, waited = 0.0, []
    for t in sorted(run.transfers, key=lambda t: t.start_s):
        expected_bytes = prompts[t.request_id] * 4 * 196_608
        assert t.num_bytes == expected_bytes
        assert t.end_s - t.start_s == pytest.approx(expected_bytes / 50e9, rel=1e-9)
        # It starts once its first token is out and the link is free; the second token
        # cannot precede its arrival.
        times = by_id[t.request_id].token_times_s
        assert t.start_s == pytest.approx(max(times[0], link_free_s), rel=1e-12)
        assert times[1] > t.end_s
        assert t.exposed_s == pytest.approx(t.end_s - times[0])
        if t.start_s > times[0]:
            waited.append(t.request_id)
        link_free_s = t.end_s
    assert waited, "no hand-off waited for the link"
    long = next(t for t in run.transfers if t.request_id == "r3")
    assert long.end_s - long.start_s == pytest.approx(3000 * 4 * 196_608 / 50e9)  # 47.2 ms


def test_hand_offs_to_different_replicas_share_only_the_sending_link():
    """With two decode replicas, hand-offs from the one prefill replica still go one at a
    time (its link), whichever decode replica they go to."""
    cluster = Cluster(OURO_1P4B, H200, ENGINE_ARGS, num_prefill=1, num_decode=2,
                      link_bytes_per_s=IB_NDR_BYTES_PER_S)  # fmt: skip
    run = cluster.run(_workload())
    assert {t.dst for t in run.transfers} == {0, 1}
    spans = sorted((t.start_s, t.end_s) for t in run.transfers)
    assert all(end <= next_start + 1e-12 for (_, end), (next_start, _) in zip(spans, spans[1:]))


def test_one_colocated_replica_equals_the_single_simulator():
    work = _workload()
    single = Simulator(OURO_1P4B, H200, ENGINE_ARGS).run(work)
    clustered = Cluster(OURO_1P4B, H200, ENGINE_ARGS, num_colocated=1).run(work)
    expected = {
        r.request_id: (r.token_times_s, r.finished_s, r.exit_depths) for r in single.records
    }
    got = {r.request_id: (r.token_times_s, r.finished_s, r.exit_depths) for r in clustered.records}
    assert got == expected
    assert clustered.clock_s == single.clock_s


def test_colocated_routing_spreads_load_and_finishes_everything():
    work = _workload()
    cluster = Cluster(OURO_1P4B, H200, ENGINE_ARGS, num_colocated=4)
    run = cluster.run(work)
    used = {runs[0][1] for runs in run.produced.values()}
    assert used == {0, 1, 2, 3}
    assert all(len(runs) == 1 for runs in run.produced.values())  # no request moves
    stats = cluster_stats("4", run)
    assert stats.num_requests == 12
    assert stats.itl.p99_s == stats.decode_itl.p99_s


def test_simulate_cli_runs_the_pd_scenario(tmp_path, capsys):
    import json

    from loopserve.cli.main import main

    argv = ["simulate", "--scenario", "pd", "--dataset", "synthetic", "--input-len", "64"]
    argv += ["--output-len", "8", "--num-requests", "10", "--request-rate", "50"]
    argv += ["--device-profile", "h200", "--pd", "1,1", "--colocated", "2", "--link", "ib"]
    argv += ["--long-share", "0.3", "--long-lens", "1000,2000", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    (row,) = json.loads((tmp_path / "scenario_pd.json").read_text())["results"]
    assert row["request_rate"] == 50
    assert row["colocated"]["name"] == "2 colocated" and row["pd"]["name"] == "1P1D ib"
    assert row["colocated"]["num_requests"] == row["pd"]["num_requests"] == 10
    assert row["pd"]["mean_transfer_ms"] > 0 and row["colocated"]["mean_transfer_ms"] == 0
    assert "PD/colocated: ITL p99" in capsys.readouterr().out
    # Landing in host memory, each long hand-off's copy holds the decode replica longer.
    host = tmp_path / "host"
    assert main([*argv[:-1], str(host), "--handoff-landing", "host"]) == 0
    (slow,) = json.loads((host / "scenario_pd.json").read_text())["results"]
    assert slow["pd"]["decode_itl"]["max_s"] > row["pd"]["decode_itl"]["max_s"]
    assert slow["colocated"] == row["colocated"]  # colocated replicas import nothing


def test_streamed_handoffs_send_chunks_during_prefill_and_land_earlier():
    """Per-chunk streaming: a long prompt's chunks go out as each finishes its last depth,
    so most of its link time runs before the first token; every byte is sent once (the same
    bytes as the whole hand-off), outputs and exits are unchanged, and the second token of a
    long prompt comes earlier than with the whole hand-off. Over NVLink, where a 256-token
    chunk's bytes take less time than its prefill (the next test has a link that queues)."""
    work = _workload()
    args = dict(ENGINE_ARGS, prefill_chunk_size=256)
    runs = {
        streaming: Cluster(OURO_1P4B, H200, args, num_prefill=1, num_decode=1,
                           streaming=streaming).run(work)
        for streaming in (False, True)
    }  # fmt: skip
    whole, streamed = ({t.request_id: t for t in runs[s].transfers} for s in (False, True))
    assert {rid: t.num_bytes for rid, t in whole.items()} == {
        rid: t.num_bytes for rid, t in streamed.items()
    }
    for rid in whole:
        assert whole[rid].exposed_s >= whole[rid].busy_s - 1e-12  # nothing hidden
    long = streamed["r3"]  # 3000 tokens: 12 chunks of 256
    assert long.start_s < long.end_s - long.exposed_s  # sending began before the first token
    assert long.exposed_s < 0.2 * long.busy_s  # the last chunk's share, not the prompt's
    records = {s: {r.request_id: r for r in runs[s].records} for s in (False, True)}
    for sim in work:
        assert (
            records[True][sim.request_id].exit_depths == records[False][sim.request_id].exit_depths
        )
    second = {s: records[s]["r3"].token_times_s[1] - records[s]["r3"].token_times_s[0]
              for s in (False, True)}  # fmt: skip
    assert second[True] < second[False]
    stats = cluster_stats("stream", runs[True])
    assert 0.5 < stats.hidden_transfer_share <= 1.0
    assert cluster_stats("whole", runs[False]).hidden_transfer_share == pytest.approx(0.0)


def test_streamed_chunks_share_the_link_with_other_hand_offs():
    """Over InfiniBand the two 3,000-token prompts' chunks (47.2 ms of link each) keep the
    prefill replica's link busy while other requests finish their prompts: their hand-offs
    wait behind those chunks (a short request can land later than it would whole), while in
    all the requests wait less for their hand-offs than with whole ones, and the long
    prompts' far less."""
    work = _workload()
    args = dict(ENGINE_ARGS, prefill_chunk_size=256)
    runs = {
        streaming: Cluster(OURO_1P4B, H200, args, num_prefill=1, num_decode=1,
                           link_bytes_per_s=IB_NDR_BYTES_PER_S, streaming=streaming).run(work)
        for streaming in (False, True)
    }  # fmt: skip
    whole, streamed = ({t.request_id: t for t in runs[s].transfers} for s in (False, True))
    for rid in whole:
        assert whole[rid].exposed_s >= whole[rid].busy_s - 1e-12  # nothing hidden
    assert any(streamed[rid].exposed_s > whole[rid].exposed_s for rid in whole)
    assert sum(t.exposed_s for t in streamed.values()) < sum(t.exposed_s for t in whole.values())
    for rid in ("r3", "r8"):
        assert streamed[rid].exposed_s < 0.5 * whole[rid].exposed_s
    # Waiting is not sending: the share of link time before the first token counts sends.
    assert cluster_stats("stream", runs[True]).hidden_transfer_share > 0.5
    assert cluster_stats("whole", runs[False]).hidden_transfer_share == 0.0
    spans = sorted((t.end_s - t.busy_s, t.end_s) for t in whole.values())
    assert all(end <= next_start + 1e-12 for (_, end), (next_start, _) in zip(spans, spans[1:]))


def test_a_hand_off_is_copied_into_the_decode_replicas_blocks_within_hbm_or_over_the_host_link():
    """The decode replica's step that admits a hand-off copies its K/V into its blocks: over
    the host link when the K/V landed in host memory, as a read and a write of HBM when the
    link wrote it into GPU memory (the default); all decode rows on the replica wait for it."""
    work = _workload()
    runs, sims = {}, {}
    for landing in ("host", "device"):
        cluster = Cluster(OURO_1P4B, H200, ENGINE_ARGS, num_prefill=1, num_decode=1,
                          link_bytes_per_s=IB_NDR_BYTES_PER_S, handoff_landing=landing)  # fmt: skip
        runs[landing], sims[landing] = cluster.run(work), cluster.decode[0].sim
    host_stats = sims["host"].executor.stats
    blocks = host_stats.swapped_blocks  # every import, every plane (nothing else swaps)
    assert blocks >= sum(-(-s.prompt_len // 16) * 4 for s in work if s.output_len > 1)
    block_bytes = 196_608 * 16
    assert host_stats.swap_time_s == pytest.approx(blocks * block_bytes / H200.effective_host_link)
    device_stats = sims["device"].executor.stats
    assert device_stats.swapped_blocks == 0  # nothing crossed the host link
    assert device_stats.swap_time_s == pytest.approx(
        2 * blocks * block_bytes / H200.effective_bandwidth
    )
    assert device_stats.swap_time_s < host_stats.swap_time_s / 10
    gap = {
        landing: {r.request_id: r.token_times_s[1] - r.token_times_s[0] for r in run.records}
        for landing, run in runs.items()
    }
    assert (
        gap["device"]["r3"] < gap["host"]["r3"]
    )  # 3,000 tokens: 41 ms over the host link, 1.1 in HBM
    with pytest.raises(ValueError, match="handoff_landing"):
        Cluster(OURO_1P4B, H200, ENGINE_ARGS, num_prefill=1, num_decode=1, handoff_landing="nic")


def test_streamed_chunks_are_written_as_they_land_so_no_copy_holds_a_decode_replica_long():
    """With the K/V landing in host memory, a whole hand-off's import copies the prompt's K/V
    in one step (3,000 tokens: 41 ms on the host link); streamed, each 256-token chunk is
    written into the reserved blocks as it lands and the import copies only the rest, so no
    copy holds the decode replica longer than about a chunk's, for the same bytes in all."""
    work = _workload()
    args = dict(ENGINE_ARGS, prefill_chunk_size=256)
    stats = {}
    for streaming in (False, True):
        cluster = Cluster(OURO_1P4B, H200, args, num_prefill=1, num_decode=1,
                          link_bytes_per_s=IB_NDR_BYTES_PER_S, streaming=streaming,
                          handoff_landing="host")  # fmt: skip
        cluster.run(work)
        stats[streaming] = cluster.decode[0].sim.executor.stats
        # The writes held the decode replica: its timeline moved by each one.
        assert cluster.decode[0].held_s == pytest.approx(stats[streaming].streamed_write_s)
    whole, streamed = stats[False], stats[True]
    chunk_s = 256 * 4 * 196_608 / H200.effective_host_link
    long_s = 3000 * 4 * 196_608 / H200.effective_host_link
    assert whole.streamed_write_s == 0.0 and whole.max_copy_s >= long_s
    assert streamed.streamed_write_s > 0.5 * whole.swap_time_s  # most of it came as chunks
    assert streamed.max_copy_s <= chunk_s + 2 * 16 * 4 * 196_608 / H200.effective_host_link
    assert streamed.swap_time_s + streamed.streamed_write_s == pytest.approx(
        whole.swap_time_s, rel=0.05
    )


def test_a_streamed_request_reserves_where_fewest_streams_are_in_flight():
    """As the engine's router (`Router.choose_handoff`): the second 3,000-token prompt
    streams to the decode replica without a stream in flight, not to the one still
    receiving the first long prompt's chunks (which the least outstanding work alone
    picks here)."""
    args = dict(ENGINE_ARGS, prefill_chunk_size=256)
    cluster = Cluster(OURO_1P4B, H200, args, num_prefill=1, num_decode=2,
                      link_bytes_per_s=IB_NDR_BYTES_PER_S, streaming=True)  # fmt: skip
    transfers = {t.request_id: t for t in cluster.run(_workload()).transfers}
    long, later = transfers["r3"], transfers["r8"]
    assert later.start_s < long.end_s  # r3's stream is still in flight when r8's begins
    assert later.dst != long.dst


def test_per_depth_prompts_stream_their_shallow_planes_before_the_first_token():
    """Under the per-depth prompt arm a chunk runs one depth per step and plane d is final
    once it ran depth d, so even a one-chunk prompt sends three of its four planes before
    its first token (its hidden link time is 3/4 of its bytes' over NVLink, which keeps up);
    under the atomic arm every plane of a chunk is final in the step that samples the first
    token, so nothing of a one-chunk prompt is hidden. Same bytes either way."""
    work = [SimRequest("short", 0.0, 200, 4, (4, 4, 4, 4))]
    transfers = {}
    for arm in ("atomic", "per_depth"):
        args = dict(ENGINE_ARGS, prefill_chunk_size=256, prefill_mode=arm)
        cluster = Cluster(OURO_1P4B, H200, args, num_prefill=1, num_decode=1, streaming=True)
        (transfers[arm],) = cluster.run(work).transfers
    per_plane_s = 200 * 196_608 / cluster.link_bytes_per_s
    assert transfers["atomic"].num_bytes == transfers["per_depth"].num_bytes == 200 * 196_608 * 4
    assert transfers["atomic"].hidden_s == pytest.approx(0.0)
    assert transfers["per_depth"].hidden_s == pytest.approx(3 * per_plane_s)


def test_the_pd_scenario_streams_per_depth_prompts_unless_an_arm_is_given():
    """`simulate --scenario pd` runs each setup with the prompt arm `serve --pd` would pick
    when no `--prefill-mode` is given: per_depth for the streamed replicas, atomic for the
    colocated and whole hand-off ones; streamed per_depth hides more link time than streamed
    atomic on the same requests (over InfiniBand, where 256-token chunks fill the link); a
    given arm runs every setup."""
    from loopserve.sim.pd_scenario import PdSpec, run_pd

    spec = PdSpec(num_requests=12, request_rates=(40.0,), num_colocated=2, num_prefill=1,
                  num_decode=1, link="ib", long_share=0.3, long_min=1500, long_max=2500,
                  dataset="synthetic")  # fmt: skip
    args = dict(ENGINE_ARGS, prefill_chunk_size=256)
    ((_, colocated, whole, streamed),) = run_pd(OURO_1P4B, H200, args, spec)
    arms = (colocated.prompt_arm, whole.prompt_arm, streamed.prompt_arm)
    assert arms == ("atomic", "atomic", "per_depth")
    ((_, *given),) = run_pd(OURO_1P4B, H200, dict(args, prefill_mode="atomic"), spec)
    assert [s.prompt_arm for s in given] == ["atomic"] * 3
    assert given[0] == colocated and given[1] == whole  # unset is atomic there
    assert streamed.hidden_transfer_share > given[2].hidden_transfer_share + 0.05
