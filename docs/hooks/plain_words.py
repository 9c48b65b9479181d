"""mkdocs hook: no page cites a requirement id or an issue number, and no snippet is left unrendered.

The product specification and the issue tracker are not part of the repository, so a
requirement id (a prefix such as PG or API, a hyphen and a number) or an issue number tells a
reader nothing. Every page's Markdown is searched after the flags hook has added its tables,
so help text pulled from the code is checked too; a hit stops the build naming the page and
the words.

An example file is included with a snippet marker (``--8<-- "examples/embed_app.py"``); a
formatter that takes the marker for Python (``--8 < --"..."``) leaves it as a literal line on
the page, which a strict build does not notice. Every page's HTML is searched for what is left
of a marker; a hit stops the build too.
"""

from __future__ import annotations

import re
from typing import Any

CITATION = re.compile(
    r"\b(?:AC|PG|PH|RPC|RP|API|EN|BE|OPS)-\d+\b"  # requirement ids: a prefix, a hyphen, a number
    r"|\bSPEC\b"  # the specification's sections
    r"|\b[Ii]ssues? \d+\b"  # issue numbers
)


# what is left of a snippet marker a formatter spaced out ("--8 < --", rendered "--8 &lt; --")
MANGLED_MARKER = re.compile(r"-{1,2}\s*8\s+(?:<|&lt;)\s*-{1,2}|-{1,2}\s*8\s*(?:<|&lt;)\s+-{1,2}")
MARKER = re.compile(r"--8(?:<|&lt;)--")  # whole, inside a code block: the file was not included
PRE = re.compile(r"<pre\b.*?</pre>", re.DOTALL)
TAG = re.compile(r"<[^>]+>")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    from mkdocs.exceptions import PluginError

    hits = sorted({m.group(0) for m in CITATION.finditer(markdown)})
    if hits:
        raise PluginError(
            f"{page.file.src_path} cites {', '.join(hits)}: say what the requirement or issue means instead"
        )
    return markdown


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    from mkdocs.exceptions import PluginError

    text = TAG.sub("", html)  # a code block's highlighting splits a marker into spans
    blocks = [TAG.sub("", block) for block in PRE.findall(html)]
    left = MANGLED_MARKER.search(text) or next(filter(None, (MARKER.search(b) for b in blocks)), None)
    if left:
        raise PluginError(
            f"{page.file.src_path} shows a snippet marker as text ({left.group(0)!r}): the file it names was not "
            'included; write it as --8<-- "path" inside a fence between <!-- fmt: off --> and <!-- fmt: on --> '
            "(the formatter takes it for Python otherwise)"
        )
    return html
