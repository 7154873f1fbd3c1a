"""`HandoffReceiver` (the decode replica's per-source reorder buffer for point-to-point
hand-offs), with scripted descriptors and a recording fake transport: whatever order the
descriptors arrive in, the transport receives or discards one source's hand-offs in send
order; a discard in the middle keeps the order; sources are independent; duplicates are
refused; a descriptor whose predecessor never comes times out and is discarded in its turn.
`HandoffInbox` keeps a received state for a retried import and drops it without a second
receive."""

from __future__ import annotations

import asyncio

import pytest

from loopserve.distributed.handoff_order import HandoffInbox, HandoffReceiver
from loopserve.distributed.transport import KVDescriptor, KVTransportError
from loopserve.engine.handoff import HandoffState


def _descriptor(request_id: str, src: int, seq: int) -> KVDescriptor:
    state = HandoffState.__new__(HandoffState)  # only `request_id` is read here
    object.__setattr__(state, "request_id", request_id)
    return KVDescriptor(state, (1,), None, src, 9, seq)


class _Transport:
    """Records the operations in the order the receiver runs them; each yields to the loop
    (as the real receive in a worker thread does) so other callers interleave."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, int]] = []

    async def receive(self, item: KVDescriptor) -> str:
        await asyncio.sleep(0)
        self.log.append(("receive", item.src_rank, item.seq))
        return f"state of {item.request_id}"

    async def discard(self, item: KVDescriptor) -> None:
        await asyncio.sleep(0)
        self.log.append(("discard", item.src_rank, item.seq))


def _receiver(timeout_s: float = 5.0) -> tuple[HandoffReceiver, _Transport]:
    transport = _Transport()
    return HandoffReceiver(transport.receive, transport.discard, timeout_s), transport


def test_out_of_order_arrivals_are_received_in_send_order():
    async def main():
        receiver, transport = _receiver()
        calls = {}
        for seq in (2, 0, 3, 1):  # the arrival order of four concurrent hand-offs
            calls[seq] = asyncio.ensure_future(receiver.take(_descriptor(f"r{seq}", 0, seq)))
            await asyncio.sleep(0.01)  # each one arrives while the earlier ones wait
        results = {seq: await call for seq, call in calls.items()}
        return receiver, transport, results

    receiver, transport, results = asyncio.run(main())
    assert transport.log == [("receive", 0, 0), ("receive", 0, 1), ("receive", 0, 2), ("receive", 0, 3)]  # fmt: skip
    assert results == {seq: f"state of r{seq}" for seq in range(4)}
    assert receiver.next_seq(0) == 4 and receiver.num_held() == 0


def test_number_two_waits_until_one_arrives():
    async def main():
        receiver, transport = _receiver()
        later = asyncio.ensure_future(receiver.take(_descriptor("r2", 0, 2)))
        await receiver.take(_descriptor("r0", 0, 0))
        await asyncio.sleep(0.02)
        waiting = (not later.done(), list(transport.log), receiver.num_held())
        await receiver.take(_descriptor("r1", 0, 1))
        await later
        return waiting, transport

    (still_waiting, log_then, held_then), transport = asyncio.run(main())
    assert still_waiting and log_then == [("receive", 0, 0)] and held_then == 1
    assert [seq for _, _, seq in transport.log] == [0, 1, 2]


def test_a_discard_in_the_middle_keeps_the_order():
    async def main():
        receiver, transport = _receiver()
        tasks = [
            asyncio.ensure_future(receiver.take(_descriptor("r2", 0, 2))),
            asyncio.ensure_future(receiver.drop(_descriptor("r1", 0, 1))),  # aborted in flight
            asyncio.ensure_future(receiver.take(_descriptor("r0", 0, 0))),
        ]
        results = await asyncio.gather(*tasks)
        return transport, results

    transport, results = asyncio.run(main())
    assert transport.log == [("receive", 0, 0), ("discard", 0, 1), ("receive", 0, 2)]
    assert results == ["state of r2", None, "state of r0"]


def test_sources_are_ordered_independently():
    async def main():
        receiver, transport = _receiver()
        blocked = asyncio.ensure_future(receiver.take(_descriptor("a1", 0, 1)))  # waits for a0
        other = await receiver.take(_descriptor("b0", 1, 0))  # source 1 is not held up
        await asyncio.sleep(0.01)
        return blocked.done(), other, transport, receiver, blocked

    blocked_done, other, transport, receiver, blocked = asyncio.run(main())
    assert not blocked_done and other == "state of b0"
    assert transport.log == [("receive", 1, 0)]
    assert (receiver.next_seq(0), receiver.next_seq(1)) == (0, 1)


def test_a_duplicate_or_passed_number_is_refused():
    async def main():
        receiver, _ = _receiver()
        await receiver.take(_descriptor("r0", 0, 0))
        with pytest.raises(KVTransportError, match="already received"):
            await receiver.take(_descriptor("r0-again", 0, 0))
        waiting = asyncio.ensure_future(receiver.take(_descriptor("r2", 0, 2)))
        await asyncio.sleep(0.01)
        with pytest.raises(KVTransportError, match="already received, discarded or queued"):
            await receiver.take(_descriptor("r2-again", 0, 2))
        waiting.cancel()

    asyncio.run(main())


def test_a_missing_predecessor_times_out_and_the_waiter_is_discarded_in_its_turn():
    async def main():
        receiver, transport = _receiver(timeout_s=0.05)
        with pytest.raises(KVTransportError, match="waited 0.05 s for number 0 from that rank"):
            await receiver.take(_descriptor("r1", 0, 1))
        # The predecessor shows up late: both leave the wire, the timed-out one as a discard.
        late = await asyncio.wait_for(receiver.take(_descriptor("r0", 0, 0)), 1.0)
        await asyncio.sleep(0.01)
        return transport, late, receiver

    transport, late, receiver = asyncio.run(main())
    assert late == "state of r0"
    assert transport.log == [("receive", 0, 0), ("discard", 0, 1)]
    assert receiver.next_seq(0) == 2 and receiver.num_held() == 0


def test_dropping_a_timed_out_or_passed_hand_off_again_is_a_no_op():
    async def main():
        receiver, transport = _receiver(timeout_s=0.05)
        with pytest.raises(KVTransportError, match="waited"):
            await receiver.take(_descriptor("r1", 0, 1))
        await receiver.drop(_descriptor("r1", 0, 1))  # the server gives up on it too
        await receiver.take(_descriptor("r0", 0, 0))
        await asyncio.sleep(0.01)
        await receiver.drop(_descriptor("r0", 0, 0))  # already imported: nothing to do
        return transport, receiver

    transport, receiver = asyncio.run(main())
    assert transport.log == [("receive", 0, 0), ("discard", 0, 1)]
    assert receiver.next_seq(0) == 2 and receiver.num_held() == 0


def test_a_transport_error_reaches_its_caller_and_the_order_moves_on():
    async def main():
        transport = _Transport()

        async def failing_receive(item: KVDescriptor) -> str:
            if item.seq == 0:
                raise KVTransportError("receive timed out")
            return await transport.receive(item)

        receiver = HandoffReceiver(failing_receive, transport.discard, 5.0)
        with pytest.raises(KVTransportError, match="receive timed out"):
            await receiver.take(_descriptor("r0", 0, 0))
        return await receiver.take(_descriptor("r1", 0, 1)), receiver

    second, receiver = asyncio.run(main())
    assert second == "state of r1" and receiver.next_seq(0) == 2


class _Endpoint:
    """A torch endpoint stand-in with the blocking calls `HandoffInbox` runs in a thread."""

    kind = "torch"
    timeout_s = 5.0

    def __init__(self) -> None:
        self.received: list[int] = []
        self.discarded: list[int] = []

    def receive(self, item: KVDescriptor) -> str:
        self.received.append(item.seq)
        return f"state of {item.request_id}"

    def discard_many(self, items: list[KVDescriptor]) -> None:
        self.discarded.extend(item.seq for item in items)


def test_inbox_keeps_a_received_state_for_the_retry_and_drops_without_receiving_twice():
    async def main():
        endpoint = _Endpoint()
        inbox = HandoffInbox(endpoint)  # type: ignore[arg-type]
        first = await inbox.take(_descriptor("a", 0, 0))
        retried = await inbox.take(_descriptor("a", 0, 0))  # the engine refused it once
        inbox.imported("a")
        await inbox.take(_descriptor("b", 0, 1))
        await inbox.drop(_descriptor("b", 0, 1))  # refused, then given up: already received
        await inbox.drop(_descriptor("c", 0, 2))  # never received: discarded in its turn
        return endpoint, first, retried

    endpoint, first, retried = asyncio.run(main())
    assert first == retried == "state of a"
    assert endpoint.received == [0, 1] and endpoint.discarded == [2]


def test_inbox_refuses_a_replica_without_a_point_to_point_endpoint():
    class _Ray:
        kind = "ray"

    with pytest.raises(KVTransportError, match="without a point-to-point KV transport"):
        HandoffInbox(_Ray())  # type: ignore[arg-type]
