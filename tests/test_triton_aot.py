"""Ahead-of-time compiles of the engine's Triton kernels for sm_80, sm_90 and sm_100, on CPU.

The launchers run on `meta` tensors shaped like Ouro-1.4B (MHA 16/16) and a GQA 32/8 model
at head_dim 128, in bf16, fp16 and fp32, and what they would launch is compiled for real
targets (`loopserve.runner.attention.triton_aot`; the test compiles its `representative`
subset, 143 compiles in 84 s cold on a 2-vCPU VM under Triton 3.9, 2026-12-06;
`python -m loopserve.runner.attention.triton_aot` runs the
full sweep whose table is in docs/gpu.md). Every kernel must keep its registers:
no stack or local memory in bf16/fp16, none in fp32 prompt tiles, shared memory within the
target's limit. A second test counts the distinct compiles a mixed engine workload triggers.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("triton", reason="triton not installed (pip install -e '.[dev]')")

import torch  # noqa: E402

from loopserve.runner.attention import triton_aot  # noqa: E402
from loopserve.runner.attention.triton_jit import observe_launches  # noqa: E402
from loopserve.sampling_params import SamplingParams  # noqa: E402
from tests.engine_utils import make_engine, run_steps  # noqa: E402


def _needs_cuda_tools() -> None:
    """Skip where Triton's wheel brings no CUDA tools (ptxas, cuobjdump) for real compiles."""
    try:
        triton_aot._cuobjdump()
    except FileNotFoundError as err:
        pytest.skip(f"{err}")


@pytest.fixture(scope="module")
def sweep():
    _needs_cuda_tools()
    return triton_aot.representative()


def test_every_kernel_compiles_for_real_targets_without_spills(sweep):
    kernels = {(r.kernel, r.variant) for r in sweep}
    assert kernels == {
        ("write_kv_kernel", "write"), ("copy_slots_kernel", "finalize"),
        ("decode_kernel", "decode"), ("decode_kernel", "split_k"),
        ("decode_kernel", "split_k_lse"),
        ("decode_reduce_kernel", "split_k_lse"), ("prefill_kernel", "prompt"),
        ("decode_kernel", "graphed"),
        ("add_norm_norm_kernel", "norms"), ("rope_qkv_kernel", "rope"),
        ("rope_qkv_kernel", "rope_interleaved"), ("rope_qkv_kernel", "rope_write"),
        ("rope_qkv_kernel", "rope_interleaved_write"), ("silu_mul_kernel", "silu_mul"),
        ("fused_linear_kernel", "linear_qkv"), ("fused_linear_kernel", "linear_gate_up"),
        ("fused_linear_kernel", "linear_down"),
    }  # fmt: skip
    assert {r.target for r in sweep} == {80, 90, 100}
    # an 8-bit cache's forms: e5m2 on sm_80 (where e4m3 is refused), e4m3 on sm_90
    fp8 = {(r.shape, r.target) for r in sweep if "/kv-" in r.shape}
    assert fp8 == {("mha16/kv-e5m2", 80), ("mha16/kv-e4m3", 90)}
    assert {r.dtype for r in sweep} == {"bfloat16", "float16", "float32"}
    bad = [r for r in sweep if not triton_aot.acceptable(r)]
    assert bad == [], triton_aot.format_table(bad)
    assert all(0 < r.registers <= 255 for r in sweep)


def test_the_resource_rule_catches_a_spilling_configuration():
    """Control: the prompt kernel on sm_80 with one warp (each thread holds four times its
    share of the tile) spills thousands of bytes to the stack (measured: 3,720 under Triton
    3.9, 3,392 under 3.6), and the rule used above rejects it."""
    _needs_cuda_tools()
    shape = triton_aot.ModelShape("mha16", 16, 16, 128, torch.bfloat16)
    (launch,) = [lch for v, lch in triton_aot.engine_launches(shape, 80) if v == "prompt"]
    staged = dict(launch.constexprs, num_warps=1)
    result = triton_aot.compile_for(
        shape, "prompt", triton_aot.Launch(launch.kernel, launch.grid, launch.args, staged), 80
    )
    assert result.stack_bytes > 1024 and not triton_aot.acceptable(result)


def test_a_mixed_workload_triggers_one_compile_per_kernel_form(tiny_dir, monkeypatch):
    """Row counts, split counts, split lengths and table widths vary from call to call; with
    `do_not_specialize` they do not multiply compiles."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = make_engine(
        tiny_dir, attention_backend="triton", prefill_mode="wavefront",
        mixed_prefill_decode=True, max_num_seqs=6,
    )  # fmt: skip
    work = []
    for i, length in enumerate([2, 7, 15, 26, 5]):
        params = SamplingParams(max_tokens=2 + i % 3, temperature=0.0, exit_threshold=0.5,
                                ignore_eos=True)  # fmt: skip
        work.append((f"m{i}", [(13 * i + j) % 256 for j in range(length)], params, i))
    with observe_launches() as launches:
        run_steps(engine, work)
    keys = {triton_aot.specialization_key(launch) for launch in launches}
    by_kernel: dict[str, int] = {}
    for key in keys:
        by_kernel[key[0]] = by_kernel.get(key[0], 0) + 1
    rows = {launch.grid[0] for launch in launches if launch.kernel.fn.__name__ == "_decode_kernel"}
    assert len(launches) > 50 and len(rows) > 2  # calls of many sizes really ran
    # write, finalize, prompt: one each; decode: one-split and split forms; the reduce's
    # BLOCK_S is the split count's power of two (a few at most).
    assert by_kernel["_write_kv_kernel"] == 1 and by_kernel["_copy_slots_kernel"] == 1
    assert by_kernel["_prefill_kernel"] == 1
    assert by_kernel["_decode_kernel"] <= 2
    assert by_kernel.get("_decode_reduce_kernel", 0) <= 3


def _launched_and_compiled(
    family, tmp_path, *, linears=False, lengths=(2, 9, 1), small=False, kv_cache_dtype="auto"
):
    """(forms the engine launched on a mixed workload, forms `engine_launches` compiles at
    the model's shape with the backend's own settings). Two loops, one layer in the prelude
    and coda, two in the core (a layer-to-layer norm is another form than a loop's last);
    `small`: one (interpreted launches cost per program; forms do not depend on depth)."""
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
    from loopserve.models.tiny import make_tiny_checkpoint
    from loopserve.runner.fused_ops import install_fused_kernels

    core = 1 if small else 2
    if family == "huginn":
        layers = dict(n_layers_in_prelude=1, n_layers_in_recurrent_block=core, n_layers_in_coda=1)
        model_dir = make_tiny_huginn_checkpoint(tmp_path, mean_recurrence=2, **layers)
    else:
        model_dir = make_tiny_checkpoint(tmp_path, seed=0, num_layers=core, total_ut_steps=2)
    engine = make_engine(model_dir, attention_backend="triton", graph_mode="emulate",
                         prefill_mode="wavefront", mixed_prefill_decode=True, max_num_seqs=4,
                         kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    model = engine.model
    if hasattr(model, "merge_projections"):
        model.merge_projections()
    install_fused_kernels(model, linears=linears, max_positions=engine.max_model_len)
    work = []
    for i, length in enumerate(lengths):
        params = SamplingParams(max_tokens=3 + i % 2, temperature=0.0, exit_threshold=0.5,
                                ignore_eos=True)  # fmt: skip
        work.append((f"f{i}", [(11 * i + j) % 200 + 3 for j in range(length)], params, i))
    with observe_launches() as launches:
        run_steps(engine, work)
    assert engine.stats.num_graph_calls > 0
    launched = {triton_aot.launch_form(launch) for launch in launches}
    config = model.config
    backend = engine.runner.attention
    shape = triton_aot.ModelShape(
        family, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        torch.float32, block_size=backend.block_size, hidden=config.hidden_size,
        intermediate=config.intermediate_size, kv_dtype=engine.runner.kv_cache.dtype,
    )  # fmt: skip
    settings = triton_aot.LaunchSettings.of_backend(
        backend, max_model_len=engine.runner.graphs.max_blocks * backend.block_size,
        max_graph_rows=max(engine.runner.graphs.buckets),
    )  # fmt: skip
    # A narrow cache's shape compiles the forms that touch the cache; the model's dtype's
    # shape the rest (norms, rotary without the write, SiLU).
    shapes = {shape, dataclasses.replace(shape, kv_dtype=None)}
    compiled = {triton_aot.launch_form(lch) for each in shapes for _, lch in
                triton_aot.engine_launches(each, 90, settings=settings)}  # fmt: skip
    return launched, compiled


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_every_form_the_engine_launches_is_in_the_compiled_set(family, tmp_path, monkeypatch):
    """The engine as it runs on CUDA (decode graphs, merged projections, every fused kernel,
    the Triton backend; interpreted here) on a mixed workload: each kernel form it launches
    (`launch_form`: kernel, tensor dtypes, constexprs, warps and stages) is one that
    `engine_launches` compiles at the model's shape with the backend's own settings, so the
    ahead-of-time sweep at a GPU's settings misses no form the engine takes there."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # two short prompts decode together, the 9-token one alone at the end (split and merged)
    launched, compiled = _launched_and_compiled(family, tmp_path, lengths=(2, 3, 9))
    kernels = {form[0] for form in launched}
    assert {"_rope_qkv_kernel", "_decode_kernel", "_prefill_kernel"} <= kernels
    decode = [dict(form[2]) for form in launched if form[0] == "_decode_kernel"]
    assert {(f["SPLIT"], f["MERGE"]) for f in decode} >= {("True", "True"), ("False", "False")}
    missing = launched - compiled
    assert missing == set(), "\n".join(map(str, sorted(missing)))


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_every_form_the_fused_linears_launch_is_in_the_compiled_set(family, tmp_path, monkeypatch):
    """The same with `fused_linears` (calls of up to 16 rows run each layer's GEMMs fused),
    their tiles chosen as on a GPU (`WIDE_TILES_ON_CPU` off): every fused GEMM form the
    engine launches, and every other, is in the compiled set."""
    from loopserve.runner import fused_linear

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused_linear, "WIDE_TILES_ON_CPU", False)
    launched, compiled = _launched_and_compiled(
        family, tmp_path, linears=True, lengths=(2,), small=True
    )
    fused = {form for form in launched if form[0] == "_fused_linear_kernel"}
    assert len(fused) >= 3  # q/k/v with the K/V write, gate/up, down at least
    missing = launched - compiled
    assert missing == set(), "\n".join(map(str, sorted(missing)))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_every_form_an_fp8_engine_launches_is_in_the_compiled_set(
    kv_cache_dtype, tmp_path, monkeypatch
):
    """With an 8-bit cache the decode (graphed too) and prompt kernels read it as fp8 and
    the rotary kernel writes its bytes (a `uint8` view, `FP8` set): each such form is
    compiled (`FP8_SHAPES` in the sweep)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launched, compiled = _launched_and_compiled("ouro", tmp_path, lengths=(2, 5), small=True,
                                                kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    fp8 = "torch." + kv_cache_dtype.replace("fp8_", "float8_").replace("e4m3", "e4m3fn")
    reading = {form[0] for form in launched if (("key_cache_ptr", fp8) in form[1])}
    assert {"_decode_kernel", "_prefill_kernel"} <= reading
    rotary = {form for form in launched if form[0] == "_rope_qkv_kernel"}
    code = "1" if kv_cache_dtype == "fp8_e4m3" else "2"
    assert rotary and all(
        {("WRITE", "True"), ("FP8", code)} <= set(form[2]) and ("k_ptr", "torch.uint8") in form[1]
        for form in rotary
    )
    missing = launched - compiled
    assert missing == set(), "\n".join(map(str, sorted(missing)))


def test_the_decode_graphs_merge_their_splits_in_one_launch_form():
    """At a GPU's settings (132 multiprocessors, 65,536 positions, buckets up to 256 rows), a
    one-row bucket splits its context 17 ways (16 KV heads) or 33 ways (8), and wide buckets
    do not split: the graphs launch the decode kernel in two forms, merging in-launch (a
    fixed merge tile, whatever the split count) or in one split, and never a reduce."""
    for name, kv_heads in (("mha16", 16), ("gqa32/8", 8)):
        shape = triton_aot.ModelShape(name, 16 if kv_heads == 16 else 32, kv_heads, 128,
                                      torch.bfloat16)  # fmt: skip
        graphed = [lch for variant, lch in triton_aot.engine_launches(shape, 90)
                   if variant == "graphed"]  # fmt: skip
        assert {lch.kernel.fn.__name__ for lch in graphed} == {"_decode_kernel"}, name
        forms = {(lch.constexprs["SPLIT"], lch.constexprs["MERGE"]) for lch in graphed}
        assert forms == {(True, True), (False, False)}, (name, forms)


def test_compiles_ask_for_fp_contraction_whatever_tritons_default(monkeypatch):
    """Triton 3.9 contracts a*b+c into an FMA unless told otherwise and 3.10 will not; the
    engine asks for it on every compiled launch and ahead-of-time compile, so the kernels'
    numerics do not change with the Triton version. With the default turned off through
    Triton's own variable, a compile of the KV-write kernel still contracts."""
    _needs_cuda_tools()
    import triton
    from triton.backends.compiler import GPUTarget

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    shape = triton_aot.ModelShape("mha16", 16, 16, 128, torch.bfloat16)
    (launch,) = [lch for v, lch in triton_aot.engine_launches(shape, 90) if v == "write"]
    compiled = triton.compile(
        triton_aot.compile_source(launch),
        target=GPUTarget("cuda", 90, 32),
        options=triton_aot.compile_options(launch),
    )
    assert compiled.metadata.enable_fp_fusion is True


def test_a_compiled_launch_passes_the_contraction_option():
    """A launch whose tensors are not on the CPU goes to the compiled form with
    `enable_fp_fusion` set (a recording stand-in for the compiled kernel: no GPU here)."""
    from loopserve.runner.attention.triton_jit import FP_FUSION, DeviceKernel

    seen = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((grid, kwargs))

    def kernel(x, BLOCK):  # noqa: N803 - a constexpr's name, as in the engine's kernels
        pass

    device_kernel = DeviceKernel(kernel)
    device_kernel.compiled = Compiled()
    device_kernel[(2,)](torch.empty(4, device="meta"), BLOCK=8)
    assert seen == [((2,), {"enable_fp_fusion": FP_FUSION, "BLOCK": 8})]
    assert FP_FUSION is True
