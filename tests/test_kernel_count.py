"""`loopserve bench kernels`: kernels of one graphed decode loop, counted by dispatch on CPU.

The count is checked against an independent expectation (Ouro's layer has four GEMMs once
the loader merged its projections: q/k/v, o, gate/up, down), and bounded by today's totals so that it cannot silently grow
back once fusion (issue #32) lowers it: lower the bounds as kernels are fused."""

from __future__ import annotations

import pytest

from loopserve.bench.kernels import VIEW_OPS, count_kernels

# Kernels per loop on the tiny checkpoints (2 Ouro layers, 4 Huginn core layers), measured
# on 2026-12-03 (docs/gpu.md, "Kernels per layer"): Ouro 139 before merged projections, 133
# before fused norms; Huginn 321 before fused norms.
BOUNDS = {"ouro": 62, "huginn": 194}


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_kernels_per_loop_are_counted_and_bounded(family):
    count = count_kernels(family)
    assert count.kernels_per_loop == sum(count.by_op.values()) > 0
    assert not set(count.by_op) & VIEW_OPS and count.views_per_loop > 0
    assert count.kernels_per_loop <= BOUNDS[family], count.by_op
    # norms and residual adds: the loop's first norm, then two fused calls per layer
    assert count.by_op["triton.add_norm_norm"] == 2 * count.num_layers + 1
    assert "aten.rsqrt" not in count.by_op
    if family == "ouro":  # q/k/v, o, gate/up, down per layer, nothing else is a GEMM
        assert count.by_op["aten.linear"] == 4 * count.num_layers
