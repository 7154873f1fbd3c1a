"""Ahead-of-time compiles of the engine's Triton kernels for real GPU targets, with no GPU.

`triton.compile` with a `GPUTarget` runs Triton's whole pipeline (TTIR, TTGIR, LLVM, PTX,
ptxas) on the CPU. This module compiles exactly what the engine's launchers would launch:
it calls them (`write_kv`, `copy_slots`, `decode_attention`, `prefill_attention`, the
fused norms' `add_norm_norm`, `fused_ops`' `rope_qkv` and `silu_mul`, and the GEMMs of
`fused_linear`) on `meta`-device tensors shaped like a model's, inside `triton_jit.record_launches`, and turns
each recorded launch into Triton's compile signature the way `JITFunction` specializes a
real call (pointer and integer arguments divisible by 16 get the divisibility hint, an
integer equal to 1 becomes a constant, arguments in `do_not_specialize` get neither).
`cuobjdump -res-usage` on the cubin (the one Triton's wheel ships) then gives registers,
stack frame and local memory per thread, and the compile metadata gives shared memory.

Used by tests/test_triton_aot.py (one representative specialization per kernel, dtype and
target, no spills allowed) and by `python -m loopserve.runner.attention.triton_aot` (the full
sweep whose table is in docs/gpu.md). Needs triton; the cubins are never loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loopserve.models.kv_dtype import FP8_E4M3_MIN_CAPABILITY
from loopserve.runner.attention import triton_kernels, triton_prefill
from loopserve.runner.attention.triton_backend import SPLIT_COUNTERS
from loopserve.runner.attention.triton_jit import FP_FUSION, Launch, record_launches
from loopserve.runner.fused_linear import MAX_ROWS, fused_linear
from loopserve.runner.fused_norms import add_norm_norm
from loopserve.runner.fused_ops import rope_qkv, silu_mul

TARGETS = (80, 90, 100)  # A100, H100/H200, B200
COMPILE_OPTIONS = ("num_warps", "num_stages")  # launch keywords that are not constexprs
# Shared memory a block may use (opt-in maximum), by compute capability.
SHARED_LIMIT_BYTES = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}
_TRITON_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",  # an 8-bit cache as the K/V writes see it (its bytes)
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}


@dataclass(frozen=True)
class ModelShape:
    """The attention shape a model's kernels are specialized for."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    num_layers: int = 2  # only the finalize copy's grid depends on it
    hidden: int | None = None  # the residual width; None: num_heads x head_dim
    intermediate: int | None = None  # the MLP's width; None: 4 x hidden
    kv_dtype: torch.dtype | None = None  # the cache's element type; None: dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def narrow_cache(self) -> bool:
        """K/V stored narrower than the model (`kv_cache_dtype` fp8): `write_kv`, the rotary
        write and the fused q/k/v GEMM's write encode them (`fp8_bits`)."""
        return self.cache_dtype != self.dtype


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    variant: str
    shape: str
    dtype: str
    target: int
    registers: int
    stack_bytes: int
    local_bytes: int
    shared_bytes: int
    shared_limit_bytes: int
    compile_s: float

    @property
    def spills(self) -> bool:
        """Per-thread stack or local memory: registers spilled (or arrays indexed at run
        time), either way traffic to device memory in the kernel's inner loop."""
        return self.stack_bytes > 0 or self.local_bytes > 0


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclass(frozen=True)
class LaunchSettings:
    """What a Triton backend chooses per device, beside the model's shape: tile sizes, rows
    per K/V-write program, the multiprocessors a decode launch fills (its split count), the
    prompt kernel's warps and stages, and what the decode graphs are sized for (their
    buckets' row counts and the context bound that fixes each bucket's split count)."""

    prompt_tile_m: int
    prompt_tile_n: int
    decode_block_n: int
    write_rows: int
    num_sms: int
    prompt_options: dict
    max_model_len: int = 65_536
    max_graph_rows: int = 256

    @classmethod
    def for_target(cls, target: int, dtype: torch.dtype, **graphs) -> LaunchSettings:
        """What `TritonBackend` picks on a GPU of compute capability `target`."""
        from loopserve.runner.attention.triton_backend import TritonBackend

        tile_m, tile_n, decode_n = TritonBackend.tile_sizes("cuda", dtype)
        return cls(tile_m, tile_n, decode_n, triton_kernels.write_rows_for("cuda"),
                   TARGET_SMS[target], triton_prefill.prompt_launch_options(target), **graphs)  # fmt: skip

    @classmethod
    def of_backend(cls, backend, *, max_model_len: int, max_graph_rows: int) -> LaunchSettings:
        """What a live `TritonBackend` picked (the test compares its launches)."""
        return cls(backend.prefill_block_m, backend.prefill_block_n, backend.decode_block_n,
                   backend.write_rows, backend.num_sms, dict(backend.prompt_options),
                   max_model_len, max_graph_rows)  # fmt: skip


# Multiprocessors of the GPU each target stands for (A100, H100/H200 SXM, B200): the decode
# split count a graph bucket launches follows from it.
TARGET_SMS = {80: 108, 90: 132, 100: 148}


def engine_launches(
    shape: ModelShape, target: int, *, rows: int = 8, settings: LaunchSettings | None = None
) -> list[tuple[str, Launch]]:
    """(variant, launch) for every kernel form the engine uses at this shape: KV write,
    finalize copy, decode in one split, split-K with its reduce, split-K returning the LSE
    (cascade attention), prompt tiles, the decode graphs' forms (int64 index buffers; the
    reduce tile of every bucket's split count), and the fused norms, rotary (alone and
    inside the K/V write) and SiLU-and-multiply in every form the families call. `settings`:
    the backend's choices (default: what it picks on a GPU of `target`). One launch per
    distinct form (`launch_form`)."""
    settings = settings or LaunchSettings.for_target(target, shape.dtype)
    dtype, heads, kv_heads, dim = shape.dtype, shape.num_heads, shape.num_kv_heads, shape.head_dim
    slots = 64 * shape.block_size
    cache = _meta(shape.num_layers, 2, slots, kv_heads, dim, dtype=shape.cache_dtype)
    key_cache, value_cache = cache[0, 0], cache[0, 1]
    query = _meta(rows, heads, dim, dtype=dtype)
    index = _meta(rows, dtype=torch.int32)
    tables = _meta(rows, 64, dtype=torch.int32)
    recorded: list[tuple[str, Launch]] = []
    forms: set[tuple] = set()

    def record(variant: str, fn, *args, **kwargs) -> None:
        with record_launches() as launches:
            fn(*args, **kwargs)
        for launch in launches:
            form = launch_form(launch)
            if form not in forms:
                forms.add(form)
                recorded.append((variant, launch))

    kv = _meta(rows, kv_heads, dim, dtype=dtype)  # an 8-bit cache's write rounds in-kernel
    record("write", triton_kernels.write_kv, kv, kv, key_cache, value_cache,
           _meta(rows, dtype=torch.int64), rows_per_program=settings.write_rows)  # fmt: skip
    pairs = _meta(rows, dtype=torch.int64)
    record("finalize", triton_kernels.copy_slots, cache, pairs, pairs)
    decode = dict(scale=dim**-0.5, block_size=shape.block_size, block_n=settings.decode_block_n)
    counters = _meta(SPLIT_COUNTERS, dtype=torch.int32)  # the backend's: splits merge in-launch
    eager = dict(tables=tables, table_idx=index, rows=index, seq_lens=index, **decode)
    out = _meta(rows, heads, dim, dtype=dtype)
    record("decode", triton_kernels.decode_attention, query, key_cache, value_cache, out,
           max_seq_len=512, split_len=512, counters=counters, **eager)  # fmt: skip
    record("split_k", triton_kernels.decode_attention, query, key_cache, value_cache, out,
           max_seq_len=4096, split_len=512, counters=counters, **eager)  # fmt: skip
    lse = _meta(rows, heads, dtype=torch.float32)
    out32 = _meta(rows, heads, dim, dtype=torch.float32)
    record("split_k_lse", triton_kernels.decode_attention, query, key_cache, value_cache, out32,
           max_seq_len=512, split_len=512, lse_out=lse, **eager)  # fmt: skip
    tiles = _meta(4, dtype=torch.int32)
    record("prompt", triton_prefill.prefill_attention, query, key_cache, value_cache, out,
           tables=tables, tile_table=tiles, tile_row=tiles, tile_pos=tiles, tile_count=tiles,
           scale=dim**-0.5, block_size=shape.block_size, block_m=settings.prompt_tile_m,
           block_n=settings.prompt_tile_n, **settings.prompt_options)  # fmt: skip
    # The decode graphs: one bucket per row count; its block tables and index columns int64
    # (views of the runner's int64 buffers), its context lengths int32; its split count
    # fixed from the rows and the context bound (one split for wide buckets).
    from loopserve.runner.attention.triton_backend import auto_split_len
    from loopserve.runner.graph_buffers import graph_buckets

    for bucket in graph_buckets(settings.max_graph_rows):
        column = _meta(bucket, dtype=torch.int64)
        split_len = auto_split_len(bucket, kv_heads, settings.max_model_len, settings.num_sms)
        rows_b = _meta(bucket, heads, dim, dtype=dtype)
        record("graphed", triton_kernels.decode_attention, rows_b, key_cache, value_cache, rows_b,
               tables=_meta(bucket, 64, dtype=torch.int64), table_idx=column, rows=column,
               seq_lens=_meta(bucket, dtype=torch.int32), max_seq_len=settings.max_model_len,
               split_len=split_len, counters=counters, **decode)  # fmt: skip
    # Rotary inside the K/V write, and the fused GEMMs (`fused_linears`: each GEMM of a layer
    # as the models call it, up to MAX_ROWS rows, rotary tables over every position read by
    # position) with and without it. A narrow cache's shape (`kv_cache_dtype` fp8) records
    # only the forms that write the cache; the others are its model dtype's.
    wide = not shape.narrow_cache
    qkv = _meta(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
    table = _meta(rows, dim, dtype=dtype)
    write = (key_cache, value_cache, _meta(rows, dtype=torch.int64))
    record("rope_write", rope_qkv, qkv, table, table, heads, kv_heads, cache=write)
    if wide:
        record("rope", rope_qkv, qkv, table, table, heads, kv_heads)
    if heads == kv_heads:  # Huginn's form: interleaved pairs, float32 tables, a q/k bias
        half = _meta(rows, dim // 2, dtype=torch.float32)
        for bias in (_meta(2, heads, dim, dtype=dtype), None):
            # (with a narrow cache: rotary alone, then `write_kv`; both forms recorded here)
            record("rope_interleaved_write", rope_qkv, qkv, half, half, heads, kv_heads,
                   interleaved=True, bias=bias, cache=write)  # fmt: skip
            if wide:
                record("rope_interleaved", rope_qkv, qkv, half, half, heads, kv_heads,
                       interleaved=True, bias=bias)  # fmt: skip
    hidden = shape.hidden or heads * dim
    norm = _MetaNorm(_meta(hidden, dtype=dtype), 1e-6)
    inner = shape.intermediate or 4 * hidden
    if wide:
        rows_h = _meta(rows, hidden, dtype=dtype)
        record("norms", add_norm_norm, rows_h, rows_h, norm, norm)  # a residual add, two norms
        record("norms", add_norm_norm, rows_h, rows_h, norm, None)  # the loop's last
        record("norms", add_norm_norm, rows_h, None, None, norm)  # the loop's first
        record("norms", add_norm_norm, rows_h, rows_h, norm, norm, norm_sum=True)  # Huginn's
        record("norms", add_norm_norm, rows_h, rows_h, norm, None, norm_sum=True)
        record("silu_mul", silu_mul, _meta(rows, 2 * inner, dtype=dtype))
    n_few = min(rows, MAX_ROWS)
    few = _meta(n_few, hidden, dtype=dtype)
    positions = _meta(n_few, dtype=torch.int64)
    few_write = (key_cache, value_cache, _meta(n_few, dtype=torch.int64))
    w_qkv = _meta((heads + 2 * kv_heads) * dim, hidden, dtype=dtype)
    w_gate_up = _meta(2 * inner, hidden, dtype=dtype)
    families = [dict(rope=(_meta(4096, dim, dtype=dtype),) * 2 + (heads, kv_heads))]  # Ouro's
    if heads == kv_heads:  # Huginn's: float32 tables of pairs, a q/k bias, norms of the sum
        pairs = _meta(4096, dim // 2, dtype=torch.float32)
        families += [dict(rope=(pairs, pairs, heads, heads), interleaved=True, norm_sum=True,
                       bias=_meta(2, heads, dim, dtype=dtype))]  # fmt: skip
    for family in families:
        for branch, cache in ((few, few_write), (None, few_write), (few, None)):
            if cache is not None or wide:
                record("linear_qkv", fused_linear, branch, w_qkv, residual=few, norm_a=norm,
                       norm_b=norm, positions=positions, cache=cache, **family)  # fmt: skip
        if wide:
            record("linear_gate_up", fused_linear, few, w_gate_up, residual=few, norm_a=norm,
                   norm_b=norm, norm_sum=family.get("norm_sum", False))  # fmt: skip
    if wide:
        record("linear_down", fused_linear, _meta(n_few, 2 * inner, dtype=dtype),
               _meta(hidden, inner, dtype=dtype), silu=True)  # fmt: skip
    return recorded


def launch_form(launch: Launch) -> tuple:
    """A kernel form as its resources depend on it: the kernel, its tensor arguments'
    dtypes, its constexprs and compile options; not integer values or alignment hints
    (`specialization_key` has those: they multiply JIT compiles, not register use)."""
    fn = launch.kernel.compiled
    tensors = tuple(
        (name, str(value.dtype))
        for name, value in zip(fn.arg_names, launch.args)
        if isinstance(value, torch.Tensor)
    )
    constexprs = tuple(sorted((str(k), str(v)) for k, v in launch.constexprs.items()))
    return (fn.__name__, tensors, constexprs)


@dataclass(frozen=True)
class _MetaNorm:
    """An RMSNorm's parameters as `add_norm_norm` reads them."""

    weight: torch.Tensor
    eps: float


def compile_options(launch: Launch) -> dict[str, int | bool]:
    """The launch keywords that are compile options (warps, stages), not constexprs, and the
    floating-point contraction every compiled launch asks for (`triton_jit.FP_FUSION`)."""
    options: dict[str, int | bool] = {
        k: v for k, v in launch.constexprs.items() if k in COMPILE_OPTIONS
    }
    options["enable_fp_fusion"] = FP_FUSION
    return options


def compile_source(launch: Launch) -> ASTSource:
    """The compile signature `JITFunction` would build for this launch."""
    kernel = launch.kernel
    fn = kernel.compiled
    names = fn.arg_names
    signature: dict[str, str] = {}
    constexprs = {k: v for k, v in launch.constexprs.items() if k not in COMPILE_OPTIONS}
    attrs: dict[tuple[int, ...], list] = {}
    for position, (name, value) in enumerate(zip(names, launch.args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
            attrs[(position,)] = [["tt.divisibility", 16]]  # allocations are 16-byte aligned
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            specialize = name not in kernel.do_not_specialize
            if specialize and value == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if specialize and value % 16 == 0:
                attrs[(position,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    for name in constexprs:
        signature[name] = "constexpr"
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def specialization_key(launch: Launch) -> tuple:
    """What makes Triton compile a kernel anew: its signature (argument types, which
    integers are 1 or multiples of 16), its constexpr values and its compile options.
    Launches with equal keys share one compile."""
    source = compile_source(launch)
    options = tuple(sorted(compile_options(launch).items()))
    return (
        launch.kernel.fn.__name__,
        tuple(sorted(source.signature.items())),
        tuple(sorted((str(k), str(v)) for k, v in source.constants.items())),
        tuple(sorted(source.attrs)),
        options,
    )


# Stack bytes per thread the rule tolerates: Triton 3.6 keeps an 8-byte stack frame in two
# forms that Triton 3.9 compiles without one (the GQA decode in bf16 on sm_90 and the fp32
# prompt tile on sm_100, 80 registers each; measured 2026-12-03).
STACK_ALLOWANCE_BYTES = 8


def acceptable(result: KernelResources) -> bool:
    """The resource rule the test enforces, under Triton 3.6 and 3.9 alike: shared memory
    within the target's limit; no local memory and at most `STACK_ALLOWANCE_BYTES` of stack
    in bf16/fp16 kernels and fp32 prompt tiles (fp32 decode may keep a few stack bytes)."""
    if result.shared_bytes > result.shared_limit_bytes:
        return False
    if result.dtype == "float32" and result.variant != "prompt":
        return True
    return result.local_bytes == 0 and result.stack_bytes <= STACK_ALLOWANCE_BYTES


def _cuobjdump() -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"cuobjdump not found at {path} (Triton's wheel ships it)")
    return path


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED and LOCAL of the cubin's one function (cuobjdump -res-usage)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(cubin)
    try:
        proc = subprocess.run(
            [_cuobjdump(), "-res-usage", handle.name], capture_output=True, text=True, check=True
        )
    finally:
        os.unlink(handle.name)
    line = next(line for line in proc.stdout.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}


def compile_for(shape: ModelShape, variant: str, launch: Launch, target: int) -> KernelResources:
    start_s = time.perf_counter()
    compiled = triton.compile(
        compile_source(launch),
        target=GPUTarget("cuda", target, 32),
        options=compile_options(launch),
    )
    elapsed_s = time.perf_counter() - start_s
    usage = resource_usage(compiled.asm["cubin"])
    return KernelResources(
        kernel=launch.kernel.fn.__name__.strip("_"),
        variant=variant,
        shape=shape.name,
        dtype=str(shape.dtype).removeprefix("torch."),
        target=target,
        registers=usage["REG"],
        stack_bytes=usage["STACK"],
        local_bytes=usage["LOCAL"],
        shared_bytes=max(usage["SHARED"], compiled.metadata.shared),
        shared_limit_bytes=SHARED_LIMIT_BYTES[target],
        compile_s=elapsed_s,
    )


OURO_SHAPES = tuple(
    ModelShape(name, heads, kv_heads, 128, dtype)
    for name, heads, kv_heads in (("mha16", 16, 16), ("gqa32/8", 32, 8))
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
)


# bf16 models with an 8-bit cache (`kv_cache_dtype`): the forms that read or write it.
FP8_SHAPES = tuple(
    ModelShape(f"{name}/kv-{kind}", heads, kv_heads, 128, torch.bfloat16, kv_dtype=kv_dtype)
    for name, heads, kv_heads in (("mha16", 16, 16), ("gqa32/8", 32, 8))
    for kind, kv_dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2))
)


def runs_on(shape: ModelShape, target: int) -> bool:
    """Whether the engine runs `shape` on a GPU of `target` (it refuses an e4m3 cache before
    sm_89)."""
    return shape.cache_dtype != torch.float8_e4m3fn or target >= FP8_E4M3_MIN_CAPABILITY


def sweep(
    shapes=OURO_SHAPES + FP8_SHAPES, targets=TARGETS, block_sizes=(16,)
) -> list[KernelResources]:
    results = []
    for base in shapes:
        for block_size in block_sizes:
            shape = dataclasses.replace(base, block_size=block_size)
            for target in filter(lambda t: runs_on(shape, t), targets):
                for variant, launch in engine_launches(shape, target):
                    results.append(compile_for(shape, variant, launch, target))
    return results


def representative() -> list[KernelResources]:
    """The test's subset: every kernel form at each target in bf16 (the decode graphs' every
    reduce tile included); the attention kernels (decode, prompt) in every dtype; the GQA
    shape's decode and decode graphs (its group changes the kernel's tiles, its split counts
    the reduce's) in bf16; with an 8-bit cache, Ouro's shape's every cache form (e5m2 on
    sm_80, e4m3 on sm_90; the full sweep has both wherever they run)."""
    results = []
    for target in TARGETS:
        for shape in OURO_SHAPES:
            bf16 = shape.dtype == torch.bfloat16
            if shape.name != "mha16" and not bf16:
                continue
            for variant, launch in engine_launches(shape, target):
                if shape.name == "mha16":
                    wanted = bf16 or variant in ("decode", "prompt")
                else:
                    wanted = variant in ("decode", "graphed")
                if wanted:
                    results.append(compile_for(shape, variant, launch, target))
        for shape in FP8_SHAPES:  # e5m2 where e4m3 cannot run (sm_80), e4m3 on sm_90
            wanted = {80: "mha16/kv-e5m2", 90: "mha16/kv-e4m3"}.get(target)
            if shape.name == wanted:
                for variant, launch in engine_launches(shape, target):
                    results.append(compile_for(shape, variant, launch, target))
    return results


def format_table(results: list[KernelResources]) -> str:
    lines = [
        "| kernel | variant | shape | dtype | sm | registers | stack B | local B | shared B |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.kernel} | {r.variant} | {r.shape} | {r.dtype} | {r.target} | {r.registers} "
            f"| {r.stack_bytes} | {r.local_bytes} | {r.shared_bytes} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="AOT-compile loopserve's Triton kernels")
    parser.add_argument("--block-sizes", default="16,32", help="comma-separated KV block sizes")
    args = parser.parse_args(argv)
    block_sizes = tuple(int(b) for b in args.block_sizes.split(","))
    results = sweep(block_sizes=block_sizes)
    print(format_table(results))
    bad = [r for r in results if not acceptable(r)]
    spilled = [r for r in results if r.spills]
    print(f"\n{len(results)} compiles, {sum(r.compile_s for r in results):.0f} s; "
          f"{len(spilled)} with stack or local memory, {len(bad)} breaking the rule "
          "(`acceptable`)")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
