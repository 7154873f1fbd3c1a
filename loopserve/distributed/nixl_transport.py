"""`NixlTransport`: hand-off K/V read by the decode replica over NIXL (the "nixl" kind).

NIXL (`pip install -e '.[nixl]'`, NVIDIA's transfer library that vLLM's disaggregation uses)
moves registered memory between agents through a backend; this transport uses its UCX backend
(DRAM over TCP or shared memory on one machine; VRAM over RDMA or NVLink where UCX has them).
The contract is `loopserve.distributed.transport`'s; what differs from the torch transport:

- One NIXL agent per replica, named after the group and its rank. No rendezvous: a
  descriptor carries the sender's agent metadata as of that send (a few hundred bytes; it
  lists the memory registered, so it is taken after registering) and the serialized NIXL
  descriptors of the K/V, and the receiver loads that metadata before each read.
- `send` registers the exported K/V tensor with NIXL, keeps it, and returns a `KVDescriptor`
  whose `source` is a `NixlSource`; nothing moves yet. The decode replica's `receive` READs
  the bytes into a buffer of its own (registered for the read, deregistered after) and sends
  the sequence number as the transfer's notification; the sender releases the tensor when
  that notification arrives (`reap`, run by every `send`, `stats` and `flush`). `discard`
  reads nothing: it sends the notification alone, so the sender releases the tensor too.
- No ordering between hand-offs is needed (each read names its own memory), but the numbering
  is per (sender, receiver) pair as the torch transport's, so the decode side's
  `HandoffInbox` serves both kinds unchanged.
- Failures are per hand-off: a read that fails or does not finish within `timeout_s` raises
  `KVTransportError` for that hand-off (the pool then falls back to the object store, as
  for the torch transport), and the endpoint stays usable; a read from a sender whose
  process is gone fails. A sent tensor stays registered until its read or discard is
  notified, or the endpoint closes: it is never released on a timer, because over UCX a
  read of host memory that was deregistered and freed can still succeed and return
  whatever the memory holds now (seen here: a read after deregistration returned without
  error). So a decode replica that dies leaves its unread hand-offs' host copies on the
  prefill replica until the endpoint closes (`num_pending_sends` counts them).

Only DRAM has run (2 vCPUs, no GPU, NIXL 1.5.1 with torch 2.13 CPU): the prefill side exports
K/V to host memory (`wants_device_kv` False) and the receiver reads into host memory.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loopserve.distributed.transport import (
    KVDescriptor,
    KVTransport,
    KVTransportError,
    NixlSpec,
    TransportStats,
    tensor_num_bytes,
)
from loopserve.engine.handoff import HandoffState
from loopserve.errors import ConfigError

logger = logging.getLogger(__name__)

BACKEND = "UCX"
POLL_S = 0.0005  # between checks of a read's state


@dataclass(frozen=True, slots=True)
class NixlSource:
    """Where a hand-off's K/V lies: the sender's agent, its metadata (for `add_remote_agent`)
    and the serialized NIXL descriptors of the registered tensor."""

    agent: str
    metadata: bytes
    descs: bytes


@dataclass(slots=True)
class _Sent:
    kv: Any  # the registered tensor, kept alive until read or discarded
    registration: Any
    num_bytes: int


def load_nixl():
    """NIXL's agent and config classes; `ConfigError` naming the extra when absent."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as err:
        raise ConfigError(
            "the nixl KV transport needs NIXL: pip install -e '.[nixl]' (after torch)"
        ) from err
    return nixl_agent, nixl_agent_config


class NixlTransport(KVTransport):
    kind = "nixl"
    wants_device_kv = False  # only DRAM has run

    def __init__(self, spec: NixlSpec, rank: int) -> None:
        super().__init__(rank)
        nixl_agent, nixl_agent_config = load_nixl()
        self.timeout_s = spec.timeout_s
        self.name = f"loopserve-{spec.group}-{rank}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=[BACKEND]))
        self._sent: dict[tuple[int, int], _Sent] = {}  # (destination, seq) -> kept tensor
        self._next_seq: dict[int, int] = {}  # destination -> its next sequence number
        self._closed = False

    def check_usable(self) -> None:
        if self._closed:
            raise KVTransportError(f"the nixl KV transport of rank {self.rank} is closed")

    # ---- the sending side ----------------------------------------------------------------

    def send(self, state: HandoffState, destination: int) -> KVDescriptor:
        self.check_usable()
        self.reap()
        kv = state.kv.contiguous()  # type: ignore[attr-defined]
        try:
            registration = self.agent.register_memory(kv)
            descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs(kv))
            metadata = self.agent.get_agent_metadata()  # it names the registered memory
        except Exception as err:  # NIXL raises its own exception types
            raise KVTransportError(f"NIXL could not register {state.request_id!r}: {err}") from err
        seq = self._next_seq.get(destination, 0)
        self._next_seq[destination] = seq + 1
        self._sent[(destination, seq)] = _Sent(kv, registration, tensor_num_bytes(kv))
        self._count(num_sent=1)
        return KVDescriptor(
            dataclasses.replace(state, kv=None), tuple(kv.shape), kv.dtype, self.rank,
            destination, seq, source=NixlSource(self.name, metadata, descs),
        )  # fmt: skip

    def reap(self) -> None:
        """Release the tensors whose read (or discard) was notified."""
        if self._closed:
            return
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                destination, seq, read = message.decode().split(":")
                sent = self._sent.pop((int(destination), int(seq)), None)
                if sent is not None:
                    self._release(sent)
                    if read == "read":
                        self._count(bytes_sent=sent.num_bytes)

    def _release(self, sent: _Sent) -> None:
        self.agent.deregister_memory(sent.registration)

    def stats(self) -> TransportStats:
        self.reap()
        return dataclasses.replace(self._counts, num_pending_sends=len(self._sent))

    def flush(self, timeout_s: float) -> TransportStats:
        deadline = time.monotonic() + timeout_s
        while self._sent and time.monotonic() < deadline:
            self.reap()
            time.sleep(POLL_S * 10)
        return self.stats()

    def close(self) -> None:
        if self._closed:
            return
        for sent in self._sent.values():
            self._release(sent)
        self._sent.clear()
        self._closed = True

    # ---- the receiving side --------------------------------------------------------------

    def _receive(self, items: Sequence[HandoffState | KVDescriptor]) -> list[HandoffState]:
        return [self._read(self._source_of(item), item) for item in items]  # type: ignore[arg-type]

    def discard_many(self, items: Sequence[HandoffState | KVDescriptor]) -> None:
        """Tell each sender to release the K/V without reading it."""
        for item in items:
            source = self._source_of(item)
            self.agent.send_notif(source.agent, self._message(item, "discard"))  # type: ignore[arg-type]
        self._count(num_discarded=len(items))

    def _source_of(self, item: HandoffState | KVDescriptor) -> NixlSource:
        self.check_usable()
        source = getattr(item, "source", None)
        if not isinstance(source, NixlSource):
            raise KVTransportError(
                f"hand-off {item.request_id!r} was not sent by the nixl transport (this "
                "replica's); restarted since it was sent?"
            )
        # The sender's metadata as of this send (it lists the memory registered for it).
        self.agent.add_remote_agent(source.metadata)
        return source

    @staticmethod
    def _message(item: KVDescriptor, what: str) -> bytes:
        return f"{item.dst_rank}:{item.seq}:{what}".encode()

    def _read(self, source: NixlSource, item: KVDescriptor) -> HandoffState:
        import torch

        buffer = torch.empty(item.shape, dtype=item.dtype)
        registration = self.agent.register_memory(buffer)
        handle = None
        try:
            remote = self.agent.deserialize_descs(source.descs)
            local = self.agent.get_xfer_descs(buffer)
            handle = self.agent.initialize_xfer(
                "READ", local, remote, source.agent, self._message(item, "read")
            )
            status = self.agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while status not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise KVTransportError(
                        f"reading hand-off {item.request_id!r} from {source.agent} took more "
                        f"than {self.timeout_s} s"
                    )
                time.sleep(POLL_S)
                status = self.agent.check_xfer_state(handle)
            if status != "DONE":
                raise KVTransportError(f"NIXL could not read hand-off {item.request_id!r}")
        except KVTransportError:
            raise
        except Exception as err:  # NIXL's own errors: this hand-off is lost, not the endpoint
            raise KVTransportError(f"NIXL could not read {item.request_id!r}: {err}") from err
        finally:
            if handle is not None:
                self.agent.release_xfer_handle(handle)
            self.agent.deregister_memory(registration)
        return dataclasses.replace(item.state, kv=buffer)
