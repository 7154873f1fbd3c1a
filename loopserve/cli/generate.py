"""`loopserve generate`: offline generation from the command line (flags and run)."""

from __future__ import annotations

import argparse
import json

from loopserve.engine_args import add_engine_args, engine_args_from
from loopserve.threads import add_threads_arg
from loopserve.workloads.args import int_list, show_progress


def token_ids(text: str) -> list[int]:
    """argparse type: comma-separated non-negative token ids, e.g. `1,2,3`."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative integers, got {text!r}")
    return values


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `loopserve generate`: prompts, sampling parameters and every engine flag."""
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument(
        "--prompt-token-ids",
        type=token_ids,
        action="append",
        default=[],
        help="a prompt as comma-separated token ids (repeatable)",
    )
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1.0: off)")
    sampling.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest (-1: off)")
    sampling.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    loops = parser.add_argument_group("loops")
    loops.add_argument("--min-loops", type=int, default=1, help="loops every token runs at least")
    loops.add_argument(
        "--max-loops", type=int, default=None, help="loops a token runs at most (None: all)"
    )
    loops.add_argument(
        "--exit-threshold",
        type=float,
        default=1.0,
        help="exit once the gate's cumulative exit probability reaches this; 1.0 means never "
        "exit early (every token runs --max-loops loops)",
    )
    loops.add_argument(
        "--exit-trace",
        type=int_list,
        default=None,
        help="comma-separated loops per output token, replayed cyclically; needs --exit-mode trace",
    )
    add_threads_arg(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object per output")
    out.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (one is drawn only when stderr is a terminal)",
    )
    add_engine_args(parser)


def main_from_args(args: argparse.Namespace) -> int:
    from loopserve.errors import UsageError
    from loopserve.llm import LLM  # lazy: torch
    from loopserve.sampling_params import SamplingParams
    from loopserve.threads import apply_cpu_threads

    if args.exit_trace is not None and args.exit_mode != "trace":
        raise UsageError("--exit-trace needs --exit-mode trace")
    prompts: list = list(args.prompt) + list(args.prompt_token_ids)
    if not prompts:
        prompts = ["Once upon a time"]
    engine_args = engine_args_from(args)
    apply_cpu_threads(engine_args.get("device") or "cpu", args.threads)  # threads.py
    llm = LLM(**engine_args)
    num_loops = llm.engine.num_loops
    if args.exit_trace is not None and max(args.exit_trace) > num_loops:
        raise UsageError(
            f"--exit-trace values must be in 1..{num_loops} (this model runs {num_loops} "
            f"loops); got {max(args.exit_trace)}"
        )
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
        exit_trace=args.exit_trace,
    )
    outputs = llm.generate(prompts, params, use_tqdm=show_progress(args))
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
            metrics = output.metrics
            if metrics.spec_drafted:
                record["speculation"] = {
                    "drafted": metrics.spec_drafted,
                    "accepted": metrics.spec_accepted,
                    "rejected": metrics.spec_rejected,
                    "redrafted": metrics.spec_redrafted,
                }
            print(json.dumps(record))
        else:
            shown = output.prompt if output.prompt is not None else output.prompt_token_ids
            print(f"prompt: {shown!r}")
            print(f"output: {output.text!r}")
            print(f"tokens: {output.token_ids}")
            print(f"loops:  {output.exit_depths} (mean {output.mean_loops:.2f})")
            metrics = output.metrics
            if metrics.spec_drafted:  # self-speculative decoding ran
                acceptance = metrics.spec_acceptance
                shown_rate = "-" if acceptance is None else f"{acceptance:.2f}"
                print(
                    f"drafts: {metrics.spec_drafted} made, {metrics.spec_accepted} accepted, "
                    f"{metrics.spec_rejected} rejected (acceptance {shown_rate}), "
                    f"{metrics.spec_redrafted} replaced by a deeper loop's"
                )
            print(f"finish: {output.finish_reason}\n")
    return 0
