"""The package's dependencies point one way (docs/architecture.md's map) and have no cycles.

Every `import` counts: module level, inside functions, and under `TYPE_CHECKING`. A module may
import only from its own room or from rooms listed before it in `LAYERS`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "loopserve"

# Lowest first. Rooms are the package's subpackages and its top-level modules.
LAYERS = (
    "errors",
    "threads",
    "engine_args",
    "sampling_params",
    "outputs",
    "workloads",
    "exit",
    "contracts",
    "execution",
    "config",
    "text",
    "models",
    "scheduler",
    "runner",
    "reference",
    "engine",
    "distributed",
    "server",
    "llm",
    "cli",
    "bench",
    "sim",
    "eval",
    "gpu_check",
)


def _module_name(path: Path) -> str:
    parts = ["loopserve", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported loopserve module, line) for every import in the file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = [f"{target}.{alias.name}" for alias in node.names]
            found += [(target, node.lineno)] + [(n, node.lineno) for n in names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
    return [(t, line) for t, line in found if t.startswith("loopserve.") or t == "loopserve"]


def _graph() -> dict[str, list[tuple[str, int]]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        module: [(t, line) for t, line in _imports(path) if t in files and t != module]
        for module, path in files.items()
    }


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package's own __init__


def test_every_room_is_in_the_layer_map():
    rooms = {_room(m) for m in _graph()} - {None}
    assert rooms <= set(LAYERS), f"add {sorted(rooms - set(LAYERS))} to LAYERS"


def test_imports_point_down_the_layers_only():
    rank = {room: i for i, room in enumerate(LAYERS)}
    upward = []
    for module, targets in _graph().items():
        room = _room(module)
        if room is None:
            continue
        for target, line in targets:
            other = _room(target)
            if other is not None and other != room and rank[other] > rank[room]:
                upward.append(f"{module}:{line} imports {target} ({other} is above {room})")
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = {m: sorted({t for t, _ in targets}) for m, targets in _graph().items()}
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            targets = graph[node]
            if i < len(targets):
                work.append((node, i + 1))
                target = targets[i]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    assert not cycles, cycles


def test_the_checks_see_upward_imports_and_cycles(tmp_path):
    """Control: a room importing from above it, and a two-module cycle, are reported."""
    fake = tmp_path / "loopserve"
    (fake / "text").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "text" / "__init__.py").write_text("")
    (fake / "text" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loopserve.engine import b\n"
    )
    (fake / "engine").mkdir()
    (fake / "engine" / "__init__.py").write_text("")
    (fake / "engine" / "b.py").write_text("def f():\n    from loopserve.text import a\n")
    globals()["PACKAGE"], original = fake, PACKAGE
    try:
        try:
            test_imports_point_down_the_layers_only()
        except AssertionError as err:
            assert "loopserve.text.a:3 imports loopserve.engine.b" in str(err)
        else:
            raise AssertionError("the upward import was not reported")
        try:
            test_no_import_cycles()
        except AssertionError as err:
            assert "loopserve.engine.b" in str(err) and "loopserve.text.a" in str(err)
        else:
            raise AssertionError("the cycle was not reported")
    finally:
        globals()["PACKAGE"] = original
