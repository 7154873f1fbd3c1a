"""Named GPU profiles for the simulated executor: peak numbers, efficiencies, overheads.

A `DeviceProfile` is what the cost model needs from a GPU: HBM capacity, peak HBM bandwidth,
peak dense BF16 tensor-core throughput, the fraction of each that real kernels achieve, and a
fixed host/launch overhead per kernel group (one core call, one coda, one sampling pass).
Peak numbers are the vendors' datasheet figures; the efficiencies are deliberately generic
(the same for every profile) and are not fitted to any benchmark target.

Sources (datasheet figures; "dense" = without 2:4 sparsity, i.e. half the headline number):
- H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet — 80 GB HBM3, 3.35 TB/s,
  BF16 1,979 TFLOP/s with sparsity -> 989 TFLOP/s dense.
- H200 SXM 141GB: NVIDIA H200 Tensor Core GPU datasheet — 141 GB HBM3e, 4.8 TB/s,
  BF16 1,979 TFLOP/s with sparsity -> 989 TFLOP/s dense (same compute die as H100).
- A100 SXM4 80GB: NVIDIA A100 Tensor Core GPU datasheet — 80 GB HBM2e, 2,039 GB/s,
  BF16 312 TFLOP/s dense (624 with sparsity).
- B200 (HGX B200): NVIDIA HGX/DGX B200 datasheet — 180 GB HBM3e per GPU (1,440 GB per
  8-GPU system), 8 TB/s, BF16 4.5 PFLOP/s with sparsity -> ~2.25 PFLOP/s dense.

Host link (swap preemption copies KV blocks over it, one direction at a time): H100 SXM5 and
H200 SXM datasheets list "PCIe Gen5: 128 GB/s" (both directions together), i.e. 64 GB/s per
direction; A100 SXM4 "PCIe Gen4: 64 GB/s" -> 32 GB/s per direction; for B200 we assume the
same PCIe Gen5 x16 host link as Hopper (64 GB/s per direction). A GH200 would use NVLink-C2C,
450 GB/s per direction (NVIDIA GH200 datasheet: 900 GB/s total). Swap copies are priced at
`bandwidth_efficiency` of that figure.

Efficiencies: streaming kernels (copy/triad) reach ~90% of HBM bandwidth on Hopper/Ampere,
and large BF16 GEMMs reach ~70-80% of dense tensor-core peak (cuBLAS). We use 0.90 and 0.75.
The per-call overhead models one CUDA-graph launch plus host work (~10 µs).
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.errors import ConfigError

GB = 10**9
TB = 10**12


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    hbm_bytes: int
    hbm_bandwidth_bytes_per_s: float
    peak_bf16_flops_per_s: float
    bandwidth_efficiency: float = 0.90
    compute_efficiency: float = 0.75
    call_overhead_s: float = 10e-6
    source: str = ""
    host_link_bytes_per_s: float = 64 * 10**9  # one direction (see the module docstring)
    # Device time of one kernel inside a CUDA graph beyond its roofline (launch gap, ramp and
    # tail), charged per kernel the family's layers launch (`cost_model.KERNEL_COUNTS`); 0:
    # not priced. `kernels_per_layer`: price that many per layer instead of the measured
    # count (a fused build's, to model it); None: the measured count. `fused_linears`: core
    # calls of up to 16 rows launch the counts of the runner's `fused_linears` build
    # (`cost_model.FUSED_LINEAR_KERNEL_COUNTS`) instead.
    kernel_s: float = 0.0
    kernels_per_layer: float | None = None
    fused_linears: bool = False

    def __post_init__(self) -> None:
        for name in ("bandwidth_efficiency", "compute_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ConfigError(f"{name} must be in (0, 1], got {value}")
        if self.call_overhead_s < 0:
            raise ConfigError(f"call_overhead_s must be >= 0, got {self.call_overhead_s}")
        if self.kernel_s < 0 or (self.kernels_per_layer is not None and self.kernels_per_layer < 0):
            raise ConfigError("kernel_s and kernels_per_layer must be >= 0")

    @property
    def effective_bandwidth(self) -> float:
        """Achievable HBM bytes per second."""
        return self.hbm_bandwidth_bytes_per_s * self.bandwidth_efficiency

    @property
    def effective_flops(self) -> float:
        """Achievable dense BF16 FLOP per second."""
        return self.peak_bf16_flops_per_s * self.compute_efficiency

    @property
    def effective_host_link(self) -> float:
        """Achievable device<->host bytes per second, one direction."""
        return self.host_link_bytes_per_s * self.bandwidth_efficiency


DEVICE_PROFILES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("h100", 80 * GB, 3.35 * TB, 989e12, source="NVIDIA H100 SXM5 datasheet"),
    "h200": DeviceProfile("h200", 141 * GB, 4.8 * TB, 989e12, source="NVIDIA H200 SXM datasheet"),
    "a100": DeviceProfile(
        "a100",
        80 * GB,
        2.039 * TB,
        312e12,
        source="NVIDIA A100 SXM4 80GB datasheet",
        host_link_bytes_per_s=32 * GB,
    ),
    "b200": DeviceProfile("b200", 180 * GB, 8.0 * TB, 2250e12, source="NVIDIA HGX B200 datasheet"),
}


def get_device_profile(name: str) -> DeviceProfile:
    try:
        return DEVICE_PROFILES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown device profile {name!r}; choose one of {', '.join(DEVICE_PROFILES)}"
        ) from None
