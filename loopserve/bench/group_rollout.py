"""The group-rollout arm of `loopserve bench throughput` (`--group-size n`).

An RL rollout (GRPO and its kin) samples n continuations of each of G prompts and submits
them together. This arm replays that: the workload's first G = num_requests // n prompts,
each n times, sampled (temperature 1, a seed per sample, `ignore_eos`, the prompt's
`output_len`), exits by the model's gate at `--exit-threshold` (1.0 when it is not given;
prompt groups need the gate: an exit trace is per request), with new prompts every round
(the same ones rotated: nothing is in the prefix cache from an earlier round). Two engines
of the refill arm run it, interleaved round by round: `shared` (prompt groups on, scheduler/groups.py: one
prefill per prompt) and `independent` (`share_prompts=False`: n prefills per prompt).
Reported per arm: output tok/s, wall time, and the prompt work executed (prompt rows x the
loops each ran, `EngineStats.num_prompt_row_loops`), with the followers that forked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from loopserve.bench.common import median_of
from loopserve.bench.throughput_report import RunResult
from loopserve.bench.throughput_workload import BenchRequest
from loopserve.engine.llm_engine import LLMEngine
from loopserve.sampling_params import SamplingParams

ARMS = ("independent", "shared")


def group_workload(
    requests: list[BenchRequest], group_size: int, exit_threshold: float, round_idx: int = 0
) -> tuple[list[BenchRequest], list[SamplingParams]]:
    """G prompts x `group_size` samples, each group's samples one after another. Each round
    rotates the prompts' tokens by a round-specific amount, so no round's prompts are in the
    prefix cache from an earlier one (an RL rollout's next batch has new prompts)."""
    groups = max(1, len(requests) // group_size)
    work: list[BenchRequest] = []
    params: list[SamplingParams] = []
    for g, request in enumerate(requests[:groups]):
        shift = (round_idx + 1) % len(request.prompt_token_ids)
        ids = request.prompt_token_ids
        rotated = BenchRequest(ids[shift:] + ids[:shift], request.output_len, None)
        for i in range(group_size):
            work.append(rotated)
            params.append(
                SamplingParams(
                    max_tokens=request.output_len,
                    temperature=1.0,
                    seed=g * group_size + i,
                    ignore_eos=True,
                    exit_threshold=exit_threshold,
                )
            )
    return work, params


def run_group_rollout(
    requests: list[BenchRequest],
    *,
    group_size: int,
    exit_threshold: float,
    repeats: int,
    build: Callable[[bool, list[BenchRequest]], LLMEngine],
    run: Callable[[LLMEngine, list[BenchRequest], list[SamplingParams], str], RunResult],
    on_run: Callable[[str], None] = lambda label: None,
) -> dict[str, object]:
    """Both arms, a warm-up group then `repeats` interleaved rounds; `build(share_prompts,
    work)` makes an arm's engine, `run` runs one workload on it (`run_workload`)."""
    work, params = group_workload(requests, group_size, exit_threshold)
    engines = {name: build(name == "shared", work) for name in ARMS}  # (rotations: same sizes)
    runs: dict[str, list[RunResult]] = {name: [] for name in ARMS}
    row_loops: dict[str, list[int]] = {name: [] for name in ARMS}
    forked: dict[str, list[int]] = {name: [] for name in ARMS}
    for round_idx in range(-1, repeats):  # round -1 is the warm-up: one group
        work, params = group_workload(requests, group_size, exit_threshold, round_idx)
        for name in ARMS:
            engine = engines[name]
            n = group_size if round_idx < 0 else len(work)
            before = engine.core.stats().num_forked_requests
            result = run(engine, work[:n], params[:n], f"g{round_idx}")
            on_run(f"{'warm-up' if round_idx < 0 else f'round {round_idx + 1}'} group {name}")
            if round_idx >= 0:
                stats = engine.core.stats()
                runs[name].append(result)
                row_loops[name].append(stats.num_prompt_row_loops)
                forked[name].append(stats.num_forked_requests - before)
    medians = {name: median_of(runs[name]) for name in ARMS}
    shared, independent = medians["shared"], medians["independent"]
    return {
        "group_size": group_size,
        "groups": len(work) // group_size,
        "exit_threshold": exit_threshold,
        "arms": {
            name: {
                "median": asdict(medians[name]),
                "runs": [asdict(r) for r in runs[name]],
                "prompt_row_loops": row_loops[name][-1],
                "forked": forked[name][-1],
            }
            for name in ARMS
        },
        "shared_over_independent": {
            "tok_per_s": shared.output_tokens_per_s / independent.output_tokens_per_s,
            "prompt_row_loops": row_loops["shared"][-1] / row_loops["independent"][-1],
            "tok_per_s_per_round": [
                s.output_tokens_per_s / i.output_tokens_per_s
                for s, i in zip(runs["shared"], runs["independent"])
            ],
        },
    }


def format_group_rollout(group: dict) -> list[str]:
    lines = [
        f"group rollout: {group['groups']} prompts x {group['group_size']} samples "
        f"(temperature 1, gate at {group['exit_threshold']})",
        f"{'arm':<11} {'tok/s':>7} {'wall s':>7} {'prompt row-loops':>16} {'forked':>6}",
    ]
    for name, arm in group["arms"].items():
        m = RunResult(**arm["median"])
        lines.append(
            f"{name:<11} {m.output_tokens_per_s:>7.1f} {m.wall_s:>7.2f} "
            f"{arm['prompt_row_loops']:>16} {arm['forked']:>6}"
        )
    ratio = group["shared_over_independent"]
    rounds = ", ".join(f"{x:.2f}" for x in ratio["tok_per_s_per_round"])
    lines.append(
        f"shared over independent: {ratio['tok_per_s']:.2f}x tok/s (per round {rounds}), "
        f"{ratio['prompt_row_loops']:.3f}x prompt row-loops"
    )
    return lines
