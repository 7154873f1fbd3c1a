"""`TorchDistTransport`: hand-off K/V point to point over one `torch.distributed` group.

The "torch" kind of `loopserve.distributed.transport` (its docstring states the contract:
pairing by per-pair sequence numbers, timeouts, failure). This room owns the process group
membership of one replica, the `isend`s it has posted and not yet seen complete (a waiter
thread completes them in order, so counting never blocks), and the `irecv`s of a batch of
descriptors. Gloo on CPU, NCCL on CUDA, one code path; only gloo has run.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loopserve.distributed.transport import (
    KVDescriptor,
    KVTransport,
    KVTransportError,
    NixlSpec,
    RayObjectStoreTransport,
    TorchDistSpec,
    TransportStats,
    tensor_num_bytes,
)
from loopserve.engine.handoff import HandoffState
from loopserve.errors import ConfigError

logger = logging.getLogger(__name__)

_WARM_UP_TAG = 2**31 - 1  # hand-off tags count up from 0


@dataclass(slots=True)
class _PendingSend:
    work: Any  # torch.distributed.Work
    tensor: Any  # kept alive until the send completes
    destination: int
    seq: int
    request_id: str
    deadline_s: float
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: str | None = None  # set by the waiter thread before `done`


class TorchDistTransport(KVTransport):
    """K/V point to point over `torch.distributed` (gloo on CPU, NCCL on CUDA)."""

    kind = "torch"
    wants_device_kv = True

    def __init__(self, spec: TorchDistSpec, rank: int) -> None:
        import torch
        import torch.distributed as dist

        super().__init__(rank)
        if dist.is_initialized():
            raise KVTransportError("this process already belongs to a torch.distributed group")
        self.timeout_s = spec.timeout_s
        self._timeout = datetime.timedelta(seconds=spec.timeout_s)
        kwargs: dict[str, Any] = {}
        if spec.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            kwargs["device_id"] = self.device  # eager communicator creation
        else:
            self.device = torch.device("cpu")  # gloo sends host memory
        dist.init_process_group(
            spec.backend,
            init_method=spec.init_method,
            rank=rank,
            world_size=spec.world_size,
            timeout=self._timeout,
            **kwargs,
        )
        self._next_seq: dict[int, int] = {}
        self._expected_seq: dict[int, int] = {}
        self.backend = spec.backend
        self._pending: list[_PendingSend] = []
        self._failure: str | None = None
        self._closed = False
        self._warm_up(spec.senders, spec.receivers)
        self._waits: queue.SimpleQueue[_PendingSend | None] = queue.SimpleQueue()
        threading.Thread(target=self._wait_sends, name="kv-send-waiter", daemon=True).start()

    def _wait_sends(self) -> None:
        """The waiter thread: completes pending sends in the order posted, so that `reap`
        can count them without blocking."""
        while (pending := self._waits.get()) is not None:
            try:
                self._complete(pending.work, pending.deadline_s)
            except (RuntimeError, TimeoutError) as err:
                pending.error = str(err)
            pending.done.set()

    def _complete(self, work: Any, deadline_s: float) -> None:
        """Block the calling thread until `work` is done; raises RuntimeError or TimeoutError.
        Gloo reports an operation complete only once someone waits on it, and a wait that
        times out poisons the whole group, so no polling with short timeouts: one wait(),
        bounded by the group's timeout. NCCL's wait() would only make the current CUDA stream
        wait: poll the work's event instead, up to `deadline_s`."""
        if self.backend == "gloo":
            work.wait()
            return
        while not work.is_completed():
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"not done within {self.timeout_s} s")
            time.sleep(0.0005)

    def _warm_up(self, senders: Sequence[int], receivers: Sequence[int]) -> None:
        """One tiny blocking message over every sender -> receiver pair, pairs in one global
        order (so no two ranks wait on each other): NCCL creates a pair's communicator on its
        first message, blocking both sides, which must not happen inside `send`."""
        import torch
        import torch.distributed as dist

        probe = torch.zeros(1, device=self.device)
        for src in senders:
            for dst in receivers:
                if self.rank == src:
                    dist.send(probe, dst=dst, tag=_WARM_UP_TAG)
                elif self.rank == dst:
                    dist.recv(probe, src=src, tag=_WARM_UP_TAG)

    def check_usable(self) -> None:
        if self._closed:
            raise KVTransportError("the kv transport is closed")
        if self._failure is not None:
            raise KVTransportError(f"the kv transport failed earlier: {self._failure}")

    def _fail(self, message: str) -> KVTransportError:
        if self._failure is None:
            self._failure = message
            logger.error("kv transport rank %d: %s", self.rank, message)
        return KVTransportError(message)

    def send(self, state: HandoffState, destination: int) -> KVDescriptor:
        import torch.distributed as dist

        self.check_usable()
        self.reap()
        self.check_usable()
        if destination == self.rank:
            raise KVTransportError(f"rank {self.rank} cannot hand off to itself")
        kv = state.kv.to(self.device).contiguous()  # type: ignore[attr-defined]
        seq = self._next_seq.get(destination, 0)
        self._next_seq[destination] = seq + 1
        try:
            work = dist.isend(kv, dst=destination, tag=seq)
        except RuntimeError as err:  # e.g. the peer's connection is gone (gloo)
            raise self._fail(f"posting hand-off {state.request_id!r} failed: {err}") from err
        deadline_s = time.monotonic() + self.timeout_s
        pending = _PendingSend(work, kv, destination, seq, state.request_id, deadline_s)
        self._pending.append(pending)
        self._waits.put(pending)
        return KVDescriptor(
            dataclasses.replace(state, kv=None),
            tuple(kv.shape),
            kv.dtype,
            self.rank,
            destination,
            seq,
        )

    def _receive(self, items: Sequence[HandoffState | KVDescriptor]) -> list[HandoffState]:
        import torch
        import torch.distributed as dist

        self.check_usable()
        expected = dict(self._expected_seq)
        for item in items:  # check the whole batch before posting anything
            if not isinstance(item, KVDescriptor):
                raise KVTransportError(
                    f"hand-off {item.request_id!r} is not a torch transport descriptor"
                )
            if item.dst_rank != self.rank:
                raise KVTransportError(
                    f"hand-off {item.request_id!r} is addressed to rank {item.dst_rank}, "
                    f"not {self.rank}"
                )
            want = expected.get(item.src_rank, 0)
            if item.seq != want:
                raise KVTransportError(
                    f"hand-off {item.request_id!r} is number {item.seq} from rank "
                    f"{item.src_rank}, but number {want} is next: hand-offs from one replica "
                    "must be received or discarded in the order they were sent"
                )
            expected[item.src_rank] = want + 1
        posted = []
        for item in items:
            buffer = torch.empty(item.shape, dtype=item.dtype, device=self.device)
            posted.append((item, buffer, dist.irecv(buffer, src=item.src_rank, tag=item.seq)))
        self._expected_seq = expected
        states = []
        for item, buffer, work in posted:
            try:
                self._complete(work, time.monotonic() + self.timeout_s)
            except (RuntimeError, TimeoutError) as err:
                raise self._fail(
                    f"receiving hand-off {item.request_id!r} (number {item.seq} from rank "
                    f"{item.src_rank}) failed: {err}"
                ) from err
            states.append(dataclasses.replace(item.state, kv=buffer))
        return states

    def reap(self) -> None:
        """Count completed sends; fail on a send that errored or outlived `timeout_s`."""
        now, still = time.monotonic(), []
        for pending in self._pending:
            if pending.done.is_set():
                if pending.error is not None:
                    self._fail(self._describe(pending, f"failed: {pending.error}"))
                else:
                    self._count(num_sent=1, bytes_sent=tensor_num_bytes(pending.tensor))
            else:
                if now > pending.deadline_s:
                    self._fail(self._describe(pending, f"not received in {self.timeout_s} s"))
                still.append(pending)
        self._pending = still

    def _describe(self, pending: _PendingSend, what: str) -> str:
        return (
            f"sending hand-off {pending.request_id!r} (number {pending.seq} to rank "
            f"{pending.destination}) {what}"
        )

    def stats(self) -> TransportStats:
        if not self._closed:
            self.reap()
        return dataclasses.replace(
            self._counts, num_pending_sends=len(self._pending), failure=self._failure
        )

    def flush(self, timeout_s: float) -> TransportStats:
        deadline = time.monotonic() + timeout_s
        for pending in self._pending:
            pending.done.wait(max(0.0, deadline - time.monotonic()))
        self.reap()
        for pending in self._pending:
            self._fail(self._describe(pending, f"still pending after a {timeout_s} s flush"))
        return self.stats()

    def close(self) -> None:
        import torch.distributed as dist

        if self._closed:
            return
        if self._pending and self._failure is None:
            self.flush(self.timeout_s)
        self._closed = True
        self._waits.put(None)  # the waiter ends after the wait it is in (bounded)
        if self._pending and dist.get_backend() == "nccl":
            # A pending NCCL send would make a clean destroy wait for its peer.
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
        self._pending = []


def make_kv_transport(
    kind: str, rank: int, spec: TorchDistSpec | NixlSpec | None = None
) -> KVTransport:
    """The endpoint of one replica (runs inside the replica's process); `spec` is the
    group's `TorchDistSpec` (torch) or `NixlSpec` (nixl)."""
    if kind == "ray":
        return RayObjectStoreTransport(rank)
    if kind == "torch":
        assert isinstance(spec, TorchDistSpec), "the torch transport needs a TorchDistSpec"
        return TorchDistTransport(spec, rank)
    if kind == "nixl":
        from loopserve.distributed.nixl_transport import NixlTransport

        assert isinstance(spec, NixlSpec), "the nixl transport needs a NixlSpec"
        return NixlTransport(spec, rank)
    raise ConfigError(f"unknown kv transport {kind!r}: choose ray, torch or nixl")
