"""The shape of the tree, checked: no import cycle inside isolane/, no module over 500
lines, and the layering between packages.

The rules (docs/ARCHITECTURE.md states them for contributors):

- Every ``import``/``from ... import`` anywhere in a module counts — at module level and
  inside functions, methods and ``try`` blocks — and so does
  ``importlib.import_module("literal")``. Only imports under ``if TYPE_CHECKING:`` are
  exempt (its ``else:`` branch runs, so it counts).
- ``from isolane.pkg import name`` is an edge to ``isolane.pkg.name`` when that is a
  submodule, else to ``isolane.pkg`` (its ``__init__``); ``import isolane.a.b`` is an
  edge to ``isolane.a.b``; relative imports resolve against the importing module.
- A cycle is a strongly connected component of two or more modules.
- A module is too long past 500 lines (``wc -l``).
- Layering (``LAYERS``): errors and units import nothing of isolane; storage and lanes
  nothing of the products, the routing, the wire or the service; wire and cluster are
  pure (no storage, lanes, node, client); snapshot and kvpool do not import each other
  or the node; a client does not import the node; no core package imports cli or
  integrations.

Today's offenders are listed below, each with the helper who removes it. A listed entry
that no longer occurs fails too, so a fix removes its entry and the lists only shrink.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "isolane"
MAX_LINES = 500

# Import edges (importer, imported) that close a cycle today. The cycle check runs on the
# graph without them; each must still exist (else remove it here).
CYCLE_EDGES_ALLOWED: dict[tuple[str, str], str] = {}

# Modules over MAX_LINES today.
LONG_MODULES_ALLOWED: dict[str, str] = {}

# Layering: a module under the first prefix imports nothing under the others.
FRONTS = ("isolane.cli", "isolane.integrations")
SERVICE = ("isolane.node", "isolane.client")
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("isolane.errors", ("isolane.",)),
    ("isolane.units", ("isolane.",)),
    # the storage seam and the lanes sit under the products and the service
    (
        "isolane.storage",
        ("isolane.lanes", "isolane.snapshot", "isolane.kvpool", "isolane.cluster",
         "isolane.wire", *SERVICE, *FRONTS),
    ),
    (
        "isolane.lanes",
        ("isolane.snapshot", "isolane.kvpool", "isolane.cluster", "isolane.wire", *SERVICE,
         *FRONTS),
    ),
    # what crosses the wire and the routing are pure: no I/O packages, no service
    ("isolane.wire", ("isolane.storage", "isolane.lanes", *SERVICE, *FRONTS)),
    ("isolane.cluster", ("isolane.storage", "isolane.snapshot", "isolane.kvpool", *SERVICE,
                         *FRONTS)),
    # the two products do not know each other, nor the node that serves them
    ("isolane.snapshot", ("isolane.kvpool", "isolane.node", *FRONTS)),
    ("isolane.kvpool", ("isolane.snapshot", "isolane.node", *FRONTS)),
    # a client speaks the wire format, it does not import the server
    ("isolane.client", ("isolane.node", *FRONTS)),
    # no core package reaches out to the front ends
    *((pkg, FRONTS) for pkg in ("isolane.config", "isolane.config_checks", "isolane.node")),
)

# Layering edges that break a rule today.
LAYER_EDGES_ALLOWED: dict[tuple[str, str], str] = {}

# Old module paths kept for users (docs/ARCHITECTURE.md, "Moved modules"): each hands
# every name on to its new module through ``isolane.moved.forward`` and holds nothing
# else (test below), so it adds no import edge of its own.
DEPRECATION_SHIMS: dict[str, str] = {
    "isolane.kvpool.hooks": "isolane.integrations.transformers_kv",
    "isolane.kvpool.vllm_connector": "isolane.integrations.vllm.connector",
    "isolane.snapshot.callbacks": "isolane.integrations.callbacks",
}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int


def module_name(root: Path, path: Path) -> str:
    """``root/a/b.py`` -> ``<root.name>.a.b``; a package's ``__init__.py`` -> the package."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(root, p): p for p in sorted(root.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of the tree except those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _imported_names(node: ast.AST, name: str, is_package: bool) -> Iterator[tuple[str, str | None]]:
    """(module, attribute or None) pairs one import node asks for."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, None
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = name.split(".")
            if not is_package:
                base.pop()
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            yield target, alias.name
    elif (
        isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
            or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
        )
    ):
        yield node.args[0].value, None


def import_edges(root: Path) -> list[Edge]:
    """Every runtime import edge between modules of the tree at root, once per pair
    (with the first line that makes it)."""
    mods = modules(root)
    first_line: dict[tuple[str, str], int] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _runtime_nodes(tree):
            for target, attr in _imported_names(node, name, is_package):
                if attr is not None and f"{target}.{attr}" in mods:
                    target = f"{target}.{attr}"
                if target in mods and target != name:
                    line = getattr(node, "lineno", 0)
                    key = (name, target)
                    first_line[key] = min(line, first_line.get(key, line))
    return [Edge(a, b, line) for (a, b), line in sorted(first_line.items())]


def strongly_connected(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of two or more nodes, sorted."""
    graph: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, int]] = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            successors = graph[node]
            if i < len(successors):
                work.append((node, i + 1))
                nxt = successors[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
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
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(found)


def cycles(
    root: Path, allowed: Iterable[tuple[str, str]] = ()
) -> list[tuple[list[str], list[Edge]]]:
    """Each import cycle of the tree (its modules and the edges inside it)."""
    skip = set(allowed)
    edges = [e for e in import_edges(root) if (e.importer, e.imported) not in skip]
    found = []
    for component in strongly_connected(modules(root), ((e.importer, e.imported) for e in edges)):
        members = set(component)
        inside = [e for e in edges if e.importer in members and e.imported in members]
        found.append((component, inside))
    return found


def long_modules(root: Path, max_lines: int = MAX_LINES) -> dict[str, int]:
    """Modules over max_lines lines, counted as ``wc -l`` does (newlines)."""
    counts = {name: path.read_bytes().count(b"\n") for name, path in modules(root).items()}
    return {name: n for name, n in counts.items() if n > max_lines}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix if prefix.endswith(".") else prefix + ".")


def layer_violations(root: Path, layers: Iterable[tuple[str, tuple[str, ...]]]) -> list[Edge]:
    found = []
    rules = list(layers)
    for edge in import_edges(root):
        for pkg, forbidden in rules:
            if _under(edge.importer, pkg) and any(
                _under(edge.imported, f) and not _under(edge.imported, pkg) for f in forbidden
            ):
                found.append(edge)
                break
    return found


def _describe(found: list[tuple[list[str], list[Edge]]]) -> str:
    lines = []
    for component, inside in found:
        lines.append("cycle: " + ", ".join(component))
        lines.extend(f"    {e.importer} -> {e.imported} (line {e.line})" for e in inside)
    return "\n".join(lines)


# --- the tree ------------------------------------------------------------------------


def test_no_import_cycle() -> None:
    found = cycles(ROOT, CYCLE_EDGES_ALLOWED)
    assert not found, (
        "import cycles inside isolane/ (break each: move the shared piece into a module both "
        "import, or import under `if TYPE_CHECKING:` if it is only for annotations):\n"
        + _describe(found)
    )


def stale_cycle_edges(root: Path, allowed: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Allowed edges that no longer close a cycle (gone, or both ends no longer in one
    strongly connected component of the whole graph)."""
    edges = [(e.importer, e.imported) for e in import_edges(root)]
    component_of = {
        member: i
        for i, component in enumerate(strongly_connected(modules(root), edges))
        for member in component
    }
    present = set(edges)
    return sorted(
        (a, b)
        for a, b in allowed
        if (a, b) not in present or a not in component_of or component_of[a] != component_of.get(b)
    )


def test_allowed_cycle_edges_still_close_a_cycle() -> None:
    stale = stale_cycle_edges(ROOT, CYCLE_EDGES_ALLOWED)
    assert not stale, f"remove these from CYCLE_EDGES_ALLOWED, they close no cycle now: {stale}"


def test_no_module_over_500_lines() -> None:
    over = long_modules(ROOT)
    new = {m: n for m, n in over.items() if m not in LONG_MODULES_ALLOWED}
    assert not new, f"modules over {MAX_LINES} lines (split them by concept): {new}"
    stale = sorted(set(LONG_MODULES_ALLOWED) - set(over))
    assert not stale, f"remove these from LONG_MODULES_ALLOWED, they are short now: {stale}"


def test_layering() -> None:
    found = layer_violations(ROOT, LAYERS)
    new = [e for e in found if (e.importer, e.imported) not in LAYER_EDGES_ALLOWED]
    assert not new, "imports against the layering:\n" + "\n".join(
        f"    {e.importer} -> {e.imported} (line {e.line})" for e in new
    )
    stale = sorted(set(LAYER_EDGES_ALLOWED) - {(e.importer, e.imported) for e in found})
    assert not stale, f"remove these from LAYER_EDGES_ALLOWED, they are gone: {stale}"


@pytest.mark.parametrize(("old", "new"), sorted(DEPRECATION_SHIMS.items()))
def test_a_deprecation_shim_only_hands_names_on(old: str, new: str) -> None:
    """Docstring, ``from isolane.moved import forward``, ``__getattr__, __dir__ =
    forward(__name__, new)``: nothing more."""
    path = ROOT.parent / (old.replace(".", "/") + ".py")
    body = ast.parse(path.read_text()).body
    assert len(body) == 3, ast.dump(ast.Module(body=body, type_ignores=[]))
    doc, imp, assign = body
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    assert isinstance(imp, ast.ImportFrom) and imp.module == "isolane.moved"
    assert [a.name for a in imp.names] == ["forward"]
    assert isinstance(assign, ast.Assign) and isinstance(assign.value, ast.Call)
    assert ast.unparse(assign.targets[0]) == "(__getattr__, __dir__)"
    assert ast.unparse(assign.value) == f"forward(__name__, {new!r})"


# --- the checker, on small trees -------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text, encoding="utf-8")
    return root


def test_checker_finds_a_function_level_cycle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "a.py": "from pkg import b\n",
            "b.py": "def f():\n    from pkg.c import x\n    return x\n",
            "c.py": "import pkg.a\nx = 1\n",
            "d.py": "from pkg import a\n",
        },
    )
    found = cycles(root)
    assert [component for component, _ in found] == [["pkg.a", "pkg.b", "pkg.c"]]
    assert "pkg.b -> pkg.c (line 2)" in _describe(found)
    assert cycles(root, [("pkg.c", "pkg.a")]) == []
    assert stale_cycle_edges(
        root, [("pkg.c", "pkg.a"), ("pkg.d", "pkg.a"), ("pkg.a", "pkg.d")]
    ) == [
        ("pkg.a", "pkg.d"),
        ("pkg.d", "pkg.a"),
    ]


def test_checker_ignores_type_checking_imports_only(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "a.py": "from pkg.b import B\n",
            "b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg.a import A\nelse:\n    pass\nB = 1\n"
            ),
        },
    )
    assert cycles(root) == []
    (root / "b.py").write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from pkg.a import A\n",
        encoding="utf-8",
    )
    assert [c for c, _ in cycles(root)] == [["pkg.a", "pkg.b"]]


def test_checker_resolves_relative_package_and_lazy_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "sub/__init__.py": "from .x import X\n",
            "sub/x.py": "from .. import top\nX = 1\n",
            "top.py": (
                "import importlib\ndef get():\n    return importlib.import_module('pkg.sub')\n"
            ),
        },
    )
    edges = {(e.importer, e.imported) for e in import_edges(root)}
    assert edges == {("pkg.sub", "pkg.sub.x"), ("pkg.sub.x", "pkg.top"), ("pkg.top", "pkg.sub")}
    assert [c for c, _ in cycles(root)] == [["pkg.sub", "pkg.sub.x", "pkg.top"]]


def test_checker_finds_a_long_module_and_a_layer_break(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "low/a.py": "x = 1\n" * 501,
            "low/b.py": "x = 1\n" * 500,
            "high.py": "",
            "low/c.py": "def f():\n    from pkg import high\n",
        },
    )
    assert long_modules(root) == {"pkg.low.a": 501}
    found = layer_violations(root, [("pkg.low", ("pkg.high",))])
    assert [(e.importer, e.imported) for e in found] == [("pkg.low.c", "pkg.high")]


@pytest.mark.parametrize(
    "prefix, name, inside",
    [
        ("isolane.cli", "isolane.cli.main", True),
        ("isolane.cli", "isolane.client", False),
        ("isolane.", "isolane.errors", True),
    ],
)
def test_prefix_match_is_by_package(prefix: str, name: str, inside: bool) -> None:
    assert _under(name, prefix) is inside
