"""`PDStream` failure and abort paths, driven by scripted replicas (no Ray cluster, no model).

Each fake replica answers the calls the pool makes (`prefill`, `import_handoff`,
`decode_stream`, `abort`) the way Ray does: a streaming call returns a generator whose
`__anext__` gives an awaitable reference, a plain call returns an awaitable reference, and a
dead actor raises `RayActorError`. The tests script what each replica does and when, so the
paths a real cluster hits only by timing (a replica dying before any output, a decode replica
refusing or dying before it takes a request, a client leaving while the request is in flight)
run every time; so does prefix routing among prefill replicas, the rebasing of a hand-off's
times from another machine's clock, and the torch KV transport's rules (a descriptor goes to
the decode replica chosen at submission, and is dropped there if it is not imported), and a
client leaving before the first item (DP and PD pools abort on the replica). Real replicas are
in tests/test_pd_serving.py. Needs Ray only for its
exception types (the optional `ray` extra).
"""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from tests.optional import require

require("ray", "serve")

ray = pytest.importorskip("ray", reason="needs the optional `ray` extra (pip install '.[ray]')")

from loopserve.distributed.args import PDSpec  # noqa: E402
from loopserve.distributed.pd_pool import PDReplicaPool  # noqa: E402
from loopserve.distributed.pool import PoolConfig, ReplicaPool, ReplicaState, _Replica  # noqa: E402
from loopserve.distributed.pool_stream import ReplicaFailedError  # noqa: E402
from loopserve.distributed.replica import Accepted, Exported, Rejected  # noqa: E402
from loopserve.distributed.replica_messages import ChunkSent  # noqa: E402
from loopserve.distributed.router import RoutedRequest  # noqa: E402
from loopserve.engine.async_llm import GenerateRequest, QueueFullError  # noqa: E402
from loopserve.outputs import RequestMetrics, RequestOutput  # noqa: E402
from loopserve.sampling_params import SamplingParams  # noqa: E402
from loopserve.text.input_processor import ProcessedPrompt  # noqa: E402

END = object()  # ends a scripted stream


class Ref:
    """A Ray object reference stand-in: awaiting it gives the value or raises the error."""

    def __init__(self, value: object) -> None:
        self.value = value
        self.awaited = False

    def __await__(self):
        return self._get().__await__()

    async def _get(self) -> object:
        self.awaited = True
        if isinstance(self.value, asyncio.Event):  # an answer held back by the test
            await self.value.wait()
            return self.answer
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class Stream:
    """A streaming call's generator; the test pushes items (an exception: the call fails)."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[object] = asyncio.Queue()

    def push(self, *items: object) -> None:
        for item in items:
            self.items.put_nowait(item)

    async def __anext__(self) -> object:
        item = await self.items.get()
        if item is END:
            raise StopAsyncIteration
        if isinstance(item, Ref):  # a reference pushed as is (the hand-off state)
            return item
        return Ref(item)


class Method:
    def __init__(self, call: Callable[..., object]) -> None:
        self.call = call

    def remote(self, *args: object) -> object:
        return self.call(*args)


class FakeReplica:
    """Records every call; `prefill` and `decode_stream` return the next scripted stream,
    `import_handoff` the next scripted answer."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.streams: list[Stream] = []
        self.answers: list[Ref] = []
        self.scripted: dict[str, list[Ref]] = {}  # other calls' next answers (else Ref(None))
        names = ("generate", "prefill", "import_handoff", "decode_stream", "abort", "drop_handoff",
                 "reserve_imports", "write_kv_chunk", "release_imports")  # fmt: skip
        for name in names:
            setattr(self, name, Method(self._recorder(name)))

    def _recorder(self, name: str) -> Callable[..., object]:
        def call(*args: object) -> object:
            self.calls.append((name, args))
            if name in ("generate", "prefill", "decode_stream"):
                stream = Stream()
                self.streams.append(stream)
                return stream
            if name == "import_handoff":
                return self.answers.pop(0)
            if self.scripted.get(name):
                return self.scripted[name].pop(0)
            return Ref(None)

        return call

    def called(self, name: str) -> list[tuple]:
        return [args for call, args in self.calls if call == name]


def _output(request_id: str, token_ids: list[int], *, finished: bool, new: int) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        token_ids=token_ids,
        text="",
        exit_depths=[4] * len(token_ids),
        finish_reason="length" if finished else None,
        metrics=RequestMetrics(0.0, 0.0, 0.1, 1.0 if finished else None),
        new_token_ids=token_ids[-new:],
        new_exit_depths=[4] * new,
    )


def _pool(spec: PDSpec, routing: str = "least_load") -> tuple[PDReplicaPool, list[FakeReplica]]:
    pool = PDReplicaPool({"block_size": 4}, PoolConfig(num_replicas=1, routing=routing), spec)
    fakes = [FakeReplica() for _ in range(pool.num_replicas)]
    pool.replica_set.replicas = [
        _Replica(i, fake, ReplicaState.SERVING, instance_id=f"i{i}", role=pool.role_of(i))
        for i, fake in enumerate(fakes)
    ]
    pool.replica_set.info = object()  # type: ignore[assignment]  # loaded (prompts processed)
    return pool, fakes


def _submit(
    pool: PDReplicaPool, request_id: str = "r", max_tokens: int = 3, prompt: list[int] | None = None
):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = GenerateRequest(request_id, ProcessedPrompt(None, prompt or [1, 2, 3]), params)
    return pool.submit([request])


async def _until(condition: Callable[[], Any]) -> None:
    """Let the legs run until `condition` holds (a hand-off retry waits 50 ms)."""
    for _ in range(5000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


def test_prefill_replica_dying_before_any_output_reroutes_to_the_other():
    async def main():
        pool, (p0, p1, d2) = _pool(PDSpec(2, 1))
        submitting = asyncio.ensure_future(_submit(pool))
        await _until(lambda: p0.streams)
        p0.streams[0].push(Accepted(), ray.exceptions.RayActorError())  # dies, no output
        await _until(lambda: p1.streams)  # re-submitted to prefill replica 1
        stream = await submitting
        state = Ref("the exported state")
        d2.answers.append(Ref(Accepted()))
        p1.streams[0].push(Accepted(), _output("r", [7], finished=False, new=1))
        p1.streams[0].push(Exported("r", 1), state, END)
        await _until(lambda: d2.streams)
        d2.streams[0].push(_output("r", [7, 8, 9], finished=True, new=2), END)
        outputs = [output async for output in stream]
        return pool, stream, outputs, state, (p0, p1, d2)

    pool, stream, outputs, state, (p0, p1, d2) = asyncio.run(main())
    assert [o.new_token_ids for o in outputs] == [[7], [8, 9]]
    assert outputs[-1].token_ids == [7, 8, 9] and outputs[-1].finished
    assert stream.num_reroutes == 1 and stream.replica == 1
    assert pool.replicas[0].state is ReplicaState.RESTARTING  # out of rotation until it is back
    assert pool.replicas[0].num_failed_requests == 0  # nothing was lost
    assert d2.called("import_handoff") == [(state, None, None)]  # the reference, as is
    assert not state.awaited  # the server never fetched the state (its K/V)
    assert d2.called("decode_stream") == [("r", False)]
    assert pool.num_in_flight == 0


def test_hand_off_retries_a_refusing_or_dead_decode_replica():
    async def main():
        pool, (p0, d1, d2) = _pool(PDSpec(1, 2))
        d1.answers.append(Ref(ray.exceptions.RayActorError()))  # dies before taking it
        refused = Rejected.of(QueueFullError("100 requests in flight, the limit is 100"))
        d2.answers.extend([Ref(refused), Ref(Accepted())])  # full, then takes it
        submitting = asyncio.ensure_future(_submit(pool))
        await _until(lambda: p0.streams)
        p0.streams[0].push(Accepted(), _output("r", [5], finished=False, new=1))
        stream = await submitting
        p0.streams[0].push(Exported("r", 1), Ref("state"), END)
        first = await stream.__anext__()
        await _until(lambda: d2.streams)
        d2.streams[0].push(_output("r", [5, 6, 7], finished=True, new=2), END)
        rest = [output async for output in stream]
        return pool, [first, *rest], (p0, d1, d2)

    pool, outputs, (p0, d1, d2) = asyncio.run(main())
    assert outputs[-1].token_ids == [5, 6, 7] and outputs[-1].finished
    assert len(d1.called("import_handoff")) == 1 and not d1.called("decode_stream")
    assert len(d2.called("import_handoff")) == 2  # refused once, then taken
    assert pool.replicas[1].state is ReplicaState.RESTARTING
    assert pool.replicas[2].num_handoffs == 1 and pool.replicas[0].num_handoffs == 1
    assert pool.router.load(0) == pool.router.load(2) == 0  # nothing left outstanding


def test_closing_while_the_request_is_in_flight_aborts_it_once_taken():
    async def main():
        pool, (p0, d1) = _pool(PDSpec(1, 1))
        held = Ref(asyncio.Event())  # the decode replica's answer, held back
        d1.answers.append(held)
        submitting = asyncio.ensure_future(_submit(pool, max_tokens=50))
        await _until(lambda: p0.streams)
        p0.streams[0].push(Accepted(), _output("r", [5], finished=False, new=1))
        stream = await submitting
        first = await stream.__anext__()
        p0.streams[0].push(Exported("r", 1), Ref("state"), END)
        await _until(lambda: d1.called("import_handoff"))
        stream.close()  # the client leaves while the decode replica is taking the request
        held.answer = Accepted()
        held.value.set()
        await _until(lambda: d1.called("abort"))
        return pool, first, (p0, d1)

    pool, first, (p0, d1) = asyncio.run(main())
    assert first.new_token_ids == [5]
    assert d1.called("abort") == [(["r"],)]  # aborted where it landed
    assert not d1.called("decode_stream")  # nobody listens any more
    assert not p0.called("abort")  # it had left the prefill replica
    assert pool.num_in_flight == 0 and not pool.streams


def test_closing_before_the_export_aborts_on_prefill_and_drops_the_state():
    async def main():
        pool, (p0, d1) = _pool(PDSpec(1, 1))
        submitting = asyncio.ensure_future(_submit(pool, max_tokens=50))
        await _until(lambda: p0.streams)
        p0.streams[0].push(Accepted(), _output("r", [5], finished=False, new=1))
        stream = await submitting
        await stream.__anext__()
        stream.close()  # before the replica's export reached the pool
        await _until(lambda: p0.called("abort"))
        # The replica had exported it already: its state arrives and must go nowhere.
        p0.streams[0].push(Exported("r", 1), Ref("state"), END)
        for _ in range(20):
            await asyncio.sleep(0)
        return pool, (p0, d1)

    pool, (p0, d1) = asyncio.run(main())
    assert p0.called("abort") == [(["r"],)]
    assert not d1.calls  # never imported
    assert pool.num_in_flight == 0


def test_prefix_routing_keeps_a_shared_prefix_on_one_prefill_replica():
    shared = list(range(10, 22))  # three full blocks of 4

    async def submitted(pool, fakes, request_id, prompt):
        before = [len(f.streams) for f in fakes]
        submitting = asyncio.ensure_future(_submit(pool, request_id, 50, prompt))
        await _until(lambda: [len(f.streams) for f in fakes] != before)
        (index,) = [i for i, f in enumerate(fakes) if len(f.streams) != before[i]]
        fakes[index].streams[-1].push(Accepted())
        return await submitting, index

    async def main():
        pool, fakes = _pool(PDSpec(2, 1), routing="prefix")
        # Three same-prefix requests in flight at once: by load they would alternate.
        same = [await submitted(pool, fakes, f"s{i}", shared + [90 + i]) for i in range(3)]
        other = await submitted(pool, fakes, "o", list(range(50, 62)))
        return pool, same, other

    pool, same, (_, other_index) = asyncio.run(main())
    indices = {index for _, index in same}
    assert len(indices) == 1 and indices <= {0, 1}, indices  # a prefill replica
    assert other_index == 1 - indices.pop()  # the other prompt went by load
    assert pool.replicas[0].num_prefix_hits + pool.replicas[1].num_prefix_hits == 2


def _state(**times: object):
    from loopserve.engine.handoff import HandoffState

    return HandoffState(
        request_id="r",
        prompt_token_ids=[1, 2],
        output_token_ids=[3],
        exit_depths=[4],
        logprobs=[],
        params=SamplingParams(),
        num_planes=4,
        block_size=4,
        num_kv_positions=2,
        kv=None,
        generator_state=None,
        **times,  # type: ignore[arg-type]
    )


def test_times_of_a_hand_off_from_another_machine_are_rebased():
    import time

    from loopserve.distributed.replica import rebase_times

    state = _state(arrival_s=10.0, first_scheduled_s=10.5, first_token_s=11.0, token_times_s=[11.0])
    here_offset_s = time.time() - time.monotonic()
    assert rebase_times(state, None) is state
    assert rebase_times(state, here_offset_s) is state  # the same machine: one clock
    # The exporter's monotonic clock reads 250 s less than ours at the same wall time.
    moved = rebase_times(state, here_offset_s + 250.0)
    assert moved.arrival_s == pytest.approx(260.0, abs=1e-3)
    assert moved.first_scheduled_s == pytest.approx(260.5, abs=1e-3)
    assert moved.first_token_s == pytest.approx(261.0, abs=1e-3)
    assert moved.token_times_s == pytest.approx([261.0], abs=1e-3)
    assert moved.kv is state.kv and moved.output_token_ids == [3]
    unscheduled = rebase_times(_state(arrival_s=1.0), here_offset_s - 5.0)
    assert unscheduled.arrival_s == pytest.approx(-4.0, abs=1e-3)
    assert unscheduled.first_token_s is None


def _torch_pool(spec: PDSpec) -> tuple[PDReplicaPool, list[FakeReplica]]:
    """A pool whose hand-offs go point to point (as after `connect_kv_transport`)."""
    pool, fakes = _pool(spec)
    pool.kv_transport = "torch"
    pool.kv_group = object()  # type: ignore[assignment]  # connected (never called here)
    return pool, fakes


def test_torch_transport_sends_to_the_decode_replica_chosen_at_submission():
    async def main():
        pool, (p0, d1, d2) = _torch_pool(PDSpec(1, 2))
        pool.router.assign(1, [RoutedRequest("busy", 0, 500)])  # replica 1 has work
        d2.answers.append(Ref(Accepted()))
        submitting = asyncio.ensure_future(_submit(pool))
        await _until(lambda: p0.streams)
        p0.streams[0].push(Accepted(), _output("r", [5], finished=False, new=1))
        stream = await submitting
        p0.streams[0].push(Exported("r", 1, None, 2), Ref("descriptor"), END)
        await _until(lambda: d2.streams)
        d2.streams[0].push(_output("r", [5, 6], finished=True, new=1), END)
        return [o async for o in stream], (p0, d1, d2)

    outputs, (p0, d1, d2) = asyncio.run(main())
    assert outputs[-1].token_ids == [5, 6]
    ((requests, destinations, stream_to),) = p0.called("prefill")
    assert destinations == {"r": 2} and stream_to is None  # least loaded (rank = index)
    assert len(d2.called("import_handoff")) == 1 and not d1.calls


def test_closing_while_a_descriptor_is_in_flight_drops_it_on_its_destination():
    async def main():
        pool, (p0, d1) = _torch_pool(PDSpec(1, 1))
        submitting = asyncio.ensure_future(_submit(pool, max_tokens=50))
        await _until(lambda: p0.streams)
        p0.streams[0].push(Accepted(), _output("r", [5], finished=False, new=1))
        stream = await submitting
        await stream.__anext__()
        stream.close()  # before the export reached the pool
        descriptor = Ref("descriptor")
        p0.streams[0].push(Exported("r", 1, None, 1), descriptor, END)
        await _until(lambda: d1.called("drop_handoff"))
        return pool, d1, descriptor

    pool, d1, descriptor = asyncio.run(main())
    assert d1.called("drop_handoff") == [(descriptor,)]  # the reference, for its turn
    assert not d1.called("import_handoff") and not descriptor.awaited
    assert pool.num_in_flight == 0


def test_a_refused_descriptor_is_retried_on_its_destination_only_then_dropped_on_timeout(
    monkeypatch,
):
    import loopserve.distributed.pd_decode_leg as pd_decode_leg

    monkeypatch.setattr(pd_decode_leg, "HANDOFF_WAIT_S", 0.2)

    async def main():
        pool, (p0, d1, d2) = _torch_pool(PDSpec(1, 2))
        full = Rejected.of(QueueFullError("4 requests in flight, the limit is 4"))
        d1.answers.extend(Ref(full) for _ in range(100))
        submitting = asyncio.ensure_future(_submit(pool))
        await _until(lambda: p0.streams)
        p0.streams[0].push(Accepted(), _output("r", [5], finished=False, new=1))
        stream = await submitting
        p0.streams[0].push(Exported("r", 1, None, 1), Ref("descriptor"), END)
        outputs = []
        with pytest.raises(ReplicaFailedError, match="no decode replica could take"):
            async for output in stream:
                outputs.append(output)
        await _until(lambda: d1.called("drop_handoff"))
        return outputs, (p0, d1, d2)

    outputs, (p0, d1, d2) = asyncio.run(main())
    assert [o.new_token_ids for o in outputs] == [[5]]
    assert len(d1.called("import_handoff")) >= 2 and not d2.calls  # never another replica
    assert len(d1.called("drop_handoff")) == 1


def test_a_transport_failure_fails_the_request_and_later_hand_offs_use_the_object_store():
    async def main():
        pool, (p0, d1) = _torch_pool(PDSpec(1, 1))
        broken = Rejected("KVTransportError", "receiving hand-off 'r' failed: timed out")
        d1.answers.append(Ref(broken))
        submitting = asyncio.ensure_future(_submit(pool))
        await _until(lambda: p0.streams)
        p0.streams[0].push(Accepted(), _output("r", [5], finished=False, new=1))
        stream = await submitting
        p0.streams[0].push(Exported("r", 1, None, 1), Ref("descriptor"), END)
        with pytest.raises(ReplicaFailedError, match="replica 1 failed this request"):
            async for _ in stream:
                pass
        d1.answers.append(Ref(Accepted()))
        later = asyncio.ensure_future(_submit(pool, "later"))
        await _until(lambda: len(p0.streams) == 2)
        p0.streams[1].push(Accepted(), _output("later", [7], finished=False, new=1))
        stream = await later
        p0.streams[1].push(Exported("later", 1), Ref("state"), END)
        await _until(lambda: d1.streams)
        d1.streams[0].push(_output("later", [7, 8], finished=True, new=1), END)
        return pool, [o async for o in stream], p0

    pool, outputs, p0 = asyncio.run(main())
    assert outputs[-1].token_ids == [7, 8]
    assert "KVTransportError" not in (pool.kv_transport_fallback or "")
    assert "receiving hand-off 'r' failed" in (pool.kv_transport_fallback or "")
    assert not pool.uses_point_to_point
    assert [args[1] for args in p0.called("prefill")] == [{"r": 1}, None]  # object store now


@pytest.mark.parametrize("kind", ["data_parallel", "pd"])
def test_a_client_leaving_before_the_first_item_aborts_on_the_replica(kind):
    """Cancelled while waiting for the replica's first item (its `Accepted`): the replica adds
    the requests anyway, so the pool takes them back with an abort (DP and PD alike)."""

    async def main():
        if kind == "pd":
            pool, fakes = _pool(PDSpec(1, 1))
        else:
            pool = ReplicaPool({"block_size": 4}, PoolConfig(num_replicas=2))
            fakes = [FakeReplica() for _ in range(2)]
            pool.replica_set.replicas = [
                _Replica(i, fake, ReplicaState.SERVING, instance_id=f"i{i}")
                for i, fake in enumerate(fakes)
            ]
            pool.replica_set.info = object()  # type: ignore[assignment]
        submitting = asyncio.ensure_future(_submit(pool, "gone"))
        await _until(lambda: any(fake.streams for fake in fakes))
        submitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submitting
        return fakes

    fakes = asyncio.run(main())
    started = [fake for fake in fakes if fake.streams]
    assert len(started) == 1
    assert started[0].called("abort") == [(["gone"],)]


# ---- streamed hand-offs (`kv_handoff="stream"`, pd_kv_stream.py) ----------------------------


def _stream_pool(spec: PDSpec) -> tuple[PDReplicaPool, list[FakeReplica]]:
    pool, fakes = _pool(spec)
    pool.kv_handoff = "stream"
    return pool, fakes


def _released(fake: FakeReplica) -> list[str]:
    return [r for (ids,) in fake.called("release_imports") for r in ids]


def test_a_streamed_hand_off_goes_where_its_chunks_went():
    """Blocks are reserved on the least-loaded decode replica before the prompt runs; each
    chunk's reference goes there unfetched; the final hand-off goes there too (not to the
    other, idle-looking replica) once the writes succeeded; the import takes the
    reservation, so nothing is released."""

    async def main():
        pool, (p0, d1, d2) = _stream_pool(PDSpec(1, 2))
        pool.router.assign(1, [RoutedRequest("busy", 0, 500)])  # replica 1 has work
        d2.scripted["reserve_imports"] = [Ref([1])]  # its cache holds the first block
        d2.scripted["write_kv_chunk"] = [Ref(2)]
        d2.answers.append(Ref(Accepted()))
        submitting = asyncio.ensure_future(_submit(pool, prompt=list(range(1, 15))))
        await _until(lambda: p0.streams)
        chunk = Ref("chunk [1, 3)")
        p0.streams[0].push(Accepted(), ChunkSent("r", 1, 2), chunk)
        await _until(lambda: d2.called("write_kv_chunk"))
        pool.router.finish("busy")  # replica 1 idle now: the final still goes to 2
        p0.streams[0].push(_output("r", [5], finished=False, new=1))
        stream = await submitting
        p0.streams[0].push(Exported("r", 1, None, None, 3), Ref("state"), END)
        await _until(lambda: d2.streams)
        d2.streams[0].push(_output("r", [5, 6, 7], finished=True, new=2), END)
        return [o async for o in stream], chunk, (p0, d1, d2)

    outputs, chunk, (p0, d1, d2) = asyncio.run(main())
    assert outputs[-1].token_ids == [5, 6, 7]
    ((requests, destinations, stream_to),) = p0.called("prefill")
    assert stream_to == {"r": 1} and destinations is None
    assert d2.called("write_kv_chunk") == [(chunk,)] and not chunk.awaited
    assert len(d2.called("import_handoff")) == 1 and not d1.calls
    assert _released(d2) == []


def test_a_failed_write_replays_the_kept_chunks_on_a_serving_replica():
    """The reserving decode replica dies under a chunk write and when asked again: the
    request is reserved on the other decode replica, every kept chunk is written there, and
    the final hand-off goes there."""

    async def main():
        pool, (p0, d1, d2) = _stream_pool(PDSpec(1, 2))
        pool.router.assign(2, [RoutedRequest("busy", 0, 500)])  # replica 1 is chosen first
        d1.scripted["reserve_imports"] = [Ref([0]), Ref(ray.exceptions.RayActorError())]
        d1.scripted["write_kv_chunk"] = [Ref(2), Ref(ray.exceptions.RayActorError())]
        d2.scripted["reserve_imports"] = [Ref([0])]
        d2.scripted["write_kv_chunk"] = [Ref(2), Ref(2)]
        d2.answers.append(Ref(Accepted()))
        submitting = asyncio.ensure_future(_submit(pool, prompt=list(range(1, 20))))
        await _until(lambda: p0.streams)
        chunks = [Ref("chunk [0, 2)"), Ref("chunk [2, 4)")]
        p0.streams[0].push(Accepted(), ChunkSent("r", 0, 2), chunks[0])
        p0.streams[0].push(ChunkSent("r", 2, 2), chunks[1])
        p0.streams[0].push(_output("r", [5], finished=False, new=1))
        stream = await submitting
        p0.streams[0].push(Exported("r", 1, None, None, 4), Ref("state"), END)
        await _until(lambda: d2.streams)
        d2.streams[0].push(_output("r", [5, 6], finished=True, new=1), END)
        return pool, [o async for o in stream], chunks, (p0, d1, d2)

    pool, outputs, chunks, (p0, d1, d2) = asyncio.run(main())
    assert outputs[-1].token_ids == [5, 6]
    assert d1.called("write_kv_chunk") == [(chunks[0],), (chunks[1],)]
    assert d2.called("write_kv_chunk") == [(chunks[0],), (chunks[1],)]  # replayed, in order
    assert not d1.called("import_handoff") and len(d2.called("import_handoff")) == 1
    assert _released(d1) == ["r"] and _released(d2) == []
    assert pool.replicas[1].state is ReplicaState.RESTARTING


@pytest.mark.parametrize("how", ["prefill_dies", "finishes_on_prefill", "client_leaves"])
def test_a_request_that_will_not_be_imported_releases_its_reservation(how):
    """Its prefill replica dies mid-stream (after output: the request fails with the retry
    error), it finishes with its first token, or the client leaves: the reservation on the
    decode replica is released, and a chunk that still arrives is not written."""

    async def main():
        pool, (p0, d1) = _stream_pool(PDSpec(1, 1))
        d1.scripted["reserve_imports"] = [Ref([0])]
        d1.scripted["write_kv_chunk"] = [Ref(2)]
        submitting = asyncio.ensure_future(_submit(pool, prompt=list(range(1, 20))))
        await _until(lambda: p0.streams)
        p0.streams[0].push(Accepted(), ChunkSent("r", 0, 2), Ref("chunk"))
        p0.streams[0].push(_output("r", [5], finished=how == "finishes_on_prefill", new=1))
        stream = await submitting
        error = None
        if how == "prefill_dies":
            p0.streams[0].push(ray.exceptions.RayActorError())
            try:
                [o async for o in stream]
            except ReplicaFailedError as err:
                error = err
        elif how == "finishes_on_prefill":
            p0.streams[0].push(END)
            [o async for o in stream]
        else:
            await stream.__anext__()
            stream.close()
        await _until(lambda: d1.called("release_imports"))
        p0.streams[0].push(ChunkSent("r", 2, 2), Ref("late chunk"))
        await asyncio.sleep(0.01)
        return error, (p0, d1)

    error, (p0, d1) = asyncio.run(main())
    assert _released(d1) == ["r"]
    assert len(d1.called("write_kv_chunk")) == 1 and not d1.called("import_handoff")
    assert (error is not None) == (how == "prefill_dies")


def test_a_replica_unreachable_after_its_restart_serves_again_at_its_next_reply():
    """A call to a replica that restarted can still fail with `ActorUnavailableError` ("the
    actor is restarting": the caller's view of the actor lags the restart). That takes the
    new instance out of rotation, but only until it answers: treating it as that instance's
    death made the pool drop every later reply as stale and wait forever for a restart that
    had already happened (seen in tests/test_pd_streaming.py under load). A call that finds
    the instance dead still makes its late replies stale."""
    import ray.exceptions

    from loopserve.distributed.replica_messages import ReplicaStats
    from loopserve.engine.stats import EngineStats

    pool = ReplicaPool({"block_size": 4}, PoolConfig(num_replicas=1))
    replicas = pool.replica_set
    replica = _Replica(0, FakeReplica(), ReplicaState.SERVING, instance_id="new")
    replicas.replicas = [replica]

    def reply(instance_id):
        replicas._apply_stats(replica, ReplicaStats(instance_id, True, False, 0, EngineStats()))

    unavailable = ray.exceptions.ActorUnavailableError("The actor is restarting.", None)
    replicas.replica_failed(0, "new", unavailable)
    assert replica.state is ReplicaState.RESTARTING and replicas.serving_replicas() == []
    reply("new")
    assert replica.state is ReplicaState.SERVING and replica.num_restarts == 0

    replicas.replica_failed(0, "new", ray.exceptions.ActorDiedError())
    reply("new")  # sent before it died
    assert replica.state is ReplicaState.RESTARTING
    reply("newer")  # the restarted instance
    assert replica.state is ReplicaState.SERVING and replica.num_restarts == 1


def test_streamed_hand_offs_in_flight_spread_over_the_decode_replicas():
    """A decode replica with a streamed hand-off in flight (reserved, not yet imported) is
    passed over for the next reservation although it has the least outstanding work: two
    prompts streaming to one replica share its link, and their chunks queue behind each
    other past their first tokens. The count drops when a request that finishes with its
    first token releases its reservation, and when an import takes one."""

    async def main():
        pool, (p0, d1, d2) = _stream_pool(PDSpec(1, 2))
        pool.router.assign(2, [RoutedRequest("busy", 0, 500)])  # replica 2 has more work
        d1.scripted["reserve_imports"] = [Ref([0])]
        d2.scripted["reserve_imports"] = [Ref([0])]
        d1.answers.append(Ref(Accepted()))
        first = asyncio.ensure_future(_submit(pool, "a", prompt=list(range(1, 15))))
        await _until(lambda: len(p0.streams) == 1)
        second = asyncio.ensure_future(_submit(pool, "b", prompt=list(range(1, 15))))
        await _until(lambda: len(p0.streams) == 2)
        counts = [(pool.router.handoffs(1), pool.router.handoffs(2))]
        p0.streams[1].push(Accepted(), _output("b", [5], finished=True, new=1), END)
        [o async for o in await second]  # "b" ends with its first token: released
        await _until(lambda: d2.called("release_imports"))
        counts.append((pool.router.handoffs(1), pool.router.handoffs(2)))
        p0.streams[0].push(Accepted(), _output("a", [5], finished=False, new=1))
        stream = await first
        p0.streams[0].push(Exported("a", 1, None, None, 3), Ref("state"), END)
        await _until(lambda: d1.streams)
        d1.streams[0].push(_output("a", [5, 6, 7], finished=True, new=2), END)
        outputs = [o async for o in stream]
        counts.append((pool.router.handoffs(1), pool.router.handoffs(2)))
        return counts, outputs, (p0, d1, d2)

    counts, outputs, (p0, d1, d2) = asyncio.run(main())
    reserved = {i: [r.request_id for (requests,) in fake.called("reserve_imports") for r in requests]
                for i, fake in ((1, d1), (2, d2))}  # fmt: skip
    assert reserved == {1: ["a"], 2: ["b"]}
    assert counts == [(1, 1), (1, 0), (0, 0)]
    assert outputs[-1].token_ids == [5, 6, 7]
    assert _released(d2) == ["b"] and _released(d1) == []
