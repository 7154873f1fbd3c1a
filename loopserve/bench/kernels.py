"""`loopserve bench kernels`: device kernels per layer in one graphed decode loop, on CPU.

A looped model pays every kernel of its core once per loop, so the kernel count of one core
call bounds what a CUDA graph can do for it: each small kernel costs device time even inside
a graph. This counts, without a GPU, what a decode loop launches as the runner prepares the
model on CUDA (merged projections, the fused norms, rotary and SiLU-and-multiply kernels of
`runner/fused_norms.py` and `runner/fused_ops.py`) with the attention backend CUDA resolves
to (`triton`; `--attention-backend torch` counts the torch one): it runs a short decode on a
tiny checkpoint of the family through the decode graphs' static buffers
(`graph_mode=emulate`), then replays one graphed call's core under a torch dispatch counter.
Each Triton launch counts as one kernel (here it runs under Triton's interpreter, whose own
tensor work is not the GPU's and is left out). Operators that only make a view
(`aten.view`, `slice`, `select`, `transpose`, ...) or only allocate (`aten.empty`) launch no
kernel and are left out; every other one is counted as one kernel (an upper bound where an
operator runs as several kernels on a GPU, a lower bound where it runs as several on CPU),
per loop and per layer of the core.

Issue #32 measures fusion against this: the goal is <= 10 kernels per layer.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from loopserve.engine.llm_engine import LLMEngine
from loopserve.errors import ConfigError
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.models.tiny import make_tiny_checkpoint
from loopserve.runner.attention.triton_jit import DeviceKernel
from loopserve.runner.fused_linear import MAX_ROWS as FUSED_MAX_ROWS
from loopserve.runner.fused_ops import install_fused_kernels
from loopserve.sampling_params import SamplingParams

# Operators that return views or metadata only: no kernel.
VIEW_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.slice", "aten.select", "aten.unsqueeze",
    "aten.squeeze", "aten.transpose", "aten.t", "aten.permute", "aten.expand",
    "aten.as_strided", "aten.alias", "aten.detach", "aten.split", "aten.split_with_sizes",
    "aten.unbind", "aten._reshape_alias", "aten.view_as", "aten.chunk", "aten.narrow",
    "aten.lift_fresh", "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.is_same_size",
})  # fmt: skip
# Any other operator whose result shares an argument's storage (not in-place): no kernel.
ALIAS = "aliasing (no copy)"
# Operators that only allocate (from the caching allocator; static inside a graph): no kernel.
ALLOC_OPS = frozenset({"aten.empty", "aten.empty_like", "aten.new_empty", "aten.empty_strided"})


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if not name.endswith("_") and _aliases_an_input(out, args):
            name = ALIAS  # a reshape that could view, a `to` that changed nothing: no kernel
        self.ops[name] += 1
        return out


def _aliases_an_input(out, args) -> bool:
    """The result is a tensor sharing storage with a tensor argument (a view, or the argument
    itself), so the operator copied nothing."""
    if not isinstance(out, torch.Tensor):
        return False
    storage = out.untyped_storage().data_ptr()
    return any(
        isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() == storage
        for arg in args
    )


@dataclass(frozen=True)
class KernelCount:
    family: str
    num_layers: int  # layers of the core (one loop)
    kernels_per_loop: int
    views_per_loop: int
    by_op: dict[str, int]  # kernel-launching operators of one loop

    @property
    def kernels_per_layer(self) -> float:
        return self.kernels_per_loop / self.num_layers


@contextlib.contextmanager
def _counting_triton(launches: Counter[str]):
    """Every Triton launch (`triton_jit.DeviceKernel`) counts as one kernel, and its
    interpreted run stays out of the dispatch count."""
    original = DeviceKernel.__getitem__

    def getitem(kernel, grid):
        launch = original(kernel, grid)

        def counted(*args, **kwargs):
            launches[f"triton.{kernel.fn.__name__.lstrip('_')}"] += 1
            with _disable_current_modes():
                return launch(*args, **kwargs)

        return counted

    DeviceKernel.__getitem__ = getitem
    try:
        yield
    finally:
        DeviceKernel.__getitem__ = original


def counting(fn, seen: list[Counter[str]]):
    """`fn` that appends each call's device operators (dispatched aten ops and Triton
    launches, views and allocations included) to `seen`."""

    def counted(*args, **kwargs):
        launches: Counter[str] = Counter()
        with _counting_triton(launches), _Counter() as counter:
            out = fn(*args, **kwargs)
        seen.append(counter.ops + launches)
        return out

    return counted


def kernels_of(ops: Counter[str]) -> dict[str, int]:
    """The operators of `ops` that launch a kernel (views and allocations left out)."""
    return {op: n for op, n in ops.items() if op not in VIEW_OPS | ALLOC_OPS | {ALIAS}}


TINY_CORE_LAYERS = {"ouro": 2, "huginn": 4}  # the tiny checkpoints' core depth


def count_kernels(
    family: str = "ouro",
    *,
    rows: int = 4,
    num_layers: int | None = None,
    attention_backend: str = "triton",
    fused_linears: bool = False,
    kv_cache_dtype: str = "auto",
) -> KernelCount:
    """Kernels of one graphed decode loop of `rows` rows on a tiny `family` checkpoint (its
    core with `num_layers` layers; None: the tiny default, 2 for Ouro, 4 for Huginn), with
    the model as the loader and runner prepare it for CUDA (`fused_linears`: as the runner
    option of that name prepares it; `kv_cache_dtype`: the engine's). Counted once per
    process for each distinct count, however the arguments are spelled."""
    layers = TINY_CORE_LAYERS[family] if num_layers is None else num_layers
    return _count_kernels(family, rows, layers, attention_backend, fused_linears, kv_cache_dtype)


@functools.lru_cache(maxsize=16)  # deterministic per arguments: counted once per process
def _count_kernels(
    family: str,
    rows: int,
    num_layers: int,
    attention_backend: str,
    fused_linears: bool,
    kv_cache_dtype: str,
) -> KernelCount:
    with tempfile.TemporaryDirectory() as directory:
        # Two loops per token (and one prelude and coda layer): what a loop launches does not
        # depend on them, the prompt step's time (every layer interpreted) does.
        if family == "huginn":
            model_dir = make_tiny_huginn_checkpoint(
                Path(directory), mean_recurrence=2, n_layers_in_recurrent_block=num_layers,
                n_layers_in_prelude=1, n_layers_in_coda=1,
            )  # fmt: skip
        else:
            model_dir = make_tiny_checkpoint(
                Path(directory), seed=0, num_layers=num_layers, total_ut_steps=2
            )
        # The Triton backend on CPU runs interpreted (the engine asks for this switch).
        interpret = {"TRITON_INTERPRET": "1"} if attention_backend == "triton" else {}
        with mock.patch.dict(os.environ, interpret):
            engine = LLMEngine.from_engine_args(
                model=str(model_dir), dtype="float32", num_blocks=128, block_size=16,
                max_num_seqs=rows, graph_mode="emulate", attention_backend=attention_backend,
                enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype,
            )  # fmt: skip
    merge = getattr(engine.model, "merge_projections", None)
    if merge is not None:  # count the model as the loader and runner prepare it on CUDA
        merge()
    install_fused_kernels(engine.model, linears=fused_linears)
    # One-token prompts: the count is of a decode call, and every interpreted program of a
    # prompt call runs in Python.
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"k{i}", [3 + i], params)
    graphs = engine.runner.graphs
    assert graphs is not None
    core, seen = graphs.core, []
    while not seen and engine.has_unfinished_requests():
        if not any(r.in_prompt_phase for r in engine.scheduler.running):
            graphs.core = counting(core, seen)
        engine.step()
    graphs.core = core
    assert seen, "no graphed decode call ran"
    ops = seen[0]
    kernels = kernels_of(ops)
    views = sum(n for op, n in ops.items() if op in VIEW_OPS | {ALIAS})
    return KernelCount(
        family, engine.model.config.num_core_layers, sum(kernels.values()), views,
        dict(sorted(kernels.items(), key=lambda item: -item[1])),
    )  # fmt: skip


@dataclass(frozen=True)
class KernelModel:
    """Kernels of one decode loop as `per_layer x core layers + per_loop`: the slope between
    two counts at different layer counts, and what a loop launches whatever its depth (the
    final norm, RoPE tables, attention metadata). What the simulator prices per core call
    (`sim.cost_model.KERNELS`)."""

    family: str
    per_layer: float
    per_loop: float


def kernel_model(
    family: str = "ouro",
    *,
    rows: int = 4,
    attention_backend: str = "triton",
    fused_linears: bool = False,
    kv_cache_dtype: str = "auto",
) -> KernelModel:
    """Count at 2 and 4 core layers and split the count (one of them is the tiny default
    depth, which `count_kernels(family)` shares)."""
    count = functools.partial(
        count_kernels, family, rows=rows, attention_backend=attention_backend,
        fused_linears=fused_linears, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    small, large = count(num_layers=2), count(num_layers=4)
    per_layer = (large.kernels_per_loop - small.kernels_per_loop) / 2
    return KernelModel(family, per_layer, small.kernels_per_loop - per_layer * 2)


def main_from_args(args) -> int:
    torch.set_num_threads(1)
    backend, fused, kv_dtype = args.attention_backend, args.fused_linears, args.kv_cache_dtype
    if fused and args.rows > FUSED_MAX_ROWS:
        raise ConfigError(
            f"--fused-linears runs calls of up to {FUSED_MAX_ROWS} rows; --rows {args.rows} "
            "would count the merged GEMMs it keeps for wider calls"
        )
    count = count_kernels(
        args.family, rows=args.rows, attention_backend=backend, fused_linears=fused,
        kv_cache_dtype=kv_dtype,
    )  # fmt: skip
    print(f"{count.family}: {count.kernels_per_loop} kernels per loop over "
          f"{count.num_layers} core layers = {count.kernels_per_layer:.1f} per layer "
          f"({count.views_per_loop} view operators left out; attention: {backend}"
          f"{'; fused linears' if fused else ''})")  # fmt: skip
    for op, n in count.by_op.items():
        print(f"  {op:<40} {n:>4}  ({n / count.num_layers:.1f} per layer)")
    model = kernel_model(
        args.family, rows=args.rows, attention_backend=backend, fused_linears=fused,
        kv_cache_dtype=kv_dtype,
    )  # fmt: skip
    print(f"split (counted at two core depths): {model.per_layer:g} per layer + "
          f"{model.per_loop:g} per loop")  # fmt: skip
    if args.output_json:
        record = dict(asdict(count), kernels_per_layer=count.kernels_per_layer)
        record.update(split_per_layer=model.per_layer, split_per_loop=model.per_loop)
        Path(args.output_json).write_text(json.dumps(record, indent=1))
    return 0
