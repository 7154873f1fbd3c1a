"""`PDReplicaPool`: prefill/decode disaggregation behind the `AsyncLLM` interface (`--pd`).

A `ReplicaPool` whose replicas have roles: P prefill replicas (indices 0..P-1) and Q decode
replicas (P..P+Q-1). A submission goes to one prefill replica (the router's policy among the
serving prefill replicas: least outstanding tokens, or prompt prefix), which runs the prompts
at full depth and the first output token of each request, and streams those first outputs back
at once. Then it exports each request (`EngineReplica.prefill`: `Exported`, then the
`HandoffState` with the K/V of every plane as a separate Ray object). The pool passes that
object's reference, unfetched, to the least-loaded serving decode replica
(`pd_decode_leg.hand_off`, the one place a transport choice would slot in), which imports it and
streams the remaining outputs. `PDStream` (pd_stream.py) follows one submission through these
steps, with the failure and abort semantics it documents.

Hand-off (`kv_handoff`, `--kv-handoff`): "whole" moves each request's K/V after its first
token; "stream" reserves blocks on a decode replica before the prompt runs (the one with the
fewest streamed hand-offs in flight, then the least loaded: `Router.choose_handoff`, since
streams to one replica share its link) and moves each plane's
run of prompt blocks as soon as it is final, while later chunks compute, so only the last
blocks travel after the first token (engine/kv_stream.py; pd_decode_leg.py has the failure
semantics). Chunks go through the object store ("ray") or are read over NIXL ("nixl"), not
by "torch". Engine arguments without a `prefill_mode` get per_depth when streaming
(`with_default_prefill_mode`: a chunk's shallow planes leave while it runs its deeper
loops).

KV transport (`kv_transport`, `--kv-transport`): "ray" moves every state with its K/V through
the object store. "torch" ("auto" on CUDA): once every replica has loaded, the pool joins them
into one `torch.distributed` group (`connect_kv_transport`; rank = replica index) and is not
ready before. A submission then gets its decode replica at once (the serving decode replica
with the least outstanding work), the prefill replica sends each request's K/V there itself
(`isend`) and yields a descriptor that only that replica can import (in send order per
source: `HandoffReceiver`); a request aborted while its descriptor is in flight is dropped on
its destination (`drop_handoff`), never just forgotten, so the pair's order holds. A torch
group cannot take a restarted replica: when any replica fails or restarts (or a receive, a
drop or a send fails, or the group cannot be set up) the pool falls back for good: later hand-offs go through
the object store as with "ray" (`kv_transport_fallback`, logged, the metric
`loopserve_kv_transport_fallback`).

This is the `ReplicaPool` with `PDRoles` given to its replica set (role of each replica,
readiness needs a serving replica of each role, `/health` fields per role), `PDStream` as its
stream type, the KV transport's state (which listens to the set's failures and restarts to
fall back) and the background tasks of the streams (cancelled at shutdown). Probes,
restarts and metrics are the replica set's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from loopserve.distributed.args import STREAM_WITH_TORCH, PDSpec, with_default_prefill_mode
from loopserve.distributed.pd_stream import DECODE, PREFILL, PDStream
from loopserve.distributed.pool import ReplicaPool
from loopserve.distributed.pool_replicas import PoolConfig, Roles
from loopserve.distributed.transport import (
    DEFAULT_TIMEOUT_S,
    POINT_TO_POINT,
    KVTransportGroup,
    connect_kv_transport,
    resolve_kv_transport,
)
from loopserve.engine.async_llm import EngineNotReadyError
from loopserve.models.loader import require_handoff

logger = logging.getLogger(__name__)


KV_HANDOFFS = ("whole", "stream")
STREAMING_TRANSPORTS = ("ray", "nixl")


def check_kv_handoff(kv_handoff: str, kv_transport: str) -> str:
    """The `--kv-handoff` value, checked against the resolved transport; `ValueError` names
    what does not go together."""
    if kv_handoff not in KV_HANDOFFS:
        raise ValueError(f"unknown kv_handoff {kv_handoff!r}: choose one of {KV_HANDOFFS}")
    if kv_handoff == "stream" and kv_transport not in STREAMING_TRANSPORTS:
        raise ValueError(STREAM_WITH_TORCH)
    return kv_handoff


class PDRoles(Roles):
    """P prefill replicas (indices 0..P-1), then Q decode replicas."""

    def __init__(self, spec: PDSpec) -> None:
        self.spec = spec

    def role_of(self, index: int) -> str:
        return PREFILL if index < self.spec.num_prefill else DECODE

    def missing(self, serving: list[int]) -> str | None:
        for role, count in ((PREFILL, self.spec.num_prefill), (DECODE, self.spec.num_decode)):
            if not any(self.role_of(i) == role for i in serving):
                return f"no {role} replica is serving right now (0 of {count}; restarting)"
        return None

    def health(self, serving: list[int]) -> dict[str, object]:
        roles = [self.role_of(i) for i in serving]
        return {
            "prefill_serving": roles.count(PREFILL),
            "decode_serving": roles.count(DECODE),
            "pd": str(self.spec),
        }


class PDReplicaPool(ReplicaPool):
    """`ReplicaPool` with prefill and decode roles; see the module docstring."""

    stream_type = PDStream

    def __init__(
        self,
        engine_args: dict[str, object],
        config: PoolConfig,
        spec: PDSpec,
        *,
        on_load_error: Callable[[BaseException], None] | None = None,
        kv_transport: str = "ray",
        kv_transfer_timeout_s: float = DEFAULT_TIMEOUT_S,
        kv_handoff: str = "whole",
    ) -> None:
        if spec.num_prefill < 1 or spec.num_decode < 1:
            raise ValueError(f"--pd needs >= 1 replica per role, got {spec}")
        if engine_args.get("async_scheduling"):  # no request could ever be handed off
            raise ValueError("prefill/decode disaggregation needs async_scheduling off")
        require_handoff(engine_args.get("model"))  # type: ignore[arg-type]
        engine_args = with_default_prefill_mode(kv_handoff, engine_args)  # per_depth: stream
        config = dataclasses.replace(config, num_replicas=spec.num_prefill + spec.num_decode)
        super().__init__(engine_args, config, on_load_error=on_load_error, roles=PDRoles(spec))
        self.spec = spec
        self.replica_set.on_failure.append(
            lambda index, _instance, why: self.fall_back(f"replica {index} failed ({why})")
        )
        self.replica_set.on_restart.append(
            lambda index: self.fall_back(f"replica {index} restarted")  # no rank in the group
        )
        self._leg_tasks: set[asyncio.Task[None]] = set()
        device = str(engine_args.get("device") or "cpu")
        if kv_handoff == "stream" and kv_transport == "auto":
            kv_transport = "ray"  # the one transport chunks travel by
        self.kv_transport = resolve_kv_transport(kv_transport, device)  # "ray" | "torch" | "nixl"
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self.kv_group: KVTransportGroup | None = None
        self.kv_transport_fallback: str | None = None  # why hand-offs left the torch transport
        self._kv_connecting = self.kv_transport in POINT_TO_POINT
        self.kv_handoff = check_kv_handoff(kv_handoff, self.kv_transport)

    @property
    def streams_kv(self) -> bool:
        """Whether hand-offs stream their K/V chunk by chunk (`--kv-handoff stream`)."""
        return self.kv_handoff == "stream"

    # ---- the KV transport ----------------------------------------------------------------

    async def _start(self) -> None:
        await super()._start()
        kind = self.kv_transport
        if kind not in POINT_TO_POINT or self.load_error is not None or self.replica_set.closed:
            return
        try:
            # Every rank must join the group: wait for every replica's engine.
            await asyncio.gather(*(r.actor.info.remote() for r in self.replicas))
            ranks = range(self.num_replicas)
            self.kv_group = await asyncio.to_thread(
                connect_kv_transport,
                kind,
                [r.actor for r in self.replicas],
                senders=[i for i in ranks if self.role_of(i) == PREFILL],
                receivers=[i for i in ranks if self.role_of(i) == DECODE],
                on_cuda=str(self.engine_args.get("device") or "cpu").startswith("cuda"),
                timeout_s=self.kv_transfer_timeout_s,
            )
            logger.info("kv transport: %s between %d replicas", kind, len(ranks))
        except Exception as err:  # serve anyway, through the object store
            logger.exception("setting up the %s kv transport failed", kind)
            self.fall_back(f"setting up the {kind} kv transport failed: {err!r}")
        finally:
            self._kv_connecting = False

    @property
    def uses_point_to_point(self) -> bool:
        """Whether new hand-offs go point to point (torch or nixl, connected, not fallen back)."""
        return self.kv_group is not None and self.kv_transport_fallback is None

    def fall_back(self, why: str) -> None:
        """Move every later hand-off to the object store, for good (see the module
        docstring); idempotent."""
        if self.kv_transport not in POINT_TO_POINT or self.kv_transport_fallback is not None:
            return
        self.kv_transport_fallback = why
        self.metrics.set_kv_transport_fallback()
        logger.warning(
            "kv transport: later hand-offs go through Ray's object store (%s); restart the "
            "server to use %s again",
            why,
            self.kv_transport,
        )

    def kv_destinations(self, request_ids: list[str]) -> dict[str, int] | None:
        """Decode replicas (ranks) for the point-to-point transport to send these requests' K/V to,
        chosen now (least outstanding work); None when hand-offs go by the object store."""
        candidates = self.serving_of(DECODE)
        if not self.uses_point_to_point or not candidates:
            return None
        index = self.router.choose(candidates, None).replica
        return dict.fromkeys(request_ids, index)

    def serving_of(self, role: str) -> list[int]:
        return [i for i in self.serving_replicas() if self.role_of(i) == role]

    @property
    def is_ready(self) -> bool:
        return super().is_ready and not self._kv_connecting

    def health(self) -> dict[str, object]:
        health = super().health()
        health["kv_transport"] = self.kv_transport
        if self.kv_transport_fallback is not None:
            health["kv_transport_fallback"] = self.kv_transport_fallback
        return health

    def check_usable(self) -> None:
        super().check_usable()
        if self._kv_connecting:
            raise EngineNotReadyError("the replicas are still joining the kv transport group")

    def spawn(self, work: Any) -> asyncio.Task[None]:
        """Run a stream's leg in the background; shutdown cancels what is left."""
        task = asyncio.ensure_future(work)
        self._leg_tasks.add(task)
        task.add_done_callback(self._leg_tasks.discard)
        return task

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        await super().shutdown(timeout_s)
        tasks = list(self._leg_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["DECODE", "PREFILL", "PDReplicaPool", "PDStream"]
