"""What the engine returns per request, and what one step produced for it.

`RequestDelta` is what the engine hands its output processor after a step: only what is new
for one request (plus its fixed facts by reference), so per-step output work does not grow
with the length of the output. `RequestOutput` is what callers read: with the request's
`output_kind` "cumulative" the whole output so far plus the step's delta (`new_*`), with
"delta" only what is new (token_ids == new_token_ids, text == new_text, ...), with
"final_only" one cumulative output when the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(slots=True)
class RequestMetrics:
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float | None
    token_times_s: tuple[float, ...] = ()
    num_cached_prompt_tokens: int = 0  # prompt positions served by the prefix cache
    num_preemptions: int = 0
    # Self-speculative decoding: drafts made, drafts the real token confirmed, drafts it
    # rejected (rolled back). Zero for a request that did not speculate.
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_rejected: int = 0
    spec_redrafted: int = 0  # drafts a deeper loop replaced before verification

    @property
    def spec_acceptance(self) -> float | None:
        """Accepted over verified drafts (None: no draft verified)."""
        verified = self.spec_accepted + self.spec_rejected
        return self.spec_accepted / verified if verified else None

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
    rank: int | None = None  # 1 + the number of more likely tokens (prompt logprobs)
    loops: int | None = None  # the loop whose output scored this prompt position


@dataclass(slots=True)
class RequestOutput:
    """Not frozen (like vLLM's): the engine builds one per request per step, and a frozen
    dataclass costs about 3x as much to build (docs/benchmarks.md, "Host work per core
    call")."""

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
    # Output tokens so far (the length of `token_ids` except for "delta" outputs, whose
    # cumulative fields hold only what is new).
    num_output_tokens: int = -1
    output_kind: str = "cumulative"
    # With `SamplingParams.prompt_logprobs`: one entry per prompt token, None for the first
    # (nothing precedes it). In "delta" outputs only the first output carries them.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        if self.num_output_tokens < 0:
            self.num_output_tokens = len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def mean_loops(self) -> float:
        return sum(self.exit_depths) / len(self.exit_depths) if self.exit_depths else 0.0


class RequestDelta(NamedTuple):
    """What one engine step produced for one request (see the module docstring). A NamedTuple:
    the engine builds one per request per step."""

    request_id: str
    prompt_token_ids: list[int]  # the request's own list, not a copy
    new_token_ids: list[int]
    new_exit_depths: list[int]
    new_logprobs: list[TokenLogprob] | None  # None when the request asked for none
    token_times_s: list[float]  # every output token's time so far: the request's own list
    num_output_tokens: int  # after this step
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    stop_token_id: int | None  # the stop token or EOS that finished it, if one did
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float | None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    new_prompt_logprobs: list[TokenLogprob] | None = None  # once, with the first output
    spec: tuple[int, int, int, int] = (0, 0, 0, 0)  # drafted, accepted, rejected, redrafted
