"""Prompt-scheduling benchmarks: shared machinery and `loopserve bench wcpb`.

`bench wcpb` measures prompt throughput of wavefront chunked prefill (WCPB) against atomic
chunked prefill: a few long prompts (`max_tokens=1`, so the run is all prompt work), one row
budget (`max_num_batched_tokens`), a sweep of chunk sizes. Per (arm, chunk) it reports prompt
tokens/s, wall time, prompt core calls and mean rows per prompt core call. Arms run
interleaved (A, B, A, B, ...) on a fresh engine each run; every metric is the median over
`--repeats` rounds. Output: a table, a JSON file and a matplotlib figure.

Shared with `bench interference` (`loopserve.bench.prompt_interference`): the arm table, the
synthetic model, engine construction, and `CallRecorder`, an engine-core observer that
counts rows by kind in every core call of a step (an atomic prompt item runs `num_depths`
core calls inside one step).

Defaults scale the GPU setting (4 x 8064-token prompts, budget 1024) down 4x for a 2-core CPU:
4 x 2048 tokens, budget 256 = 4 prompts x D=4 depths x chunk 16, so wavefront at chunk 16 is
not budget-bound. This module does not judge targets; `docs/benchmarks.md` records results.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch

from loopserve.bench.args import add_model_args  # noqa: F401  (re-export)
from loopserve.bench.args import add_wcpb_args as add_cli_args  # noqa: F401
from loopserve.bench.common import (  # noqa: F401  (re-exported for bench interference)
    blocks_for,
    machine_info,
    median_of,
    model_dir_for,
    ouro_config,
    pyplot,
    random_prompts,
    write_outputs,
)
from loopserve.contracts import ItemKind, RunnerOutput, SchedulerOutput
from loopserve.engine.llm_engine import LLMEngine
from loopserve.errors import ConfigError, LoopserveError
from loopserve.sampling_params import SamplingParams
from loopserve.workloads.arms import prompt_arm_args

T = TypeVar("T")


class InvalidRunError(LoopserveError, RuntimeError):
    """A run did not exercise what its arm claims (e.g. a mixed arm without mixed calls)."""


@dataclass(frozen=True, slots=True)
class CoreCall:
    step: int  # 0-based index of the engine step that ran it
    prompt_rows: int
    decode_rows: int


@dataclass(frozen=True, slots=True)
class CallSummary:
    num_core_calls: int
    num_prompt_core_calls: int  # calls with at least one prompt row
    num_mixed_core_calls: int  # calls with prompt and decode rows
    prompt_rows_per_prompt_core_call: float
    prompt_rows_per_core_call: float
    decode_rows_per_core_call: float


class CallRecorder:
    """Observes every executed step of `engine.core`; records the rows of each core call by
    kind."""

    def __init__(self, engine: LLMEngine) -> None:
        self.calls: list[CoreCall] = []
        self.num_steps = 0
        self.remove = engine.core.add_observer(self._record)

    def _record(self, scheduled: SchedulerOutput, _output: RunnerOutput) -> None:
        groups = scheduled.row_groups()
        if groups:
            # Loop k of a step runs the groups with more than k depths (atomic prompts: all
            # D); replay rows count as decode rows.
            for k in range(max(group.num_depths for group in groups)):
                active = [group for group in groups if k < group.num_depths]
                prompt = sum(g.token_count for g in active if g.kind == ItemKind.PROMPT)
                decode = sum(g.token_count for g in active) - prompt
                self.calls.append(CoreCall(self.num_steps, prompt, decode))
            self.num_steps += 1

    def summary(self, first_step: int = 0, end_step: int | None = None) -> CallSummary:
        """Counts over the core calls of steps in [first_step, end_step)."""
        end = self.num_steps if end_step is None else end_step
        calls = [c for c in self.calls if first_step <= c.step < end]
        num_prompt = sum(1 for c in calls if c.prompt_rows)
        prompt_rows = sum(c.prompt_rows for c in calls)
        return CallSummary(
            num_core_calls=len(calls),
            num_prompt_core_calls=num_prompt,
            num_mixed_core_calls=sum(1 for c in calls if c.prompt_rows and c.decode_rows),
            prompt_rows_per_prompt_core_call=prompt_rows / max(1, num_prompt),
            prompt_rows_per_core_call=prompt_rows / max(1, len(calls)),
            decode_rows_per_core_call=sum(c.decode_rows for c in calls) / max(1, len(calls)),
        )


def build_engine(
    args: argparse.Namespace, model_dir: Path, arm: str, *, chunk_size: int, **overrides: object
) -> LLMEngine:
    engine_args: dict[str, object] = dict(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=chunk_size,
        fill_prompt_chunks=getattr(args, "fill_prompt_chunks", True),
        exit_mode="trace",
        **prompt_arm_args(arm),
    )
    engine_args.update(overrides)
    return LLMEngine.from_engine_args(**engine_args)


@dataclass(frozen=True, slots=True)
class PromptRun:
    """One run of one arm at one chunk size over all prompts."""

    prompt_tokens: int
    wall_s: float
    prompt_tokens_per_s: float
    num_steps: int
    num_prompt_core_calls: int
    mean_rows_per_prompt_core_call: float
    prompt_tokens_per_cpu_s: float  # process CPU time: steadier than wall on a shared machine
    host_overhead_share: float


def run_prompts(engine: LLMEngine, prompts: list[list[int]], tag: str) -> tuple[PromptRun, list]:
    """All prompts at once, `max_tokens=1`; returns the run and the first tokens."""
    recorder = CallRecorder(engine)
    engine.reset_stats()
    params = SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, exit_trace=(engine.num_loops,)
    )
    start_s, start_cpu_s = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    first_tokens: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                raise InvalidRunError(f"request {out.request_id} failed: {out.error}")
            if out.finished:
                first_tokens[out.request_id] = out.token_ids[0]
    wall_s, cpu_s = time.perf_counter() - start_s, time.process_time() - start_cpu_s
    calls = recorder.summary()
    num_tokens = sum(len(p) for p in prompts)
    run = PromptRun(
        prompt_tokens=num_tokens,
        wall_s=wall_s,
        prompt_tokens_per_s=num_tokens / wall_s,
        num_steps=engine.stats.num_steps,
        num_prompt_core_calls=calls.num_prompt_core_calls,
        mean_rows_per_prompt_core_call=calls.prompt_rows_per_prompt_core_call,
        prompt_tokens_per_cpu_s=num_tokens / cpu_s,
        host_overhead_share=engine.stats.host_overhead_share,
    )
    return run, [first_tokens[f"{tag}-{i}"] for i in range(len(prompts))]


def run_wcpb(args: argparse.Namespace, model_dir: Path) -> dict:
    info = machine_info(loadavg_1m_start=os.getloadavg()[0])
    model_config = ouro_config(model_dir, "wcpb")
    D, vocab = model_config.num_loops, model_config.vocab_size
    prompts = random_prompts(args.prompt_lens, vocab, args.seed)
    num_blocks = blocks_for(args.prompt_lens, args.block_size, D)
    common = dict(num_blocks=num_blocks, max_num_seqs=len(prompts))
    smallest = min(args.chunk_sizes)
    warm = build_engine(args, model_dir, args.arms[0], chunk_size=smallest, **common)
    run_prompts(warm, [p[: 4 * smallest] for p in prompts], "warmup")  # torch and allocator
    del warm
    rows = []
    for chunk in args.chunk_sizes:
        runs: dict[str, list[PromptRun]] = {arm: [] for arm in args.arms}
        tokens: dict[str, list[int]] = {}
        for round_idx in range(args.repeats):
            for arm in args.arms:  # interleaved: drift on the machine hits every arm alike
                engine = build_engine(args, model_dir, arm, chunk_size=chunk, **common)
                run, tokens[arm] = run_prompts(engine, prompts, f"r{round_idx}")
                runs[arm].append(run)
                del engine  # free its KV before the next engine allocates
                if not args.no_progress:  # one line per run, terminal or log
                    print(f"  chunk {chunk:>4} {arm:<15} {run.prompt_tokens_per_s:8.1f} tok/s")
        agree = len({tuple(t) for t in tokens.values()}) == 1
        for arm, arm_runs in runs.items():
            rows.append(
                dict(arm=arm, chunk_size=chunk, median=asdict(median_of(arm_runs)),
                     first_tokens_agree=agree, runs=[asdict(r) for r in arm_runs])
            )  # fmt: skip
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(num_loops=D, num_blocks=num_blocks, model_dir=str(model_dir))
    return {"config": config, "machine": info, "results": rows, "ratios": ratios(rows)}


RATIO_KEYS = ("mean_rows_per_prompt_core_call", "prompt_tokens_per_s", "prompt_tokens_per_cpu_s")


def ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """wavefront / atomic per chunk size (keys: chunk sizes), where both ran."""
    by = {(r["arm"], r["chunk_size"]): r["median"] for r in rows}
    both = [c for arm, c in by if arm == "wavefront" and ("atomic", c) in by]
    return {
        str(c): {k: by["wavefront", c][k] / by["atomic", c][k] for k in RATIO_KEYS} for c in both
    }


def format_wcpb(result: dict) -> str:
    header = "arm             chunk   tok/s tok/cpu-s  wall s P calls rows/call host %"
    lines = [header, "-" * len(header)]
    for row in result["results"]:
        m = row["median"]
        lines.append(
            f"{row['arm']:<15} {row['chunk_size']:>5} {m['prompt_tokens_per_s']:>7.1f} "
            f"{m['prompt_tokens_per_cpu_s']:>9.1f} "
            f"{m['wall_s']:>7.2f} {m['num_prompt_core_calls']:>7.0f} "
            f"{m['mean_rows_per_prompt_core_call']:>9.1f} {100 * m['host_overhead_share']:>5.1f}%"
        )
    for chunk, r in result["ratios"].items():
        rows_x, rate_x, cpu_x = (r[k] for k in RATIO_KEYS)
        lines.append(
            f"wavefront/atomic @ chunk {chunk}: rows/call {rows_x:.2f}x, tok/s {rate_x:.2f}x, "
            f"tok/cpu-s {cpu_x:.2f}x"
        )
    return "\n".join(lines)


def plot_wcpb(result: dict):
    fig, (ax_rows, ax_rate) = pyplot().subplots(1, 2, figsize=(10, 4))
    for arm in dict.fromkeys(r["arm"] for r in result["results"]):
        rows = sorted((r["chunk_size"], r["median"]) for r in result["results"] if r["arm"] == arm)
        chunks = [c for c, _ in rows]
        ax_rows.plot(
            chunks, [m["mean_rows_per_prompt_core_call"] for _, m in rows], "o-", label=arm
        )
        ax_rate.plot(chunks, [m["prompt_tokens_per_s"] for _, m in rows], "o-", label=arm)
    budget = result["config"]["max_num_batched_tokens"]
    for ax, ylabel in ((ax_rows, "rows per prompt core call"), (ax_rate, "prompt tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["config"]["chunk_sizes"], map(str, result["config"]["chunk_sizes"]))
        ax.set_xlabel("prefill chunk size (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_rows.axhline(budget, color="grey", ls="--", lw=1)  # the row budget
    fig.suptitle(f"WCPB vs atomic: {len(result['config']['prompt_lens'])} prompts, budget {budget}")
    fig.tight_layout()
    return fig


def main_from_args(args: argparse.Namespace) -> int:
    sizes = args.chunk_sizes
    if args.repeats < 1 or max(sizes) > args.max_num_batched_tokens or len(set(sizes)) < len(sizes):
        raise ConfigError(
            "need --repeats >= 1 and distinct --chunk-sizes <= --max-num-batched-tokens"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="loopserve-wcpb-") as tmp:
        model_dir = model_dir_for(args, tmp, max(args.prompt_lens) + 1)
        result = run_wcpb(args, model_dir)
    print(format_wcpb(result))
    write_outputs(result, args, plot_wcpb)
    return 0
