"""Calibrating a `DeviceProfile` from measured GPU timings (written by the GPU check).

File format (JSON, `format: "loopserve-calibration/1"`):

    {"format": "loopserve-calibration/1",
     "device_profile": "h200",            # the profile the fit starts from
     "device_name": "NVIDIA H200", "dtype": "bfloat16", "dry_run": false,
     "fitted": {"bandwidth_efficiency": 0.81, "compute_efficiency": 0.62,
                "call_overhead_s": 2.1e-05},
     "points": [{"kind": "decode_loop" | "prefill_call", "rows": 64, "context": 512,
                 "bytes": 3.1e9, "flops": 1.2e11,
                 "measured_s": 0.0009, "predicted_s": 0.0008}, ...],
     "throughput": [{"arm": "refill", "measured_tok_s": ..., "predicted_tok_s": ...}, ...]}

Only `device_profile` and `fitted` are needed to calibrate; the rest documents the run.
The fit: decode loops are HBM-bound, so `measured = overhead + bytes / (bw * eff_bw)` is a
least-squares line over the decode points (intercept = call overhead, slope gives the
bandwidth efficiency); prefill calls are compute-bound, so `eff_peak = flops / ((measured -
overhead) * peak)`, the median over prefill points. Efficiencies are clamped to (0, 1].
`load_calibrated_profile(path)` returns the named profile with the fitted numbers. Pure
arithmetic and JSON; no torch.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from loopserve.errors import ConfigError
from loopserve.sim.hardware import DeviceProfile, get_device_profile

FORMAT = "loopserve-calibration/1"


@dataclass(frozen=True, slots=True)
class TimingPoint:
    kind: str  # "decode_loop" or "prefill_call"
    rows: int
    context: int
    bytes: float
    flops: float
    measured_s: float
    predicted_s: float


def _clamp(value: float) -> float:
    return min(1.0, max(1e-3, value))


def fit_profile(profile: DeviceProfile, points: list[TimingPoint]) -> DeviceProfile:
    """`profile` with efficiencies and call overhead fitted to the measured points."""
    decode = [p for p in points if p.kind == "decode_loop"]
    prefill = [p for p in points if p.kind == "prefill_call"]
    overhead, bw_eff = profile.call_overhead_s, profile.bandwidth_efficiency
    if len(decode) >= 2 and len({p.bytes for p in decode}) >= 2:
        slope, intercept = statistics.linear_regression(
            [p.bytes for p in decode], [p.measured_s for p in decode]
        )
        if slope > 0:
            bw_eff = _clamp(1.0 / (slope * profile.hbm_bandwidth_bytes_per_s))
            overhead = max(0.0, intercept)
    compute_eff = profile.compute_efficiency
    effs = [
        p.flops / ((p.measured_s - overhead) * profile.peak_bf16_flops_per_s)
        for p in prefill
        if p.measured_s > overhead
    ]
    if effs:
        compute_eff = _clamp(statistics.median(effs))
    return dataclasses.replace(
        profile,
        bandwidth_efficiency=bw_eff,
        compute_efficiency=compute_eff,
        call_overhead_s=overhead,
        source=f"{profile.source}; calibrated",
    )


def calibration_record(
    base: DeviceProfile, fitted: DeviceProfile, points: list[TimingPoint], **extra: object
) -> dict:
    return {
        "format": FORMAT,
        "device_profile": base.name,
        **extra,
        "fitted": {
            "bandwidth_efficiency": fitted.bandwidth_efficiency,
            "compute_efficiency": fitted.compute_efficiency,
            "call_overhead_s": fitted.call_overhead_s,
        },
        "points": [dataclasses.asdict(p) for p in points],
    }


def load_calibrated_profile(path: str | Path) -> DeviceProfile:
    """The device profile named in a calibration file, with its fitted numbers applied."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read calibration file {path}: {err}") from err
    if record.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a {FORMAT} file (format={record.get('format')!r})")
    fitted = record.get("fitted", {})
    names = ("bandwidth_efficiency", "compute_efficiency", "call_overhead_s")
    if set(fitted) != set(names):
        raise ConfigError(f"{path}: 'fitted' must have exactly {', '.join(names)}")
    base = get_device_profile(record["device_profile"])
    return dataclasses.replace(
        base, **{name: float(fitted[name]) for name in names}, source=f"calibrated from {path}"
    )
