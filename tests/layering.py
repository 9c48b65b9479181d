"""The layering check: one direction of dependencies, no import cycles.

Layers, lowest first; a module may import its own layer and the ones below, never above:

    0 protocol   llamactor.protocol.*            data only: messages, events, wire, plan, errors
    1 core       llamactor.runtime.kernel.*      the actor kernel
                 llamactor.runtime.engine.*      the llama.cpp bindings (model, context, sampling)
    2 actors     llamactor.actors.*              supervisor, groups, coordinator, policies
    3 service    llamactor.runtime.service.*     Runtime facade, admission, config, metrics
    4 app        llamactor.runtime.http.*, llamactor.runtime.cli*, llamactor.runtime.serve*, llamactor.runtime.preset*,
                 llamactor.runtime.api, llamactor.runtime (the public surface), llamactor.ops.*

The table is pyproject's import-linter contract (``[tool.importlinter]``, id "layers"), read
from there: ``lint-imports`` (run by ``make test``) and this AST walk check the same rules.
The walk adds what the contracts do not say: an import cycle between modules of different
packages, and a layer for every module (so no new module escapes the contract).

Every import statement counts, at module level or inside a function, under TYPE_CHECKING or
not. Importing ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` too; those implicit parent
imports are not edges (the package ``__init__``s are kept free of upward imports by the
fresh-interpreter test, which checks what an import really loads).
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
_CONFIG = tomllib.loads(PYPROJECT.read_text())["tool"]

# Folder of the repository -> the package it installs as (pyproject's package-dir).
PACKAGE_DIRS: dict[str, str] = {folder: package for package, folder in _CONFIG["setuptools"]["package-dir"].items()}

LAYER_NAMES = ("protocol", "core", "actors", "service", "app")

# The contract cannot list llamactor.runtime itself (the lower layers live under it): the package
# module, the embedding API's lazy names, is of the top layer (and the "public-surface" contract
# keeps the layers below from importing it).
PUBLIC_SURFACE = "llamactor.runtime"


def contract_layers(config: Mapping[str, object] = _CONFIG) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The import-linter "layers" contract as (name, module prefixes) pairs, lowest first."""
    contracts = config["importlinter"]["contracts"]  # type: ignore[index]
    (contract,) = [c for c in contracts if c["id"] == "layers"]
    rows = [tuple(m.strip() for m in re.split(r"[:|]", layer)) for layer in reversed(contract["layers"])]
    assert len(rows) == len(LAYER_NAMES), f"name the {len(rows)} layers of the contract in LAYER_NAMES"
    return tuple(zip(LAYER_NAMES, rows))


LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = contract_layers()


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (resolved to a module of the tree when it is one)
    line: int


def modules(root: Path, package_dirs: Mapping[str, str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the mapped folders."""
    out: dict[str, Path] = {}
    for folder, package in package_dirs.items():
        for file in sorted((root / folder).rglob("*.py")):
            rel = file.relative_to(root / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = file
    return out


def imports(mods: Mapping[str, Path]) -> list[Import]:
    """Every import of a module of the tree, resolved (``from a import b`` is ``a.b`` when that
    is a module, else ``a``)."""
    found: list[Import] = []
    for name, file in mods.items():
        is_pkg = file.name == "__init__.py"
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, is_pkg, node.module, node.level)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] in ("llamactor", *[p.split(".")[-1] for p in PACKAGE_DIRS.values()]):
                    found.append(Import(name, t, node.lineno))
    return found


def _absolute(module: str, is_pkg: bool, target: str | None, level: int) -> str:
    if level == 0:
        return target or ""
    parts = module.split(".")
    base = parts if is_pkg else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> int:
    """Index of the layer with the longest matching prefix (the public surface: the top one);
    -1 outside every layer."""
    if module == PUBLIC_SURFACE:
        return len(layers) - 1
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def violations(
    root: Path, package_dirs: Mapping[str, str] = PACKAGE_DIRS, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS
) -> list[str]:
    """Modules in no layer, upward imports and imports of bare top-level names (``import runtime``)."""
    mods = modules(root, package_dirs)
    bare = {p.split(".")[-1] for p in package_dirs.values()}
    out = [f"{m} is in no layer (add it to pyproject's layers contract)" for m in mods if layer_of(m, layers) < 0]
    for imp in imports(mods):
        if layer_of(imp.source, layers) < 0:
            continue  # reported above
        if imp.target.split(".")[0] in bare:
            out.append(f"{imp.source}:{imp.line} imports the bare package {imp.target!r}")
            continue
        src, dst = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if dst > src:
            out.append(
                f"{imp.source}:{imp.line} ({layers[src][0]}) imports {imp.target} ({layers[dst][0]}), a higher layer"
            )
    return out


def cycles(root: Path, package_dirs: Mapping[str, str] = PACKAGE_DIRS) -> list[list[str]]:
    """Import cycles between modules (strongly connected components of more than one module)."""
    mods = modules(root, package_dirs)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for imp in imports(mods):
        if imp.target in mods and imp.target != imp.source and not imp.source.startswith(imp.target + "."):
            graph[imp.source].add(imp.target)
    return [c for c in _scc(graph) if len(c) > 1]


def _scc(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out
