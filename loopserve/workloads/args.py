"""argparse types and flag groups shared by `bench` and `simulate` (no engine imports)."""

from __future__ import annotations

import argparse
import sys

from loopserve.workloads.arms import arm_list

__all__ = [
    "add_output_args",
    "add_progress_arg",
    "arm_list",
    "int_list",
    "positive_int",
    "show_progress",
]


def int_list(text: str) -> list[int]:
    """argparse type for comma-separated positive integers, e.g. `8,16,32`."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type for an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_output_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    default_json: str | None = None,
    default_dir: str | None = None,
) -> None:
    """The one spelling of output locations across `bench` and `simulate`: `--output-json`
    (a file; figures go next to it) or `--output-dir`. The old `--out` / `--out-dir` are
    hidden aliases."""
    if default_json is not None:
        parser.add_argument(
            "--output-json", default=default_json, help="where to write the JSON result"
        )
        parser.add_argument(
            "--out", dest="output_json", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    if default_dir is not None:
        parser.add_argument(
            "--output-dir", default=default_dir, help="directory for the JSON result and figures"
        )
        parser.add_argument(
            "--out-dir", dest="output_dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )


def add_progress_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output (a bar on a terminal, else a line every 30 s)",
    )


def show_progress(args: argparse.Namespace) -> bool:
    """Draw a progress bar: not turned off and stderr is a terminal (not a log or a pipe)."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()
