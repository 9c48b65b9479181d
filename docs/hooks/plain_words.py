"""mkdocs hook: no page cites a requirement id or an issue number; it says what they mean.

The product specification and the issue tracker are not part of the repository, so a
requirement id (a prefix such as PG or API, a hyphen and a number) or an issue number tells a
reader nothing. Every page's Markdown is searched after the flags hook has added its tables,
so help text pulled from the code is checked too; a hit stops the build naming the page and
the words.
"""

from __future__ import annotations

import re
from typing import Any

CITATION = re.compile(
    r"\b(?:AC|PG|PH|RPC|RP|API|EN|BE|OPS)-\d+\b"  # requirement ids: a prefix, a hyphen, a number
    r"|\bSPEC\b"  # the specification's sections
    r"|\b[Ii]ssues? \d+\b"  # issue numbers
)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    from mkdocs.exceptions import PluginError

    hits = sorted({m.group(0) for m in CITATION.finditer(markdown)})
    if hits:
        raise PluginError(
            f"{page.file.src_path} cites {', '.join(hits)}: say what the requirement or issue means instead"
        )
    return markdown
