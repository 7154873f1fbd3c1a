"""Engine flags shared by every CLI command; names equal `LLM(**engine_args)` keywords.

The flags come from the one engine-argument table in `loopserve.engine_args`; this module
re-exports its argparse helpers for the commands (and `int_list` for older callers).
"""

from __future__ import annotations

from loopserve.engine_args import ENGINE_ARGS, add_engine_args, engine_args_from
from loopserve.workloads.args import int_list

ENGINE_ARG_NAMES = tuple(arg.name for arg in ENGINE_ARGS)

__all__ = ["ENGINE_ARG_NAMES", "add_engine_args", "engine_args_from", "int_list"]
