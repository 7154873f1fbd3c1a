"""KV transports for the prefill/decode hand-off: how a `HandoffState`'s K/V bytes get from a
prefill replica to a decode replica.

One `KVTransport` endpoint lives in each replica (`EngineReplica.handoff.kv_transport`). The prefill
side calls `send(state, destination)` and gets back what the driver passes on through Ray
(a Ray actor call or object ref); the decode side calls `receive_many(items)` on those and
gets `HandoffState`s with their K/V to import, or `discard_many(items)` for hand-offs it
drops (an aborted request): a dropped hand-off must still be discarded so the bytes pair up.

- `RayObjectStoreTransport` ("ray", the default): the K/V tensor stays in the state and rides
  in Ray's object store with the metadata. `send` and `receive` only count bytes.
- `TorchDistTransport` ("torch", in `torch_transport`): every replica of the hand-off joins
  one `torch.distributed` process group (one rank per replica; TCP rendezvous on rank 0's
  node, at a port free there; `nccl` when the replicas run on CUDA, `gloo` on CPU: the same
  code; NCCL needs each rank on its own GPU). `send` posts a
  point-to-point `isend` of the K/V tensor (on CUDA straight from device memory: the replica
  exports with `to_host=False`) and returns a `KVDescriptor` (the state with `kv=None`, the
  shape, dtype, ranks and a sequence number); the descriptor goes through Ray, and the decode
  side posts `irecv`s into fresh buffers on its device and waits for them.
- `NixlTransport` ("nixl", in `nixl_transport`): `send` registers the K/V with NIXL and
  returns a `KVDescriptor` whose `source` says where it lies; the decode side reads it
  (UCX), and the read's notification releases the sender's copy. No group to join, no
  ordering needed (the numbering is kept so the decode side's inbox serves both kinds).

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
them after the group's timeout. Under gloo a wait that times out also fails every other
pending operation of the group (gloo signals the timeout to all its connections).

`connect_kv_transport` is the driver's side: it sets up one endpoint per replica actor (rank =
position in the list) and returns a `KVTransportGroup` to look up ranks, read stats and close.
Only the CPU/gloo path has run; NCCL is written to the same API but untested. This module
imports neither torch nor Ray at load time (the CLI reads `KV_TRANSPORTS`).
"""

from __future__ import annotations

import dataclasses
import socket
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loopserve.engine.handoff import HandoffState
from loopserve.errors import ConfigError, LoopserveError

KV_TRANSPORTS = ("ray", "torch", "nixl", "auto")
# Kinds whose hand-offs travel apart from the state (a `KVDescriptor` goes through Ray).
POINT_TO_POINT = frozenset({"torch", "nixl"})
DEFAULT_TIMEOUT_S = 120.0


class KVTransportError(LoopserveError, RuntimeError):
    """A hand-off's K/V could not be moved; the endpoint is unusable until rebuilt."""


def resolve_kv_transport(name: str, device: str) -> str:
    """The transport a flag value names, "ray", "torch" or "nixl"; `auto` is torch (NCCL)
    on CUDA, else ray."""
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
    an `irecv` of `shape`/`dtype` from `src_rank` with tag `seq` (torch), or reads it from
    `source` (nixl: a `NixlSource`). `seq` counts per (source, destination) pair."""

    state: HandoffState
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype
    src_rank: int
    dst_rank: int
    seq: int
    source: Any = None

    @property
    def request_id(self) -> str:
        return self.state.request_id


def tensor_num_bytes(tensor: Any) -> int:
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
        self._count(
            num_received=len(states), bytes_received=sum(tensor_num_bytes(s.kv) for s in states)
        )
        return states

    def receive(self, item: HandoffState | KVDescriptor) -> HandoffState:
        return self.receive_many([item])[0]

    def discard_many(self, items: Sequence[HandoffState | KVDescriptor]) -> None:
        """Drop hand-offs that will not be imported (aborted requests), after receiving their
        bytes so that later hand-offs from the same sender still pair up."""
        states = self._receive(items)
        self._count(
            num_discarded=len(states), bytes_received=sum(tensor_num_bytes(s.kv) for s in states)
        )

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
        self._count(num_sent=1, bytes_sent=tensor_num_bytes(state.kv))
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


@dataclass(frozen=True, slots=True)
class NixlSpec:
    """What every replica of one NIXL group shares: its name (an agent is named after it and
    its rank) and the read timeout."""

    group: str
    timeout_s: float = DEFAULT_TIMEOUT_S


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
    for hand-offs from the ranks in `senders` to those in `receivers`. `kind` is "ray",
    "torch" or "nixl" (resolve flag values with `resolve_kv_transport` first). Blocks until every
    replica joined (torch: the rendezvous, bounded by `timeout_s`)."""
    import ray

    spec: Any = None
    if kind == "nixl":
        import uuid

        spec = NixlSpec(uuid.uuid4().hex[:12], timeout_s)
    elif kind == "torch":
        init_method = ray.get(replicas[0].kv_transport_address.remote())
        backend = "nccl" if on_cuda else "gloo"
        spec = TorchDistSpec(
            init_method, len(replicas), backend, timeout_s, tuple(senders), tuple(receivers)
        )
    elif kind != "ray":
        raise ConfigError(f"unknown kv transport {kind!r}: choose ray, torch or nixl")
    joins = [
        replica.setup_kv_transport.remote(kind, rank, spec) for rank, replica in enumerate(replicas)
    ]
    ray.get(joins, timeout=timeout_s + 30.0)  # each join is bounded by the group's timeout
    return KVTransportGroup(kind, replicas, timeout_s)
