"""The decode-interference workload: a decode population plus long prompts injected into it.

`InterferenceSpec` describes it (the simulator's GPU-sized defaults); `interference_stats`
turns one run's measurements into the fields of `InterferenceRun`, the same for `bench
interference` (a real engine on CPU) and `simulate --scenario interference` (the simulated
GPU). The window runs from the first injection to the last injected prompt's first token.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from loopserve.errors import ConfigError
from loopserve.workloads.metrics import WindowGaps


@dataclass(frozen=True)
class InterferenceSpec:
    num_decode: int = 64
    decode_prompt_len: int = 128
    decode_max_tokens: int = 1536  # must outlast the prompts; the KV of all must fit
    prompt_lens: tuple[int, ...] = (8064, 8064, 8064, 8064)
    inject_at: tuple[int, ...] = (8, 8, 8, 8)
    prefill_chunk_size: int = 512
    max_num_batched_tokens: int = 2048
    fill_prompt_chunks: bool = True  # new chunks cut to the rows their call has left
    exit_dist: str = "ouro_1p4b_t0.5"
    seed: int = 0

    def validate(self) -> None:
        if len(self.inject_at) != len(self.prompt_lens):
            raise ConfigError("inject_at needs one value per prompt length")
        if self.num_decode < 1 or max(self.inject_at) >= self.decode_max_tokens:
            raise ConfigError("need num_decode >= 1 and every inject_at < decode_max_tokens")


@dataclass(frozen=True)
class InterferenceRun:
    """What one arm did inside the measurement window (rows per core call count every
    depth's call; `prompt_rows_per_prompt_core_call` is None where a tool does not count
    prompt core calls)."""

    window_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    tpot_ms: float
    ttft_mean_s: float
    ttft_max_s: float
    prompt_token_loops_per_s: float
    output_tokens_per_s: float
    num_core_calls: int
    num_mixed_core_calls: int
    prompt_rows_per_core_call: float
    decode_rows_per_core_call: float
    prompt_rows_per_prompt_core_call: float | None = None


def interference_stats(
    window: WindowGaps,
    window_s: float,
    ttft_s: list[float],
    *,
    prompt_token_loops: int,
    num_first_tokens: int,
    **calls: float | int | None,
) -> dict[str, float | int | None]:
    """The fields of an `InterferenceRun`: ITL/TPOT from the population's gaps inside the
    window, TTFT of the injected prompts, throughputs over the window; `calls` are the
    core-call counts (`num_core_calls`, `num_mixed_core_calls`, rows per call...)."""
    itl_ms = 1e3 * np.asarray(window.gaps_s)
    return dict(
        window_s=window_s,
        itl_p50_ms=float(np.percentile(itl_ms, 50)),
        itl_p99_ms=float(np.percentile(itl_ms, 99)),
        itl_max_ms=float(itl_ms.max()),
        tpot_ms=1e3 * statistics.fmean(window.per_request_mean_s),
        ttft_mean_s=statistics.fmean(ttft_s),
        ttft_max_s=max(ttft_s),
        prompt_token_loops_per_s=prompt_token_loops / window_s,
        output_tokens_per_s=(window.num_tokens + num_first_tokens) / window_s,
        **calls,
    )
