"""Latency measures shared by the benchmarks and the simulator.

`window_gaps` is the decode-interference benchmarks' inter-token latency: the gaps between
consecutive tokens of each request whose later token falls inside a measurement window
(start, end], measured the same way on a real engine's token times and on simulated ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WindowGaps:
    """Inter-token gaps of several requests whose later token falls in (start, end]."""

    gaps_s: list[float]
    per_request_mean_s: list[float]  # mean gap of each request with at least one gap
    num_tokens: int  # tokens stamped inside the window


def window_gaps(token_times: list[list[float]], start_s: float, end_s: float) -> WindowGaps:
    """ITL inside a measurement window (the decode-interference benchmarks' definition)."""
    gaps: list[float] = []
    per_request: list[float] = []
    num_tokens = 0
    for times in token_times:
        mine = [b - a for a, b in zip(times, times[1:]) if start_s < b <= end_s]
        num_tokens += sum(1 for t in times if start_s < t <= end_s)
        gaps += mine
        if mine:
            per_request.append(sum(mine) / len(mine))
    return WindowGaps(gaps, per_request, num_tokens)
