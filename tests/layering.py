"""The layering check (issue 10): one direction of dependencies, no import cycles.

Layers, lowest first; a module may import its own layer and the ones below, never above:

    0 protocol   llamactor.protocol.*            data only: messages, events, wire, plan, errors
    1 core       llamactor.runtime.kernel.*      the actor kernel
                 llamactor.runtime.engine.*      the llama.cpp bindings (model, context, sampling)
    2 actors     llamactor.actors.*              supervisor, groups, coordinator, policies
    3 service    llamactor.runtime.service.*     Runtime facade, admission, config, metrics
    4 app        llamactor.runtime.http.*, llamactor.runtime.cli, llamactor.runtime.api,
                 llamactor.runtime (the public surface), llamactor.ops.*

Every import statement counts, at module level or inside a function, under TYPE_CHECKING or
not. Importing ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` too; those implicit parent
imports are not edges (the package ``__init__``s are kept free of upward imports by the
fresh-interpreter test, which checks what an import really loads).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# Folder of the repository -> the package it installs as (pyproject's package-dir).
PACKAGE_DIRS = {
    "protocol": "llamactor.protocol",
    "runtime": "llamactor.runtime",
    "actors": "llamactor.actors",
    "ops": "llamactor.ops",
}

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("protocol", ("llamactor.protocol",)),
    ("core", ("llamactor.runtime.kernel", "llamactor.runtime.engine")),
    ("actors", ("llamactor.actors",)),
    ("service", ("llamactor.runtime.service",)),
    ("app", ("llamactor.runtime.http", "llamactor.runtime.cli", "llamactor.runtime.api", "llamactor.runtime",
             "llamactor.ops")),
)


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


def layer_of(module: str, layers: Iterable[tuple[str, tuple[str, ...]]] = LAYERS) -> int:
    """Index of the layer with the longest matching prefix; -1 outside every layer."""
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def violations(root: Path, package_dirs: Mapping[str, str] = PACKAGE_DIRS,
               layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> list[str]:
    """Upward imports and imports of bare top-level names (``import runtime``)."""
    mods = modules(root, package_dirs)
    bare = {p.split(".")[-1] for p in package_dirs.values()}
    out: list[str] = []
    for imp in imports(mods):
        if imp.target.split(".")[0] in bare:
            out.append(f"{imp.source}:{imp.line} imports the bare package {imp.target!r}")
            continue
        src, dst = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if dst > src:
            out.append(f"{imp.source}:{imp.line} ({layers[src][0]}) imports {imp.target} ({layers[dst][0]}), "
                       f"a higher layer")
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
