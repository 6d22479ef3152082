"""The rooms' one direction: every `kvpilot` import follows the layer table of
`docs/architecture.md`, and no import cycle exists among the `kvpilot` modules.

Every import counts: module level, inside functions (lazy) and under `TYPE_CHECKING`. A
module of a room may import its own room and the rooms of lower layers (a larger number),
never a room of its own layer or above. The table is read from the document, so the map a
newcomer reads is the rule the code is held to.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("operator", "engine", "kernels", "cli")
TABLE_MARK = "<!-- layers: read by tests/test_layers.py -->"


def _modules() -> dict[str, Path]:
    """Gives every kvpilot module of the code folders by dotted name (packages by __init__)."""
    mods: dict[str, Path] = {}
    for folder in CODE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if "kvpilot" not in parts:
                continue
            parts = parts[parts.index("kvpilot"):]  # a folder may hold a package root deeper
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, int]]:
    """Gives the kvpilot modules `name` imports (any place, any kind) with their lines."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from a import b`: the submodule a.b when it is one, else a itself
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                          for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in mods:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                found.append((candidate, node.lineno))
    return found


def room_of(module: str) -> str:
    """Gives the room of a kvpilot module: `cli`, `operator`, `kernels`, or the engine's
    subpackage (`kvpilot.engine.core.scheduler` -> `core`)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("cli", "operator", "kernels"):
        return parts[1]
    if len(parts) > 2 and parts[1] == "engine":
        return parts[2]
    return module  # kvpilot, kvpilot.engine: namespaces, in no room


def layer_table(text: str) -> dict[str, int]:
    """Gives room -> layer from the document's layer table (layer 1 on top)."""
    after = text.split(TABLE_MARK, 1)
    assert len(after) == 2, f"docs/architecture.md has no {TABLE_MARK!r} table"
    layers: dict[str, int] = {}
    for line in after[1].strip().splitlines():
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not cells[0].isdigit():
            continue  # the header and its rule
        for room in re.findall(r"`([a-z_]+)/?`", cells[1]):
            assert room not in layers, f"room {room!r} is in two layers"
            layers[room] = int(cells[0])
    return layers


MODULES = _modules()
GRAPH = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}
LAYERS = layer_table((ROOT / "docs/architecture.md").read_text())


def upward_imports(graph: dict[str, list[tuple[str, int]]], layers: dict[str, int]
                   ) -> list[str]:
    """Gives each import against the layer order, as 'module:line -> module (why)'."""
    wrong = []
    for name, targets in graph.items():
        source = room_of(name)
        for target, line in targets:
            dest = room_of(target)
            if dest == source:
                continue
            if source not in layers or dest not in layers:
                wrong.append(f"{name}:{line} -> {target} (a room the table does not list)")
            elif layers[dest] <= layers[source]:
                wrong.append(f"{name}:{line} -> {target} (layer {layers[source]} {source} "
                             f"may not import layer {layers[dest]} {dest})")
    return wrong


def import_cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Gives the strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return cycles


def test_the_code_folders_hold_the_rooms_the_table_lists() -> None:
    assert len(MODULES) > 300
    loose = sorted(name for name, path in MODULES.items()
                   if name.startswith("kvpilot.engine.") and name.count(".") == 2
                   and path.name != "__init__.py")
    assert not loose, f"modules outside every room: {loose}"
    rooms = {room_of(name) for name in MODULES}
    assert rooms == set(LAYERS), (f"in the code, not the table: {sorted(rooms - set(LAYERS))}; "
                                  f"in the table, not the code: {sorted(set(LAYERS) - rooms)}")


def test_every_import_follows_the_layer_order() -> None:
    wrong = upward_imports(GRAPH, LAYERS)
    assert not wrong, "imports against docs/architecture.md's layers:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    cycles = import_cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": [("b", 1)], "b": [("a", 2)], "c": []}, [["a", "b"]]),
    ({"a": [("b", 1)], "b": [("c", 1)], "c": [("a", 1)]}, [["a", "b", "c"]]),
    ({"a": [("b", 1)], "b": [], "c": [("b", 1)]}, []),
])
def test_cycles_are_found(graph: dict[str, list[tuple[str, int]]],
                          expected: list[list[str]]) -> None:
    assert import_cycles(graph) == expected


def test_an_upward_or_sideways_import_is_named() -> None:
    layers = {"server": 3, "router": 3, "core": 7, "contracts": 9}
    graph = {"kvpilot.engine.core.scheduler": [("kvpilot.engine.server.app", 12)],
             "kvpilot.engine.router.app": [("kvpilot.engine.server.app", 4),
                                           ("kvpilot.engine.contracts.args", 5)],
             "kvpilot.engine.server.app": [("kvpilot.engine.core.scheduler", 9)]}
    assert upward_imports(graph, layers) == [
        "kvpilot.engine.core.scheduler:12 -> kvpilot.engine.server.app "
        "(layer 7 core may not import layer 3 server)",
        "kvpilot.engine.router.app:4 -> kvpilot.engine.server.app "
        "(layer 3 router may not import layer 3 server)"]
