"""`loopserve bench kernels`: kernels of one graphed decode loop, counted by dispatch on CPU.

The model is counted as the runner prepares it on CUDA (merged projections; fused norms,
rotary and SiLU-and-multiply) with the Triton attention backend, each Triton launch one
kernel. The count is checked against an independent expectation (per layer: four GEMMs,
two fused norm calls, one rotary that also writes K/V, one SiLU-and-multiply and a decode
attention launch) and bounded by today's totals so that it cannot silently grow back: lower
the bounds as kernels are fused."""

from __future__ import annotations

import pytest

from loopserve.bench.kernels import VIEW_OPS, count_kernels, counting, kernel_model, kernels_of
from loopserve.runner.fused_linear import MAX_ROWS
from loopserve.sim.cost_model import (
    FP8_WRITE_KERNELS,
    FUSED_LINEAR_KERNEL_COUNTS,
    FUSED_LINEAR_MAX_ROWS,
    HUGINN_0125,
    KERNEL_COUNTS,
    OURO_1P4B,
)

# Kernels per loop on the tiny checkpoints (2 Ouro layers, 4 Huginn core layers), measured
# on 2026-12-03 (docs/gpu.md, "Kernels per layer"): Ouro 139 before merged projections, 133
# before fused norms, 62 before fused rotary and SiLU-and-multiply with the torch attention
# backend; Huginn 321, then 194; then 26 and 53 before rotary moved into the K/V write;
# Huginn 49 before its rotary frequencies were cached and its adapter read the carried state
# without a concatenation (2026-12-06).
BOUNDS = {"ouro": 24, "huginn": 43}


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_kernels_per_loop_are_counted_and_bounded(family):
    count = count_kernels(family)
    layers = count.num_layers
    assert count.kernels_per_loop == sum(count.by_op.values()) > 0
    assert not set(count.by_op) & VIEW_OPS and count.views_per_loop > 0
    assert count.kernels_per_loop <= BOUNDS[family], count.by_op
    # norms and residual adds: the loop's first norm, then two fused calls per layer
    assert count.by_op["triton.add_norm_norm_kernel"] == 2 * layers + 1
    for kernel in ("rope_qkv_kernel", "silu_mul_kernel", "decode_kernel"):
        assert count.by_op[f"triton.{kernel}"] == layers, kernel
    assert "triton.write_kv_kernel" not in count.by_op  # rotary writes K/V itself
    assert not {"aten.rsqrt", "aten.silu", "aten.neg", "aten.index_put_"} & set(count.by_op)
    # q/k/v, o, gate/up, down per layer (Huginn's adapter besides), nothing else a GEMM
    assert count.by_op["aten.linear"] == 4 * layers + (family == "huginn")


def test_kernels_per_layer_meet_the_goal():
    """Split over two core depths: <= 10 kernels per layer for Ouro, Huginn's within 1.2x;
    the simulator prices what the counter counts."""
    ouro, huginn = kernel_model("ouro"), kernel_model("huginn")
    assert ouro.per_layer <= 10
    assert huginn.per_layer <= 1.2 * ouro.per_layer
    # Per core layer of a whole loop at the published shapes (the per-loop kernels shared
    # by 24 Ouro-1.4B layers, by Huginn-0125's 4): within 1.2x too.
    ouro_loop = ouro.per_layer + ouro.per_loop / OURO_1P4B.num_core_layers
    huginn_loop = huginn.per_layer + huginn.per_loop / HUGINN_0125.num_core_layers
    assert huginn_loop <= 1.2 * ouro_loop, (huginn_loop, ouro_loop)
    for model in (ouro, huginn):
        assert KERNEL_COUNTS[model.family] == (model.per_layer, model.per_loop), model


def test_the_torch_attention_backend_is_counted_too():
    count = count_kernels("ouro", attention_backend="torch")
    assert "aten.scaled_dot_product_attention" in count.by_op
    assert "triton.decode_kernel" not in count.by_op


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_fused_linears_run_a_layer_in_five_launches(family):
    """With `fused_linears` each layer is [add + norm + q/k/v + rotary + K/V write],
    attention, the output projection, [add + norm + gate/up], [SiLU + down]; a loop's first
    norm folds into its first GEMM and the rotary tables are read by position, so a loop adds
    only its last add + norm (and Huginn's adapter and carried-state concatenation)."""
    count = count_kernels(family, num_layers=2, fused_linears=True)  # 2 layers: interpreted
    layers, huginn = count.num_layers, family == "huginn"
    assert count.by_op["triton.fused_linear_kernel"] == 3 * layers
    assert count.by_op["aten.linear"] == layers + huginn  # o_proj (and the adapter)
    assert count.by_op["triton.decode_kernel"] == layers
    assert count.by_op["triton.add_norm_norm_kernel"] == 1
    assert not {"triton.rope_qkv_kernel", "triton.silu_mul_kernel", "aten.cos"} & set(count.by_op)
    # What the simulator prices (`simulate --fused-linears`); the split by `kernel_model` at
    # two depths gives the same (counted at one depth here to keep the suite short).
    per_layer, per_loop = FUSED_LINEAR_KERNEL_COUNTS[family]
    assert count.kernels_per_loop == per_layer * layers + per_loop
    assert per_layer == 5 and FUSED_LINEAR_MAX_ROWS == MAX_ROWS


@pytest.mark.parametrize("linears", [False, True])
def test_huginns_prelude_and_coda_run_the_cores_fused_blocks(linears, tmp_path, monkeypatch):
    """Once per token, Huginn's prelude (in the graphed step's enter) and coda with the
    final norms (its leave) run the same fused blocks as its core: every norm in a fused
    kernel (the loop-first norm, two per layer, the coda's ln_f before and after), and with
    `fused_linears` three fused GEMMs a layer. Before, each norm was 5 aten kernels there:
    74 and 83 kernels against 27 and 26 (15 and 14 with fused linears)."""
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
    from loopserve.runner.fused_ops import install_fused_kernels
    from loopserve.sampling_params import SamplingParams
    from tests.engine_utils import make_engine

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = make_engine(
        # one layer a block: what is counted is once per token (interpreted launches are slow)
        make_tiny_huginn_checkpoint(tmp_path, mean_recurrence=2, n_layers_in_recurrent_block=1,
                                    n_layers_in_prelude=1, n_layers_in_coda=1),  # fmt: skip
        graph_mode="emulate",
        attention_backend="triton", max_num_seqs=2,
    )  # fmt: skip
    install_fused_kernels(engine.model, linears=linears, max_positions=engine.max_model_len)
    for i in range(2):
        engine.add_request(f"k{i}", [3 + i], SamplingParams(max_tokens=2, temperature=0.0))
    graphs, seen = engine.runner.graphs, {"enter": [], "leave": []}
    for name in seen:
        setattr(graphs, name, counting(getattr(graphs, name), seen[name]))
    while engine.has_unfinished_requests():
        engine.step()
    config = engine.model.config
    layers = {"enter": config.n_layers_in_prelude, "leave": config.n_layers_in_coda}
    for name, calls in seen.items():
        assert calls, f"no graphed {name} ran"
        ops = kernels_of(calls[-1])
        assert not {"aten.pow", "aten.rsqrt", "aten.mean"} & set(ops), (name, ops)
        norms = ops["triton.add_norm_norm_kernel"]
        fused = ops.get("triton.fused_linear_kernel", 0)
        if linears:  # the branch's last norm (and the coda's first ln_f) stand alone
            assert fused == 3 * layers[name] and norms == 1 + (name == "leave"), (name, ops)
        else:
            assert fused == 0 and norms == 2 * layers[name] + 1 + (name == "leave"), (name, ops)


def test_fused_linears_keep_huginn_within_the_goal_of_ouro():
    """Per core layer of a whole loop at the published depths: Huginn-0125's 4 layers share
    3 per-loop kernels, Ouro-1.4B's 24 share 1; within 1.2x."""
    (o_layer, o_loop), (h_layer, h_loop) = FUSED_LINEAR_KERNEL_COUNTS.values()
    ouro = o_layer + o_loop / OURO_1P4B.num_core_layers
    huginn = h_layer + h_loop / HUGINN_0125.num_core_layers
    assert huginn <= 1.2 * ouro, (huginn, ouro)


def test_a_one_row_call_merges_its_split_attention_in_the_same_launch():
    """One row splits its attention over the GPU (here the backend's nominal 4 SMs: 4 KV
    heads' programs, 2 splits); the splits merge inside the decode launch, so one row launches
    what four rows launch, no reduce kernel (10 per layer before)."""
    one, four = count_kernels("ouro", rows=1), count_kernels("ouro")
    assert "triton.decode_reduce_kernel" not in one.by_op
    assert one.kernels_per_loop == four.kernels_per_loop


def test_bench_kernels_refuses_rows_it_cannot_count_as_asked(capsys):
    """`--rows 0` named the engine's max_num_seqs; `--fused-linears` with more rows than the
    fused path takes counted the merged GEMMs under the fused label."""
    from loopserve.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "kernels", "--rows", "0"])
    assert exit_info.value.code == 2 and "argument --rows" in capsys.readouterr().err
    assert main(["bench", "kernels", "--rows", str(MAX_ROWS + 1), "--fused-linears"]) == 2
    assert f"up to {MAX_ROWS} rows" in capsys.readouterr().err


def test_an_fp8_cache_costs_no_kernel_more():
    """`kv_cache_dtype` fp8: the rotary kernel writes K/V as fp8 bytes itself (`fp8_bits`),
    so a loop launches what it launches with the model's dtype, as the simulator prices it."""
    from loopserve.sim.cost_model import ModelShape

    count, plain = count_kernels("ouro", kv_cache_dtype="fp8_e4m3"), count_kernels("ouro")
    assert count.by_op == plain.by_op
    assert "triton.write_kv_kernel" not in count.by_op and "aten.clamp" not in count.by_op
    narrow, wide = (
        ModelShape.from_config(OURO_1P4B, kv_dtype_bytes=1),
        ModelShape.from_config(OURO_1P4B),
    )
    assert narrow.kernels_per_layer == wide.kernels_per_layer == KERNEL_COUNTS["ouro"][0]
    # Huginn's interleaved rotary leaves the 8-bit write to `write_kv`: one launch more a
    # layer, which the simulator adds
    # (two core layers: `kernel_model` counts that depth too, once per process)
    huginn = count_kernels("huginn", num_layers=2, kv_cache_dtype="fp8_e4m3")
    huginn_plain = count_kernels("huginn", num_layers=2)
    assert huginn.by_op["triton.write_kv_kernel"] == huginn.num_layers
    added = huginn.kernels_per_loop - huginn_plain.kernels_per_loop
    assert added == FP8_WRITE_KERNELS["huginn"] * huginn.num_layers
    huginn_shape = ModelShape.from_config(HUGINN_0125, kv_dtype_bytes=1)
    assert huginn_shape.kernels_per_layer == KERNEL_COUNTS["huginn"][0] + 1
    assert 2 * narrow.kv_bytes_per_token_per_depth == wide.kv_bytes_per_token_per_depth
    # with fused linears too: their q/k/v GEMM writes the bytes
    fused = count_kernels("ouro", num_layers=2, fused_linears=True, kv_cache_dtype="fp8_e5m2")
    assert fused.by_op == count_kernels("ouro", num_layers=2, fused_linears=True).by_op
