"""Host time per core call, for the simulator: a line in the call's rows, fitted from
`loopserve bench host`.

The simulator's cost model prices device time. The engine also spends host time on every
core call (scheduling, input preparation, result application, output processing), once per
loop. `HostModel` prices it as `per_call_s + per_row_s * rows`; `HostModel.fit` fits that
line to `bench host` points (least squares), and `MEASURED_CPU` is the fit of the table in
docs/benchmarks.md (this repository's 2-core CPU machines; a faster host scales it down).

How the simulator uses it (`Simulator(host_model=...)`): a step's host time is the sum over
its core calls. Without async scheduling the step takes device + host; with it, the ideal
overlap, max(device, host) (an upper bound on what `async_scheduling` hides today: it
overlaps row selection and output processing, not input preparation; docs/simulator.md).
A step whose host time exceeds its device time is host-bound; the result reports their share.
Pure arithmetic; torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loopserve.errors import ConfigError


@dataclass(frozen=True, slots=True)
class HostModel:
    per_call_s: float
    per_row_s: float
    source: str = ""

    def call_s(self, rows: int) -> float:
        return self.per_call_s + self.per_row_s * rows

    def step_s(self, rows_per_core_call: Sequence[int]) -> float:
        return sum(self.call_s(rows) for rows in rows_per_core_call)

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]], source: str = "") -> HostModel:
        """Least-squares line through (rows, host seconds per call) points."""
        if len(points) < 2:
            raise ValueError("fitting a host model needs at least two (rows, seconds) points")
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        var = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
        return cls(max(0.0, mean_y - slope * mean_x), max(0.0, slope), source)


def step_time_s(device_s: float, host_s: float, *, overlap: bool) -> float:
    """Wall time of one step: serial, or with host and device work overlapped (ideal)."""
    return max(device_s, host_s) if overlap else device_s + host_s


# `loopserve bench host` (null core, Triton backend, graph buffers, 256-position contexts,
# one torch thread, 200 steps) on a 2-vCPU development machine (AVX-512), after the
# persistent decode batch; see docs/benchmarks.md ("Persistent decode batch").
MEASURED_CPU_POINTS: tuple[tuple[int, float], ...] = (
    (1, 141e-6),
    (8, 213e-6),
    (32, 295e-6),
    (128, 499e-6),
    (256, 824e-6),
)
MEASURED_CPU = HostModel.fit(MEASURED_CPU_POINTS, source="bench host, 2-vCPU development machine")


def load_host_model(spec: str | None) -> HostModel | None:
    """`--host-model`: None, 'cpu' (`MEASURED_CPU`) or a `bench host --output-json` file."""
    if spec is None:
        return None
    if spec == "cpu":
        return MEASURED_CPU
    try:
        record = json.loads(Path(spec).read_text())
        points = [(int(p["rows"]), float(p["host_us"]) * 1e-6) for p in record["points"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"--host-model {spec!r}: not 'cpu' nor a bench host JSON ({err})"
        ) from err
    return HostModel.fit(points, source=spec)
