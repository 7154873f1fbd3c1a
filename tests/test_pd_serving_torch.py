"""Serving prefill/decode disaggregation with the torch KV transport (`PDReplicaPool(...,
kv_transport="torch")`, `--pd prefill=1,decode=1 --kv-transport torch`) on a local Ray
cluster, gloo on CPU: outputs equal one colocated engine for both layouts (two exit modes),
the K/V goes over torch.distributed (byte counters on both sides equal the exported planes'
size computed from the checkpoint's config), concurrent streams all hand off exactly, an abort
right after the first token leaves both replicas idle and the pair's order intact (a later
request still hands off exactly), and a decode replica dying makes later hand-offs fall back
to the object store.

One Ray cluster serves the module; one pool runs at a time. Skipped when Ray
is not installed (it is the optional `ray` extra)."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio
import time

import pytest

from tests.optional import require

require("ray", "serve")

ray = pytest.importorskip("ray", reason="needs the optional `ray` extra (pip install '.[ray]')")
from loopserve.engine.async_llm import GenerateRequest  # noqa: E402
from loopserve.llm import LLM  # noqa: E402
from loopserve.sampling_params import SamplingParams  # noqa: E402
from tests.pd_pools import (  # noqa: E402
    DECODE,
    PREFILL,
    collect,
    exported_kv_bytes,
    prompt_ids,
    run_cases,
    transport_stats,
)
from tests.server_utils import prometheus_values  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ENGINE_ARGS = {"dtype": "float32", "num_blocks": 512, "block_size": 4, "max_num_seqs": 4}
NUM_LOOPS = 4


def _engine_args(model_dir, layout: str, exit_mode: str) -> dict:
    return {
        "model": str(model_dir),
        **ENGINE_ARGS,
        "layout": layout,
        "exit_mode": exit_mode,
        "lookahead_seed": 7,
    }


@pytest.fixture
def pools(pd_pools, tiny_tok_dir):
    """The module's torch-transport pool for (layout, exit mode)."""

    def get(layout: str, exit_mode: str):
        return pd_pools.get(_engine_args(tiny_tok_dir, layout, exit_mode), kv_transport="torch")

    return get


CASES = {  # request id -> (prompt, params): greedy, seeded, loop settings, one ends at once
    "g": (prompt_ids(1, 9), SamplingParams(max_tokens=9, temperature=0.0, exit_threshold=0.5, ignore_eos=True)),
    "s": (prompt_ids(2, 13), SamplingParams(max_tokens=7, temperature=1.0, seed=41, exit_threshold=0.7, ignore_eos=True)),
    "one": (prompt_ids(3, 6), SamplingParams(max_tokens=1, temperature=0.8, seed=42, ignore_eos=True)),
    "k": (prompt_ids(4, 22), SamplingParams(max_tokens=11, temperature=0.7, top_k=30, seed=43, min_loops=2, ignore_eos=True)),
    "m": (prompt_ids(5, 1), SamplingParams(max_tokens=6, temperature=0.0, max_loops=2, ignore_eos=True)),
}  # fmt: skip


@pytest.mark.parametrize(
    "layout,exit_mode", [("last_exited", "ouro_delayed"), ("shared", "random_lookahead")]
)
def test_torch_transport_serving_equals_colocated_and_moves_the_kv_point_to_point(
    pools, tiny_tok_dir, loop, layout, exit_mode
):
    pool = pools(layout, exit_mode)
    assert pool.uses_point_to_point and pool.health()["kv_transport"] == "torch"
    before = transport_stats(pool, loop)
    results = run_cases(pool, loop, CASES)  # five streams at once: their hand-offs race
    after = transport_stats(pool, loop)
    expected = LLM(**_engine_args(tiny_tok_dir, layout, exit_mode)).generate(
        [p for p, _ in CASES.values()], [sp for _, sp in CASES.values()]
    )
    for rid, (outputs, stream), want in zip(CASES, results, expected):
        final = outputs[-1]
        assert final.token_ids == want.token_ids, rid
        assert final.exit_depths == want.exit_depths, rid
        assert final.finish_reason == want.finish_reason, rid
        assert (rid in stream.decode_replicas) == (rid != "one"), rid
    assert [len(w.token_ids) for w in expected] == [9, 7, 1, 11, 6]
    assert min(d for (o, _) in results for d in o[-1].exit_depths[1:]) < NUM_LOOPS  # early exits
    # Four hand-offs (not max_tokens=1), each the K/V of its prompt (one token sampled, not
    # yet fed), sent by rank 0 and received by rank 1 over torch.distributed.
    kv_bytes = sum(
        exported_kv_bytes(tiny_tok_dir, layout, len(p))
        for rid, (p, _) in CASES.items()
        if rid != "one"
    )
    sent = after[PREFILL].bytes_sent - before[PREFILL].bytes_sent
    received = after[DECODE].bytes_received - before[DECODE].bytes_received
    assert (after[PREFILL].kind, after[DECODE].kind) == ("torch", "torch")
    assert after[PREFILL].num_sent - before[PREFILL].num_sent == 4
    assert after[DECODE].num_received - before[DECODE].num_received == 4
    assert sent == received == kv_bytes
    assert after[PREFILL].failure is None and after[DECODE].failure is None
    assert pool.kv_transport_fallback is None
    # /metrics shows the same bytes per replica and role.
    loop.run_until_complete(pool.refresh_stats())
    values = prometheus_values(pool.metrics.render(pool.snapshot, num_in_flight=0, is_ready=True))
    sent_key = 'loopserve_kv_transport_bytes_total{direction="sent",replica="0",role="prefill"}'
    received_key = 'loopserve_kv_transport_bytes_total{direction="received",replica="1",role="decode"}'  # fmt: skip
    assert values[sent_key] == after[PREFILL].bytes_sent
    assert values[received_key] == after[DECODE].bytes_received
    assert values["loopserve_kv_transport_fallback"] == 0


def test_many_concurrent_streams_all_hand_off_exactly(pools, tiny_tok_dir, loop):
    pool = pools("last_exited", "ouro_delayed")
    cases = {
        f"c{i}": (
            prompt_ids(60 + i, 3 + 2 * i),
            SamplingParams(max_tokens=4 + i % 3, temperature=0.9, seed=500 + i, ignore_eos=True),
        )
        for i in range(8)
    }
    before = transport_stats(pool, loop)
    results = run_cases(pool, loop, cases)
    after = transport_stats(pool, loop)
    expected = LLM(**_engine_args(tiny_tok_dir, "last_exited", "ouro_delayed")).generate(
        [p for p, _ in cases.values()], [sp for _, sp in cases.values()]
    )
    for rid, (outputs, _), want in zip(cases, results, expected):
        assert outputs[-1].token_ids == want.token_ids, rid
        assert outputs[-1].exit_depths == want.exit_depths, rid
    assert after[DECODE].num_received - before[DECODE].num_received == 8
    assert after[PREFILL].num_sent - before[PREFILL].num_sent == 8
    assert after[DECODE].failure is None and pool.kv_transport_fallback is None


def test_abort_at_the_first_token_drops_the_kv_and_keeps_the_pair_in_order(
    pools, tiny_tok_dir, loop
):
    pool = pools("last_exited", "ouro_delayed")
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    before = transport_stats(pool, loop)

    async def close_at_first_token(request_id: str, seed: int) -> list:
        stream = await pool.submit([GenerateRequest(request_id, prompt_ids(seed, 10), params)])
        first = await stream.__anext__()
        stream.close()  # what a client disconnect does, while the hand-off is under way
        return [first]

    async def aborts():
        return await asyncio.gather(*(close_at_first_token(f"x{i}", 80 + i) for i in range(3)))

    seen = loop.run_until_complete(aborts())

    async def settle():
        while True:
            stats = await asyncio.gather(*(r.actor.stats.remote() for r in pool.replicas))
            if all(
                s.snapshot.num_running == s.snapshot.num_waiting == s.num_in_flight == 0
                for s in stats
            ):
                return stats
            await asyncio.sleep(0.05)

    idle = loop.run_until_complete(asyncio.wait_for(settle(), 60.0))
    assert all(len(outputs) == 1 and not outputs[0].finished for outputs in seen)
    for stats in idle:  # every KV block came back, on both sides
        assert stats.snapshot.kv_blocks_free == stats.snapshot.kv_blocks_total
    # Whether each was exported (and sent) before its abort reached the prefill replica is
    # timing; every one that was sent leaves the wire, imported (then aborted) or dropped.
    # A hand-off can still be on the wire when both replicas are idle: wait for it to land.
    deadline_s = time.monotonic() + 30.0
    while True:
        mid = transport_stats(pool, loop)
        num_sent = mid[PREFILL].num_sent - before[PREFILL].num_sent
        num_received = mid[DECODE].num_received - before[DECODE].num_received
        num_discarded = mid[DECODE].num_discarded - before[DECODE].num_discarded
        if num_received + num_discarded == num_sent or time.monotonic() > deadline_s:
            break
        time.sleep(0.05)
    assert num_received + num_discarded == num_sent
    assert mid[PREFILL].num_pending_sends == 0 and mid[PREFILL].failure is None
    # A later request still pairs up.
    later = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs, stream = loop.run_until_complete(collect(pool, "after", prompt_ids(90, 7), later))
    want = LLM(**_engine_args(tiny_tok_dir, "last_exited", "ouro_delayed")).generate(
        [prompt_ids(90, 7)], [later]
    )[0]
    assert outputs[-1].token_ids == want.token_ids and stream.decode_replicas == {"after": DECODE}
    final = transport_stats(pool, loop)
    assert final[DECODE].num_received == mid[DECODE].num_received + 1
    assert final[DECODE].failure is None and pool.kv_transport_fallback is None


def test_a_later_hand_off_waits_for_an_earlier_one_to_be_dropped(pools, tiny_tok_dir, loop):
    """Drive the prefill replica directly so that one descriptor is certainly in flight and
    never imported: the next hand-off from that replica waits on the decode replica until the
    earlier one is dropped (its K/V taken off the wire), then decodes exactly."""
    pool = pools("last_exited", "ouro_delayed")
    assert pool.info is not None
    prompt = pool.info.input_processor.process(prompt_ids(70, 5))
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    before = transport_stats(pool, loop)

    async def export_one() -> list:
        generator = pool.replicas[PREFILL].actor.prefill.remote(
            [GenerateRequest("held", prompt, params)], {"held": DECODE}
        )
        return [await ref async for ref in generator]

    accepted, first, exported, descriptor = loop.run_until_complete(export_one())
    assert first.new_token_ids and exported.destination == DECODE
    assert descriptor.state.kv is None and (descriptor.src_rank, descriptor.dst_rank) == (0, 1)

    async def later_while_held():
        task = asyncio.ensure_future(collect(pool, "next", prompt_ids(71, 8), params))
        while not any("next" in s.handoffs.in_flight for s in pool.streams):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the import call reaches the decode replica and waits
        waiting = await pool.replicas[DECODE].actor.kv_transport_stats.remote()
        await pool.replicas[DECODE].actor.drop_handoff.remote(descriptor)
        return waiting, task.done(), await task

    waiting, done_while_held, (outputs, _) = loop.run_until_complete(later_while_held())
    assert not done_while_held and waiting.num_received == before[DECODE].num_received
    want = LLM(**_engine_args(tiny_tok_dir, "last_exited", "ouro_delayed")).generate(
        [prompt_ids(71, 8)], [params]
    )[0]
    assert outputs[-1].token_ids == want.token_ids and outputs[-1].exit_depths == want.exit_depths
    after = transport_stats(pool, loop)
    assert after[DECODE].num_discarded == before[DECODE].num_discarded + 1
    assert after[DECODE].num_received == before[DECODE].num_received + 1
    assert after[DECODE].failure is None and after[PREFILL].num_pending_sends == 0


def test_a_decode_replica_dying_falls_back_to_the_object_store(pools, tiny_tok_dir, loop):
    pool = pools("last_exited", "ouro_delayed")
    ray.kill(pool.replicas[DECODE].actor, no_restart=False)

    async def wait_fallback_and_restart():
        while pool.kv_transport_fallback is None:
            await asyncio.sleep(0.05)
        assert await pool.wait_serving(2, timeout_s=120.0), pool.health()

    loop.run_until_complete(asyncio.wait_for(wait_fallback_and_restart(), 150.0))
    assert not pool.uses_point_to_point
    assert "replica 1" in pool.health()["kv_transport_fallback"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs, stream = loop.run_until_complete(collect(pool, "fallback", prompt_ids(95, 9), params))
    want = LLM(**_engine_args(tiny_tok_dir, "last_exited", "ouro_delayed")).generate(
        [prompt_ids(95, 9)], [params]
    )[0]
    assert outputs[-1].token_ids == want.token_ids and outputs[-1].exit_depths == want.exit_depths
    assert stream.decode_replicas == {"fallback": DECODE}
    # The restarted decode replica has the object-store endpoint: nothing went point to point.
    restarted = ray.get(pool.replicas[DECODE].actor.kv_transport_stats.remote())
    assert (restarted.kind, restarted.num_received, restarted.bytes_received) == ("ray", 0, 0)
    loop.run_until_complete(pool.refresh_stats())
    values = prometheus_values(pool.metrics.render(pool.snapshot, num_in_flight=0, is_ready=True))
    assert values["loopserve_kv_transport_fallback"] == 1
