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


# A request that fails inside the engine carries its error as text ("Type: message") through
# the executor, the engine core, Ray and the output stream. When the request's own input was
# to blame (its grammar met a limit of the structured-output library while the output was
# being generated), the text says so in this one form, so that the server can answer 400
# naming the field instead of a 500.
_CLIENT_ERROR = "InvalidRequestError(param="  # then the param, "): " and the message
_CLIENT_ERROR_END = "): "


def describe_failure(err: BaseException) -> str:
    """The text of a request's failure: `InvalidRequestError(param=P): message` for the
    request's own invalid input, else `Type: message`."""
    if isinstance(err, InvalidRequestError):
        return f"{_CLIENT_ERROR}{err.param or ''}{_CLIENT_ERROR_END}{err.message}"
    return f"{type(err).__name__}: {err}"


def client_error_in(text: str | None) -> InvalidRequestError | None:
    """The `InvalidRequestError` a failure text (`describe_failure`, possibly behind a prefix
    such as "sampling failed: ") reports, or None when the failure was the engine's."""
    if not text:
        return None
    start = text.find(_CLIENT_ERROR)
    if start < 0:
        return None
    param_start = start + len(_CLIENT_ERROR)
    param_end = text.find(_CLIENT_ERROR_END, param_start)
    if param_end < 0:
        return None
    param = text[param_start:param_end] or None
    return InvalidRequestError(text[param_end + len(_CLIENT_ERROR_END) :], param=param)


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
