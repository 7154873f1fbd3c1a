"""Typed errors that cross the public API.

User mistakes raise `InvalidRequestError` (HTTP 400 in the server) or `ConfigError`
(start-up). Internal invariants use `assert`; they are bugs, not user errors.
"""

from __future__ import annotations


class LoopserveError(Exception):
    """Base class of every error loopserve raises on purpose."""


class InvalidRequestError(LoopserveError, ValueError):
    """A request (prompt or sampling parameters) is malformed.

    `param` names the offending field when one field is to blame.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class CapacityError(InvalidRequestError):
    """A request can never fit (context length or KV blocks)."""


class ConfigError(LoopserveError, ValueError):
    """An engine configuration is invalid; the message names the values and a fix."""


class ModelLoadError(LoopserveError, OSError):
    """A checkpoint cannot be found or does not match the architecture."""


class UsageError(Exception):
    """A bad combination of command-line flags found after parsing: the `loopserve` command
    reports it like argparse's own errors (`usage`, `loopserve CMD: error: ...`, exit code 2)."""


class EngineNotReadyError(LoopserveError):
    """The engine is still loading or is shutting down; nothing was submitted."""


class EngineDeadError(LoopserveError):
    """The engine thread died; no request can make progress any more."""


class QueueFullError(LoopserveError):
    """Too many requests in flight; the client should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
