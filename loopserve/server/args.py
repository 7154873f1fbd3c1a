"""Flags of `loopserve serve`, kept apart from the server so `serve --help` imports neither
torch nor fastapi."""

from __future__ import annotations

import argparse

from loopserve.engine_args import add_engine_args

DEFAULT_MAX_BODY_BYTES = 4 * 1024**2
DEFAULT_MODEL_NAME = "loopserve-default"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `loopserve serve`: every engine flag plus the server's own."""
    add_engine_args(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind")
    group.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    group.add_argument(
        "--served-model-name",
        default=None,
        help=f"model id in the API (default: --model, or {DEFAULT_MODEL_NAME})",
    )
    group.add_argument(
        "--max-pending-requests",
        type=int,
        default=1024,
        help="requests in flight (queued + running) before answering 429",
    )
    group.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted (larger: 413)",
    )
    group.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads on CPU (default: cores - 1, leaving one for the event loop; "
        "OMP_NUM_THREADS overrides)",
    )
    group.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=10.0,
        help="on SIGTERM, how long in-flight requests may finish before they are aborted",
    )
    group.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="server log level",
    )
