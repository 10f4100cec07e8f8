"""The import graph of rollout/, lora/, speculative/ and weightsync/ against the layer order
docs/architecture.md states: no cycles, no import of a higher layer (bar the few named in
UPWARD, each with its reason), nothing from benchmarks/, scripts/ or tests/.

Every import in a module's ast counts: at the top, inside a function (lazy) and under
TYPE_CHECKING. Pure ast over the source files, nothing is imported.

The layer table is the fenced block under the "<!-- layers" marker in docs/architecture.md,
top layer first. A line that starts with a number starts a layer: its number, its name, then
module patterns; an indented line without a number carries on the layer above it. A pattern
(`rollout.cache`) covers that module and every module under it; a module's layer is that of
its longest matching pattern.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout", "lora", "speculative", "weightsync")
FORBIDDEN = ("benchmarks", "scripts", "tests", "conftest")  # never imported by the packages
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# (importer, imported) -> why it stays. At most 10.
UPWARD: dict[tuple[str, str], str] = {
    ("rollout.request", "rollout.cache.radix"):
        "type only: Req.last_node is the radix node its cached prefix is locked at; the tree (cache "
        "layer) owns the type, and the request sits below the KV manager that moves its slots",
}


def layer_table(text: str) -> list[tuple[int, str, list[str]]]:
    """(number, name, patterns) of each layer, top first, from the architecture doc's block."""
    marker = text.index("<!-- layers")
    start = text.index("```", marker)
    start = text.index("\n", start) + 1
    end = text.index("```", start)
    layers: list[tuple[int, str, list[str]]] = []
    for line in text[start:end].splitlines():
        if not line.strip():
            continue
        head = re.match(r"^\s*(\d+)\s+(\w[\w-]*)\s+(.*)$", line)
        if head:
            layers.append((int(head[1]), head[2], head[3].split()))
        elif line.startswith(" ") and layers:
            layers[-1][2].extend(line.split())
        else:
            raise ValueError(f"docs/architecture.md layer table: cannot read {line!r}")
    return layers


def module_names() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def imported_names(module: str, path: Path) -> Iterator[str]:
    """Every name an import statement of the file names (`from a.b import c` gives a.b.c,
    which the caller resolves to a.b where a.b.c is not a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """module -> the project modules it imports; and (module, name) of each forbidden import."""
    mods = module_names()
    graph: dict[str, set[str]] = {}
    forbidden = []
    for module, path in mods.items():
        targets = set()
        for name in imported_names(module, path):
            if name.split(".")[0] in FORBIDDEN:
                forbidden.append((module, name))
            while name not in mods and "." in name:
                name = name.rpartition(".")[0]
            if name in mods and name != module:
                targets.add(name)
        graph[module] = targets
    return graph, forbidden


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str, patterns: dict[str, int]) -> int | None:
    name = module
    while True:
        if name in patterns:
            return patterns[name]
        if "." not in name:
            return None
        name = name.rpartition(".")[0]


@pytest.fixture(scope="module")
def imports() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    return import_graph()


@pytest.fixture(scope="module")
def graph(imports) -> dict[str, set[str]]:
    return imports[0]


@pytest.fixture(scope="module")
def layers() -> list[tuple[int, str, list[str]]]:
    return layer_table(ARCHITECTURE.read_text())


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[int, str, list[str]]]) -> list[str]:
    patterns = {pattern: number for number, _, names in layers for pattern in names}
    names = {number: name for number, name, _ in layers}
    found = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module, patterns)
        for target in sorted(targets):
            theirs = layer_of(target, patterns)
            if mine is not None and theirs is not None and theirs > mine and (module, target) not in UPWARD:
                found.append(f"{module} ({names[mine]}) imports {target} ({names[theirs]})")
    return found


def test_layer_table_is_well_formed(layers: list[tuple[int, str, list[str]]], graph: dict[str, set[str]]) -> None:
    numbers = [number for number, _, _ in layers]
    assert numbers == list(range(len(layers) - 1, -1, -1)), f"layers numbered top to bottom down to 0: {numbers}"
    patterns = [pattern for _, _, names in layers for pattern in names]
    assert len(patterns) == len(set(patterns)), "a module pattern appears in two layers"
    unmatched = [p for p in patterns if not any(m == p or m.startswith(p + ".") for m in graph)]
    assert not unmatched, f"patterns that name no module (renamed or removed?): {unmatched}"
    by_pattern = {pattern: number for number, _, names in layers for pattern in names}
    unplaced = sorted(m for m in graph if layer_of(m, by_pattern) is None)
    assert not unplaced, f"modules in no layer of docs/architecture.md: {unplaced}"


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    found = cycles(graph)
    assert not found, "import cycles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(component) for component in found)


def test_no_import_against_the_layer_order(graph: dict[str, set[str]], layers) -> None:
    found = upward_imports(graph, layers)
    assert not found, "imports against the layer order of docs/architecture.md:\n" + "\n".join(found)


def test_upward_imports_are_few_and_still_there(graph: dict[str, set[str]]) -> None:
    assert len(UPWARD) <= 10
    gone = [pair for pair in UPWARD if pair[1] not in graph.get(pair[0], ())]
    assert not gone, f"allowed upward imports that no longer exist (drop them from UPWARD): {gone}"


def test_packages_import_no_benchmark_script_or_test(imports) -> None:
    found = imports[1]
    assert not found, "package modules importing benchmarks/, scripts/ or tests/:\n" + "\n".join(
        f"{module} imports {name}" for module, name in found)


def test_the_checks_catch_a_cycle_and_an_upward_import(graph: dict[str, set[str]], layers) -> None:
    # the checks themselves, on the real graph with one edge added
    cyclic = {**graph, "rollout.kernels": graph["rollout.kernels"] | {"rollout.cache.kv_pool"}}
    assert ["rollout.cache.kv_pool", "rollout.kernels"] in cycles(cyclic)
    upward = {**graph, "rollout.scheduler": graph["rollout.scheduler"] | {"lora.manager"}}
    assert set(upward_imports(upward, layers)) - set(upward_imports(graph, layers)) == {
        "rollout.scheduler (core) imports lora.manager (features)"}
