"""`build_engine_core`: config -> KV manager -> scheduler -> executor -> engine core, once.

`LLMEngine` (with a `ModelRunner`) and the simulator (with a `SimExecutor`) both build their
core here, so the plane count, the KV manager and the scheduler come from the same config
the same way. The executor is made from the KV manager (`make_executor(kv)`), because it
needs the host pool's size; the core class follows `config.async_scheduling` unless the
caller says otherwise (the simulator prices async overlap itself on a synchronous core).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from loopserve.config import EngineConfig
from loopserve.engine.async_core import AsyncEngineCore
from loopserve.engine.core import EngineCore
from loopserve.execution import Executor, num_planes
from loopserve.scheduler.kv_cache import KVCacheManager
from loopserve.scheduler.scheduler import Scheduler

__all__ = ["build_engine_core"]


def build_engine_core(
    config: EngineConfig,
    *,
    num_loops: int,
    bytes_per_block: int,
    make_executor: Callable[[KVCacheManager], Executor],
    async_scheduling: bool | None = None,
    clock: Callable[[], float] = time.perf_counter,
    extra_planes: int = 0,
    prefix_key_by_max_loops: bool = False,
    prompt_loops_by_request: bool = False,
    leave_attends: bool = False,
    score_store: bool = True,
    defers_leave: bool = False,
    once_weight: float = 0.0,
) -> EngineCore:
    """The engine core for `config` (its `cache.num_blocks` resolved) over the executor
    `make_executor` builds; `core.scheduler.kv` is the KV manager. `extra_planes`: planes
    beyond the layout's that every request holds (a family's once-per-position K/V, e.g.
    Huginn's prelude and coda layers); `prefix_key_by_max_loops`: cached prompt pages are
    shared only between requests with the same loop bound (`KVCacheManager.match_prefix`);
    `prompt_loops_by_request`: a request's prompt runs its loop bound, not all D loops;
    `leave_attends`: the family's leave attends to earlier positions (`Scheduler`);
    `score_store`: the executor keeps prompt rows' outputs for cached pages (else no page is
    published as scored); `defers_leave`: coda batching in time, with the family's
    once-per-token weight in loops (`once_weight`; the executor must defer too)."""
    kv = KVCacheManager.from_config(
        config,
        num_planes=num_planes(config.cache.layout, num_loops) + extra_planes,
        bytes_per_block=bytes_per_block,
    )
    kv.key_by_max_loops = prefix_key_by_max_loops
    kv.score_store = score_store
    scheduler = Scheduler(
        config,
        num_loops=num_loops,
        kv=kv,
        prompt_loops_by_request=prompt_loops_by_request,
        leave_attends=leave_attends,
        defers_leave=defers_leave,
        once_weight=once_weight,
    )
    use_async = config.async_scheduling if async_scheduling is None else async_scheduling
    core_class = AsyncEngineCore if use_async else EngineCore
    return core_class(scheduler, make_executor(kv), clock=clock)
