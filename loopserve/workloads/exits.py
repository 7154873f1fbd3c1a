"""Exit distributions shared by the tools: how many loops each generated token uses.

`OURO_1P4B_T05` is Ouro-1.4B's trained exit gate at threshold 0.5, measured on GSM8K decode
tokens: P(exit after 1, 2, 3, 4 loops) = (0.0, 0.043, 0.877, 0.080). The Huginn-0125 ones are
step counts its authors recorded (see `HUGINN_0125_LATENT_DIFF_COUNTS`). `exit_distribution`
parses the names the benchmarks and the simulator accept; `exit_probabilities` is the
probability vector of a named distribution (what `bench throughput` samples traces from).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loopserve.errors import ConfigError

# Trained Ouro-1.4B gate at threshold 0.5 (GSM8K decode tokens): P(loops = 1..4).
OURO_1P4B_T05 = (0.0, 0.043, 0.877, 0.080)
# Huginn-0125 at r = 32: how many generated tokens used 1..32 steps, as its authors recorded
# them in the output cells of their demo notebook (`examples/inference_demo.ipynb` of the
# public repository seal-rg/recurrent-pretraining, commit bafbb14): one greedy chat answer to
# a GSM8K-style question, lookup latest-m4, their adaptive generation. A token recorded as 0
# never fired its criterion (the notebook's code leaves 0 then): it ran all 32 steps. The
# prompt's own entry (the first) is left out. latent-diff at its default threshold 0.03: 154
# tokens, mean 25.97 steps; argmax-stability at 10 stable steps: 130 tokens, mean 13.80.
HUGINN_0125_LATENT_DIFF_COUNTS = (0,) * 19 + (2, 7, 17, 27, 10, 11, 10, 10, 18, 15, 13, 4, 10)
HUGINN_0125_ARGMAX10_COUNTS = (0,) * 10 + (
    56, 17, 10, 8, 11, 6, 2, 6, 1, 2, 1, 2, 2, 1, 2, 1, 1, 0, 0, 0, 0, 1,
)  # fmt: skip
MEASURED_COUNTS = {
    "huginn_0125_latent_diff": HUGINN_0125_LATENT_DIFF_COUNTS,
    "huginn_0125_argmax10": HUGINN_0125_ARGMAX10_COUNTS,
}
NAMED_EXIT_DISTRIBUTIONS = ("ouro_1p4b_t0.5", "uniform", "full", *MEASURED_COUNTS)


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

    `ouro_1p4b_t0.5` (needs D = 4), `huginn_0125_latent_diff` and `huginn_0125_argmax10`
    (need D = 32), `uniform` (1..D equally likely), `full` (always D),
    `probs:p1,p2,...,pD` (explicit, normalised), `trace:l1,l2,...` (replayed cyclically).
    """
    if spec == "ouro_1p4b_t0.5":
        if num_loops != len(OURO_1P4B_T05):
            raise ConfigError(f"{spec} is defined for 4 loops; this model has {num_loops}")
        return ExitDistribution(spec, OURO_1P4B_T05)
    if spec in MEASURED_COUNTS:
        counts = MEASURED_COUNTS[spec]
        if num_loops != len(counts):
            raise ConfigError(
                f"{spec} is defined for {len(counts)} steps; this model has {num_loops}"
            )
        return ExitDistribution(spec, tuple(c / sum(counts) for c in counts))
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


def exit_probabilities(name: str, num_loops: int) -> tuple[float, ...]:
    """P(exit after 1..D loops) of a named distribution (`uniform`, `full`, `ouro_1p4b_t0.5`)."""
    if name not in NAMED_EXIT_DISTRIBUTIONS:
        raise ConfigError(
            f"--exit-dist must be one of {', '.join(NAMED_EXIT_DISTRIBUTIONS)}; got {name!r}"
        )
    return exit_distribution(name, num_loops).probs
