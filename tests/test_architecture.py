"""The shape of the tree, checked: no import cycle inside isolane/, modules about as long
as their concept needs, the layering between packages, and no module-level A/B switch.

The rules (docs/ARCHITECTURE.md states them for contributors):

- Every ``import``/``from ... import`` anywhere in a module counts — at module level and
  inside functions, methods, ``try`` blocks and ``if TYPE_CHECKING:`` (a type-only
  cycle is still two modules that know each other's insides) — and so does
  ``importlib.import_module("literal")``.
- ``from isolane.pkg import name`` is an edge to ``isolane.pkg.name`` when that is a
  submodule, else to ``isolane.pkg`` (its ``__init__``); ``import isolane.a.b`` is an
  edge to ``isolane.a.b``; relative imports resolve against the importing module.
- A cycle is a strongly connected component of two or more modules.
- Length is a guideline, not a cap: a module past ``MAX_LINES`` (``wc -l``) is one
  concept that needs the room, named in ``LONG_MODULES`` with why; split where the
  concept splits, never to meet a count.
- Layering (``LAYERS``): errors and units import nothing of isolane; storage and lanes
  nothing of the products, the routing, the wire or the service; wire and cluster are
  pure (no storage, lanes, node, client); snapshot and kvpool do not import each other
  or the node; a client does not import the node; no core package imports cli or
  integrations.
- One path per operation: no test or benchmark sets a module-level or class-level
  boolean of isolane (``monkeypatch.setattr(x, "NAME", True)``, ``setattr``, or
  ``x.NAME = False``): a switch between two paths is an experiment, and its winner
  should be the only path (a choice users really have is a constructor or config
  option).

A listed entry that no longer occurs fails too, so the lists only shrink.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "isolane"
MAX_LINES = 800
TESTS_AND_BENCHMARKS = (ROOT.parent / "tests", ROOT.parent / "benchmarks")

# Import edges (importer, imported) that close a cycle today. The cycle check runs on the
# graph without them; each must still exist (else remove it here).
CYCLE_EDGES_ALLOWED: dict[tuple[str, str], str] = {}

# Modules whose one concept needs more than MAX_LINES, and why.
LONG_MODULES: dict[str, str] = {
    "isolane.kvpool.log.segment_log": (
        "the segment log is one class whose reopen, reads, writes, sealing, eviction and "
        "compaction share its locks, segment table and key directory"),
}

# Module- or class-level booleans that tests or benchmarks still set, and why.
SWITCHES_ALLOWED: dict[str, str] = {}

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
    *((pkg, FRONTS) for pkg in ("isolane.config", "isolane.node")),
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


def _import_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of the tree, ``if TYPE_CHECKING:`` blocks included."""
    return ast.walk(tree)


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
    """Every import edge between modules of the tree at root (type-only ones too), once
    per pair (with the first line that makes it)."""
    mods = modules(root)
    first_line: dict[tuple[str, str], int] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _import_nodes(tree):
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
        "import cycles inside isolane/, type-only imports included (break each: move the "
        "shared piece into a module both import, or merge two halves of one concept):\n"
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


def test_a_long_module_is_one_concept_that_needs_the_room() -> None:
    over = long_modules(ROOT)
    new = {m: n for m, n in over.items() if m not in LONG_MODULES}
    assert not new, (f"modules over {MAX_LINES} lines: split each where its concept splits, "
                     f"or name it in LONG_MODULES with the concept that needs the room: {new}")
    stale = sorted(set(LONG_MODULES) - set(over))
    assert not stale, f"remove these from LONG_MODULES, they are short now: {stale}"


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


def boolean_attributes(root: Path) -> set[str]:
    """Names bound to ``True``/``False`` at module level or in a class body of the tree
    (not a dataclass's fields: those are per-instance settings)."""
    names: set[str] = set()
    for path in modules(root).values():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        bodies = [tree.body] + [
            n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
            and not any("dataclass" in ast.unparse(d) for d in n.decorator_list)]
        for body in bodies:
            for stmt in body:
                value = stmt.value if isinstance(stmt, ast.Assign | ast.AnnAssign) else None
                if isinstance(value, ast.Constant) and isinstance(value.value, bool):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def switch_settings(paths: Iterable[Path], names: set[str]) -> list[tuple[str, int, str]]:
    """Where code under ``paths`` sets one of ``names`` as an attribute: ``x.NAME = ...``,
    ``setattr(x, "NAME", ...)`` or ``monkeypatch.setattr(x, "NAME", ...)``."""
    found = []
    for base in paths:
        for path in sorted(base.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                hit = None
                if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    hit = next((t.attr for t in targets
                                if isinstance(t, ast.Attribute) and t.attr in names), None)
                elif (isinstance(node, ast.Call) and len(node.args) >= 2
                      and ast.unparse(node.func).split(".")[-1] == "setattr"
                      and isinstance(node.args[1], ast.Constant)
                      and node.args[1].value in names):
                    hit = str(node.args[1].value)
                if hit is not None:
                    found.append((str(path.relative_to(base.parent)), node.lineno, hit))
    return found


def test_no_test_or_benchmark_flips_a_module_switch() -> None:
    found = switch_settings(TESTS_AND_BENCHMARKS, boolean_attributes(ROOT))
    new = [f for f in found if f[2] not in SWITCHES_ALLOWED]
    assert not new, (
        "tests or benchmarks set a module- or class-level boolean of isolane: an A/B "
        "switch between two paths. Keep the winner as the only path, or make a real "
        "choice a constructor/config option:\n"
        + "\n".join(f"    {path}:{line} sets {name}" for path, line, name in new))
    stale = sorted(set(SWITCHES_ALLOWED) - {name for _p, _l, name in found})
    assert not stale, f"remove these from SWITCHES_ALLOWED, nothing sets them now: {stale}"


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


def test_checker_counts_type_checking_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "a.py": "from pkg.b import B\n",
            "b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg.a import A\nB = 1\n"
            ),
        },
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
            "low/a.py": "x = 1\n" * (MAX_LINES + 1),
            "low/b.py": "x = 1\n" * MAX_LINES,
            "high.py": "",
            "low/c.py": "def f():\n    from pkg import high\n",
        },
    )
    assert long_modules(root) == {"pkg.low.a": MAX_LINES + 1}
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


def test_checker_finds_a_switch_set_by_a_test(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"a.py": "FAST = False\nclass C:\n    on = True\n    n = 3\n"})
    assert boolean_attributes(root) == {"FAST", "on"}
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        "def test(monkeypatch, c):\n"
        "    monkeypatch.setattr(a, 'FAST', True)\n"
        "    c.on = False\n"
        "    setattr(c, 'on', True)\n"
        "    c.n = 4\n"
        "    c.other = True\n", encoding="utf-8")
    found = sorted((line, name) for _p, line, name in
             switch_settings([tests], boolean_attributes(root)))
    assert found == [(2, "FAST"), (3, "on"), (4, "on")]
