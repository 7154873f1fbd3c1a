"""`loopserve bench speculative`: self-speculative decoding beside plain decoding, one run.

For each stream count (requests in flight) and temperature, one engine per configuration
(plain decoding, and each `K:d` of `--configs`) replays the same prompts (`ignore_eos`,
exactly `--output-len` tokens each, so every configuration emits as many tokens), arms
interleaved round after round; medians are reported. Per configuration: output tok/s and
its ratio to plain decoding, core calls per output token (at one stream a core call is one
step, and on a GPU at low load a step costs about the same with one row or a few, so this
ratio is the step-count speed-up a GPU would see; on a CPU a call costs about its rows), the
draft statistics (drafted, accepted / verified = acceptance, redrafted per output token) and
the loop distribution of the drafts (`stable`: P(s = j), the first loop from which the
coda's argmax stays the emitted token, measured at full depth by teacher forcing the greedy
outputs; the simulator's `--draft-stable-dist`). Greedy outputs are checked equal to plain
decoding's. `docs/speculative.md` records results.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from loopserve.bench.args import add_speculative_args as add_cli_args  # noqa: F401
from loopserve.bench.common import machine_info, write_json
from loopserve.engine.llm_engine import LLMEngine
from loopserve.errors import ConfigError
from loopserve.models.huginn import HuginnForLoopedLM
from loopserve.models.huginn_dense import step_logits
from loopserve.models.tiny import DEFAULT_MODEL_DIR
from loopserve.reference import _prompt_loop_outputs
from loopserve.sampling_params import SamplingParams
from loopserve.workloads.progress import progress_bar

PROMPTS = (
    "The history of the city",
    "Once upon a time there was",
    "In machine learning, a model",
    "The weather today is",
    "She opened the door and",
    "Recurrent depth transformers are",
    "The best way to learn",
    "A long time ago in a",
    "My favourite food is",
    "The river flows",
    "He said that the",
    "Scientists have found",
)


def _configs(text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--configs wants K:d pairs, got {text!r}") from None
    if not all(len(p) == 2 and p[0] > 0 and p[1] > 0 for p in pairs):
        raise ConfigError(f"--configs wants K:d pairs of positive integers, got {text!r}")
    return pairs  # type: ignore[return-value]


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> dict:
    engine.reset_stats()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    wall = time.perf_counter() - start
    stats = engine.stats
    ordered = [outputs[f"{tag}-{i}"] for i in range(len(prompts))]
    metrics = [o.metrics for o in ordered]
    return {
        "wall_s": wall,
        "output_tokens": stats.num_output_tokens,
        "tok_s": stats.num_output_tokens / wall,
        "core_calls_per_token": stats.num_core_calls / stats.num_output_tokens,
        "rows_per_call": stats.mean_rows_per_core_call,
        "drafted": sum(m.spec_drafted for m in metrics),
        "accepted": sum(m.spec_accepted for m in metrics),
        "rejected": sum(m.spec_rejected for m in metrics),
        "redrafted": sum(m.spec_redrafted for m in metrics),
        "tokens": [o.token_ids for o in ordered],
    }


def _loop_logits(model, token_ids: list[int], start: int) -> list[torch.Tensor]:
    """Logits [S - start, vocab] of positions start.. after each loop, teacher forced at full
    depth, from the family's dense reference."""
    if isinstance(model, HuginnForLoopedLM):
        return [logits[start:] for logits in step_logits(model, token_ids)]
    loops = _prompt_loop_outputs(model, token_ids + [0], "last_exited")
    return [model.coda(h[start:]) for h in loops]


def stable_loop_distribution(engine: LLMEngine, prompts, token_lists) -> list[float]:
    """P(s = j): s the first loop from which the coda's argmax stays the emitted token, over
    every emitted position, by teacher forcing prompt + outputs at full depth."""
    model = engine.model
    counts = [0] * model.num_loops
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, token_lists):
            ids = list(prompt) + list(tokens)
            loops = _loop_logits(model, ids, len(prompt) - 1)
            argmax = torch.stack([logits.argmax(-1) for logits in loops])
            for column in argmax.T.tolist():
                s = len(column) - 1
                while s > 0 and column[s - 1] == column[-1]:
                    s -= 1
                counts[s] += 1
    total = sum(counts)
    return [c / total for c in counts]


def run_benchmark(args: argparse.Namespace) -> dict:
    configs = [(0, 1)] + _configs(args.configs)
    streams = [int(x) for x in args.streams.split(",")]
    temperatures = [float(x) for x in args.temperatures.split(",")]
    model = args.model or str(DEFAULT_MODEL_DIR)
    probe = LLMEngine.from_engine_args(model=model, dtype="float32", num_blocks=64)
    tokenizer = probe.tokenizer
    if tokenizer is not None:
        texts = [tokenizer.encode(p) for p in PROMPTS]
    else:
        vocab = probe.model.config.vocab_size
        texts = [[(7 * i + 3 * j) % vocab for j in range(6)] for i in range(len(PROMPTS))]
    results = []
    total = len(streams) * len(temperatures) * (args.repeats + 1) * len(configs)
    with progress_bar(args, total=total, desc="bench speculative", unit="run") as bar:
        for num_streams in streams:
            prompts = [texts[i % len(texts)] for i in range(num_streams * args.rounds_of_requests)]
            engines = {
                (k, d): LLMEngine.from_engine_args(
                    model=model,
                    dtype="float32",
                    max_num_seqs=num_streams,
                    speculative_tokens=k,
                    draft_loops=d,
                    speculative_max_seqs=num_streams,
                )
                for k, d in configs
            }
            for temperature in temperatures:
                params = SamplingParams(
                    max_tokens=args.output_len, temperature=temperature, seed=0, ignore_eos=True
                )
                runs: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
                for round_index in range(-1, args.repeats):  # -1: warm-up
                    for config in configs:
                        run = _run(engines[config], prompts, params, f"r{round_index}")
                        if round_index >= 0:
                            runs[config].append(run)
                        bar.update(1)
                plain = runs[(0, 1)]
                row = {"streams": num_streams, "temperature": temperature, "configs": []}
                plain_tok_s = statistics.median(r["tok_s"] for r in plain)
                plain_calls = statistics.median(r["core_calls_per_token"] for r in plain)
                if temperature == 0:
                    row["stable_loop_dist"] = stable_loop_distribution(
                        probe, prompts, plain[0]["tokens"]
                    )
                for (k, d), config_runs in runs.items():
                    last = config_runs[-1]
                    if temperature == 0:  # greedy: speculation changes nothing
                        assert last["tokens"] == plain[-1]["tokens"], f"K={k} d={d} differs"
                    tok_s = statistics.median(r["tok_s"] for r in config_runs)
                    calls = statistics.median(r["core_calls_per_token"] for r in config_runs)
                    verified = last["accepted"] + last["rejected"]
                    row["configs"].append(
                        {
                            "K": k,
                            "d": d,
                            "tok_s": tok_s,
                            "tok_s_ratio": tok_s / plain_tok_s,
                            "core_calls_per_token": calls,
                            "core_call_ratio": plain_calls / calls,
                            "rows_per_call": statistics.median(
                                r["rows_per_call"] for r in config_runs
                            ),
                            "drafted": last["drafted"],
                            "acceptance": last["accepted"] / verified if verified else None,
                            "redrafted_per_token": last["redrafted"] / last["output_tokens"],
                        }
                    )
                results.append(row)
            del engines
    return {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "machine": machine_info(python=platform.python_version()),
        "results": results,
    }


def format_report(result: dict) -> str:
    lines = []
    for row in result["results"]:
        lines.append(f"streams {row['streams']}, temperature {row['temperature']}")
        if "stable_loop_dist" in row:
            dist = ", ".join(f"{p:.3f}" for p in row["stable_loop_dist"])
            lines.append(f"  draft stable-loop distribution P(s=j): {dist}")
        lines.append(
            f"  {'K:d':>5} {'tok/s':>8} {'x plain':>8} {'calls/tok':>9} {'x calls':>8} "
            f"{'rows/call':>9} {'drafted':>8} {'accept':>7} {'redraft/tok':>11}"
        )
        for c in row["configs"]:
            name = "plain" if c["K"] == 0 else f"{c['K']}:{c['d']}"
            acceptance = "-" if c["acceptance"] is None else f"{c['acceptance']:.3f}"
            lines.append(
                f"  {name:>5} {c['tok_s']:>8.1f} {c['tok_s_ratio']:>8.2f} "
                f"{c['core_calls_per_token']:>9.2f} {c['core_call_ratio']:>8.2f} "
                f"{c['rows_per_call']:>9.2f} {c['drafted']:>8} {acceptance:>7} "
                f"{c['redrafted_per_token']:>11.3f}"
            )
    return "\n".join(lines)


def main_from_args(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        result = run_benchmark(args)
    finally:
        torch.set_num_threads(threads)
    print(format_report(result))
    print(f"wrote {write_json(result, args.output_json)}")
    return 0
