"""`AsyncLLM` and the server's failure paths, in-process (no sockets, no subprocess).

Each test runs its own event loop with `asyncio.run` and its own engine on the tiny seeded
checkpoint; HTTP-level checks go through `httpx.ASGITransport` into `build_app`.
"""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio
import gc
import json
import threading
import time
import weakref

import pytest

from tests.optional import require

require("serve")
import httpx
import torch

from loopserve.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineNotReadyError,
    GenerateRequest,
    QueueFullError,
)
from loopserve.engine.llm_engine import LLMEngine
from loopserve.errors import CapacityError, InvalidRequestError
from loopserve.sampling_params import SamplingParams
from loopserve.server.api_server import build_app

NUM_BLOCKS = 128
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_torch_thread():
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture
def make_engine(tiny_tok_dir):
    def make() -> LLMEngine:
        return LLMEngine.from_engine_args(
            model=str(tiny_tok_dir), dtype="float32", num_blocks=NUM_BLOCKS
        )

    return make


async def started(engine: LLMEngine, **kwargs: object) -> AsyncLLM:
    async_llm = AsyncLLM(engine, **kwargs)
    async_llm.start()
    assert await async_llm.wait_ready(timeout_s=30)
    return async_llm


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline_s, "condition not met in time"
        await asyncio.sleep(0.01)


def test_generate_deltas_add_up_to_the_offline_result(make_engine):
    params = SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=0.6)
    offline = make_engine()
    offline.add_request("a", "The quick brown fox", params)
    finals = []
    while offline.has_unfinished_requests():
        finals += [o for o in offline.step() if o.finished]
    (expected,) = finals

    async def main() -> list:
        async_llm = await started(make_engine())
        try:
            return [
                out async for out in await async_llm.generate("a", "The quick brown fox", params)
            ]
        finally:
            await async_llm.shutdown(1.0)

    outputs = asyncio.run(main())
    final = outputs[-1]
    assert final.finished and all(not o.finished for o in outputs[:-1])
    assert final.token_ids == expected.token_ids
    assert final.exit_depths == expected.exit_depths
    assert "".join(o.new_text for o in outputs) == final.text == expected.text
    assert [t for o in outputs for t in o.new_token_ids] == final.token_ids


class Cycle:
    me: Cycle


@pytest.mark.parametrize("freeze", [False, True])
def test_a_serving_process_freezes_its_start_up_heap_once_the_engine_loads(tiny_dir, freeze):
    """`freeze_heap` (what `loopserve serve` and a Ray replica pass): once the engine has
    loaded, the engine and everything alive then sit in the permanent generation that
    garbage collections skip; a request's objects made later are collected as before, and
    it serves the same tokens. Off (the default, the library's), nothing is frozen."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine_args = dict(model=str(tiny_dir), dtype="float32", num_blocks=NUM_BLOCKS)
    offline = LLMEngine.from_engine_args(**engine_args)
    offline.add_request("a", [5, 17, 42], params)
    finals = []
    while offline.has_unfinished_requests():
        finals += [o for o in offline.step() if o.finished]
    engines: list[LLMEngine] = []

    def load() -> LLMEngine:
        engines.append(LLMEngine.from_engine_args(**engine_args))
        return engines[-1]

    async def main() -> list:
        async_llm = AsyncLLM(load, freeze_heap=freeze)
        async_llm.start()
        assert await async_llm.wait_ready(timeout_s=30)
        try:
            return [out async for out in await async_llm.generate("a", [5, 17, 42], params)]
        finally:
            await async_llm.shutdown(1.0)

    try:
        outputs = asyncio.run(main())
        tracked = gc.get_objects()
        assert any(obj is engines[0] for obj in tracked) is not freeze
        assert (gc.get_freeze_count() > 0) is freeze
        cycle = Cycle()  # garbage made after the freeze is still collected
        cycle.me, gone = cycle, weakref.ref(cycle)
        del cycle
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()  # this test process goes on: give its heap back to the collector
    assert outputs[-1].token_ids == finals[0].token_ids


def test_invalid_requests_raise_before_streaming_and_leave_nothing_behind(make_engine):
    async def main() -> None:
        async_llm = await started(make_engine())
        try:
            with pytest.raises(InvalidRequestError) as err:
                await async_llm.generate("bad", "hi", SamplingParams(max_loops=9))
            assert err.value.param == "max_loops"
            with pytest.raises(CapacityError):
                await async_llm.generate("big", [5] * 1000, SamplingParams(max_tokens=10))
            # a batch is atomic: one bad request rejects the others too
            batch = [
                GenerateRequest("ok", "hi", SamplingParams(max_tokens=2)),
                GenerateRequest("bad", "hi", SamplingParams(min_loops=5)),
            ]
            with pytest.raises(InvalidRequestError):
                await async_llm.submit(batch)
            assert async_llm.num_in_flight == 0
            await wait_for(lambda: async_llm.snapshot.num_running == 0)
            assert async_llm.snapshot.num_waiting == 0
        finally:
            await async_llm.shutdown(1.0)

    asyncio.run(main())


def test_closing_a_stream_early_aborts_and_returns_its_blocks(make_engine):
    async def main() -> None:
        async_llm = await started(make_engine())
        try:
            stream = await async_llm.submit([GenerateRequest("long", "hello", LONG)])
            with stream:
                first = await stream.__anext__()
                assert not first.finished
                assert async_llm.snapshot.kv_blocks_free < NUM_BLOCKS
            snapshot = lambda: async_llm.snapshot  # noqa: E731
            await wait_for(lambda: snapshot().kv_blocks_free == NUM_BLOCKS)
            assert async_llm.num_in_flight == 0
            assert async_llm.metrics.finished_count("abort") == 1
        finally:
            await async_llm.shutdown(1.0)

    asyncio.run(main())


def test_too_many_requests_in_flight_raise_queue_full(make_engine):
    async def main() -> None:
        async_llm = await started(make_engine(), max_pending_requests=2)
        try:
            stream = await async_llm.submit(
                [GenerateRequest(f"r{i}", "hello", LONG) for i in range(2)]
            )
            with pytest.raises(QueueFullError):
                await async_llm.submit([GenerateRequest("r2", "hello", LONG)])
            stream.close()
            stream = await async_llm.submit([GenerateRequest("r3", "hi", SamplingParams())])
            stream.close()
        finally:
            await async_llm.shutdown(1.0)

    asyncio.run(main())


def test_dead_engine_thread_fails_streams_and_refuses_work(make_engine):
    engine = make_engine()

    def broken_step():
        raise RuntimeError("boom")

    async def main() -> None:
        async_llm = await started(engine)
        try:
            engine.step = broken_step
            stream = await async_llm.submit([GenerateRequest("a", "hello", LONG)])
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert async_llm.is_dead and not async_llm.is_ready
            with pytest.raises(EngineDeadError):
                await async_llm.submit([GenerateRequest("b", "hello", LONG)])
        finally:
            await async_llm.shutdown(1.0)

    asyncio.run(main())


def test_shutdown_aborts_requests_still_running_at_the_timeout(make_engine):
    async def main() -> list:
        async_llm = await started(make_engine())
        outputs = await async_llm.generate("a", "hello", LONG)
        first = await outputs.__anext__()
        shutdown = asyncio.ensure_future(async_llm.shutdown(0.2))
        rest = [out async for out in outputs]
        await shutdown
        with pytest.raises(EngineNotReadyError):
            await async_llm.submit([GenerateRequest("b", "hello", LONG)])
        return [first, *rest]

    outputs = asyncio.run(main())
    assert outputs[-1].finish_reason == "abort"
    assert len(outputs[-1].token_ids) < LONG.max_tokens


# ---- HTTP failure paths, in-process --------------------------------------------------------


def test_engine_failure_is_500_or_stream_error_event_and_server_stays_healthy(
    make_engine, monkeypatch
):
    engine = make_engine()

    def failing_execute(_scheduled):
        raise RuntimeError("kernel exploded")

    async def main() -> tuple[httpx.Response, list[str], httpx.Response]:
        async_llm = await started(engine)
        app = build_app(async_llm, "tiny")
        transport = httpx.ASGITransport(app=app)
        body = {"prompt": "hello", "max_tokens": 4}
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                monkeypatch.setattr(engine.runner, "execute", failing_execute)
                plain = await client.post("/v1/completions", json=body)
                streamed = await client.post("/v1/completions", json=body | {"stream": True})
                health = await client.get("/health")
        finally:
            await async_llm.shutdown(1.0)
        return plain, streamed.text.strip().split("\n\n"), health

    plain, events, health = asyncio.run(main())
    assert plain.status_code == 500
    assert plain.json()["error"]["code"] == "engine_error"
    # The exception text stays in the log; the client gets an error id only.
    assert "kernel exploded" not in plain.json()["error"]["message"]
    assert "error id" in plain.json()["error"]["message"]
    assert "kernel exploded" not in events[-2]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "server_error"
    assert health.status_code == 200


def test_non_streaming_request_aborted_while_serving_is_500_with_an_error_id(tiny_tok_dir):
    """A queued request (`max_num_seqs=1`, a long request runs) that the engine aborts while
    the server still accepts work produced nothing: 500 with an error id, not 200 with empty
    text (503 is for shutdown)."""
    engine = LLMEngine.from_engine_args(
        model=str(tiny_tok_dir), dtype="float32", num_blocks=NUM_BLOCKS, max_num_seqs=1
    )

    async def main() -> httpx.Response:
        async_llm = await started(engine)
        transport = httpx.ASGITransport(app=build_app(async_llm, "tiny"))
        hog = await async_llm.generate("hog", "hello", LONG)
        try:
            await hog.__anext__()  # "hog" runs and holds the only sequence
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                body = {"prompt": "hi", "max_tokens": 4}
                post = asyncio.ensure_future(client.post("/v1/completions", json=body))
                await wait_for(lambda: async_llm.snapshot.num_waiting == 1)
                async_llm.abort(engine.scheduler.waiting[0].request_id)
                return await post
        finally:
            await hog.aclose()
            await async_llm.shutdown(1.0)

    response = asyncio.run(main())
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "aborted")
    assert "error id" in error["message"]


def test_health_is_503_while_loading_and_after_the_engine_dies(make_engine):
    release = asyncio.Event()

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()

        def slow_factory() -> LLMEngine:
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
            raise RuntimeError("no such checkpoint")

        async_llm = AsyncLLM(slow_factory)
        app = build_app(async_llm, "tiny")
        async_llm.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            codes = [(await client.get("/health")).status_code]
            codes.append((await client.post("/v1/completions", json={"prompt": "x"})).status_code)
            release.set()
            await wait_for(lambda: async_llm.is_dead)
            codes.append((await client.get("/health")).status_code)
        await async_llm.shutdown(1.0)
        assert isinstance(async_llm.load_error, RuntimeError)
        return codes

    assert asyncio.run(main()) == [503, 503, 503]


def test_model_without_tokenizer_serves_token_ids_and_refuses_chat(tiny_dir):
    engine = LLMEngine.from_engine_args(model=str(tiny_dir), dtype="float32", num_blocks=32)

    async def main() -> list[httpx.Response]:
        async_llm = await started(engine)
        transport = httpx.ASGITransport(app=build_app(async_llm, "tiny"))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                body = {"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 1, "ignore_eos": True}
                chat = {"messages": [{"role": "user", "content": "hi"}]}
                return [
                    await client.post("/v1/completions", json=body),
                    await client.post("/v1/completions", json={"prompt": "text"}),
                    await client.post("/v1/chat/completions", json=chat),
                ]
        finally:
            await async_llm.shutdown(1.0)

    ids, text, chat = asyncio.run(main())
    assert ids.status_code == 200, ids.text
    choice = ids.json()["choices"][0]
    assert len(choice["exit_depths"]) == 3
    assert all(token.startswith("token_id:") for token in choice["logprobs"]["tokens"])
    assert (text.status_code, text.json()["error"]["param"]) == (400, "prompt")
    assert (chat.status_code, chat.json()["error"]["param"]) == (400, "messages")


@pytest.mark.parametrize("on_device", [False, True])
def test_export_submission_hands_off_with_the_k_v_where_asked(make_engine, on_device):
    """`submit(export=True)` ends a request's stream with its `HandoffState` after its first
    token; `export_on_device` reaches `LLMEngine.export_request` as `to_host=False` (the torch
    transport sends device memory; on CPU both are host tensors)."""
    from loopserve.engine.handoff import HandoffState

    engine = make_engine()
    calls = []
    export = engine.export_request

    def recording_export(request_id, *, to_host=True, pending=False):
        calls.append((to_host, pending))
        return export(request_id, to_host=to_host, pending=pending)

    engine.export_request = recording_export  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def main() -> list:
        async_llm = await started(engine)
        stream = await async_llm.submit(
            [GenerateRequest("h", "hello there", params)],
            export=True,
            export_on_device=on_device,
        )
        items = [item async for item in stream]
        await async_llm.shutdown()
        return items

    items = asyncio.run(main())
    assert isinstance(items[-1], HandoffState) and len(items[-1].output_token_ids) == 1
    assert items[-1].kv is not None and items[-1].kv.numel() > 0
    # The engine thread does not wait for the copy; the stream yields the settled tensor.
    assert calls == [(not on_device, True)]


def test_served_hand_offs_land_their_kv_off_the_engine_thread(tiny_dir):
    """A decode replica's chunk writes and imports (`ReplicaHandoff.write_kv_chunk`,
    `import_handoff`) land each K/V (`LLMEngine.land_kv`: on CUDA pinned and copied on a side
    stream) in a worker thread, neither on the engine thread nor on the event loop's, and the
    engine then copies only landed K/V (none comes as a plain tensor); the streamed and the
    whole hand-off both decode to the reference tokens."""
    from loopserve.distributed.replica_handoff import ReplicaHandoff
    from loopserve.distributed.replica_messages import Accepted
    from tests.engine_utils import make_engine as make_step_engine
    from tests.engine_utils import reference_for

    prefill, decode = make_step_engine(tiny_dir), make_step_engine(tiny_dir)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = {"s": list(range(3, 27)), "w": list(range(40, 51))}  # streamed, whole
    assert decode.reserve_import("s", prompts["s"], params) == 0
    for request_id, prompt in prompts.items():
        prefill.add_request(request_id, prompt, params)
    prefill.stream_export("s")
    chunks, states = [], {}
    while len(states) < len(prompts):
        prefill.step()
        chunks += prefill.take_kv_chunks()
        for request_id in prompts.keys() - states.keys():
            if prefill.can_export(request_id):
                states[request_id] = prefill.export_request(request_id)
    assert len(chunks) >= 2 and states["s"].first_block > 0  # "s" came in parts
    landing_threads = []
    land_kv = decode.land_kv

    def recording_land_kv(kv):
        landing_threads.append(threading.current_thread())
        return land_kv(kv)

    decode.land_kv = recording_land_kv  # type: ignore[method-assign]

    async def main() -> tuple[dict, threading.Thread]:
        async_llm = await started(decode)
        handoff = ReplicaHandoff(decode, started=lambda: async_llm, add_all=lambda *a: [])
        try:
            for chunk in chunks:
                assert await handoff.write_kv_chunk(chunk) == chunk.num_blocks
            for state in states.values():
                assert isinstance(await handoff.import_handoff(state, None), Accepted)
            outputs = {}
            for request_id in prompts:
                async for output in handoff.decode_stream(request_id):
                    outputs[request_id] = output
            engine_thread = await async_llm.call(lambda engine: threading.current_thread())
            return outputs, engine_thread
        finally:
            await async_llm.shutdown(timeout_s=10)

    outputs, engine_thread = asyncio.run(main())
    assert len(landing_threads) == len(chunks) + len(states)
    assert not {engine_thread, threading.main_thread()} & set(landing_threads)
    swap = decode.runner.moves.swap
    # Every chunk and the whole hand-off wrote blocks ("s"'s final part may have none left).
    assert swap.num_imports_landed >= len(chunks) + 1 and swap.num_imports_unlanded == 0
    landing = decode.runner.handoff  # on CPU every K/V stays on the host
    assert (landing.num_landed_device, landing.num_landed_host) == (0, len(chunks) + 2)
    for request_id, prompt in prompts.items():
        expected = reference_for(decode, prompt, params)
        assert outputs[request_id].finished
        assert outputs[request_id].token_ids == expected.token_ids, request_id


def test_a_stalled_engine_waits_for_a_command_instead_of_stepping(tiny_dir):
    """A reservation holds 20 of the decode engine's 40 blocks; a request whose prompt needs
    28 waits for them, so no step can run anything until the reserved request's hand-off
    arrives. The engine thread waits for that command (at most `STALL_WAIT_S` at a time)
    instead of stepping again at once, which kept a core busy for as long as the stall
    lasted; the import then wakes it, and both requests finish with the reference tokens."""
    from loopserve.engine.engine_thread import STALL_WAIT_S
    from tests.engine_utils import make_engine as make_step_engine
    from tests.engine_utils import reference_for

    prefill = make_step_engine(tiny_dir)
    decode = make_step_engine(tiny_dir, num_blocks=40)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    streamed, big = list(range(3, 19)), list(range(40, 68))  # 16 and 28 prompt tokens
    assert decode.reserve_import("r", streamed, params) == 0
    prefill.add_request("r", streamed, params)
    prefill.stream_export("r")
    while not prefill.can_export("r"):
        prefill.step()
        for chunk in prefill.take_kv_chunks():
            decode.write_kv_chunk(chunk)
    state = prefill.export_request("r")
    window_s = 0.4

    async def main() -> tuple[int, dict]:
        async_llm = await started(decode)
        try:
            big_stream = await async_llm.submit([GenerateRequest("big", big, params)])
            await asyncio.sleep(window_s / 4)  # "big" waits for blocks: the engine stalls
            before = await async_llm.call(lambda engine: engine.stats.num_steps)
            await asyncio.sleep(window_s)
            steps = await async_llm.call(lambda engine: engine.stats.num_steps) - before
            assert await async_llm.call(lambda engine: engine.stalled)
            r_stream = await async_llm.submit_import(state, None)
            outputs = {}
            for stream in (r_stream, big_stream):
                async for output in stream:
                    if output.finished:
                        outputs[output.request_id] = output
            return steps, outputs
        finally:
            await async_llm.shutdown(timeout_s=10)

    steps, outputs = asyncio.run(main())
    # One step per wait plus one per command; stepping at once ran thousands in the window.
    assert steps <= window_s / STALL_WAIT_S + 4, steps
    for request_id, prompt in (("r", streamed), ("big", big)):
        assert outputs[request_id].token_ids == reference_for(decode, prompt, params).token_ids
