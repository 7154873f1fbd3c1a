"""What the engine returns per request: cumulative results plus this step's delta."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestMetrics:
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float | None
    token_times_s: tuple[float, ...] = ()
    num_cached_prompt_tokens: int = 0  # prompt positions served by the prefix cache
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s

    @property
    def itl_s(self) -> tuple[float, ...]:
        times = self.token_times_s
        return tuple(b - a for a, b in zip(times, times[1:]))


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    exit_depths: list[int]  # loops used per output token (1..D)
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None
    # This step's delta, for streaming.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_exit_depths: list[int] = field(default_factory=list)
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    error: str | None = None  # set when the request failed inside the engine

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def mean_loops(self) -> float:
        return sum(self.exit_depths) / len(self.exit_depths) if self.exit_depths else 0.0
