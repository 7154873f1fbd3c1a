"""`PoolStream`: the outputs of one submission on one data-parallel replica (`ReplicaPool`).

An `EngineStream` (engine/client.py: async iteration, `close`, `with`) reading
a Ray streaming generator from `EngineReplica.generate`. Closing it early aborts its unfinished
requests on their replica. A replica failure before any output reached the consumer re-submits
the requests to another replica (at most `MAX_REROUTES` times); after that the stream raises
`ReplicaFailedError` (HTTP 503). Routing bookkeeping (outstanding tokens) is updated as outputs
arrive. The pool owns replica states; the open step (choose a replica, assign the routing, call
it, handle a failed or refused first item) is `place_submission` (placement.py), shared with
`PDStream`; this room only follows one submission.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from loopserve.distributed.placement import StreamOwner, place_submission
from loopserve.distributed.replica_messages import EngineFailed
from loopserve.distributed.router import RoutedRequest
from loopserve.engine.async_llm import (
    EngineNotReadyError,
    GenerateRequest,
)
from loopserve.engine.client import EngineStream
from loopserve.errors import LoopserveError
from loopserve.outputs import RequestOutput

if TYPE_CHECKING:
    from loopserve.distributed.pool_replicas import _Replica

logger = logging.getLogger(__name__)
MAX_REROUTES = 2


class ReplicaFailedError(EngineNotReadyError):
    """The replica serving a request failed after the request had produced output; the
    replica is restarting and the client may retry (HTTP 503)."""


class PoolStream(EngineStream):
    """The outputs of one submission on one replica (an `EngineStream`).

    A replica failure before any output reached the consumer re-submits the requests to
    another replica; after that it raises `ReplicaFailedError`.
    """

    def __init__(
        self,
        owner: StreamOwner,
        requests: list[GenerateRequest],
        routed: list[RoutedRequest],
        prompt_token_ids: list[int] | None,
    ) -> None:
        super().__init__([r.request_id for r in requests])
        self.owner = owner
        self.requests = requests
        self._routed = routed
        self._prompt_token_ids = prompt_token_ids
        self._generator: Any = None  # ray.ObjectRefGenerator
        self.replica: int | None = None
        self._instance_id: str | None = None
        self.delivered_any = False  # some output reached the consumer
        self.num_reroutes = 0

    async def open(self, excluded: set[int]) -> None:
        """Route and submit; retry on another replica if the chosen one fails first
        (`place_submission`)."""
        pool = self.owner

        def start(index: int, replica: _Replica) -> Any:
            self.replica, self._instance_id = index, replica.instance_id
            return replica.actor.generate.remote(self.requests)

        placed = await place_submission(
            pool,
            serving=pool.serving_replicas,
            total=pool.num_replicas,
            what="replica",
            request_ids=self.request_ids,
            routed=self._routed,
            prompt_token_ids=self._prompt_token_ids,
            excluded=excluded,
            start=start,
        )
        self._generator = placed.generator

    def _release_routing(self) -> None:
        for request_id in self.request_ids:
            self.owner.router.finish(request_id)

    async def _next_item(self) -> RequestOutput | None:
        import ray

        try:
            item = await (await self._generator.__anext__())
        except ray.exceptions.RayActorError as err:  # the replica process is gone
            await self._on_replica_failure(f"{type(err).__name__}: {err}", replica_down=True)
            return None
        except (ray.exceptions.RayError, StopAsyncIteration) as err:  # this stream only
            await self._on_replica_failure(f"{type(err).__name__}: {err}", replica_down=False)
            return None
        if isinstance(item, EngineFailed):  # the replica's engine died
            await self._on_replica_failure(item.message, replica_down=True)
            return None
        return item

    def _delivered(self, output: RequestOutput) -> None:  # type: ignore[override]
        router = self.owner.router
        router.progress(output.request_id, len(output.new_token_ids))
        self.delivered_any = True
        if output.finished:
            router.finish(output.request_id)
            self.owner.metrics.observe_finished(output)

    async def _on_replica_failure(self, why: str, *, replica_down: bool) -> None:
        """Re-route if nothing was delivered yet; else fail the stream with a 503 error.
        `replica_down`: the replica itself failed (take it out of rotation)."""
        pool = self.owner
        assert self.replica is not None
        failed = self.replica
        if replica_down:
            pool.replica_failed(failed, self._instance_id, why)
        self._release_routing()
        if not self.delivered_any and self.num_reroutes < MAX_REROUTES and pool.is_accepting:
            self.num_reroutes += 1
            logger.warning(
                "re-routing %d requests away from replica %d", len(self._unfinished), failed
            )
            try:
                await self.open(excluded={failed})
                return
            except LoopserveError as err:
                why = f"{why}; re-routing failed: {err}"
        pool.replicas[failed].num_failed_requests += len(self._unfinished)
        self.owner.metrics.finished.labels(finish_reason="error").inc(len(self._unfinished))
        self._unfinished.clear()
        self.close()
        logger.error("replica %d failed requests %s: %s", failed, self.request_ids, why)
        if replica_down:
            raise ReplicaFailedError(
                f"replica {failed} failed while serving this request; it is being restarted, "
                "retry the request"
            )
        raise ReplicaFailedError(
            f"replica {failed} failed this request (details are in the server log); retry it"
        )

    def abort_unfinished(self, request_ids: list[str] | None = None) -> None:
        """Ask the replica to abort (some of) this stream's unfinished requests; their final
        outputs (finish reason "abort") still arrive through the stream."""
        ids = sorted(
            self._unfinished if request_ids is None else self._unfinished & set(request_ids)
        )
        if ids and self.replica is not None:
            self.owner.replicas[self.replica].actor.abort.remote(ids)

    def _closed_with(self, unfinished_ids: list[str]) -> None:
        if unfinished_ids and self._generator is not None:  # opened: a replica runs them
            self.abort_unfinished()
            self.owner.metrics.finished.labels(finish_reason="abort").inc(len(unfinished_ids))
        self._release_routing()
        self._generator = None
        self.owner.on_stream_closed(self)
