"""The house's layout as DESIGN.md draws it: no import circle among our modules, each internal
package imports only the packages below it, and every name the README uses imports from where the
README says (its Python blocks run as written)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

import etl

ROOT = Path(__file__).resolve().parents[2]
#: DESIGN.md's package table: what each package may import of ours.
MAY_IMPORT = {"schemas": set(), "dedup": {"schemas"}, "connectors": {"schemas", "dedup"},
              "etl": {"schemas", "dedup", "connectors"}}


def modules() -> dict[str, Path]:
    found = {}
    for package in MAY_IMPORT:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:  # Alembic's scripts, run by Alembic
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module → our modules it imports, anywhere in it (lazy and TYPE_CHECKING imports too: a
    circle through a lazy import is still a circle in the design). Importing ``a.b.c`` counts as
    importing ``a.b.c`` only, not the packages above it, as import-linter counts."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                if target.split(".")[0] in MAY_IMPORT and (found := resolve(target)) not in (None, name):
                    graph[name].add(found)  # type: ignore[arg-type]
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
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


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_each_package_imports_only_those_below_it() -> None:
    wrong = sorted((name, target) for name, targets in import_graph().items() for target in targets
                   if target.split(".")[0] not in MAY_IMPORT[name.split(".")[0]] | {name.split(".")[0]})
    assert wrong == []


def test_the_testing_tools_import_from_etl_testing() -> None:
    from etl.testing import BatchServer, FakeLLM, FaultServer, ListSource  # noqa: F401, PLC0415


README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_python_blocks_run_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block runs after the ones before it (they build on each other, as a reader's session)."""
    monkeypatch.chdir(ROOT)  # the blocks name files relative to the project
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 5
    namespace: dict[str, object] = {}
    for number, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {number + 1}", "exec", dont_inherit=True), namespace)  # noqa: S102


def test_every_name_the_readme_calls_inline_is_public() -> None:
    """``Name(...)`` in the README's prose imports from ``etl`` (or is defined in one of its blocks)."""
    namespace: dict[str, object] = {}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for block in re.findall(r"```python\n(.*?)```", README, re.S):
            exec(compile(block, "README.md", "exec", dont_inherit=True), namespace)  # noqa: S102
    finally:
        os.chdir(cwd)
    called = {name for span in re.findall(r"`([^`\n]+)`", README) for name in re.findall(r"\b([A-Z]\w+)\(", span)}
    assert called, "no inline call found: the pattern is broken"
    assert sorted(name for name in called if name not in etl.__all__ and name not in namespace) == []
