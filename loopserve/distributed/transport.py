"""KV transports for the prefill/decode hand-off: how a `HandoffState`'s K/V bytes get from a
prefill replica to a decode replica.

One `KVTransport` endpoint lives in each replica (`EngineReplica.kv_transport`). The prefill
side calls `send(state, destination)` and gets back what the driver passes on through Ray
(a Ray actor call or object ref); the decode side calls `receive_many(items)` on those and
gets `HandoffState`s with their K/V to import, or `discard_many(items)` for hand-offs it
drops (an aborted request): a dropped hand-off must still be discarded so the bytes pair up.

- `RayObjectStoreTransport` ("ray", the default): the K/V tensor stays in the state and rides
  in Ray's object store with the metadata. `send` and `receive` only count bytes.
- `TorchDistTransport` ("torch"): every replica of the hand-off joins one `torch.distributed`
  process group (one rank per replica; TCP rendezvous on rank 0's node, at a port free there;
  `nccl` when the replicas run on CUDA, `gloo` on CPU: the same code). `send` posts a
  point-to-point `isend` of the K/V tensor (on CUDA straight from device memory: the replica
  exports with `to_host=False`) and returns a `KVDescriptor` (the state with `kv=None`, the
  shape, dtype, ranks and a sequence number); the descriptor goes through Ray, and the decode
  side posts `irecv`s into fresh buffers on its device and waits for them.

Pairing: sends from one rank to another are numbered 0, 1, 2, ... (the number is also the
gloo tag); a receiver must receive (or discard) one source's descriptors in that order and
raises `KVTransportError` otherwise. NCCL ignores tags and matches point-to-point messages in
order per pair, so the rule is what keeps NCCL correct; gloo follows the same rule so CPU runs
check it. Timeouts: every wait is bounded by `timeout_s` (the group's timeout too). A receive
that times out, or a send not received within `timeout_s` of being posted (checked by `reap`,
which every `send`, `stats` and `flush` run, and by `flush`), marks the endpoint failed: the
order of its pairs is lost, so later calls raise `KVTransportError` naming the first failure,
and the group must be rebuilt (close on every replica, connect again). `close` waits at most
`timeout_s` for pending sends, then destroys the group (aborts it on NCCL when sends are still
pending), so nothing waits forever. A decode replica that dies closes its sockets: under gloo
the prefill side's pending sends and receives fail at once; under NCCL the watchdog aborts
them after the group's timeout.

`connect_kv_transport` is the driver's side: it sets up one endpoint per replica actor (rank =
position in the list) and returns a `KVTransportGroup` to look up ranks, read stats and close.
Only the CPU/gloo path has run; NCCL is written to the same API but untested. This module
imports neither torch nor Ray at load time (the CLI reads `KV_TRANSPORTS`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import queue
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loopserve.distributed.handoff import HandoffState
from loopserve.errors import ConfigError, LoopserveError

logger = logging.getLogger(__name__)

KV_TRANSPORTS = ("ray", "torch", "auto")
DEFAULT_TIMEOUT_S = 120.0
_WARM_UP_TAG = 2**31 - 1  # hand-off tags count up from 0


class KVTransportError(LoopserveError, RuntimeError):
    """A hand-off's K/V could not be moved; the endpoint is unusable until rebuilt."""


def resolve_kv_transport(name: str, device: str) -> str:
    """ "ray" or "torch" for a flag value; `auto` is torch (NCCL) on CUDA, else ray."""
    if name not in KV_TRANSPORTS:
        raise ConfigError(
            f"unknown kv_transport {name!r}: choose one of {', '.join(KV_TRANSPORTS)}"
        )
    if name == "auto":
        return "torch" if device.startswith("cuda") else "ray"
    return name


@dataclass(frozen=True, slots=True)
class TransportStats:
    """Counters of one endpoint. Bytes count K/V tensors only: for "ray" the bytes put into
    (sent) and read from (received) the object store, for "torch" the bytes of completed
    point-to-point sends and receives. Discarded hand-offs are received, then dropped."""

    kind: str
    rank: int
    num_sent: int = 0
    num_received: int = 0
    num_discarded: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    num_pending_sends: int = 0
    failure: str | None = None


@dataclass(frozen=True, slots=True)
class KVDescriptor:
    """A hand-off whose K/V travels point to point: `state` has `kv=None`; the receiver posts
    an `irecv` of `shape`/`dtype` from `src_rank` with tag `seq`."""

    state: HandoffState
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype
    src_rank: int
    dst_rank: int
    seq: int

    @property
    def request_id(self) -> str:
        return self.state.request_id


def _num_bytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


class KVTransport(ABC):
    """One replica's endpoint; see the module docstring for the contract."""

    kind: str
    # Whether the prefill side should export the K/V on its device (`to_host=False`).
    wants_device_kv: bool = False

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._counts = TransportStats(self.kind, rank)

    def _count(self, **deltas: int) -> None:
        current = self._counts
        self._counts = dataclasses.replace(
            current, **{name: getattr(current, name) + delta for name, delta in deltas.items()}
        )

    @abstractmethod
    def send(self, state: HandoffState, destination: int) -> HandoffState | KVDescriptor:
        """Start moving `state` to the replica of rank `destination`; returns what to pass on."""

    @abstractmethod
    def _receive(self, items: Sequence[HandoffState | KVDescriptor]) -> list[HandoffState]:
        """The states of `items` with their K/V; counts nothing."""

    def receive_many(self, items: Sequence[HandoffState | KVDescriptor]) -> list[HandoffState]:
        """The states of `items` (in order), each with its K/V on this replica's device."""
        states = self._receive(items)
        self._count(num_received=len(states), bytes_received=sum(_num_bytes(s.kv) for s in states))
        return states

    def receive(self, item: HandoffState | KVDescriptor) -> HandoffState:
        return self.receive_many([item])[0]

    def discard_many(self, items: Sequence[HandoffState | KVDescriptor]) -> None:
        """Drop hand-offs that will not be imported (aborted requests), after receiving their
        bytes so that later hand-offs from the same sender still pair up."""
        states = self._receive(items)
        self._count(num_discarded=len(states), bytes_received=sum(_num_bytes(s.kv) for s in states))

    def check_usable(self) -> None:  # noqa: B027 (always usable by default)
        """Raise `KVTransportError` if `send` would refuse (a failed or closed endpoint)."""

    def stats(self) -> TransportStats:
        return self._counts

    def flush(self, timeout_s: float) -> TransportStats:
        """Wait up to `timeout_s` for pending sends; the stats after."""
        return self.stats()

    def close(self) -> None:  # noqa: B027 (nothing to release by default)
        """Release the endpoint (idempotent)."""


class RayObjectStoreTransport(KVTransport):
    """The K/V rides inside the state, through Ray's object store (CPU tensors)."""

    kind = "ray"

    def send(self, state: HandoffState, destination: int) -> HandoffState:
        kv = state.kv
        if kv.device.type != "cpu":  # type: ignore[attr-defined]
            state = dataclasses.replace(state, kv=kv.cpu())  # type: ignore[attr-defined]
        self._count(num_sent=1, bytes_sent=_num_bytes(state.kv))
        return state

    def _receive(self, items: Sequence[HandoffState | KVDescriptor]) -> list[HandoffState]:
        for item in items:
            if not isinstance(item, HandoffState) or item.kv is None:
                raise KVTransportError(
                    f"hand-off {item.request_id!r} carries no K/V: it was sent by another "
                    "transport than this replica's (ray)"
                )
        return list(items)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class TorchDistSpec:
    """How every replica of one group joins it (the same for all ranks)."""

    init_method: str  # tcp://host:port of rank 0
    world_size: int
    backend: str  # "gloo" | "nccl"
    timeout_s: float = DEFAULT_TIMEOUT_S
    senders: tuple[int, ...] = ()  # ranks that send hand-offs (prefill replicas)
    receivers: tuple[int, ...] = ()  # ranks that receive them (decode replicas)


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


def free_rendezvous_address() -> str:
    """`tcp://ip:port` on this node: its Ray node address (loopback outside Ray) and a port
    free now (a tiny race with other programs binding it before rank 0 does)."""
    host = "127.0.0.1"
    try:
        import ray

        if ray.is_initialized():
            host = ray.util.get_node_ip_address()
    except ImportError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    return f"tcp://{host}:{port}"


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
        work = dist.isend(kv, dst=destination, tag=seq)
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
                    self._count(num_sent=1, bytes_sent=_num_bytes(pending.tensor))
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


def make_kv_transport(kind: str, rank: int, spec: TorchDistSpec | None = None) -> KVTransport:
    """The endpoint of one replica (runs inside the replica's process)."""
    if kind == "ray":
        return RayObjectStoreTransport(rank)
    if kind == "torch":
        assert spec is not None, "the torch transport needs a TorchDistSpec"
        return TorchDistTransport(spec, rank)
    raise ConfigError(f"unknown kv transport {kind!r}: choose ray or torch")


class KVTransportGroup:
    """The driver's handle on the endpoints of a list of replica actors (rank = index)."""

    def __init__(self, kind: str, replicas: Sequence[Any], timeout_s: float) -> None:
        self.kind = kind
        self.replicas = list(replicas)
        self.timeout_s = timeout_s

    def rank_of(self, replica_index: int) -> int:
        return replica_index

    def stats(self) -> list[TransportStats]:
        import ray

        return ray.get([r.kv_transport_stats.remote() for r in self.replicas])

    def flush(self, replica_indices: Sequence[int] | None = None) -> list[TransportStats]:
        """Wait (bounded) for the pending sends of these replicas (all by default)."""
        import ray

        indices = range(len(self.replicas)) if replica_indices is None else replica_indices
        return ray.get(
            [self.replicas[i].flush_kv_transport.remote(self.timeout_s) for i in indices]
        )

    def close(self) -> None:
        import ray

        refs = [r.close_kv_transport.remote() for r in self.replicas]
        ray.get(refs, timeout=self.timeout_s + 30.0)  # a close waits for pending sends


def connect_kv_transport(
    kind: str,
    replicas: Sequence[Any],
    *,
    senders: Sequence[int],
    receivers: Sequence[int],
    on_cuda: bool,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> KVTransportGroup:
    """Set up the endpoints of `replicas` (Ray actor handles of `EngineReplica`; rank = index)
    for hand-offs from the ranks in `senders` to those in `receivers`. `kind` is "ray" or
    "torch" (resolve flag values with `resolve_kv_transport` first). Blocks until every
    replica joined (torch: the rendezvous, bounded by `timeout_s`)."""
    import ray

    spec = None
    if kind == "torch":
        init_method = ray.get(replicas[0].kv_transport_address.remote())
        backend = "nccl" if on_cuda else "gloo"
        spec = TorchDistSpec(
            init_method, len(replicas), backend, timeout_s, tuple(senders), tuple(receivers)
        )
    elif kind != "ray":
        raise ConfigError(f"unknown kv transport {kind!r}: choose ray or torch")
    ray.get(
        [
            replica.setup_kv_transport.remote(kind, rank, spec)
            for rank, replica in enumerate(replicas)
        ]
    )
    return KVTransportGroup(kind, replicas, timeout_s)
