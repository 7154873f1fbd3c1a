"""Data-parallel replicas on a local Ray cluster: outputs, prefix routing, replica failure.

One Ray cluster and one pool of two replicas (tiny seeded model, one torch thread each, prefix
routing) serve every test of this module, on one event loop; the replica-kill test runs last.
Skipped when Ray is not installed (it is the optional `ray` extra).
"""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio
import os

import pytest

from tests.optional import require

require("ray", "serve")
import httpx

ray = pytest.importorskip("ray", reason="needs the optional `ray` extra (pip install '.[ray]')")
from loopserve.distributed.pool import (  # noqa: E402
    PoolConfig,
    ReplicaFailedError,
    ReplicaPool,
    ReplicaState,
)
from loopserve.engine.async_llm import GenerateRequest  # noqa: E402
from loopserve.llm import LLM  # noqa: E402
from loopserve.sampling_params import SamplingParams  # noqa: E402
from loopserve.server.api_server import build_app  # noqa: E402
from tests.ray_utils import start_local_ray, stop_local_ray  # noqa: E402
from tests.server_utils import prometheus_values, sse_payloads  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ENGINE_ARGS = {"dtype": "float32", "num_blocks": 512, "block_size": 4, "max_num_seqs": 2}
NUM_LOOPS = 4  # the tiny checkpoint's loops per token


@pytest.fixture(scope="module")
def pool(tiny_dir, loop):
    start_local_ray(4)  # logical: the pool's two replicas plus the offline test's two
    config = PoolConfig(num_replicas=2, routing="prefix", torch_threads=1, max_restarts=2)
    replica_pool = ReplicaPool({"model": str(tiny_dir), **ENGINE_ARGS}, config)

    async def start() -> None:
        replica_pool.start()
        assert await replica_pool.wait_serving(2, timeout_s=120.0), replica_pool.health()

    loop.run_until_complete(start())
    yield replica_pool
    loop.run_until_complete(replica_pool.shutdown(5.0))
    stop_local_ray()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """One in-process engine (DP=1): the expected outputs."""
    return LLM(str(tiny_dir), **ENGINE_ARGS)


async def _run(pool: ReplicaPool, request_id: str, prompt: list[int], params: SamplingParams):
    stream = await pool.submit([GenerateRequest(request_id, prompt, params)])
    final = None
    with stream:
        async for output in stream:
            final = output
    return final, stream


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 37 + i * 11) % 97 + 3 for i in range(length)]


def test_two_replicas_return_what_one_engine_returns_per_request(pool, reference, loop):
    prompts = [_prompt(s, 5 + s) for s in range(6)]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, exit_threshold=0.5),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True),
    ]
    cases = [(f"dp-{i}-{j}", p, sp) for i, p in enumerate(prompts) for j, sp in enumerate(params)]
    routed_before = [r.num_routed for r in pool.replicas]

    async def main():
        return await asyncio.gather(*(_run(pool, rid, p, sp) for rid, p, sp in cases))

    results = loop.run_until_complete(main())
    expected = reference.generate([p for _, p, _ in cases], [sp for _, _, sp in cases])
    for (final, _), want in zip(results, expected):
        assert final.token_ids == want.token_ids
        assert final.exit_depths == want.exit_depths
        assert final.finish_reason == "length"
    routed = [r.num_routed - b for r, b in zip(pool.replicas, routed_before)]
    assert sorted(routed) != [0, len(cases)], routed  # both replicas served
    assert sum(routed) == len(cases)
    depths = [d for final, _ in results for d in final.exit_depths]
    assert min(depths) < NUM_LOOPS  # early exits happened (exit_threshold 0.5)


def test_prefix_routing_keeps_a_shared_prefix_on_one_replica(pool, loop):
    shared = _prompt(90, 12)  # three full blocks of 4
    loop.run_until_complete(pool.refresh_stats())
    before = prometheus_values(pool.metrics.render(pool.snapshot, num_in_flight=0, is_ready=True))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    async def main():
        # All four same-prefix requests are in flight together: by load they would alternate.
        same = [
            asyncio.ensure_future(_run(pool, f"px-{i}", shared + [5 + i, 7], params))
            for i in range(4)
        ]
        await asyncio.sleep(0)
        other = await _run(pool, "px-other", _prompt(91, 12), params)
        return await asyncio.gather(*same), other

    same, (other_final, other_stream) = loop.run_until_complete(main())
    replicas = {stream.replica for _, stream in same}
    assert len(replicas) == 1, replicas
    (prefix_replica,) = replicas

    loop.run_until_complete(pool.refresh_stats())  # fresh replica gauges, not 0.5 s old
    after = prometheus_values(pool.metrics.render(pool.snapshot, num_in_flight=0, is_ready=True))

    def delta(name: str, replica: int) -> float:
        key = f'{name}{{replica="{replica}"}}'
        return after[key] - before.get(key, 0.0)

    assert delta("loopserve_router_requests_total", prefix_replica) == 4
    assert delta("loopserve_router_prefix_hits_total", prefix_replica) == 3
    other_replica = 1 - prefix_replica
    assert other_stream.replica == other_replica
    assert delta("loopserve_router_requests_total", other_replica) == 1
    assert all(final.finish_reason == "length" for final, _ in same)
    # Routing made the prefix cache hit: with two seats, the last two same-prefix requests are
    # admitted after the first two published the shared blocks.
    assert delta("loopserve_generation_tokens_total", prefix_replica) == 4 * 16
    assert delta("loopserve_generation_tokens_total", other_replica) == 16
    assert delta("loopserve_prefix_cache_hits_total", prefix_replica) > 0
    assert delta("loopserve_prefix_cache_hits_total", other_replica) == 0


def test_http_metrics_label_replicas_and_health_is_ok(pool, loop):
    app = build_app(pool, "tiny")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            health = await client.get("/health")
            metrics = await client.get("/metrics")
            completion = await client.post(
                "/v1/completions",
                json={"prompt": _prompt(3, 6), "max_tokens": 4, "ignore_eos": True},
            )
        return health, metrics, completion

    health, metrics, completion = loop.run_until_complete(main())
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["replicas_serving"] == 2
    values = prometheus_values(metrics.text)
    assert values['loopserve_replica_serving{replica="0"}'] == 1
    assert values['loopserve_replica_serving{replica="1"}'] == 1
    assert values["loopserve_replicas_serving"] == 2
    assert completion.status_code == 200
    assert len(completion.json()["choices"][0]["exit_depths"]) == 4


def test_closing_a_stream_aborts_its_request_on_the_replica(pool, loop):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)  # 408 of 512 blocks
    aborts_before = _finished(pool, "abort")

    async def main():
        stream = await pool.submit([GenerateRequest("gone", _prompt(5, 8), params)])
        actor = pool.replicas[stream.replica].actor
        before = (await actor.stats.remote()).snapshot.num_output_tokens
        async for output in stream:
            if output.token_ids:
                break
        stream.close()  # what a client disconnect does
        while True:  # fresh gauges from the replica until the request is gone
            snap = (await actor.stats.remote()).snapshot
            if snap.num_running == 0 and snap.num_waiting == 0:
                return output, snap, snap.num_output_tokens - before
            await asyncio.sleep(0.05)

    output, snap, num_generated = loop.run_until_complete(asyncio.wait_for(main(), 60.0))
    assert not output.finished
    assert num_generated < 400  # it stopped long before max_tokens
    assert snap.kv_blocks_free == snap.kv_blocks_total  # its KV blocks came back
    assert _finished(pool, "abort") == aborts_before + 1


def _finished(pool: ReplicaPool, reason: str) -> float:
    text = pool.metrics.render(pool.snapshot, num_in_flight=0, is_ready=True)
    return prometheus_values(text)[f'loopserve_requests_finished_total{{finish_reason="{reason}"}}']


def test_offline_llm_with_two_replicas_returns_what_one_engine_returns(pool, tiny_dir, reference):
    prompts = [_prompt(70 + s, 4 + 3 * s) for s in range(5)]
    params = [
        SamplingParams(max_tokens=8, temperature=0.8, seed=99 + i, ignore_eos=True)
        for i in range(5)
    ]
    llm = LLM(str(tiny_dir), data_parallel_size=2, **ENGINE_ARGS)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        split = llm._replicas.last_split
    finally:
        llm._replicas.shutdown()
    expected = reference.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    assert [o.exit_depths for o in outputs] == [e.exit_depths for e in expected]
    assert sorted(split) != [0, 5] and sum(split) == 5, split  # both replicas ran requests


def test_killed_replica_loses_no_request_and_rejoins(pool, reference, loop):
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    prompts = {f"kill-{i}": _prompt(40 + i, 6) for i in range(8)}
    outcomes: dict[str, object] = {}
    streams = {}
    all_submitted = asyncio.Event()
    first_output = asyncio.Event()
    health_after_kill = {}
    victim = {}  # the replica to kill: the one serving the HTTP stream
    app = build_app(pool, "tiny")

    async def http_stream() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://localhost", timeout=120.0
        ) as client:
            body = {"prompt": _prompt(39, 6), "max_tokens": 80, "ignore_eos": True, "stream": True}
            return await client.post("/v1/completions", json=body)

    async def one(request_id: str) -> None:
        try:
            stream = await pool.submit([GenerateRequest(request_id, prompts[request_id], params)])
            streams[request_id] = stream
            if len(streams) == len(prompts):
                all_submitted.set()
            with stream:
                async for output in stream:
                    if stream.replica == victim["index"] and output.new_token_ids:
                        first_output.set()
                    if output.finished:
                        outcomes[request_id] = output
        except ReplicaFailedError as err:
            outcomes[request_id] = err

    async def main():
        http_task = asyncio.ensure_future(http_stream())
        while not any(s.delivered_any for s in pool.streams):  # the HTTP stream is streaming
            await asyncio.sleep(0.01)
        victim["index"] = pool.streams[0].replica
        tasks = [asyncio.ensure_future(one(rid)) for rid in prompts]
        # Kill once every request is on a replica (4 or 5 each; with max_num_seqs 2, two of
        # the victim's run and the others wait) and the victim has streamed tokens.
        await asyncio.wait_for(all_submitted.wait(), 60.0)
        await asyncio.wait_for(first_output.wait(), 60.0)
        ray.kill(pool.replicas[victim["index"]].actor, no_restart=False)
        while pool.replicas[victim["index"]].state is ReplicaState.SERVING:
            await asyncio.sleep(0.01)
        health_after_kill.update(pool.health())
        await asyncio.gather(*tasks)
        http_response = await http_task
        assert await pool.wait_serving(2, timeout_s=120.0), pool.health()
        # Two at once: the first goes to replica 0 (a tie goes to the lowest index), the
        # second to the less loaded replica 1.
        after = await asyncio.gather(
            _run(pool, "after-0", _prompt(60, 6), params),
            _run(pool, "after-1", _prompt(61, 6), params),
        )
        return after, http_response

    after, http_response = loop.run_until_complete(main())
    events = sse_payloads(http_response.text.splitlines())
    assert any(e["choices"][0]["exit_depths"] for e in events[:-2]), events[:3]  # it streamed
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]  # the stream ends with an error event
    assert error["code"] == "engine_unavailable"
    assert f"replica {victim['index']} failed" in error["message"]
    assert set(outcomes) == set(prompts)  # every request ended one way or the other
    failed = [rid for rid, o in outcomes.items() if isinstance(o, ReplicaFailedError)]
    assert failed, "the kill came mid-load, so some running request must fail"
    expected = dict(zip(prompts, reference.generate(list(prompts.values()), params)))
    for rid, outcome in outcomes.items():
        if rid not in failed:
            assert outcome.token_ids == expected[rid].token_ids, rid
    assert sum(s.num_reroutes for s in streams.values()) >= 1  # waiting ones moved
    assert health_after_kill["status"] == "degraded"
    assert pool.replicas[victim["index"]].num_restarts == 1
    assert pool.health()["status"] == "ok"
    assert {stream.replica for _, stream in after} == {0, 1}  # the restarted replica serves
    assert all(final.finish_reason == "length" for final, _ in after)


def test_embedded_ray_starts_replicas_at_the_normal_nice_level(monkeypatch):
    from loopserve.distributed import ray_init

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    ray_init.start_embedded_ray(3)
    assert os.environ["RAY_worker_niceness"] == "0"
    assert calls == [dict(num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1",
                          object_store_memory=None)]  # fmt: skip
    monkeypatch.setenv("RAY_worker_niceness", "5")  # the operator's choice stands
    ray_init.start_embedded_ray(2, 80 * 1024**2)
    assert os.environ["RAY_worker_niceness"] == "5"
