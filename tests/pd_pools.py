"""What the prefill/decode serving tests share: a 1P1D pool per engine configuration (one
alive at a time), request streams gathered on the module's event loop, replica and transport
counters, and a kill in the middle of a workload. Imported only by modules that `require`
Ray; the `pd_pools` fixture (tests/conftest.py) hands out a `PDPools`."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path

import ray

from loopserve.distributed.args import PDSpec
from loopserve.distributed.pd_pool import PDReplicaPool
from loopserve.distributed.pool import PoolConfig
from loopserve.engine.async_llm import GenerateRequest
from loopserve.errors import EngineNotReadyError
from loopserve.sampling_params import SamplingParams

PREFILL, DECODE = 0, 1  # replica indices (and transport ranks) in a 1P1D pool


def prompt_ids(seed: int, length: int) -> list[int]:
    return [(seed * 37 + i * 11) % 400 + 3 for i in range(length)]


def start_pool(loop: asyncio.AbstractEventLoop, engine_args: dict, **options) -> PDReplicaPool:
    """A started 1P1D pool (two one-CPU replicas, two restarts each) with both replicas
    serving; `options` are `PDReplicaPool`'s (kv_transport, kv_handoff)."""
    config = PoolConfig(num_replicas=2, torch_threads=1, max_restarts=2)
    pool = PDReplicaPool(engine_args, config, PDSpec(1, 1), **options)

    async def start() -> None:
        pool.start()
        assert await pool.wait_ready(timeout_s=120.0), pool.health()
        assert await pool.wait_serving(2, timeout_s=120.0), pool.health()

    loop.run_until_complete(start())
    return pool


class PDPools:
    """One pool per (engine arguments, pool options), started when a test first asks for it;
    asking for another configuration shuts the running one down (each costs about 3 s)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.key: tuple | None = None
        self.pool: PDReplicaPool | None = None

    def get(self, engine_args: dict, **options) -> PDReplicaPool:
        key = (tuple(sorted(engine_args.items())), tuple(sorted(options.items())))
        if self.key == key:
            assert self.pool is not None  # a replica a test killed has restarted
            assert self.loop.run_until_complete(self.pool.wait_serving(2, 120.0))
            return self.pool
        self.close()
        self.pool = start_pool(self.loop, engine_args, **options)
        self.key = key
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.loop.run_until_complete(self.pool.shutdown(5.0))
        self.key = self.pool = None


async def collect(pool: PDReplicaPool, request_id: str, prompt: list[int], params):
    """Every output of one request's stream, and the stream."""
    stream = await pool.submit([GenerateRequest(request_id, prompt, params)])
    with stream:
        return [output async for output in stream], stream


def gather(loop: asyncio.AbstractEventLoop, *coroutines, timeout_s: float = 300.0):
    """The coroutines' results; a pool that stops making progress fails the test after
    `timeout_s` instead of hanging the suite (a decode replica once deadlocked here)."""

    async def main():
        return await asyncio.wait_for(asyncio.gather(*coroutines), timeout_s)

    return loop.run_until_complete(main())


def run_cases(pool, loop, cases: dict[str, tuple[list[int], SamplingParams]]):
    """`collect` of every case (request id -> prompt, params) at once."""
    return gather(loop, *(collect(pool, rid, p, sp) for rid, (p, sp) in cases.items()))


async def replica_stats(pool: PDReplicaPool) -> list:
    return await asyncio.gather(*(r.actor.stats.remote() for r in pool.replicas))


async def settled(pool: PDReplicaPool) -> list:
    """Every replica's stats once none runs, waits or has a request in flight."""
    while True:
        stats = await replica_stats(pool)
        if all(
            s.snapshot.num_running == s.snapshot.num_waiting == s.num_in_flight == 0 for s in stats
        ):
            return stats
        await asyncio.sleep(0.05)


def transport_stats(pool: PDReplicaPool, loop: asyncio.AbstractEventLoop) -> list:
    """Both endpoints' transport counters, after the prefill side's pending sends completed
    (bounded). It runs the pool's event loop meanwhile: the server's hand-off tasks (imports,
    drops) must go on for the sends to complete."""

    async def main():
        await pool.replicas[PREFILL].actor.flush_kv_transport.remote(30.0)
        return await asyncio.gather(*(r.actor.kv_transport_stats.remote() for r in pool.replicas))

    return loop.run_until_complete(main())


def kill_during(pool, loop, requests, params, kill_when: Callable[[], bool], kill_index: int):
    """Submit `requests` (request id, prompt), kill replica `kill_index` once `kill_when()`
    holds, and collect each stream's outcome: (request id, "done" or "failed", outputs), where
    "failed" is the documented retry error (`ReplicaFailedError`/`EngineNotReadyError`, HTTP
    503). Returns once the killed replica serves again."""

    async def one(request_id, prompt):
        outputs = []
        try:
            stream = await pool.submit([GenerateRequest(request_id, prompt, params)])
            with stream:
                async for output in stream:
                    outputs.append(output)
        except EngineNotReadyError:
            return request_id, "failed", outputs
        return request_id, "done", outputs

    async def main():
        tasks = [asyncio.ensure_future(one(rid, p)) for rid, p in requests]
        while not kill_when():
            await asyncio.sleep(0.001)
        ray.kill(pool.replicas[kill_index].actor, no_restart=False)
        done = await asyncio.wait_for(asyncio.gather(*tasks), 300.0)
        assert await pool.wait_serving(2, timeout_s=120.0), pool.health()
        return done

    return loop.run_until_complete(main())


def exported_kv_bytes(model_dir: Path, layout: str, num_positions: int) -> int:
    """Bytes of one exported tiny-Ouro request at block size 4, from the checkpoint's config:
    layers x K/V x planes x whole blocks x 4 positions x kv heads x head dim x 4 bytes
    (float32)."""
    config = json.loads((model_dir / "config.json").read_text())
    planes = config["total_ut_steps"] if layout == "last_exited" else 1
    blocks = math.ceil(num_positions / 4)
    per_position = config["num_key_value_heads"] * config["head_dim"] * 4
    return config["num_hidden_layers"] * 2 * planes * blocks * 4 * per_position
