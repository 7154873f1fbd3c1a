"""A pool's start-up reads every replica's `info` call, also those that finish after the
first (no Ray needed: the calls are plain awaitables here)."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio
import gc

from tests.optional import require

require("serve")  # the pool's metrics module imports prometheus_client
from loopserve.distributed.pool_replicas import _first_info


def _run_first_info(first_fails: bool) -> tuple[object, list[dict]]:
    """`_first_info` over a call that finishes at once and one that fails later (a replica
    killed at shutdown before it loaded); returns its result and what the loop reported as
    unhandled."""
    loop = asyncio.new_event_loop()
    unhandled: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    release = asyncio.Event()

    async def fast():
        if first_fails:
            raise RuntimeError("the model failed to load")
        return "info"

    async def killed_later():
        await release.wait()
        raise RuntimeError("the actor died before it ran")

    async def main():
        try:
            result = await _first_info([fast(), killed_later()])
        except RuntimeError as err:
            result = err
        release.set()
        for _ in range(3):
            await asyncio.sleep(0)
        return result

    try:
        result = loop.run_until_complete(main())
        gc.collect()  # an unread task exception is reported when its task is collected
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    return result, unhandled


def test_the_first_info_wins_and_a_later_failure_is_not_reported_as_unread():
    result, unhandled = _run_first_info(first_fails=False)
    assert result == "info"
    assert unhandled == []


def test_a_first_call_that_fails_is_the_load_error():
    result, unhandled = _run_first_info(first_fails=True)
    assert isinstance(result, RuntimeError) and "failed to load" in str(result)
    assert unhandled == []
