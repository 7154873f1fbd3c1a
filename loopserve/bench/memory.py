"""`loopserve bench memory`: a KV pool too small for worst-case reservation, three ways.

The same seeded workload (random token-id prompts, `ignore_eos`, exits replayed from a
uniform trace over 1..D loops so every arm runs the same loops) runs to completion on three
engines that differ only in memory management:
- `full`: `kv_reservation="full"` (admission reserves `prompt + max_tokens - 1` positions x
  planes; never preempts);
- `recompute`: incremental allocation, recompute preemption;
- `swap`: incremental allocation, swap preemption.

Clients that do not know the output length send a large `max_tokens` (`--client-max-tokens`);
each request actually stops at its own output length: the bench aborts it once it has that
many tokens (random weights emit no meaningful EOS), so the engine never learns the length
in advance. Reports output tokens/s, completed
requests, mean running requests per step, preemptions and replayed rows per arm.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loopserve.sampling_params import SamplingParams

ARMS = {
    "full": {"kv_reservation": "full"},
    "recompute": {"kv_reservation": "incremental", "preemption_mode": "recompute"},
    "swap": {"kv_reservation": "incremental", "preemption_mode": "swap"},
}


@dataclass
class ArmResult:
    arm: str
    wall_s: float
    output_tokens: int
    completed: int
    output_tok_per_s: float
    mean_running: float
    steps: int
    preemptions_recompute: int
    preemptions_swap: int
    replayed_rows: int
    swapped_bytes: int


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (None: embedded model)")
    parser.add_argument("--num-requests", type=int, default=48, help="requests, all at t=0")
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=[16, 96], help="prompt length range (min max)"
    )
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=[16, 128], help="output length range (min max)"
    )
    parser.add_argument(
        "--client-max-tokens", type=int, default=512, help="max_tokens every client sends"
    )
    parser.add_argument(
        "--num-blocks", type=int, default=512, help="KV pool in blocks of 16 positions"
    )
    parser.add_argument("--max-num-seqs", type=int, default=32, help="running requests at most")
    parser.add_argument(
        "--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms to compare"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--out", default=None, help="write results as JSON here")


def build_workload(args: argparse.Namespace, vocab: int, num_loops: int):
    rng = random.Random(args.seed)
    work = []
    for i in range(args.num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))]
        trace = tuple(rng.randint(1, num_loops) for _ in range(32))
        work.append((f"m{i}", prompt, rng.randint(*args.output_len), trace))
    return work


def run_arm(args: argparse.Namespace, name: str, work) -> ArmResult:
    from loopserve.engine.llm_engine import LLMEngine  # torch: only when the bench runs

    engine = LLMEngine.from_engine_args(
        model=args.model,
        dtype="float32",
        num_blocks=args.num_blocks,
        block_size=16,
        max_num_seqs=args.max_num_seqs,
        exit_mode="trace",
        swap_space=64 * 1024**2,
        enable_prefix_caching=False,  # random prompts share nothing; keep arms comparable
        **ARMS[name],
    )
    target = {}
    for request_id, prompt, output_len, trace in work:
        params = SamplingParams(
            max_tokens=args.client_max_tokens, temperature=0, ignore_eos=True, exit_trace=trace
        )
        engine.add_request(request_id, prompt, params)
        target[request_id] = output_len
    start_s = time.perf_counter()
    tokens = completed = steps = running = 0
    while engine.has_unfinished_requests():
        running += engine.scheduler.num_running
        outputs = engine.step()
        steps += 1
        for out in outputs:
            tokens += len(out.new_token_ids)
            if len(out.token_ids) >= target[out.request_id] and not out.finished:
                engine.abort_request(out.request_id)  # the request's natural end
                completed += 1
            elif out.finished:
                completed += 1
    wall_s = time.perf_counter() - start_s
    memory, stats = engine.scheduler.memory_stats, engine.stats
    return ArmResult(
        arm=name,
        wall_s=wall_s,
        output_tokens=tokens,
        completed=completed,
        output_tok_per_s=tokens / wall_s,
        mean_running=running / max(steps, 1),
        steps=steps,
        preemptions_recompute=memory.num_preemptions_recompute,
        preemptions_swap=memory.num_preemptions_swap,
        replayed_rows=memory.num_replayed_rows,
        swapped_bytes=stats.num_swapped_out_bytes + stats.num_swapped_in_bytes,
    )


def format_results(results: list[ArmResult]) -> str:
    lines = [
        f"{'arm':>10} {'tok/s':>8} {'done':>5} {'running':>7} {'steps':>6} "
        f"{'preempt':>7} {'replayed':>8} {'swap MB':>7} {'wall s':>7}"
    ]
    for r in results:
        lines.append(
            f"{r.arm:>10} {r.output_tok_per_s:>8.1f} {r.completed:>5} {r.mean_running:>7.1f} "
            f"{r.steps:>6} {r.preemptions_recompute + r.preemptions_swap:>7} "
            f"{r.replayed_rows:>8} {r.swapped_bytes / 1e6:>7.1f} {r.wall_s:>7.1f}"
        )
    return "\n".join(lines)


def main_from_args(args: argparse.Namespace) -> int:
    from loopserve.engine.llm_engine import LLMEngine

    probe = LLMEngine.from_engine_args(model=args.model, dtype="float32", num_blocks=16)
    work = build_workload(args, probe.model.config.vocab_size, probe.num_loops)
    del probe
    results = [run_arm(args, name, work) for name in args.arms]
    print(format_results(results))
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0
