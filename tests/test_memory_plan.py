"""The CUDA memory plan's arithmetic (pure functions; the profiling itself needs CUDA)."""

from __future__ import annotations

import pytest

from loopserve.config import CacheConfig, cuda_kv_budget, resolve_num_blocks
from loopserve.errors import ConfigError

GIB = 1024**3


def test_budget_is_utilization_share_minus_peak_and_graphs():
    # 80 GiB x 0.9 = 72 GiB; minus 3 GiB peak (weights + activations + non-torch) and 1 GiB of
    # graphs leaves 68 GiB.
    budget = cuda_kv_budget(
        total_bytes=80 * GIB, gpu_memory_utilization=0.9, peak_bytes=3 * GIB, graph_bytes=GIB
    )
    assert budget == int(80 * GIB * 0.9) - 4 * GIB
    assert budget == 73014444032


def test_budget_exhausted_names_every_term():
    with pytest.raises(ConfigError) as err:
        cuda_kv_budget(
            total_bytes=1000, gpu_memory_utilization=0.5, peak_bytes=400, graph_bytes=200
        )
    text = str(err.value)
    for term in ("1000", "0.5", "400", "200", "-100", "enforce_eager"):
        assert term in text


def test_profiled_budget_sizes_blocks_after_the_inflight_reserve():
    cache = CacheConfig()
    resolved = resolve_num_blocks(
        cache, bytes_per_block=1000, free_bytes=None, reserved_bytes=2500, budget_bytes=10_000
    )
    assert resolved.num_blocks == 7  # (10000 - 2500) // 1000
    explicit = CacheConfig(kv_cache_bytes=5000)
    assert (
        resolve_num_blocks(
            explicit,
            bytes_per_block=1000,
            free_bytes=None,
            reserved_bytes=2500,
            budget_bytes=10_000,
        ).num_blocks
        == 5
    )  # an explicit byte budget wins and is not reduced
