"""`HandoffReceiver` / `HandoffInbox`: a decode replica's receiving end of point-to-point
hand-offs in serving.

With the torch KV transport a prefill replica sends a request's K/V with `isend` and the
driver passes the descriptor (`KVDescriptor`: source rank, sequence number) to the decode
replica through a Ray call. Descriptors reach the decode replica in any order (each hand-off
is its own asyncio task in the driver and its own call here), but the transport must receive
(or discard) one source's hand-offs in the order they were sent (NCCL pairs point-to-point
messages in order per pair). This room restores that order: it holds a descriptor until every
earlier sequence number from its source was received or discarded, then runs the transport
operation, one at a time for the whole replica (the callables it is given run the transport;
the replica runs them in a worker thread so the event loop keeps streaming).

A caller waits at most `timeout_s` for its turn; a descriptor whose predecessors never arrive
is then turned into a discard (its K/V is still taken off the wire when its turn comes) and
the caller gets `KVTransportError`. A second `take` of a queued or already-passed sequence
number is refused with `KVTransportError`; `drop` of one is a no-op.

`HandoffInbox` puts a `HandoffReceiver` over one replica's KV transport endpoint (its receives
run in a worker thread) and keeps a received state until it is imported: an import the engine
refuses for now (queue full) is retried with the same descriptor, whose K/V cannot be received
twice. This module imports neither torch nor Ray.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from loopserve.distributed.transport import (
    DEFAULT_TIMEOUT_S,
    POINT_TO_POINT,
    KVDescriptor,
    KVTransport,
    KVTransportError,
)
from loopserve.engine.handoff import HandoffState

ReceiveFn = Callable[[KVDescriptor], Awaitable[Any]]  # -> the HandoffState with its K/V
DiscardFn = Callable[[KVDescriptor], Awaitable[None]]


@dataclass(slots=True)
class _Held:
    item: KVDescriptor
    discard: bool
    done: asyncio.Future[Any]


class HandoffReceiver:
    """Receives or discards descriptors in send order per source; see the module docstring."""

    def __init__(self, receive: ReceiveFn, discard: DiscardFn, timeout_s: float) -> None:
        self._receive = receive
        self._discard = discard
        self.timeout_s = timeout_s
        self._next_seq: dict[int, int] = {}  # source rank -> the sequence number due next
        self._held: dict[int, dict[int, _Held]] = {}  # source rank -> seq -> waiting item
        self._draining: set[int] = set()  # sources whose drain task runs
        self._lock = asyncio.Lock()  # one transport operation at a time
        self._tasks: set[asyncio.Task[None]] = set()

    def num_held(self) -> int:
        """Descriptors waiting for their turn (or running)."""
        return sum(len(held) for held in self._held.values())

    def next_seq(self, source: int) -> int:
        return self._next_seq.get(source, 0)

    async def take(self, item: KVDescriptor) -> Any:
        """The hand-off's state with its K/V, once every earlier one from its source is done."""
        return await self._enqueue(item, discard=False)

    async def drop(self, item: KVDescriptor) -> None:
        """Receive and drop the hand-off's K/V in its turn (an aborted request); returns
        once done. Idempotent: a hand-off already off the wire, or one whose `take` timed out
        (it is dropped in its turn anyway), needs nothing more."""
        source, seq = item.src_rank, item.seq
        entry = self._held.get(source, {}).get(seq)
        if seq < self.next_seq(source) or (entry is not None and entry.discard):
            return
        await self._enqueue(item, discard=True)

    async def _enqueue(self, item: KVDescriptor, *, discard: bool) -> Any:
        source, seq = item.src_rank, item.seq
        held = self._held.setdefault(source, {})
        if seq < self.next_seq(source) or seq in held:
            raise KVTransportError(
                f"hand-off {item.request_id!r} (number {seq} from rank {source}) was already "
                "received, discarded or queued"
            )
        entry = _Held(item, discard, asyncio.get_running_loop().create_future())
        held[seq] = entry
        self._start_drain(source)
        try:
            return await asyncio.wait_for(asyncio.shield(entry.done), self.timeout_s)
        except asyncio.TimeoutError:
            if held.get(seq) is entry:  # not started: still take its bytes off the wire later
                entry.discard = True
            entry.done.add_done_callback(_retrieve)  # nobody awaits it any more
            raise KVTransportError(
                f"hand-off {item.request_id!r} (number {seq} from rank {source}) waited "
                f"{self.timeout_s} s for number {self.next_seq(source)} from that rank"
            ) from None

    def _start_drain(self, source: int) -> None:
        if source in self._draining or self.next_seq(source) not in self._held[source]:
            return
        self._draining.add(source)
        task = asyncio.ensure_future(self._drain(source))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, source: int) -> None:
        """Run the due items of `source` in order while the next one is here."""
        held = self._held[source]
        try:
            while (seq := self.next_seq(source)) in held:
                entry = held[seq]
                async with self._lock:
                    discard = entry.discard  # read under the lock: a timed-out waiter flips it
                    try:
                        if discard:
                            await self._discard(entry.item)
                            result = None
                        else:
                            result = await self._receive(entry.item)
                    except Exception as err:  # the transport failed: tell the waiter
                        if not entry.done.done():
                            entry.done.set_exception(err)
                    else:
                        if not entry.done.done():
                            entry.done.set_result(result)
                del held[seq]
                self._next_seq[source] = seq + 1
        finally:
            self._draining.discard(source)


def _retrieve(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()  # marks a late error as seen (asyncio logs unseen ones)


class HandoffInbox:
    """One replica's received point-to-point hand-offs; see the module docstring."""

    def __init__(self, transport: KVTransport) -> None:
        if transport.kind not in POINT_TO_POINT:
            raise KVTransportError(
                "a point-to-point hand-off reached a replica without a point-to-point KV "
                "transport "
                "(restarted since it was sent?)"
            )

        async def receive(item: KVDescriptor) -> HandoffState:
            return await asyncio.to_thread(transport.receive, item)

        async def discard(item: KVDescriptor) -> None:
            await asyncio.to_thread(transport.discard_many, [item])

        self.receiver = HandoffReceiver(
            receive, discard, getattr(transport, "timeout_s", DEFAULT_TIMEOUT_S)
        )
        self._received: dict[str, HandoffState] = {}  # received, not yet imported

    async def take(self, item: KVDescriptor) -> HandoffState:
        """The state of `item` with its K/V: kept from an earlier attempt, or received in its
        turn; kept until `imported` or `drop`."""
        kept = self._received.get(item.request_id)
        if kept is not None:
            return kept
        state = await self.receiver.take(item)
        self._received[item.request_id] = state
        return state

    def imported(self, request_id: str) -> None:
        self._received.pop(request_id, None)

    async def drop(self, item: KVDescriptor) -> None:
        """Forget a received state, or receive and discard the K/V of `item` in its turn."""
        if self._received.pop(item.request_id, None) is None:
            await self.receiver.drop(item)
