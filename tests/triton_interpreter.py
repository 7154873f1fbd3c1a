"""A faster Triton interpreter for the suite: the same patching, without re-scanning modules.

Under `TRITON_INTERPRET=1` every call of a `@triton.jit` helper inside a kernel (`tl.sum`,
`tl.max`, `tl.cdiv` are such helpers) patches `triton.language` again, and each patch lists
every member of five namespaces with `inspect.getmembers` to find the builtins to wrap. That
scan was 25-30% of an interpreted decode launch and of a fused-norm launch (the tiny model's
shapes, Triton 3.9, 2026-12-06). Which names are builtins does not change, so they are listed once, here,
before any launch has patched them; each patch then looks only at those names and wraps the
ones that are still builtins, as the original does. Namespaces not listed here take the
original path. Installed by tests/conftest.py when Triton's interpreter has the functions
this relies on; where it lacks them, the interpreter runs unchanged.
"""

from __future__ import annotations

import inspect


def install() -> bool:
    """Replace the interpreter's `_patch_builtin` with the listed-names version; False (and
    nothing changed) when Triton or the functions it relies on are missing."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    descriptor = getattr(tl.core, "tensor_descriptor_base", None)
    if original is None or patch_attr is None or is_builtin is None:
        return False
    if getattr(original, "lists_names_once", False):
        return True
    namespaces = [tl, tl.core, tl.tensor, tl.math] + ([descriptor] if descriptor else [])
    builtin_names = {
        id(namespace): [
            name for name, member in inspect.getmembers(namespace) if is_builtin(member)
        ]
        for namespace in namespaces
    }

    def patch_builtin(pkg, builder, scope) -> None:
        names = builtin_names.get(id(pkg))
        if names is None:
            original(pkg, builder, scope)
            return
        if names and not (
            is_builtin(getattr(pkg, names[0])) or is_builtin(getattr(pkg, names[-1]))
        ):
            return  # wrapped already (a patch wraps all of a namespace's builtins or none)
        for name in names:
            member = getattr(pkg, name)
            if is_builtin(member):  # not wrapped already by an enclosing patch
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin.lists_names_once = True  # type: ignore[attr-defined]
    interpreter._patch_builtin = patch_builtin
    return True
