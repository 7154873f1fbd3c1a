"""`bench throughput`'s workload: seeded requests with exit traces, their sampling parameters
per arm, and the KV blocks that hold them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loopserve.errors import ConfigError
from loopserve.sampling_params import SamplingParams
from loopserve.workloads.arms import Arm
from loopserve.workloads.datasets import uniform_lengths


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    exit_trace: tuple[int, ...] | None  # loops per output token; None: the gate decides


def make_workload(
    num_requests: int,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    exit_probs: tuple[float, ...] | None,
    seed: int,
) -> list[BenchRequest]:
    """Seeded requests; lengths uniform in len·[1 - ratio, 1 + ratio] (the `bench serve` rule)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    input_lens = uniform_lengths(rng, input_len, range_ratio, num_requests)
    output_lens = uniform_lengths(rng, output_len, range_ratio, num_requests)
    requests = []
    for prompt_len, out_len in zip(input_lens, output_lens):
        prompt = rng.integers(0, vocab_size, size=int(prompt_len)).tolist()
        trace = None
        if exit_probs is not None:
            loops = rng.choice(len(exit_probs), size=int(out_len), p=exit_probs) + 1
            trace = tuple(int(x) for x in loops)
        requests.append(BenchRequest(prompt, int(out_len), trace))
    return requests


def sampling_params(
    request: BenchRequest, arm: Arm, num_loops: int, exit_threshold: float
) -> SamplingParams:
    """Greedy, `ignore_eos`, exactly `output_len` tokens; full depth: trace all-D or no gate."""
    full, trace = arm.full_depth, request.exit_trace
    return SamplingParams(
        max_tokens=request.output_len,
        temperature=0.0,
        ignore_eos=True,
        exit_threshold=1.0 if full else exit_threshold,
        exit_trace=(num_loops,) if full and trace is not None else trace,
    )


def blocks_for(
    requests: list[BenchRequest], max_num_seqs: int, block_size: int, num_planes: int
) -> int:
    """KV blocks for the `max_num_seqs` largest requests at once: admission never waits on KV."""
    positions = [len(r.prompt_token_ids) + r.output_len - 1 for r in requests]
    per_request = sorted(-(-p // block_size) * num_planes for p in positions)
    return sum(per_request[-max_num_seqs:])
