"""Serving-benchmark results on disk: the JSON record and the latency figure."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from loopserve.bench.serve_metrics import BenchmarkMetrics, RequestRecord, tpot_ms


@dataclass(frozen=True)
class BenchmarkResult:
    config: dict[str, Any]
    started_at: str
    duration_s: float
    metrics: BenchmarkMetrics
    records: list[RequestRecord] = field(default_factory=list)


class ResultPaths(NamedTuple):
    json_path: Path
    png_path: Path


def _chunk_times_s(record: RequestRecord) -> np.ndarray:
    """Arrival of each text chunk relative to the benchmark start."""
    return record.start_s + record.ttft_s + np.concatenate(([0.0], np.cumsum(record.itl_s)))


def _plot(result: BenchmarkResult, png_path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: optional dependency
    from matplotlib.figure import Figure

    ok = [r for r in result.records if r.success]
    fig = Figure(figsize=(15, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).ravel()
    series = {
        "TTFT": [r.ttft_s * 1000.0 for r in ok],
        "TPOT": [t for r in ok if (t := tpot_ms(r)) is not None],
        "ITL": [gap * 1000.0 for r in ok for gap in r.itl_s],
        "E2E latency": [r.e2e_s * 1000.0 for r in ok],
    }
    for ax, (name, values) in zip(axes, series.items()):
        values_ms = np.sort(values)
        ax.step(values_ms, np.arange(1, len(values_ms) + 1) / max(len(values_ms), 1), where="post")
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    num_bins = int(min(120, max(10, result.duration_s)))
    edges_s = np.linspace(0.0, max(result.duration_s, 1e-6), num_bins + 1)
    width_s = edges_s[1] - edges_s[0]
    times_s = [_chunk_times_s(r) for r in ok]
    # A chunk may carry several tokens: spread each request's tokens evenly over its chunks.
    weights = [np.full(len(t), r.output_tokens / len(t)) for r, t in zip(ok, times_s)]
    tokens, _ = np.histogram(
        np.concatenate(times_s) if ok else [],
        bins=edges_s,
        weights=np.concatenate(weights) if ok else None,
    )
    centers_s = (edges_s[:-1] + edges_s[1:]) / 2
    axes[4].plot(centers_s, tokens / width_s)
    axes[4].set(title="Output throughput over time", xlabel="s since start", ylabel="tokens/s")
    starts_s = np.array([r.start_s for r in result.records])
    ends_s = starts_s + np.array([r.e2e_s for r in result.records])
    in_flight = [int(np.sum((starts_s <= t) & (t < ends_s))) for t in centers_s]
    axes[5].plot(centers_s, in_flight)
    axes[5].set(title="Requests in flight", xlabel="s since start", ylabel="requests")
    for ax in axes[4:]:
        ax.grid(alpha=0.3)
    config = result.config
    fig.suptitle(
        f"{config['model']} @ {config['endpoint']}  rate={config['request_rate']}  "
        f"concurrency={config['max_concurrency']}  n={config['num_requests']}"
    )
    fig.savefig(png_path, dpi=100)


def write_results(
    result: BenchmarkResult, out_dir: str | Path, stem: str | None = None
) -> ResultPaths:
    """Write `<stem>.json` (config, metrics, per-request records) and `<stem>.png` (plots)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or "serve-" + result.started_at.replace(":", "").replace("-", "")
    paths = ResultPaths(out_dir / f"{stem}.json", out_dir / f"{stem}.png")
    document = {
        "config": result.config,
        "started_at": result.started_at,
        "metrics": asdict(result.metrics),
        "requests": [asdict(r) for r in result.records],
    }
    paths.json_path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    _plot(result, paths.png_path)
    return paths
