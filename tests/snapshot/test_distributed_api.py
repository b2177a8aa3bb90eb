"""distributed.py keeps only the collectives and drives saves through the save
transaction's public API: it may not reach into another module's objects (no
``store._prefix``, ``saves._slot``, ``from ... import _private``)."""

from __future__ import annotations

import ast
from pathlib import Path

import isolane.snapshot.distributed as distributed

OWN = ("self", "cls")


def private_uses(source: str) -> list[str]:
    """``line: what`` for each private attribute of another object read or written
    (``x._name``, dunders aside, ``self``/``cls`` allowed) and each private name
    imported from another module."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in OWN):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    return sorted(found, key=lambda entry: int(entry.split(":")[0]))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_distributed_uses_no_private_member_of_another_module() -> None:
    source = Path(distributed.__file__).read_text()
    assert private_uses(source) == []


def test_the_check_finds_private_members_and_imports() -> None:
    source = (
        "from isolane.snapshot.store import _prefix, check\n"
        "def f(store, self):\n"
        "    store._save_slot.acquire()\n"
        "    self._mine = store.url.__len__()\n"
        "    return store.saves._slot\n")
    assert private_uses(source) == [
        "1: from isolane.snapshot.store import _prefix",
        "3: store._save_slot",
        "5: store.saves._slot",
    ]
