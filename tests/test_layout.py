"""The layout table of docs/architecture.md (docs/hooks/layout.py): made from the code when the
site is built, it has a row for every folder of Python in the package and names every long module."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _hook():
    spec = importlib.util.spec_from_file_location("layout_hook", REPO / "docs" / "hooks" / "layout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_module_is_in_a_row_and_every_long_one_is_named():
    layout = _hook()
    rows = layout.rows()
    counted = {m for r in rows for m in r["sizes"]}
    for folder in ("protocol", "actors", "ops", "runtime"):
        for path in (REPO / folder).rglob("*.py"):
            rel = str(path.relative_to(REPO))
            if rel != "runtime/__init__.py":  # the embedding API's lazy loader: no layer of its own
                assert rel in counted, f"{rel} is in no row of the layout (add its package to the layers contract)"
    for r in rows:
        for module, lines in r["sizes"].items():
            assert (module in r["long"]) == (lines > layout.LONG_MODULE_LINES), module
    page = layout.on_page_markdown("before\n<!-- layout -->\nafter\n")
    assert "`llamactor.protocol`" in page and "<!-- layout -->" not in page
    assert "| 0 data | `llamactor.protocol` |" in page
