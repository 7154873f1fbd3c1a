"""`loopserve bench batch-invariant`: what batch-invariant mode costs.

The same seeded workload (random token-id prompts, greedy, `ignore_eos`, exits replayed from a
uniform per-token trace over 1..D loops, so both modes run the same loops) runs to completion
on two engines that differ only in `batch_invariant`, in alternating order for `--repeats`
rounds. Reports each mode's median output tokens/s, the ratio, and whether both modes emitted
the same tokens and exit depths (they may differ at near-ties: the modes round differently).
It times; it does not judge. `docs/benchmarks.md` records results.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

MODES = {"default": False, "batch_invariant": True}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (None: embedded model)")
    parser.add_argument("--num-requests", type=int, default=16, help="requests, all at t=0")
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=[16, 64], help="prompt length range (min max)"
    )
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=[32, 64], help="output length range (min max)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=16, help="running requests at most")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of both modes (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--out", default=None, help="write results as JSON here")


def build_workload(args: argparse.Namespace, vocab: int, num_loops: int):
    rng = random.Random(args.seed)
    work = []
    for i in range(args.num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))]
        trace = tuple(rng.randint(1, num_loops) for _ in range(32))
        work.append((f"b{i}", prompt, rng.randint(*args.output_len), trace))
    return work


def run_mode(args: argparse.Namespace, batch_invariant: bool, work):
    """(output tokens/s, {request_id: (token_ids, exit_depths)}) of one run to completion."""
    from loopserve.engine.llm_engine import LLMEngine  # torch: only when the bench runs
    from loopserve.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(
        model=args.model,
        dtype="float32",
        num_blocks=2048,
        block_size=16,
        max_num_seqs=args.max_num_seqs,
        exit_mode="trace",
        enable_prefix_caching=False,  # random prompts share nothing
        batch_invariant=batch_invariant,
    )
    for request_id, prompt, output_len, trace in work:
        params = SamplingParams(
            max_tokens=output_len, temperature=0, ignore_eos=True, exit_trace=trace
        )
        engine.add_request(request_id, prompt, params)
    outputs = {}
    start_s = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = (out.token_ids, out.exit_depths)
    wall_s = time.perf_counter() - start_s
    tokens = sum(len(token_ids) for token_ids, _ in outputs.values())
    return tokens / wall_s, outputs


def main_from_args(args: argparse.Namespace) -> int:
    import torch

    from loopserve.bench.common import machine_info
    from loopserve.engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    probe = LLMEngine.from_engine_args(model=args.model, dtype="float32", num_blocks=16)
    work = build_workload(args, probe.model.config.vocab_size, probe.num_loops)
    del probe
    rates: dict[str, list[float]] = {name: [] for name in MODES}
    outputs: dict[str, dict] = {}
    for round_index in range(args.repeats):
        order = list(MODES) if round_index % 2 == 0 else list(reversed(MODES))
        for name in order:
            rate, outputs[name] = run_mode(args, MODES[name], work)
            rates[name].append(rate)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    result = {
        "tok_per_s": medians,
        "tok_per_s_all": rates,
        "batch_invariant_over_default": medians["batch_invariant"] / medians["default"],
        "same_outputs": outputs["default"] == outputs["batch_invariant"],
        "machine": machine_info(),
    }
    for name, value in medians.items():
        print(f"{name:>16}: {value:8.1f} output tok/s (median of {args.repeats})")
    print(f"batch_invariant / default: {result['batch_invariant_over_default']:.3f}")
    print(f"same tokens and exit depths: {result['same_outputs']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
