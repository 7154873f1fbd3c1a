"""Simulated workloads: request lengths, arrival times and per-token exit depths.

A workload is a list of `SimRequest`s (id, arrival time, prompt and output lengths, and an
exit trace: loops used by each output token). Lengths come from ShareGPT through
`loopserve.workloads.datasets` (token counts approximated by its documented rule, ceil(UTF-8
bytes / 4), unless a tokenizer's `count_tokens` is passed) or from its synthetic sampler.
Arrivals are Poisson at a rate (exponential gaps) or all at t=0 (rate = inf, offline).
Exit depths are drawn per token from an `ExitDistribution`; the simulator replays them with
`exit_mode="trace"`, so no gate is needed. Everything is seeded; nothing here runs a model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loopserve.errors import ConfigError
from loopserve.workloads.datasets import sample_random, sample_sharegpt
from loopserve.workloads.exits import (  # noqa: F401  (re-exported for sim callers)
    NAMED_EXIT_DISTRIBUTIONS,
    OURO_1P4B_T05,
    ExitDistribution,
    exit_distribution,
)


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    exit_trace: tuple[int, ...]  # loops of output token i (the first token included)
    # Leading prompt tokens shared with other requests (a system prompt), for prefix caching;
    # the rest of the prompt is unique to the request.
    shared_prefix_len: int = 0


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. `request_rate` in requests/s; `math.inf` = all at t=0."""

    num_requests: int
    dataset: str = "sharegpt"  # or "synthetic"
    request_rate: float = math.inf
    exit_dist: str = "ouro_1p4b_t0.5"
    seed: int = 0
    input_len: int = 256  # synthetic only
    output_len: int = 256  # synthetic only
    range_ratio: float = 0.5  # synthetic only
    max_prompt_len: int = 1024  # ShareGPT filter (vLLM's rule)
    max_total_len: int = 2048  # ShareGPT filter (vLLM's rule)
    # A system prompt of this many tokens, the same for every request, put before each
    # sampled prompt (prefix-caching studies).
    shared_prefix_len: int = 0


def sample_lengths(
    spec: WorkloadSpec,
    *,
    count_tokens: Callable[[str], int] | None = None,
    conversations: list[tuple[str, str]] | None = None,
) -> list[tuple[int, int]]:
    """(prompt_len, output_len) per request, seeded by `spec.seed`."""
    if spec.dataset == "sharegpt":
        sampled = sample_sharegpt(
            spec.num_requests,
            count_tokens=count_tokens,
            seed=spec.seed,
            max_prompt_len=spec.max_prompt_len,
            max_total_len=spec.max_total_len,
            conversations=conversations,
        )
        if len(sampled) < spec.num_requests:
            raise ConfigError(
                f"ShareGPT yields only {len(sampled)} requests under the length filter; "
                f"asked for {spec.num_requests}"
            )
    elif spec.dataset == "synthetic":
        sampled = sample_random(
            spec.num_requests,
            input_len=spec.input_len,
            output_len=spec.output_len,
            range_ratio=spec.range_ratio,
            seed=spec.seed,
        )
    else:
        raise ConfigError(f"dataset must be 'sharegpt' or 'synthetic', got {spec.dataset!r}")
    return [(r.prompt_len, r.output_len) for r in sampled]


def poisson_arrivals(num_requests: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Arrival times of a Poisson process of `rate` requests/s (all 0.0 when rate is inf)."""
    if rate <= 0:
        raise ConfigError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    return np.cumsum(rng.exponential(1.0 / rate, size=num_requests)).tolist()


def build_workload(
    spec: WorkloadSpec,
    num_loops: int,
    *,
    lengths: list[tuple[int, int]] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> list[SimRequest]:
    """The requests of `spec`, in arrival order. Pass `lengths` to reuse a sampled dataset
    (e.g. the same requests at several rates): arrivals and exit traces still follow the seed."""
    if lengths is None:
        lengths = sample_lengths(spec, count_tokens=count_tokens)
    dist = exit_distribution(spec.exit_dist, num_loops)
    rng = np.random.default_rng(spec.seed)
    arrivals = poisson_arrivals(len(lengths), spec.request_rate, rng)
    exit_rng = np.random.default_rng([spec.seed, 1])  # independent of the arrival stream
    return [
        SimRequest(
            f"sim-{i}",
            arrival,
            spec.shared_prefix_len + prompt_len,
            output_len,
            dist.sample(exit_rng, output_len),
            shared_prefix_len=spec.shared_prefix_len,
        )
        for i, (arrival, (prompt_len, output_len)) in enumerate(zip(arrivals, lengths))
    ]
