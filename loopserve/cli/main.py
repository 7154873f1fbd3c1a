"""The `loopserve` command: `generate`, `serve`, `bench throughput|serve`, `simulate`.

Subcommands import their heavy modules lazily so `loopserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from loopserve.cli.engine_args import add_engine_args, engine_args_from
from loopserve.errors import LoopserveError

# (command path, module with add_cli_args/main_from_args, help)
MOUNTED = [
    (("serve",), "loopserve.server.api_server", "OpenAI-compatible HTTP server"),
    (
        ("bench", "throughput"),
        "loopserve.bench.throughput",
        "offline throughput: full-depth vs no_refill vs refill",
    ),
    (
        ("bench", "serve"),
        "loopserve.bench.serve_client",
        "replay a dataset against an OpenAI-compatible endpoint",
    ),
    (("simulate",), "loopserve.sim.cli", "simulated GPU executor driving the real scheduler"),
    (
        ("eval",),
        "loopserve.eval.cli",
        "quality (cross-entropy) versus loops across exit thresholds",
    ),
    (
        ("bench", "wcpb"),
        "loopserve.bench.prompt_sched",
        "prompt throughput: wavefront vs atomic chunked prefill over chunk sizes",
    ),
    (
        ("bench", "interference"),
        "loopserve.bench.prompt_interference",
        "decode latency while long prompts arrive: atomic vs per-depth vs mixed",
    ),
]


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument(
        "--prompt-token-ids",
        action="append",
        default=[],
        help="comma-separated token ids (repeatable)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--min-loops", type=int, default=1)
    parser.add_argument("--max-loops", type=int, default=None)
    parser.add_argument("--exit-threshold", type=float, default=1.0)
    parser.add_argument(
        "--exit-trace", default=None, help="comma-separated loops per token (exit mode trace)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per output")
    parser.add_argument("--no-progress", action="store_true")
    add_engine_args(parser)


def run_generate(args: argparse.Namespace) -> int:
    from loopserve.llm import LLM
    from loopserve.sampling_params import SamplingParams

    prompts: list = list(args.prompt)
    for text in args.prompt_token_ids:
        try:
            prompts.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            raise SystemExit(
                f"--prompt-token-ids must be comma-separated integers, got {text!r}"
            ) from None
    if not prompts:
        prompts = ["Once upon a time"]
    trace = [int(t) for t in args.exit_trace.split(",")] if args.exit_trace else None
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        min_loops=args.min_loops,
        max_loops=args.max_loops,
        exit_threshold=args.exit_threshold,
        exit_trace=trace,
    )
    llm = LLM(**engine_args_from(args))
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    for output in outputs:
        if args.json:
            record = {
                "request_id": output.request_id,
                "prompt": output.prompt,
                "prompt_token_ids": output.prompt_token_ids,
                "text": output.text,
                "token_ids": output.token_ids,
                "exit_depths": output.exit_depths,
                "finish_reason": output.finish_reason,
            }
            print(json.dumps(record))
        else:
            shown = output.prompt if output.prompt is not None else output.prompt_token_ids
            print(f"prompt: {shown!r}")
            print(f"output: {output.text!r}")
            print(f"tokens: {output.token_ids}")
            print(f"loops:  {output.exit_depths} (mean {output.mean_loops:.2f})")
            print(f"finish: {output.finish_reason}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loopserve", description="Serve looped language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation")
    add_generate_args(gen)
    gen.set_defaults(func=run_generate)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench_command", required=True
    )
    for path, module_name, help_text in MOUNTED:
        parent = bench if path[0] == "bench" else sub
        cmd = parent.add_parser(path[-1], help=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            cmd.set_defaults(func=_unavailable(module_name, err))
            continue
        module.add_cli_args(cmd)
        cmd.set_defaults(func=module.main_from_args)
    return parser


def _unavailable(module_name: str, err: ImportError):
    def run(_args: argparse.Namespace) -> int:
        print(
            f"this command needs extra packages ({module_name}: {err}); try `pip install 'loopserve[serve,bench]'`",
            file=sys.stderr,
        )
        return 2

    return run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LoopserveError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
