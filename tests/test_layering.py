"""The package's layers, checked on its source: no import from a higher layer, no import cycle.

Layers, lowest first (a module may import its own layer and the ones below):

0. core: ``errors``, ``config``, ``registry``, ``settings``, ``progress``, ``_threads``, ``architectures``;
1. ``methods/``;  2. ``kernels/``;  3. ``baselines/``;  4. ``harness/``;  5. ``reports/``;
6. the user's surface: ``harness/cli.py`` (or ``cli.py``), ``__main__`` and the package's own
   ``__init__`` (its Python API, e.g. ``load_results``, reaches into reports lazily).

No module imports a baseline: the registry loads them by module name (``BUILTIN_MODULES``) and
through entry points, so a baseline is one file that nothing else reaches into. Every import is
checked, module-level and function-local, relative ones resolved. Module-level imports (less
those under ``if TYPE_CHECKING:``, which never run) must form a DAG.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "mosaicquant"
ROOT = Path(__file__).resolve().parents[1]

CORE_MODULES = {"errors", "config", "registry", "settings", "progress", "_threads", "architectures"}
LAYER_NAMES = ("core", "methods", "kernels", "baselines", "harness", "reports", "cli")
CLI_MODULES = {PACKAGE, f"{PACKAGE}.cli", f"{PACKAGE}.harness.cli", f"{PACKAGE}.__main__"}


@dataclass(frozen=True)
class Import:
    """One import statement's target, as the importing module sees it."""

    source: str
    target: str
    line: int
    module_level: bool  # runs when ``source`` is imported (not in a function, not TYPE_CHECKING-only)
    type_only: bool = False  # under ``if TYPE_CHECKING:``: never runs


def layer_of(module: str) -> int:
    """Index into :data:`LAYER_NAMES` of a module of the package.

    Raises:
        ValueError: a module of the package that no layer holds (a new top-level module or folder).
    """
    if module in CLI_MODULES:
        return LAYER_NAMES.index("cli")
    parts = module.split(".")
    if parts[0] != PACKAGE:
        raise ValueError(f"{module!r} is not a module of {PACKAGE}")
    if len(parts) == 1 or parts[1] in CORE_MODULES:
        return LAYER_NAMES.index("core")
    if parts[1] in LAYER_NAMES:
        return LAYER_NAMES.index(parts[1])
    raise ValueError(f"{module!r} is in no layer: add it to CORE_MODULES or put it under one of "
                     f"{', '.join(LAYER_NAMES[1:-1])}")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, text: str, is_package: bool, known: set[str]) -> list[Import]:
    """Every import in ``text`` (the source of module ``source``), relative ones made absolute.

    ``from a import b`` names ``a.b`` where that is a module in ``known``, else ``a``.
    """
    found: list[Import] = []

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        if node.level:
            base = source.split(".") if is_package else source.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            parent = ".".join(base + ([node.module] if node.module else []))
        else:
            parent = node.module
        names = [f"{parent}.{alias.name}" for alias in node.names if f"{parent}.{alias.name}" in known]
        return names if len(names) == len(node.names) else [parent, *names]

    def walk(node, module_level: bool, type_only: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(Import(source, t, child.lineno, module_level and not type_only, type_only)
                             for t in targets(child))
            inner = module_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                walk(ast.Module(body=child.body, type_ignores=[]), inner, True)
                walk(ast.Module(body=child.orelse, type_ignores=[]), inner, type_only)
                continue
            walk(child, inner, type_only)

    walk(ast.parse(text), True, False)
    return found


def package_imports(root: Path = ROOT, package: str = PACKAGE) -> tuple[set[str], list[Import]]:
    """The package's modules and every import of one of them by another."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    known = set(files)
    edges = []
    for name, path in files.items():
        for imp in imports_of(name, path.read_text(), path.name == "__init__.py", known):
            if imp.target.split(".")[0] == package and imp.target != imp.source:
                edges.append(imp)
    return known, edges


def layer_violations(edges: list[Import]) -> list[str]:
    """One line per import of a higher layer, or of a baseline, naming the edge."""
    bad = []
    for imp in edges:
        src, dst = layer_of(imp.source), layer_of(imp.target)
        where = f"{imp.source}:{imp.line} imports {imp.target}"
        if dst > src:
            bad.append(f"{where} ({LAYER_NAMES[src]} may not import {LAYER_NAMES[dst]})")
        elif imp.target.startswith(f"{PACKAGE}.baselines."):
            bad.append(f"{where} (a baseline is reached only through the registry)")
    return bad


def find_cycle(edges: list[Import], module_level_only: bool = True) -> list[str] | None:
    """A cycle of imports as ``[a, b, ..., a]``, or None when they form a DAG.

    Args:
        edges: the imports.
        module_level_only: only the imports that run at import time (the default); with False,
            function-local ones too: a cycle that a function-local import merely hides.
            ``TYPE_CHECKING`` imports never count: they never run.
    """
    graph: dict[str, set[str]] = {}
    for imp in edges:
        if imp.module_level or not (module_level_only or imp.type_only):
            graph.setdefault(imp.source, set()).add(imp.target)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


# ---------------------------------------------------------------------------------------------
# the checker on small synthetic packages: it must catch what it is meant to catch


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


_CLEAN = {
    "mosaicquant/__init__.py": "",
    "mosaicquant/errors.py": "",
    "mosaicquant/methods/__init__.py": "",
    "mosaicquant/methods/quant.py": "from mosaicquant.errors import UserInputError\n",
    "mosaicquant/kernels/__init__.py": "from .gemm import gemm\n",
    "mosaicquant/kernels/gemm.py": "from ..methods import quant\nfrom . import _tl\n",
    "mosaicquant/kernels/_tl.py": "import torch\n",
    "mosaicquant/harness/__init__.py": "",
    "mosaicquant/harness/runner.py": ("from typing import TYPE_CHECKING\nfrom mosaicquant.kernels import gemm\n"
                                      "if TYPE_CHECKING:\n    from mosaicquant.harness.models import Model\n"),
    "mosaicquant/harness/models.py": "from mosaicquant.harness import runner\n",
    "mosaicquant/harness/cli.py": "from mosaicquant.harness import runner\n",
}


def test_checker_passes_a_clean_package(tmp_path):
    _write(tmp_path, _CLEAN)
    known, edges = package_imports(tmp_path)
    assert {(e.source, e.target) for e in edges} >= {
        ("mosaicquant.kernels.gemm", "mosaicquant.methods.quant"),  # relative import resolved
        ("mosaicquant.kernels.gemm", "mosaicquant.kernels._tl"),
        ("mosaicquant.kernels", "mosaicquant.kernels.gemm"),
    }
    assert layer_violations(edges) == []
    assert find_cycle(edges) is None  # runner -> models only under TYPE_CHECKING


def test_checker_names_an_import_from_a_higher_layer(tmp_path):
    files = dict(_CLEAN)
    files["mosaicquant/methods/quant.py"] = "def f():\n    from mosaicquant.kernels.gemm import gemm\n"
    _write(tmp_path, files)
    _, edges = package_imports(tmp_path)
    assert layer_violations(edges) == [
        "mosaicquant.methods.quant:2 imports mosaicquant.kernels.gemm (methods may not import kernels)"]


def test_checker_names_an_import_of_a_baseline(tmp_path):
    files = dict(_CLEAN)
    files["mosaicquant/baselines/__init__.py"] = ""
    files["mosaicquant/baselines/atom.py"] = ""
    files["mosaicquant/baselines/resq.py"] = "from .atom import x\n"
    _write(tmp_path, files)
    _, edges = package_imports(tmp_path)
    assert layer_violations(edges) == [
        "mosaicquant.baselines.resq:1 imports mosaicquant.baselines.atom (a baseline is reached only through "
        "the registry)"]


def test_checker_names_a_cycle(tmp_path):
    files = dict(_CLEAN)
    files["mosaicquant/kernels/_tl.py"] = "from mosaicquant.kernels.gemm import gemm\n"
    _write(tmp_path, files)
    _, edges = package_imports(tmp_path)
    assert layer_violations(edges) == []
    cycle = find_cycle(edges)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert sorted(cycle[:-1]) == ["mosaicquant.kernels._tl", "mosaicquant.kernels.gemm"]


def test_checker_finds_a_cycle_hidden_by_a_function_local_import(tmp_path):
    files = dict(_CLEAN)
    files["mosaicquant/kernels/_tl.py"] = "def f():\n    from mosaicquant.kernels.gemm import gemm\n"
    _write(tmp_path, files)
    _, edges = package_imports(tmp_path)
    assert find_cycle(edges) is None  # the module-level imports alone form a DAG
    cycle = find_cycle(edges, module_level_only=False)
    assert cycle is not None and sorted(cycle[:-1]) == ["mosaicquant.kernels._tl", "mosaicquant.kernels.gemm"]


def test_layer_of_refuses_a_module_in_no_layer():
    assert layer_of("mosaicquant.registry") == 0
    assert layer_of("mosaicquant.harness.cli") == LAYER_NAMES.index("cli")
    with pytest.raises(ValueError, match="mosaicquant.extras.x' is in no layer"):
        layer_of("mosaicquant.extras.x")


# ---------------------------------------------------------------------------------------------
# the package itself


def test_package_imports_follow_the_layers():
    _, edges = package_imports()
    assert len(edges) > 100  # the walk found the package
    violations = layer_violations(edges)
    assert not violations, "imports from a higher layer:\n" + "\n".join(violations)


def test_package_module_level_imports_have_no_cycle():
    _, edges = package_imports()
    cycle = find_cycle(edges)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_package_has_no_cycle_hidden_by_a_function_local_import():
    _, edges = package_imports()
    cycle = find_cycle(edges, module_level_only=False)
    assert cycle is None, "import cycle through a function-local import: " + " -> ".join(cycle)
