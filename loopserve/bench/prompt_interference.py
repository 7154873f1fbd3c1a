"""`loopserve bench interference`: how long prompts disturb a steady decode population.

A population of decode requests (`--num-decode` short prompts, `ignore_eos`, long outputs)
decodes with exits replayed from a seeded trace, uniform over 1..D loops (`exit_mode="trace"`:
every arm runs exactly the same loops per token, and the gate costs nothing). Long prompts
are injected at fixed points of decode progress — prompt j when every population request has
produced `--inject-at[j]` tokens — so the trigger is identical in every arm (default: all
four after 8 tokens, so the whole window is under prompt load). The run drives
`engine.step()` itself and stops once every injected prompt has its first token; the
population is then aborted.

The measurement window runs from the first injection to the last injected prompt's first
token. Over it: decode ITL p50/p99/max (gaps in `RequestMetrics.token_times_s` of population
requests whose later token falls in the window), TPOT (per-request mean gap, averaged), TTFT
of the injected prompts, prompt token-loops/s (prompt tokens x D / window), output tokens/s,
rows per kind per core call and the number of mixed core calls (a mixed arm without any is
invalid and raises). Arms (default A0 atomic, A1 per_depth, A2 mixed) share budget, chunk
size and `max_num_seqs`; runs are interleaved and each metric is the median of `--repeats`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from loopserve.bench.args import add_interference_args as add_cli_args  # noqa: F401
from loopserve.bench.prompt_sched import (
    CallRecorder,
    InvalidRunError,
    blocks_for,
    build_engine,
    machine_info,
    median_of,
    model_dir_for,
    ouro_config,
    pyplot,
    random_prompts,
    write_outputs,
)
from loopserve.engine.llm_engine import LLMEngine
from loopserve.errors import ConfigError
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams
from loopserve.workloads.arms import prompt_arm_args
from loopserve.workloads.interference import InterferenceRun, interference_stats
from loopserve.workloads.metrics import window_gaps


@dataclass(frozen=True, slots=True)
class Workload:
    decode_prompts: list[list[int]]
    decode_traces: list[tuple[int, ...]]
    decode_max_tokens: int
    prompts: list[list[int]]
    inject_at_tokens: list[int]


def make_workload(args: argparse.Namespace, vocab_size: int, num_loops: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    decode_prompts = random_prompts(
        [args.decode_prompt_len] * args.num_decode, vocab_size, args.seed
    )
    traces = [
        tuple(int(x) for x in rng.integers(1, num_loops + 1, size=args.decode_max_tokens))
        for _ in range(args.num_decode)
    ]
    prompts = random_prompts(args.prompt_lens, vocab_size, args.seed + 1)
    return Workload(decode_prompts, traces, args.decode_max_tokens, prompts, args.inject_at)


def drive(
    engine: LLMEngine, work: Workload, recorder: CallRecorder
) -> tuple[list[RequestOutput], list[RequestOutput], int]:
    """Step until every injected prompt has its first token, then abort the population.

    Returns (population outputs, prompt outputs, index of the first step of the window)."""
    D = engine.num_loops
    for i, (prompt, trace) in enumerate(zip(work.decode_prompts, work.decode_traces)):
        params = SamplingParams(
            max_tokens=work.decode_max_tokens, temperature=0.0, ignore_eos=True, exit_trace=trace
        )
        engine.add_request(f"d{i}", prompt, params)
    prompt_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, exit_trace=(D,))
    progress = {f"d{i}": 0 for i in range(len(work.decode_prompts))}
    pending = sorted((at, j) for j, at in enumerate(work.inject_at_tokens))
    finished: dict[str, RequestOutput] = {}
    first_step = -1
    while len(finished) < len(work.prompts):
        while pending and pending[0][0] <= min(progress.values()):
            _, j = pending.pop(0)
            engine.add_request(f"p{j}", work.prompts[j], prompt_params)
            first_step = recorder.num_steps if first_step < 0 else first_step
        for out in engine.step():
            if out.error is not None:
                raise InvalidRunError(f"request {out.request_id} failed: {out.error}")
            if out.request_id in progress:
                if out.finished:
                    raise ConfigError(
                        f"decode request {out.request_id} finished before the injected prompts "
                        f"completed; raise --decode-max-tokens (now {work.decode_max_tokens})"
                    )
                progress[out.request_id] = len(out.token_ids)
            elif out.finished:
                finished[out.request_id] = out
    population = [engine.abort_request(rid) for rid in progress]
    assert all(p is not None for p in population)
    prompts = [finished[f"p{j}"] for j in range(len(work.prompts))]
    return population, prompts, first_step  # type: ignore[return-value]


def run_arm(engine: LLMEngine, work: Workload, arm: str) -> InterferenceRun:
    recorder = CallRecorder(engine)
    population, prompts, first_step = drive(engine, work, recorder)
    calls = recorder.summary(first_step)
    if prompt_arm_args(arm).get("mixed_prefill_decode") and calls.num_mixed_core_calls == 0:
        raise InvalidRunError(f"arm {arm} ran no core call mixing prompt and decode rows")
    start_s = min(p.metrics.arrival_s for p in prompts)
    end_s = max(p.metrics.first_token_s for p in prompts)  # type: ignore[type-var]
    window_s = end_s - start_s
    window = window_gaps([out.metrics.token_times_s for out in population], start_s, end_s)
    if not window.gaps_s:
        raise InvalidRunError(f"arm {arm}: no decode token inside the window; lengthen prompts")
    stats = interference_stats(
        window,
        window_s,
        [p.metrics.ttft_s for p in prompts],  # type: ignore[misc]
        prompt_token_loops=sum(len(p) for p in work.prompts) * engine.num_loops,
        num_first_tokens=len(prompts),
        num_core_calls=calls.num_core_calls,
        num_mixed_core_calls=calls.num_mixed_core_calls,
        prompt_rows_per_core_call=calls.prompt_rows_per_core_call,
        decode_rows_per_core_call=calls.decode_rows_per_core_call,
        prompt_rows_per_prompt_core_call=calls.prompt_rows_per_prompt_core_call,
    )
    return InterferenceRun(**stats)  # type: ignore[arg-type]


def run_interference(args: argparse.Namespace, model_dir: Path) -> dict:
    info = machine_info(loadavg_1m_start=os.getloadavg()[0])
    model_config = ouro_config(model_dir, "interference")
    D = model_config.num_loops
    work = make_workload(args, model_config.vocab_size, D)
    positions = [args.decode_prompt_len + args.decode_max_tokens - 1] * args.num_decode
    num_blocks = blocks_for(positions + args.prompt_lens, args.block_size, D)
    common = dict(
        chunk_size=args.prefill_chunk_size,
        num_blocks=num_blocks,
        max_num_seqs=args.num_decode + len(args.prompt_lens),
    )
    warm = build_engine(args, model_dir, args.arms[0], **common)
    warm_work = Workload(
        work.decode_prompts[:2], work.decode_traces[:2], work.decode_max_tokens,
        [p[: 2 * args.prefill_chunk_size] for p in work.prompts[:1]], [2],
    )  # fmt: skip
    drive(warm, warm_work, CallRecorder(warm))  # torch and allocator; not measured
    del warm
    runs: dict[str, list[InterferenceRun]] = {arm: [] for arm in args.arms}
    for round_idx in range(args.repeats):
        for arm in args.arms:  # interleaved: drift on the machine hits every arm alike
            engine = build_engine(args, model_dir, arm, **common)
            run = run_arm(engine, work, arm)
            runs[arm].append(run)
            del engine
            if not args.no_progress:  # one line per run, terminal or log
                print(
                    f"  round {round_idx + 1} {arm:<15} ITL p99 {run.itl_p99_ms:8.1f} ms, "
                    f"prompt {run.prompt_token_loops_per_s:8.1f} token-loops/s"
                )
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(num_loops=D, num_blocks=num_blocks, model_dir=str(model_dir))
    arms = {
        arm: {"median": asdict(median_of(r)), "runs": [asdict(x) for x in r]}
        for arm, r in runs.items()
    }
    return {"config": config, "machine": info, "arms": arms}


def format_interference(result: dict) -> str:
    header = (
        f"{'arm':<15} {'ITL p50':>8} {'p99':>8} {'max':>8} {'TPOT':>7} {'TTFT s':>7} "
        f"{'prompt tl/s':>11} {'out tok/s':>9} {'calls':>6} {'mixed':>6} {'P rows':>6} D rows"
    )
    lines = [header + "   (ms unless noted)", "-" * len(header)]
    for arm, data in result["arms"].items():
        m = data["median"]
        lines.append(
            f"{arm:<15} {m['itl_p50_ms']:>8.1f} {m['itl_p99_ms']:>8.1f} {m['itl_max_ms']:>8.1f} "
            f"{m['tpot_ms']:>7.1f} {m['ttft_mean_s']:>7.2f} {m['prompt_token_loops_per_s']:>11.1f} "
            f"{m['output_tokens_per_s']:>9.1f} {m['num_core_calls']:>6.0f} "
            f"{m['num_mixed_core_calls']:>6.0f} {m['prompt_rows_per_core_call']:>6.1f} "
            f"{m['decode_rows_per_core_call']:>6.1f}"
        )
    return "\n".join(lines)


def plot_interference(result: dict):
    arms = list(result["arms"])
    med = [result["arms"][a]["median"] for a in arms]
    x = np.arange(len(arms))
    fig, (ax_itl, ax_ttft, ax_rate) = pyplot().subplots(1, 3, figsize=(13, 4))
    for k, (key, label) in enumerate(
        (("itl_p50_ms", "p50"), ("itl_p99_ms", "p99"), ("itl_max_ms", "max"))
    ):
        ax_itl.bar(x + (k - 1) * 0.27, [m[key] for m in med], 0.27, label=label)
    ax_itl.set_ylabel("decode ITL (ms)")
    ax_itl.set_yscale("log")
    ax_ttft.bar(x, [m["ttft_mean_s"] for m in med], 0.5)
    ax_ttft.set_ylabel("TTFT of injected prompts, mean (s)")
    ax_rate.bar(
        x - 0.2, [m["prompt_token_loops_per_s"] for m in med], 0.4, label="prompt token-loops/s"
    )
    ax_rate.bar(x + 0.2, [m["output_tokens_per_s"] for m in med], 0.4, label="output tokens/s")
    ax_rate.set_yscale("log")
    for ax in (ax_itl, ax_ttft, ax_rate):
        ax.set_xticks(x, arms, rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    ax_itl.legend()
    ax_rate.set_ylim(top=ax_rate.get_ylim()[1] * 5)  # room for the legend above the bars
    ax_rate.legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(
        f"decode interference: {cfg['num_decode']} decoding, prompts {cfg['prompt_lens']}, "
        f"chunk {cfg['prefill_chunk_size']}, budget {cfg['max_num_batched_tokens']}"
    )
    fig.tight_layout()
    return fig


def main_from_args(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.num_decode < 1:
        raise ConfigError("--repeats and --num-decode must be >= 1")
    if len(args.inject_at) != len(args.prompt_lens):
        raise ConfigError("--inject-at needs one value per --prompt-lens entry")
    if max(args.inject_at) >= args.decode_max_tokens:
        raise ConfigError("every --inject-at value must be < --decode-max-tokens")
    if args.threads:
        torch.set_num_threads(args.threads)
    max_positions = max(args.prompt_lens + [args.decode_prompt_len + args.decode_max_tokens])
    with tempfile.TemporaryDirectory(prefix="loopserve-interference-") as tmp:
        model_dir = model_dir_for(args, tmp, max_positions)
        result = run_interference(args, model_dir)
    print(format_interference(result))
    write_outputs(result, args, plot_interference)
    return 0
