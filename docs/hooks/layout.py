"""mkdocs hook: the code's layout, read from the code when the site is built.

A page asks for it with a line of its own, ``<!-- layout -->``. The table has a row per package
of the layer contract (pyproject's ``[tool.importlinter]`` "layers" list, highest layer first):
its layer, its folder, how many modules and lines of Python it holds, the packages it may import
(the layers below it), and its modules over ``LONG_MODULE_LINES`` lines. Made from the files at
build time, it cannot go stale; ``tests/test_layout.py`` checks that every folder of the
package is in a row.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- layout -->[ \t]*$", re.MULTILINE)
LONG_MODULE_LINES = 400  # past this a module holds more than one concept, or is one table
LAYER_NAMES = {0: "data", 1: "core", 2: "actors", 3: "service", 4: "app"}


def _pyproject(repo: Path) -> dict[str, Any]:
    return tomllib.loads((repo / "pyproject.toml").read_text())


def _folder(package: str, package_dirs: dict[str, str]) -> Path | None:
    """The folder (relative to the repository) of ``package``, or None for a module file."""
    for top, folder in sorted(package_dirs.items(), key=lambda kv: -len(kv[0])):
        if package == top or package.startswith(top + "."):
            rest = package[len(top) :].lstrip(".").replace(".", "/")
            return Path(folder) / rest if rest else Path(folder)
    return None


def _sources(repo: Path, target: Path, others: list[Path]) -> list[Path]:
    """The Python files of ``target`` (a folder or a module), less the folders of other rows."""
    if (repo / target).with_suffix(".py").is_file():
        return [(repo / target).with_suffix(".py")]
    files = []
    for path in sorted((repo / target).rglob("*.py")):
        rel = path.relative_to(repo)
        if any(o != target and o.is_relative_to(target) and rel.is_relative_to(o) for o in others):
            continue  # the nested package has a row of its own
        files.append(path)
    return files


def rows(repo: Path = REPO) -> list[dict[str, Any]]:
    """One row per package of the layer contract, highest layer first."""
    project = _pyproject(repo)
    package_dirs = project["tool"]["setuptools"]["package-dir"]
    contract = next(c for c in project["tool"]["importlinter"]["contracts"] if c.get("id") == "layers")
    layers = [[name.strip() for name in entry.split(":")] for entry in contract["layers"]]
    targets = [_folder(name, package_dirs) for layer in layers for name in layer]
    known = [t for t in targets if t is not None]
    out = []
    for depth, layer in enumerate(layers):
        number = len(layers) - 1 - depth
        below = [name for lower in layers[depth + 1 :] for name in lower]
        for name in layer:
            target = _folder(name, package_dirs)
            if target is None:
                continue
            files = _sources(repo, target, known)
            sizes = {str(f.relative_to(repo)): len(f.read_text().splitlines()) for f in files}
            out.append(
                {
                    "layer": f"{number} {LAYER_NAMES.get(number, '')}".strip(),
                    "package": name,
                    "folder": str(target) + ("" if (repo / target).is_dir() else ".py"),
                    "modules": len(files),
                    "lines": sum(sizes.values()),
                    "imports": below,
                    "long": sorted((m for m, n in sizes.items() if n > LONG_MODULE_LINES), key=lambda m: -sizes[m]),
                    "sizes": sizes,
                }
            )
    return out


def table(repo: Path = REPO) -> str:
    lines = [
        f"| layer | package | folder | modules | lines | may import | modules over {LONG_MODULE_LINES} lines |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows(repo):
        short = [n.removeprefix("llamactor.") for n in r["imports"]]
        long = ", ".join(f"`{Path(m).name}` ({r['sizes'][m]})" for m in r["long"]) or "none"
        lines.append(
            f"| {r['layer']} | `{r['package']}` | `{r['folder']}` | {r['modules']} | {r['lines']:,} "
            f"| {', '.join(short) or 'nothing of llamactor'} | {long} |"
        )
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_: Any) -> str:
    if not MARKER.search(markdown):
        return markdown
    return MARKER.sub(lambda _m: table(), markdown)
