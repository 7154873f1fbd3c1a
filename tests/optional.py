"""Optional test dependencies: a module that needs one skips, saying which, when it is absent.

`pytest -m gpu` must collect on a GPU image that has only torch, triton, safetensors,
tokenizers, numpy, tqdm, jinja2 and pytest; every test module that imports something beyond
those calls `require(...)` before its imports (tests/test_gpu_check.py checks this by
collecting with those packages blocked).
"""

from __future__ import annotations

import pytest

GROUPS = {
    "serve": (("fastapi", "uvicorn", "pydantic", "prometheus_client", "httpx"), "serve"),
    "ray": (("ray",), "dev or ray"),
    "hypothesis": (("hypothesis",), "dev"),
    "openai": (("openai",), "dev"),
    "structured": (("llguidance",), "dev or structured"),
}


def require(*groups: str) -> None:
    """Skip the calling module unless every package of `groups` imports."""
    for group in groups:
        modules, extra = GROUPS[group]
        for module in modules:
            pytest.importorskip(
                module,
                reason=f"needs {module} (the {extra} extra: pip install -e '.[dev,serve]')",
            )
