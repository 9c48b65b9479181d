"""mkdocs hook: the docs' flag tables, generated from ``llamactor.runtime.cliflags`` at build time.

``llamactor serve`` parses its command line from the option groups of that module, so tables
made from the same groups cannot drift from what the server does. A page asks for a table
with a line of its own:

    <!-- flags: llama-server -->   one row per group of llama-server's options: what llamactor
                                   does with them (supported, accepted and ignored, refused) and why
    <!-- flags: serve -->          every option that does something: each spelling, its
                                   environment variable and what it sets, one table per group

The groups are read by importing the module, in the Python that runs mkdocs (the repository's
``.venv`` with the ``docs`` extra installed). Where mkdocs runs from another environment, the
repository's ``.venv/bin/python`` runs this file to print them as JSON. If neither can read the
module, or a page names an unknown table, the build stops with a message saying why: a docs
site without its flag tables is not built.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MODULE = "llamactor.runtime.cliflags"
MARKER = re.compile(r"^<!-- flags: ([a-z-]+) -->[ \t]*$", re.MULTILINE)
VERDICT = {
    "config": "supported",
    "sampling": "supported (server default)",
    "process": "supported",
    "ignore": "accepted, ignored",
    "refuse": "refused (exit 2)",
}
ACTS = ("config", "sampling", "process")  # the uses whose options do something

_groups: list[dict[str, Any]] = []


def read_groups() -> list[dict[str, Any]]:
    """The option groups of ``cliflags.GROUPS`` as plain data (ImportError if not importable)."""
    import importlib

    cliflags = importlib.import_module(MODULE)
    return [
        {
            "title": g.title,
            "use": g.use.value,
            "why": g.why,
            "opts": [
                {
                    "names": list(o.names),
                    "neg": list(o.neg),
                    "value": o.value,
                    "env": o.env,
                    "field": o.field,
                    "help": o.help,
                }
                for o in g.opts
            ],
        }
        for g in cliflags.GROUPS
    ]


def _load() -> list[dict[str, Any]]:
    from mkdocs.exceptions import PluginError

    try:
        return read_groups()
    except ImportError as exc:
        here = f"{exc.__class__.__name__}: {exc}"
    python = REPO / ".venv" / "bin" / "python"
    if not python.exists():
        raise PluginError(
            f"flags hook: cannot import {MODULE} ({here}) and there is no {python} to read it with. "
            "Install llamactor with its docs extra and run mkdocs from that environment "
            "(make install; .venv/bin/pip install -e '.[docs]')."
        )
    proc = subprocess.run([str(python), __file__], capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    if proc.returncode != 0:
        raise PluginError(
            f"flags hook: cannot import {MODULE} ({here}); {python} could not read it either "
            f"(exit {proc.returncode}):\n{proc.stderr.strip()}"
        )
    return json.loads(proc.stdout)


def _text(text: str) -> str:
    """Help text as Markdown shows it literally (a ``<`` outside code spans is not HTML), one line."""
    parts = re.split(r"(`[^`]*`)", text.replace("\n", " "))
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in parts)


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped, never empty."""
    return _text(text).replace("|", "\\|") or "—"


def _long(names: list[str]) -> str:
    return names[-1] if names[-1].startswith("--") else names[0]


def _own(group: dict[str, Any]) -> bool:
    """llamactor's own groups (the module keeps them last, titled "llamactor ...")."""
    return group["title"].startswith("llamactor")


def llama_server_table(groups: list[dict[str, Any]]) -> str:
    rows = ["| Flags | What llamactor does | Why |", "|---|---|---|"]
    for g in groups:
        if _own(g):
            continue
        flags = ", ".join(f"`{_long(o['names'])}`" for o in g["opts"])
        rows.append(f"| **{_cell(g['title'])}**: {flags} | {VERDICT[g['use']]} | {_cell(g['why'])} |")
    return "\n".join(rows)


def _spelling(o: dict[str, Any]) -> str:
    value = f" {o['value']}" if o["value"] else ""
    names = ", ".join(f"`{n}`" for n in o["names"])
    neg = ", ".join(f"`{n}`" for n in o["neg"])
    return _cell(f"{names}{value}" + (f" (off: {neg})" if neg else ""))


def _meaning(use: str, o: dict[str, Any]) -> str:
    if o["help"]:
        return _cell(o["help"])
    if use == "sampling":
        return f"server default of the request field `{o['field']}`"
    if use == "process":
        return f"sets the process option `{o['field']}`"
    return f"sets `RuntimeConfig.{o['field']}`"


def serve_tables(groups: list[dict[str, Any]]) -> str:
    out: list[str] = []
    for g in groups:
        if g["use"] not in ACTS:
            continue
        out += [f"### {g['title']}", ""]
        if g["why"]:
            out += [_text(g["why"]).rstrip(".") + ".", ""]
        out += ["| Flag | Environment variable | What it does |", "|---|---|---|"]
        for o in g["opts"]:
            env = f"`{o['env']}`" if o["env"] else "—"
            out.append(f"| {_spelling(o)} | {env} | {_meaning(g['use'], o)} |")
        out.append("")
    return "\n".join(out)


TABLES = {"llama-server": llama_server_table, "serve": serve_tables}


def on_config(config: Any) -> Any:
    """Read the groups once per build, before any page: a module that cannot be read stops it."""
    global _groups
    _groups = _load()
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    from mkdocs.exceptions import PluginError

    def table(match: re.Match[str]) -> str:
        kind = match.group(1)
        if kind not in TABLES:
            raise PluginError(f"flags hook: {page.file.src_path} asks for table {kind!r}; known: {', '.join(TABLES)}")
        return TABLES[kind](_groups)

    return MARKER.sub(table, markdown)


if __name__ == "__main__":  # run by _load with the repository's Python: print the groups as JSON
    json.dump(read_groups(), sys.stdout)
