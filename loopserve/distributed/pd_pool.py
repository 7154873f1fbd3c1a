"""`PDReplicaPool`: prefill/decode disaggregation behind the `AsyncLLM` interface (`--pd`).

A `ReplicaPool` whose replicas have roles: P prefill replicas (indices 0..P-1) and Q decode
replicas (P..P+Q-1). A submission goes to one prefill replica (the router's policy among the
serving prefill replicas: least outstanding tokens, or prompt prefix), which runs the prompts
at full depth and the first output token of each request, and streams those first outputs back
at once. Then it exports each request (`EngineReplica.prefill`: `Exported`, then the
`HandoffState` with the K/V of every plane as a separate Ray object). The pool passes that
object's reference, unfetched, to the least-loaded serving decode replica
(`pd_stream.hand_off`, the one place a transport choice would slot in), which imports it and
streams the remaining outputs. `PDStream` (pd_stream.py) follows one submission through these
steps, with the failure and abort semantics it documents.

This class adds the roles to the pool: routing candidates per role, readiness (at least one
serving replica of each role), `/health` fields per role, and the background tasks of the
streams (cancelled at shutdown). Probes, restarts and metrics are the `ReplicaPool`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from loopserve.distributed.args import PDSpec
from loopserve.distributed.pd_stream import DECODE, PREFILL, PDStream
from loopserve.distributed.pool import PoolConfig, ReplicaPool
from loopserve.distributed.router import RoutedRequest
from loopserve.server.async_engine import EngineNotReadyError, GenerateRequest


class PDReplicaPool(ReplicaPool):
    """`ReplicaPool` with prefill and decode roles; see the module docstring."""

    def __init__(
        self,
        engine_args: dict[str, object],
        config: PoolConfig,
        spec: PDSpec,
        *,
        on_load_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        if spec.num_prefill < 1 or spec.num_decode < 1:
            raise ValueError(f"--pd needs >= 1 replica per role, got {spec}")
        if engine_args.get("async_scheduling"):  # no request could ever be handed off
            raise ValueError("prefill/decode disaggregation needs async_scheduling off")
        config = dataclasses.replace(config, num_replicas=spec.num_prefill + spec.num_decode)
        super().__init__(engine_args, config, on_load_error=on_load_error)
        self.spec = spec
        self._leg_tasks: set[asyncio.Task[None]] = set()

    def role_of(self, index: int) -> str:
        return PREFILL if index < self.spec.num_prefill else DECODE

    def serving_of(self, role: str) -> list[int]:
        return [i for i in self.serving_replicas() if self.role_of(i) == role]

    @property
    def is_ready(self) -> bool:
        return (
            self.info is not None
            and not self._closed
            and bool(self.serving_of(PREFILL))
            and bool(self.serving_of(DECODE))
        )

    def health(self) -> dict[str, object]:
        health = super().health()
        health["prefill_serving"] = len(self.serving_of(PREFILL))
        health["decode_serving"] = len(self.serving_of(DECODE))
        health["pd"] = str(self.spec)
        return health

    def _check_usable(self) -> None:
        super()._check_usable()
        for role, count in ((PREFILL, self.spec.num_prefill), (DECODE, self.spec.num_decode)):
            if not self.serving_of(role):
                raise EngineNotReadyError(
                    f"no {role} replica is serving right now (0 of {count}; restarting)"
                )

    def _new_stream(
        self,
        requests: list[GenerateRequest],
        routed: list[RoutedRequest],
        prompt_token_ids: list[int] | None,
    ) -> PDStream:
        return PDStream(self, requests, routed, prompt_token_ids)

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
