"""Triton kernels that compile on CUDA and run under Triton's interpreter on CPU, per launch.

`triton.jit` decides between compiling and interpreting once, when the module that defines
a kernel is imported (from `TRITON_INTERPRET`). That ties a whole process to one mode: a
test run that imported the kernels with the interpreter on would test interpreted kernels
on a GPU too. `device_kernel` keeps both forms of one kernel and picks by the device of the
launch's tensors: CUDA tensors launch the compiled `JITFunction`, CPU tensors the
`InterpretedFunction` (with Triton's own `@jit` helpers swapped for their interpreted forms
for the launch, `_interpreted_language`). No environment variable is read at import, and a
CPU-only process never compiles.

Compiled launches pin floating-point contraction on (`FP_FUSION`), whatever Triton's default.

`do_not_specialize` names integer arguments that vary per call (row counts, split counts,
split lengths): without it Triton compiles a new specialization whenever such a value
changes between 1, a multiple of 16 and anything else, which multiplies first-use compiles
in a serving run. `record_launches` lets ahead-of-time compile checks see exactly what the
launchers launch (`loopserve.runner.attention.triton_aot`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

try:  # argument typing; its first call imports Triton's gluon package (see below)
    from triton.runtime.jit import mangle_type
except ImportError:  # another Triton layout: nothing to pre-import
    mangle_type = None


# Every compiled launch (and every ahead-of-time compile, `triton_aot.compile_options`) asks
# for floating-point contraction (a*b+c as one FMA) explicitly. Triton 3.9 enables it when a
# launch does not say (and warns that Triton 3.10 will disable it by default), so pinning it
# keeps the kernels' numerics the same on every Triton version a GPU image ships.
FP_FUSION = True


class DeviceKernel:
    """One kernel in both forms; `kernel[grid](*args)` launches the form for the args' device."""

    def __init__(self, fn: Callable, do_not_specialize: Sequence[str] = ()) -> None:
        self.fn = fn
        self.do_not_specialize = tuple(do_not_specialize)
        self.compiled = JITFunction(fn, do_not_specialize=self.do_not_specialize)
        self._interpreted: InterpretedFunction | None = None

    @property
    def interpreted(self) -> InterpretedFunction:
        if self._interpreted is None:
            self._interpreted = InterpretedFunction(fn=self.fn)
        return self._interpreted

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            recorded = _recorded.get()
            if recorded is not None:  # `record_launches`: describe the launch, run nothing
                recorded.append(Launch(self, tuple(grid), args, kwargs))
                return None
            observed = _observed.get()
            if observed is not None:  # `observe_launches`: describe it and run it
                observed.append(Launch(self, tuple(grid), args, kwargs))
            if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
                with _interpreted_language(), self._interpreted_helpers():
                    return self.interpreted[grid](*args, **kwargs)
            return self.compiled[grid](*args, **{"enable_fp_fusion": FP_FUSION, **kwargs})

        return launch

    @functools.cached_property
    def _helpers(self) -> tuple[tuple[str, JITFunction, InterpretedFunction], ...]:
        """(name, helper, its interpreted form) for every `@triton.jit` helper the kernel's
        module holds (its own, such as `fp8_bits`, or imported)."""
        return tuple(
            (name, value, InterpretedFunction(fn=value.fn))
            for name, value in self.fn.__globals__.items()
            if isinstance(value, JITFunction)
        )

    @contextlib.contextmanager
    def _interpreted_helpers(self):
        """The kernel's own `@triton.jit` helpers interpreted for one launch: compiled
        `JITFunction`s (what a compile needs) cannot be called by the interpreter."""
        module = self.fn.__globals__
        for name, _, interpreted in self._helpers:
            module[name] = interpreted
        try:
            yield
        finally:
            for name, compiled, _ in self._helpers:
                module[name] = compiled


_LANGUAGE_MODULES = tuple(
    m for m in (tl, getattr(tl, "standard", None), getattr(tl, "math", None)) if m is not None
)
# Modules the interpreter patches while it runs a kernel (restored whole after each launch).
_PATCHED_MODULES = tuple(
    dict.fromkeys(m for m in (*_LANGUAGE_MODULES, getattr(tl, "core", None)) if m is not None)
)


@functools.cache
def _helper_swaps() -> tuple[tuple[object, str, JITFunction, InterpretedFunction], ...]:
    """(module, name, compiled helper, its interpreted form) for every `@jit` helper of
    `triton.language`, found once per process."""
    return tuple(
        (module, name, value, InterpretedFunction(fn=value.fn))
        for module in _LANGUAGE_MODULES
        for name, value in vars(module).items()
        if isinstance(value, JITFunction)
    )


@contextlib.contextmanager
def _interpreted_language():
    """Run Triton's own `@jit` helpers (`tl.max`, `tl.sum`, ...) interpreted for one launch.

    Those helpers are compiled or interpreted as `triton.language` is imported, like any
    `triton.jit` function; in a process that imported it without `TRITON_INTERPRET` they are
    `JITFunction`s, which the interpreter cannot call. For the launch, each module attribute
    that is such a helper is swapped for its interpreted form, and restored after."""
    # Argument typing imports Triton's gluon package lazily, and gluon checks that the helpers
    # are compiled: let that import happen before the swap.
    if mangle_type is not None:
        mangle_type(0)
    swaps = _helper_swaps()
    # The interpreter patches `triton.language` functions while a kernel runs and does not
    # always put them back: a kernel that calls an interpreted helper (`tl.sum`) patches them
    # again inside its own patch, and the inner restore keeps the patched forms. A compile
    # in the same process then fails ("'value' object has no attribute 'dtype'"). So every
    # attribute of those modules is restored as it was before the launch.
    saved = [(module, dict(vars(module))) for module in _PATCHED_MODULES]
    for module, name, _, interpreted in swaps:
        setattr(module, name, interpreted)
    try:
        yield
    finally:
        for module, attributes in saved:
            current = vars(module)
            for name, value in attributes.items():
                if current.get(name) is not value:
                    setattr(module, name, value)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a launcher would make it: grid, arguments, constexpr values."""

    kernel: DeviceKernel
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict


_recorded: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar(
    "loopserve_triton_launches", default=None
)
_observed: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar(
    "loopserve_triton_observed", default=None
)


@contextlib.contextmanager
def _collecting(var: contextvars.ContextVar[list[Launch] | None]):
    launches: list[Launch] = []
    token = var.set(launches)
    try:
        yield launches
    finally:
        var.reset(token)


def record_launches():
    """Inside this block launchers record their `Launch`es instead of running them; with
    tensors on the `meta` device nothing is allocated either. Ahead-of-time compile checks
    use it to compile exactly what the engine's launchers would launch."""
    return _collecting(_recorded)


def observe_launches():
    """Like `record_launches`, but the launches also run: what a real workload launches
    (`triton_aot.specialization_key` counts the distinct compiles it would trigger)."""
    return _collecting(_observed)


def device_kernel(*, do_not_specialize: Sequence[str] = ()) -> Callable[[Callable], DeviceKernel]:
    """Decorator: `@device_kernel(do_not_specialize=("num_rows",))` instead of `@triton.jit`."""

    def wrap(fn: Callable) -> DeviceKernel:
        return DeviceKernel(fn, do_not_specialize)

    return wrap
