"""Simulated workloads: request lengths, arrival times and per-token exit depths.

A workload is a list of `SimRequest`s (id, arrival time, prompt and output lengths, and an
exit trace: loops used by each output token). Lengths come from ShareGPT through
`loopserve.bench.datasets` (token counts approximated by its documented rule, ceil(UTF-8
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

from loopserve.bench.datasets import sample_random, sample_sharegpt
from loopserve.errors import ConfigError

# Trained Ouro-1.4B gate at threshold 0.5 (DATA.md, GSM8K decode tokens): loops 1..4.
OURO_1P4B_T05 = (0.0, 0.043, 0.877, 0.080)
NAMED_EXIT_DISTRIBUTIONS = ("ouro_1p4b_t0.5", "uniform", "full")


@dataclass(frozen=True, slots=True)
class ExitDistribution:
    """Probabilities of using 1..D loops (`probs[i]` = P(loops = i + 1)), or a fixed trace."""

    name: str
    probs: tuple[float, ...]
    trace: tuple[int, ...] | None = None

    @property
    def num_loops(self) -> int:
        return len(self.probs)

    @property
    def mean_loops(self) -> float:
        if self.trace is not None:
            return sum(self.trace) / len(self.trace)
        return sum((i + 1) * p for i, p in enumerate(self.probs))

    def sample(self, rng: np.random.Generator, num_tokens: int) -> tuple[int, ...]:
        """Loops used by each of `num_tokens` tokens."""
        if self.trace is not None:
            reps = -(-num_tokens // len(self.trace))
            return (self.trace * reps)[:num_tokens]
        loops = rng.choice(self.num_loops, size=num_tokens, p=self.probs) + 1
        return tuple(loops.tolist())


def exit_distribution(spec: str, num_loops: int) -> ExitDistribution:
    """Parse a distribution name.

    `ouro_1p4b_t0.5` (needs D = 4), `uniform` (1..D equally likely), `full` (always D),
    `probs:p1,p2,...,pD` (explicit, normalised), `trace:l1,l2,...` (replayed cyclically).
    """
    if spec == "ouro_1p4b_t0.5":
        if num_loops != len(OURO_1P4B_T05):
            raise ConfigError(f"{spec} is defined for 4 loops; this model has {num_loops}")
        return ExitDistribution(spec, OURO_1P4B_T05)
    if spec == "uniform":
        return ExitDistribution(spec, tuple(1.0 / num_loops for _ in range(num_loops)))
    if spec == "full":
        return ExitDistribution(spec, tuple(float(i == num_loops - 1) for i in range(num_loops)))
    kind, _, body = spec.partition(":")
    try:
        values = [float(v) for v in body.split(",") if v.strip()]
    except ValueError:
        values = []
    if kind == "probs" and len(values) == num_loops and min(values) >= 0 and sum(values) > 0:
        total = sum(values)
        return ExitDistribution(spec, tuple(v / total for v in values))
    if kind == "trace" and values and all(v == int(v) and 1 <= v <= num_loops for v in values):
        probs = tuple(values.count(float(i + 1)) / len(values) for i in range(num_loops))
        return ExitDistribution(spec, probs, tuple(int(v) for v in values))
    raise ConfigError(
        f"unknown exit distribution {spec!r}; use one of {', '.join(NAMED_EXIT_DISTRIBUTIONS)}, "
        f"probs:p1,...,p{num_loops} or trace:l1,l2,... (loops in 1..{num_loops})"
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
        SimRequest(f"sim-{i}", arrival, prompt_len, output_len, dist.sample(exit_rng, output_len))
        for i, (arrival, (prompt_len, output_len)) in enumerate(zip(arrivals, lengths))
    ]
