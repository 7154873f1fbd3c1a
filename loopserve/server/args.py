"""The HTTP server's flags of `loopserve serve`, kept apart from the server so `serve --help`
imports neither torch nor fastapi."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from loopserve.server.loop_classes import LoopClasses
from loopserve.text.reasoning import PARSERS as REASONING_PARSERS
from loopserve.text.tools import PARSERS as TOOL_PARSERS

DEFAULT_MAX_BODY_BYTES = 4 * 1024**2
DEFAULT_MODEL_NAME = "loopserve-default"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_BODY_DEADLINE_S = 120.0
DEFAULT_MAX_CONNECTIONS = 1000
DEFAULT_CHAT_MAX_TOKENS = 1024
API_KEY_ENV = "LOOPSERVE_API_KEY"
# Request fields `--request-defaults` may set: the looped-model extensions.
REQUEST_DEFAULT_FIELDS = ("min_loops", "max_loops", "exit_threshold", "prompt_logprobs_loop")


def _loop_classes(text: str) -> LoopClasses:
    try:
        return LoopClasses.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--loop-classes: {err}") from None


def _at_least(kind: type, low: float, high: float | None = None):
    """An argparse `type`: a `kind` (int or float) in [low, high] (finite), else the flag's
    usage error naming the range, not a traceback or a server that cannot work (port 99999
    crashed uvicorn's bind; 0 connections or pending requests refused every request)."""
    span = f">= {low}" if high is None else f"in {low}..{high}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {span}, got {text!r}") from None
        if not (math.isfinite(value) and value >= low and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    return parse


POSITIVE_SECONDS = 1e-3  # a timeout shorter than a millisecond would close every connection


def with_checkpoint_defaults(defaults: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """`--request-defaults` completed from the checkpoint's `config.json`: its exit threshold
    (Ouro's `early_exit_threshold`) for requests that send none, unless the flag names one.
    A checkpoint without it keeps the engine's default (1.0: no early exit)."""
    threshold = config.get("early_exit_threshold")
    if "exit_threshold" in defaults or threshold is None:
        return defaults
    return {**defaults, "exit_threshold": float(threshold)}


def request_defaults(text: str) -> dict[str, Any]:
    """`--request-defaults`: a JSON object of looped-model request fields, checked as
    `SamplingParams` checks them."""
    from loopserve.errors import InvalidRequestError
    from loopserve.sampling_params import SamplingParams

    try:
        defaults = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(defaults, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    unknown = sorted(set(defaults) - set(REQUEST_DEFAULT_FIELDS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(REQUEST_DEFAULT_FIELDS)}"
        )
    try:
        SamplingParams(**defaults)
    except (InvalidRequestError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return defaults


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's own flags (`loopserve serve` adds the engine's and distributed's)."""
    group = parser.add_argument_group("server")
    group.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; do not bind a public address (0.0.0.0) without --api-key",
    )
    group.add_argument("--port", type=_at_least(int, 1, 65535), default=8000, help="TCP port")
    group.add_argument(
        "--served-model-name",
        default=None,
        help="model id in the API (None: the base name of the --model directory, or "
        f"{DEFAULT_MODEL_NAME} for the embedded model)",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on /v1/* (and /metrics); also read from "
        f"${API_KEY_ENV} (preferred: a flag is visible to local users in `ps`); None: no key",
    )
    group.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without the API key (it needs the key when one is set)",
    )
    group.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        help="browser origins allowed by CORS (e.g. https://app.example); empty: no CORS headers",
    )
    group.add_argument(
        "--allowed-hosts",
        nargs="*",
        default=None,
        help="accepted Host header names, against DNS rebinding; '*' accepts any. None: "
        "localhost, 127.0.0.1 and ::1 when bound to loopback, else any",
    )
    group.add_argument(
        "--allow-client-priority",
        action="store_true",
        help="let clients set `priority` (otherwise a non-zero priority is a 400)",
    )
    group.add_argument(
        "--default-max-tokens",
        type=_at_least(int, 1),
        default=DEFAULT_CHAT_MAX_TOKENS,
        help="chat completions without max_tokens generate up to this many tokens (less when "
        "the context or KV cache holds less); completions default to 16 as in OpenAI's API",
    )
    group.add_argument(
        "--request-defaults",
        type=request_defaults,
        default={},
        help="JSON object of looped-model fields for requests that do not set them, e.g. "
        '\'{"exit_threshold": 0.6, "prompt_logprobs_loop": "exit"}\' so that an unchanged '
        "client (lm-eval) measures a threshold; fields: " + ", ".join(REQUEST_DEFAULT_FIELDS),
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="move the reasoning a chat answer writes between <think> and </think> into "
        "`reasoning_content` (messages and stream deltas) and count its tokens in "
        "usage.completion_tokens_details.reasoning_tokens (default: none, text as written)",
    )
    group.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=[*sorted(TOOL_PARSERS), "none"],
        help="read tool calls from chat answers that offered tools: hermes reads "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks into tool_calls '
        "(finish_reason tool_calls); none refuses tool_choice auto (required and named calls "
        "are enforced by a grammar either way)",
    )
    group.add_argument(
        "--loop-classes",
        type=_loop_classes,
        default=None,
        help="named loop budgets, as JSON or a JSON file's path: "
        '{"classes": {name: {exit_threshold, min_loops, max_loops, priority}}, "default": '
        'name, "api_keys": {key: name}}; a request picks one with "loop_class" or by its '
        "API key (docs/serving.md, Loop classes)",
    )
    group.add_argument(
        "--json-schema-closed",
        action="store_true",
        help="treat every JSON schema's objects that list properties and say nothing of "
        "others as closed (additionalProperties false), as vLLM's guidance backend can; "
        "response_format json_schema with strict: true is closed either way (OpenAI "
        "requires it); an open object lets a model add keys until max_tokens",
    )
    group.add_argument(
        "--header-timeout-s",
        type=_at_least(float, POSITIVE_SECONDS),
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="close a connection that has not sent a request's headers within this time",
    )
    group.add_argument(
        "--body-timeout-s",
        type=_at_least(float, POSITIVE_SECONDS),
        default=DEFAULT_BODY_TIMEOUT_S,
        help="answer 408 when the next part of a request body takes longer than this",
    )
    group.add_argument(
        "--body-deadline-s",
        type=_at_least(float, POSITIVE_SECONDS),
        default=DEFAULT_BODY_DEADLINE_S,
        help="answer 408 when a whole request body takes longer than this (trickled bodies)",
    )
    group.add_argument(
        "--max-connections",
        type=_at_least(int, 1),
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections at most; 4 more may only ask /health (a probe gets through a "
        "full server); further ones are closed at once",
    )
    group.add_argument(
        "--max-pending-requests",
        type=_at_least(int, 1),
        default=1024,
        help="requests in flight (queued + running) before answering 429",
    )
    group.add_argument(
        "--max-body-bytes",
        type=_at_least(int, 1),
        default=DEFAULT_MAX_BODY_BYTES,
        help="request bodies over this size get 413",
    )
    group.add_argument(
        "--torch-threads",
        type=_at_least(int, 1),
        default=None,
        help="torch intra-op threads on CPU (None: cores - 1, leaving one for the event loop; "
        "OMP_NUM_THREADS overrides)",
    )
    group.add_argument(
        "--shutdown-timeout-s",
        type=_at_least(float, 0),
        default=10.0,
        help="on SIGTERM, how long in-flight requests may finish before they are aborted",
    )
    group.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="log level of the server and uvicorn",
    )
