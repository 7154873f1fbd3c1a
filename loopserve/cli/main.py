"""The `loopserve` command: `generate`, `serve`, `bench ...`, `simulate`.

Each subcommand is a `Command`: its path, its help, the function that adds its flags (in a
module that imports neither torch nor fastapi) and the function that runs it (imported only
when the command runs). `loopserve --help` imports no subcommand module; `loopserve X --help`
imports only X's flag module. To add a subcommand, append a `Command` to `COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loopserve.errors import LoopserveError, UsageError


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]  # ("bench", "throughput") -> `loopserve bench throughput`
    help: str
    add_args: str  # "module:function(parser)", torch-free
    run: str  # "module:function(args) -> int", imported when the command runs


COMMANDS: list[Command] = [
    Command(
        ("generate",),
        "offline generation",
        "loopserve.cli.generate:add_cli_args",
        "loopserve.cli.generate:main_from_args",
    ),
    Command(
        ("serve",),
        "OpenAI-compatible HTTP server",
        "loopserve.cli.serve:add_cli_args",
        "loopserve.cli.serve:main_from_args",
    ),
    Command(
        ("bench", "throughput"),
        "offline throughput: full-depth vs no_refill vs refill",
        "loopserve.bench.args:add_throughput_args",
        "loopserve.bench.throughput:main_from_args",
    ),
    Command(
        ("bench", "speculative"),
        "self-speculative decoding beside plain decoding: acceptance, tok/s, core calls",
        "loopserve.bench.args:add_speculative_args",
        "loopserve.bench.speculative:main_from_args",
    ),
    Command(
        ("bench", "serve"),
        "replay a dataset against an OpenAI-compatible endpoint",
        "loopserve.bench.args:add_serve_args",
        "loopserve.bench.serve_client:main_from_args",
    ),
    Command(
        ("bench", "wcpb"),
        "prompt throughput: wavefront vs atomic chunked prefill over chunk sizes",
        "loopserve.bench.args:add_wcpb_args",
        "loopserve.bench.prompt_sched:main_from_args",
    ),
    Command(
        ("bench", "interference"),
        "decode latency while long prompts arrive: atomic vs per-depth vs mixed",
        "loopserve.bench.args:add_interference_args",
        "loopserve.bench.prompt_interference:main_from_args",
    ),
    Command(
        ("bench", "memory"),
        "a KV pool too small for full reservation: full vs incremental+recompute vs +swap",
        "loopserve.bench.memory:add_cli_args",
        "loopserve.bench.memory:main_from_args",
    ),
    Command(
        ("bench", "batch-invariant"),
        "the cost of batch-invariant mode: default vs --batch-invariant on one workload",
        "loopserve.bench.batch_invariant:add_cli_args",
        "loopserve.bench.batch_invariant:main_from_args",
    ),
    Command(
        ("bench", "host"),
        "host microseconds per core call (null core) beside the simulated GPU device time",
        "loopserve.sim.args:add_host_bench_args",
        "loopserve.sim.host_bench:main_from_args",
    ),
    Command(
        ("bench", "kernels"),
        "device kernels per layer in one graphed decode loop, counted by dispatch on CPU",
        "loopserve.bench.args:add_kernels_args",
        "loopserve.bench.kernels:main_from_args",
    ),
    Command(
        ("simulate",),
        "simulated GPU executor driving the real scheduler",
        "loopserve.sim.args:add_cli_args",
        "loopserve.sim.cli:main_from_args",
    ),
    Command(
        ("eval",),
        "quality (cross-entropy) versus loops across exit thresholds",
        "loopserve.eval.cli:add_cli_args",
        "loopserve.eval.cli:main_from_args",
    ),
]

GROUPS = {"bench": "benchmarks"}  # parent commands that only hold subcommands


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default; on/off flags, None and empty lists say theirs in the help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if (
            default is None
            or default is False
            or default == []
            or isinstance(action, argparse._StoreConstAction)
        ):
            return action.help
        return super()._get_help_string(action)


def load(target: str) -> Callable:
    """`"module:function"` -> the function (imports the module)."""
    module_name, _, name = target.partition(":")
    return getattr(importlib.import_module(module_name), name)


def _selected(argv: Sequence[str] | None) -> Command | None:
    """The command `argv` names (None: none, or every command when argv is None)."""
    words = list(argv) if argv is not None else []
    for command in COMMANDS:
        if tuple(words[: len(command.path)]) == command.path:
            return command
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; flags are added only for the command `argv` selects (all when None)."""
    return _build(argv)[0]


def _build(
    argv: Sequence[str] | None,
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    chosen = _selected(argv)
    subparsers: dict[str, argparse.ArgumentParser] = {}
    parser = argparse.ArgumentParser(
        prog="loopserve", description="Serve looped language models.", formatter_class=HelpFormatter
    )
    top = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="what to run"
    )
    groups: dict[str, argparse._SubParsersAction] = {}
    for command in COMMANDS:
        parent = top
        if len(command.path) == 2:
            group = command.path[0]
            if group not in groups:
                holder = top.add_parser(group, help=GROUPS[group], formatter_class=HelpFormatter)
                groups[group] = holder.add_subparsers(
                    dest=f"{group}_command", required=True, metavar="COMMAND", help="which one"
                )
            parent = groups[group]
        sub = parent.add_parser(
            command.path[-1],
            help=command.help,
            description=command.help,
            formatter_class=HelpFormatter,
        )
        sub.set_defaults(func=command.run)  # a "module:function" string, loaded to run
        subparsers[command.run] = sub
        if argv is None or command is chosen:
            load(command.add_args)(sub)
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subparsers = _build(argv)
    args = parser.parse_args(argv)
    try:
        run = load(args.func)
    except ImportError as err:
        print(
            f"error: this command needs extra packages ({err}); "
            "try `pip install 'loopserve[serve,bench]'`",
            file=sys.stderr,
        )
        return 2
    try:
        return int(run(args) or 0)
    except UsageError as err:
        subparsers[args.func].error(str(err))  # exits with status 2
        raise
    except LoopserveError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
