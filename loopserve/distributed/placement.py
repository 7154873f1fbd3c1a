"""Placing one submission on a replica: the open step both pool streams share.

`PoolStream` (data parallel, `EngineReplica.generate`) and `PDStream` (the prefill leg,
`EngineReplica.prefill`) open a submission the same way: choose a serving replica with the
router (`Router.choose`, excluding replicas that already failed this submission), assign the
requests' outstanding work to it, start the streaming call and wait for its first item:

- the actor is down (`RayActorError`): release the routing, mark the replica failed (the pool
  stops routing to it), exclude it and try another;
- another Ray error, or a stream that ends before its first item: a bug, not a death; release
  the routing and raise `EngineDeadError`;
- `Rejected`: release the routing and raise the submission's error (400/429/503 as with one
  engine);
- `Accepted`: count the routing on the replica and return where the submission runs.

With no candidate left the submission fails with `EngineNotReadyError` (503). The streams keep
what differs: which replicas are candidates, which call starts the work, and what they do with
the opened stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from loopserve.distributed.replica_messages import Accepted, Rejected
from loopserve.distributed.router import RoutedRequest
from loopserve.engine.async_llm import EngineDeadError, EngineNotReadyError

if TYPE_CHECKING:
    from loopserve.distributed.args import PDSpec
    from loopserve.distributed.metrics import PoolMetrics
    from loopserve.distributed.pool_replicas import _Replica
    from loopserve.distributed.router import Router

logger = logging.getLogger(__name__)


class StreamOwner(Protocol):
    """What a stream uses of its pool: declared here so that streams (and `place_submission`)
    take their pool as an explicit input and never import the pool classes."""

    router: Router
    metrics: PoolMetrics
    replicas: list[_Replica]

    @property
    def is_accepting(self) -> bool: ...

    @property
    def num_replicas(self) -> int: ...

    def serving_replicas(self) -> list[int]: ...

    def replica_failed(self, index: int, instance_id: str | None, why: object) -> None: ...

    def on_stream_closed(self, stream: Any) -> None: ...


class PDStreamOwner(StreamOwner, Protocol):
    """What a `PDStream` uses of its `PDReplicaPool` beyond `StreamOwner`."""

    spec: PDSpec

    def serving_of(self, role: str) -> list[int]: ...

    def kv_destinations(self, request_ids: list[str]) -> dict[str, int] | None: ...

    def fall_back(self, why: str) -> None: ...

    def spawn(self, work: Any) -> asyncio.Task[None]: ...


@dataclass(frozen=True, slots=True)
class Placed:
    """Where an opened submission runs: the replica, its instance and the call's stream."""

    replica: int
    instance_id: str | None
    generator: Any  # ray.ObjectRefGenerator, past its `Accepted`


async def place_submission(
    pool: StreamOwner,
    *,
    serving: Callable[[], list[int]],
    total: int,
    what: str,
    request_ids: Sequence[str],
    routed: list[RoutedRequest],
    prompt_token_ids: list[int] | None,
    excluded: set[int],
    start: Callable[[int, _Replica], Any],
) -> Placed:
    """Open a submission on one of `serving()` (minus `excluded`, which grows with each
    replica that fails here), as the module docstring says. `start(index, replica)` starts the
    streaming call on the chosen replica and returns its generator; `what` and `total` name
    the candidates in the 503 message. A cancellation while waiting for the first item (the
    client left) aborts the requests on that replica, which adds them anyway."""
    import ray

    num_requests = len(request_ids)
    while True:
        candidates = [r for r in serving() if r not in excluded]
        if not candidates:
            raise EngineNotReadyError(
                f"no {what} can take this request right now ({len(serving())} of {total} serving)"
            )
        decision = pool.router.choose(candidates, prompt_token_ids)
        replica = pool.replicas[decision.replica]
        pool.router.assign(decision.replica, routed, prompt_token_ids)
        instance_id = replica.instance_id
        generator = start(decision.replica, replica)
        try:
            first = await (await generator.__anext__())
        except ray.exceptions.RayActorError as err:  # the replica is down: try another
            _release_routing(pool, request_ids)
            pool.replica_failed(decision.replica, instance_id, err)
            excluded.add(decision.replica)
            continue
        except (ray.exceptions.RayError, StopAsyncIteration) as err:  # a bug, not a death
            _release_routing(pool, request_ids)
            logger.error("replica %d failed a submission: %r", decision.replica, err)
            raise EngineDeadError(f"replica {decision.replica} failed: {err!r}") from None
        except asyncio.CancelledError:  # the replica adds them anyway: take them back
            replica.actor.abort.remote(list(request_ids))
            raise
        if isinstance(first, Rejected):
            _release_routing(pool, request_ids)
            raise first.error()
        assert isinstance(first, Accepted), first
        replica.num_routed += num_requests
        replica.num_prefix_hits += int(decision.prefix_hit)
        return Placed(decision.replica, instance_id, generator)


def _release_routing(pool: StreamOwner, request_ids: Sequence[str]) -> None:
    for request_id in request_ids:
        pool.router.finish(request_id)
