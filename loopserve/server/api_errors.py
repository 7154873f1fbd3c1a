"""HTTP errors: `ApiError` (a status and the OpenAI error body) and the one place each
engine failure gets its status code.

400 for invalid input (including `CapacityError` and a request larger than the in-flight limit,
which no retry can fix), 404 for an unknown model, 429 when the queue is momentarily full, 503
while the engine loads, shuts down or is dead, 500 when the engine failed a request. A
non-streaming request that the engine aborted before it produced anything is an error too (503
during shutdown, else 500), never a 200 with empty text. Internal failure details go to the
server log under an error id; the client gets only that id.
"""

from __future__ import annotations

import logging
import re
import uuid

from loopserve.errors import EngineDeadError, client_error_in
from loopserve.outputs import RequestOutput
from loopserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An HTTP error with the OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    @property
    def body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()


def renamed(err: ApiError, names: dict[str, str]) -> ApiError:
    """A chat pipeline's error with the chat field it names (`max_tokens`, `stop`, ...)
    renamed to the field of the API the request came in (`names`: chat field -> that
    API's), in `param` and in the message; unchanged when the field keeps its name."""
    param = err.info.param
    name = names.get(param or "")
    if name is None:
        return err
    message = re.sub(rf"\b{re.escape(param)}\b", name, err.info.message)  # type: ignore[arg-type]
    return ApiError(err.status_code, message, type=err.info.type, param=name, code=err.info.code)


def engine_unavailable(err: Exception) -> ApiError:
    if isinstance(err, EngineDeadError):  # its text names the internal exception: log only
        logger.error("request refused: %s", err)
        return ApiError(
            503,
            "the engine stopped after an internal error (details are in the server log)",
            type="server_error",
            code="engine_dead",
        )
    return ApiError(503, str(err), type="server_error", code="engine_unavailable")


def failed_output_error(output: RequestOutput) -> ApiError:
    """A 400 naming the field when the request's own input made it fail while it ran (its
    grammar met a structured-output limit: `errors.client_error_in`); otherwise a generic
    500, the details in the log only."""
    client_error = client_error_in(output.error)
    if client_error is not None:
        logger.info("request %s failed on its input: %s", output.request_id, output.error)
        return ApiError(400, client_error.message, param=client_error.param)
    error_id = uuid.uuid4().hex[:16]
    logger.error(
        "the engine failed request %s (error id %s): %s", output.request_id, error_id, output.error
    )
    return ApiError(
        500,
        f"the engine failed request {output.request_id} (error id {error_id}; details are in "
        "the server log)",
        type="server_error",
        code="engine_error",
    )
