"""`ReplicaSet`: the replicas of a pool, started, probed and kept in rotation.

A collaborator the pool (`ReplicaPool`, pool.py) owns, with explicit inputs: the engine
arguments and `PoolConfig`, the pool's `Router` (a failed or restarted replica's entries are
dropped from it) and `PoolMetrics`, and the pool's `Roles` (which role each replica plays and
what readiness needs of each: every replica does everything by default; prefill and decode
under `--pd`). It starts Ray (or joins `ray_address`) and one `EngineReplica` actor per
replica (one GPU each on CUDA, one CPU and a fixed number of torch threads on CPU), takes the
first replica to load as the pool's `info` (a failure there is the load error), and runs one
probe per replica that polls its stats: gauges, readiness, engine death and restarts. Its
state per replica (`ReplicaState`: starting, serving, restarting, dead) is what routing,
readiness and `health()` read:

- a replica whose actor dies (or whose engine dies) is marked restarting at once
  (`replica_failed`); no new submission goes to it;
- Ray restarts the actor (`max_restarts`); the probe notices the new instance once its engine
  is loaded and puts it back into rotation (its prefix table entries are dropped);
- `health()` is "ok" with every replica serving, "degraded" with some, and the set is not
  ready with none (or, with roles, with no serving replica of some role). A replica whose
  restarts are exhausted stays "dead".

Whoever needs to know of failures and restarts (the PD pool's KV transport) subscribes
(`on_failure`, `on_restart`). Submissions, streams and shutdown's draining are the pool's.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loopserve.distributed.metrics import PoolMetrics, PoolSnapshot, ReplicaGauges
from loopserve.distributed.ray_init import start_embedded_ray
from loopserve.distributed.replica import EngineReplica, ReplicaStats
from loopserve.distributed.router import Router
from loopserve.engine.async_llm import EngineDeadError, EngineNotReadyError
from loopserve.engine.client import ModelInfo
from loopserve.engine.stats import EngineStats

logger = logging.getLogger(__name__)
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 60.0
DEFAULT_MAX_RESTARTS = 4


class ReplicaState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    RESTARTING = "restarting"
    DEAD = "dead"  # restarts exhausted


@dataclass
class _Replica:
    index: int
    actor: Any  # ray.actor.ActorHandle
    state: ReplicaState = ReplicaState.STARTING
    instance_id: str | None = None
    snapshot: EngineStats = field(default_factory=EngineStats)
    num_restarts: int = 0
    num_routed: int = 0
    num_prefix_hits: int = 0
    num_failed_requests: int = 0
    failed_instance_id: str | None = None  # the instance that failed; its late replies are stale
    role: str | None = None  # prefill | decode in a prefill/decode pool (`PDReplicaPool`)
    num_handoffs: int = 0  # requests it exported (prefill) or imported (decode)
    kv_bytes_sent: int = 0  # by its KV transport, since its instance started
    kv_bytes_received: int = 0
    kv_chunks_sent: int = 0  # streamed hand-offs' chunks, since its instance started
    kv_chunks_received: int = 0
    kv_landed: tuple[int, int] = (0, 0)  # K/V landed on the device, on the host (decode)


@dataclass(frozen=True)
class PoolConfig:
    """How the pool starts Ray and its replicas; see `ReplicaPool`."""

    num_replicas: int
    routing: str = "least_load"
    ray_address: str | None = None
    max_pending_requests: int = 1024
    max_restarts: int = DEFAULT_MAX_RESTARTS
    torch_threads: int | None = None  # per replica on CPU; None: cores // replicas (>= 1)
    num_cpus: int | None = None  # embedded cluster's CPUs; None: max(cores, replicas)
    object_store_bytes: int | None = None  # embedded cluster; None: Ray's default


class Roles:
    """Which role each replica plays and what a set needs of each role to be usable: here
    none (every replica does everything); `PDRoles` (pd_pool.py) has prefill and decode."""

    def role_of(self, index: int) -> str | None:
        return None

    def missing(self, serving: list[int]) -> str | None:
        """Why the serving replicas `serving` cannot take work (a role without one), or None."""
        return None

    def health(self, serving: list[int]) -> dict[str, object]:
        """Per-role fields for `health()`."""
        return {}


async def _first_info(calls: list) -> ModelInfo:
    """The result of whichever `info` call finishes first (a success before a failure that
    finished with it). The others are left to finish on their own; their failures (a replica
    killed at shutdown before it ever loaded) are retrieved, so none is logged as an
    exception nobody read."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.add_done_callback(_retrieve)
    for task in done:
        _retrieve(task)
    finished = sorted(done, key=lambda task: task.exception() is not None)
    return finished[0].result()


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # marks the exception as read; the probes report replica failures


PROBE_TIMED_OUT = "probe timed out"  # alive but unresponsive


def _is_unreachable(why: object) -> bool:
    """A failure that does not mean the instance died: a probe that timed out, or Ray's
    `ActorUnavailableError` (the actor is restarting or unreachable, as the caller sees it)."""
    if why == PROBE_TIMED_OUT:
        return True
    try:
        from ray.exceptions import ActorUnavailableError
    except ImportError:  # no Ray: no such error
        return False
    return isinstance(why, ActorUnavailableError)


class ReplicaSet:
    """The replicas of a pool and their states; see the module docstring."""

    def __init__(
        self,
        engine_args: dict[str, object],
        config: PoolConfig,
        *,
        router: Router,
        metrics: PoolMetrics,
        roles: Roles,
        on_load_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        if config.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {config.num_replicas}")
        self.engine_args = dict(engine_args)
        self.config = config
        self.max_pending_requests = config.max_pending_requests
        self._on_load_error = on_load_error
        self.router = router
        self.metrics = metrics
        self.roles = roles
        # Called with (index, instance id, why) when a serving replica's current instance
        # fails, and with the index when a replica comes back as a new instance.
        self.on_failure: list[Callable[[int, str | None, object], None]] = []
        self.on_restart: list[Callable[[int], None]] = []
        self.replicas: list[_Replica] = []
        self.info: ModelInfo | None = None
        self.load_error: BaseException | None = None
        self._started_ray = False
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # ---- state --------------------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return self.config.num_replicas

    def serving_replicas(self) -> list[int]:
        return [r.index for r in self.replicas if r.state is ReplicaState.SERVING]

    @property
    def is_ready(self) -> bool:
        serving = self.serving_replicas()
        return (
            self.info is not None
            and bool(serving)
            and not self._closed
            and self.roles.missing(serving) is None
        )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def is_dead(self) -> bool:
        if self.load_error is not None:
            return True
        return bool(self.replicas) and all(r.state is ReplicaState.DEAD for r in self.replicas)

    @property
    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(
            num_replicas=self.num_replicas,
            replicas=tuple(
                ReplicaGauges(
                    index=r.index,
                    state=r.state.value,
                    snapshot=r.snapshot,
                    outstanding_tokens=self.router.load(r.index),
                    num_routed=r.num_routed,
                    num_prefix_hits=r.num_prefix_hits,
                    num_restarts=r.num_restarts,
                    num_failed_requests=r.num_failed_requests,
                    role=r.role,
                    num_handoffs=r.num_handoffs,
                    kv_bytes_sent=r.kv_bytes_sent,
                    kv_bytes_received=r.kv_bytes_received,
                    kv_chunks_sent=r.kv_chunks_sent,
                    kv_chunks_received=r.kv_chunks_received,
                    kv_landed=r.kv_landed,
                )
                for r in self.replicas
            ),
        )

    def health(self) -> dict[str, object]:
        """`{"status": "ok" | "degraded" | ..., "replicas": N, "replicas_serving": k, ...}`."""
        serving = len(self.serving_replicas())
        if self.is_dead:
            status = "dead"
        elif not self.is_ready:
            status = "loading" if self.info is None else "unavailable"
        else:
            status = "ok" if serving == self.num_replicas else "degraded"
        return {
            "status": status,
            "replicas": self.num_replicas,
            "replicas_serving": serving,
            "replica_states": [r.state.value for r in self.replicas],
            **self.roles.health(self.serving_replicas()),
        }

    async def start(self) -> None:
        """Start Ray and the replicas; returns once the first replica loaded (or failed)."""
        try:
            await asyncio.to_thread(self.init_ray)  # a no-op when done before
            actor_cls = self._actor_class()
            for index in range(self.num_replicas):
                actor = actor_cls.remote(**self._replica_kwargs())
                self.replicas.append(_Replica(index, actor, role=self.roles.role_of(index)))
            # The first replica to load decides: its info serves all (they share the engine
            # arguments); if it failed, the model cannot load. The others join through their
            # probes whenever they are up (a replica waiting for a free GPU does not block).
            info = await _first_info([r.actor.info.remote() for r in self.replicas])
        except Exception as err:
            logger.exception("starting the replicas failed")
            self.load_error = err
            if self._on_load_error is not None:
                self._on_load_error(err)
            return
        self.info = info
        self.router.block_size = info.block_size
        for replica in self.replicas:
            self._tasks.append(asyncio.ensure_future(self._probe(replica)))

    def init_ray(self) -> None:
        """Start the embedded Ray cluster (or join `ray_address`) unless Ray is already
        initialized; call it from the main thread (Ray installs signal handlers there)."""
        import ray

        if ray.is_initialized():
            return
        if self.config.ray_address is not None:
            ray.init(address=self.config.ray_address, log_to_driver=True)
        else:
            start_embedded_ray(
                self.config.num_cpus or max(os.cpu_count() or 1, self.num_replicas),
                self.config.object_store_bytes,
            )
        self._started_ray = True

    def _actor_class(self) -> Any:
        import ray

        on_cuda = str(self.engine_args.get("device") or "cpu").startswith("cuda")
        return ray.remote(EngineReplica).options(
            num_cpus=0 if on_cuda else 1,
            num_gpus=1 if on_cuda else 0,
            max_restarts=self.config.max_restarts,
            max_task_retries=0,
        )

    def _replica_kwargs(self) -> dict[str, object]:
        engine_args = dict(self.engine_args)
        on_cuda = str(engine_args.get("device") or "cpu").startswith("cuda")
        if on_cuda:
            engine_args["device"] = "cuda"  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU
        threads = self.config.torch_threads
        if threads is None and not on_cuda:
            threads = max(1, (os.cpu_count() or 1) // self.num_replicas)
        return {
            "engine_args": engine_args,
            "torch_threads": threads,
            "max_pending_requests": self.max_pending_requests,
        }

    async def wait_serving(self, num_replicas: int, timeout_s: float) -> bool:
        """Wait until `num_replicas` replicas serve; False on timeout."""
        deadline_s = time.monotonic() + timeout_s
        while len(self.serving_replicas()) < num_replicas:
            if time.monotonic() > deadline_s:
                return False
            await asyncio.sleep(0.05)
        return True

    async def stop(self) -> None:
        """Cancel the probes, kill the replicas and stop Ray if we started it."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        if self.replicas:
            import ray

            for replica in self.replicas:
                ray.kill(replica.actor, no_restart=True)
            if self._started_ray:
                await asyncio.to_thread(ray.shutdown)

    def check_usable(self) -> None:
        if self.is_dead:
            raise EngineDeadError(
                f"every replica is dead: {self.load_error!r}"
                if self.load_error is not None
                else "every replica is dead (restarts exhausted)"
            )
        if self.info is None:
            raise EngineNotReadyError("the model is still loading")
        serving = self.serving_replicas()
        if not serving:
            raise EngineNotReadyError(
                f"no replica is serving right now (0 of {self.num_replicas}; restarting)"
            )
        missing = self.roles.missing(serving)
        if missing is not None:
            raise EngineNotReadyError(missing)

    # ---- failures and restarts ----------------------------------------------------------

    def replica_failed(self, index: int, instance_id: str | None, why: object) -> None:
        """A call to replica `index` (instance `instance_id`) failed: stop routing to it
        until the probe sees it serve again. Stale reports about an older instance are
        ignored. An instance known to have died has its late replies ignored too; one that
        was only unreachable (Ray's `ActorUnavailableError`: the caller's view of the actor
        may lag a restart that already finished, or the network dropped a call) serves again
        at its next reply, or a pool that saw its restart would wait for another forever."""
        replica = self.replicas[index]
        if replica.instance_id == instance_id:
            for listener in self.on_failure:
                listener(index, instance_id, why)
        if replica.state is not ReplicaState.SERVING or replica.instance_id != instance_id:
            return
        unreachable = _is_unreachable(why)
        logger.warning(
            "replica %d %s (%s); %s", index, "unreachable" if unreachable else "failed", why,
            "out of rotation until it answers" if unreachable else "waiting for its restart",
        )  # fmt: skip
        replica.state = ReplicaState.RESTARTING
        replica.failed_instance_id = None if unreachable else instance_id
        self.router.forget_replica(index)

    async def _probe(self, replica: _Replica) -> None:
        """Poll one replica's stats: gauges, readiness, engine death and restarts."""
        import ray

        while not self._closed:
            try:
                stats: ReplicaStats = await asyncio.wait_for(
                    replica.actor.stats.remote(), PROBE_TIMEOUT_S
                )
            except ray.exceptions.ActorDiedError as err:
                if self._restarts_exhausted(replica):
                    logger.error("replica %d is dead for good: %s", replica.index, err)
                    replica.state = ReplicaState.DEAD
                    self.router.forget_replica(replica.index)
                    return
                self.replica_failed(replica.index, replica.instance_id, err)
            except ray.exceptions.RayActorError as err:
                self.replica_failed(replica.index, replica.instance_id, err)
            except ray.exceptions.RayError as err:  # the call failed, the replica did not
                logger.error("probing replica %d failed: %r", replica.index, err)
            except asyncio.TimeoutError:  # alive but unresponsive: out of rotation until it answers
                self.replica_failed(replica.index, replica.instance_id, PROBE_TIMED_OUT)
            else:
                self._apply_stats(replica, stats)
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def refresh_stats(self) -> None:
        """Fetch every serving replica's gauges now (the probes do it every 0.5 s)."""
        serving = [self.replicas[i] for i in self.serving_replicas()]
        stats = await asyncio.gather(*(r.actor.stats.remote() for r in serving))
        for replica, replica_stats in zip(serving, stats):
            self._apply_stats(replica, replica_stats)

    def _restarts_exhausted(self, replica: _Replica) -> bool:
        limit = self.config.max_restarts
        return limit != -1 and replica.num_restarts >= limit

    def _apply_stats(self, replica: _Replica, stats: ReplicaStats) -> None:
        if stats.instance_id == replica.failed_instance_id:
            return  # a reply the failed instance sent before it died: stale
        if replica.instance_id is not None and stats.instance_id != replica.instance_id:
            replica.num_restarts += 1
            logger.warning("replica %d restarted (restart %d)", replica.index, replica.num_restarts)
            self.router.forget_replica(replica.index)
            for listener in self.on_restart:
                listener(replica.index)
        replica.instance_id = stats.instance_id
        replica.snapshot = stats.snapshot
        replica.kv_bytes_sent = stats.kv_bytes_sent
        replica.kv_bytes_received = stats.kv_bytes_received
        replica.kv_chunks_sent = stats.num_kv_chunks_sent
        replica.kv_chunks_received = stats.num_kv_chunks_received
        replica.kv_landed = (stats.num_kv_landed_device, stats.num_kv_landed_host)
        if stats.is_dead:  # its engine thread died; the actor lives on: restart it
            import ray

            self.replica_failed(replica.index, replica.instance_id, "engine died")
            ray.kill(replica.actor, no_restart=False)
        elif stats.is_ready and replica.state is not ReplicaState.SERVING:
            replica.state = ReplicaState.SERVING
            logger.info("replica %d serving", replica.index)
