"""The examples in the README and the docs run as they are written.

Every ``python`` block of README.md and docs/*.md that is a whole program (it calls
``anyio.run``) runs in a fresh interpreter, with the default model swapped for the tiny test
model; the example files the docs include (``--8<-- "examples/..."``) are run by their own
tests (test_embedding.py, test_policies.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
PRELUDE = """\
import pathlib
import llamactor.runtime.service.config as _config
_config.default_model_path = lambda: pathlib.Path({model!r})  # the tiny test model stands in
"""


def programs() -> list[tuple[str, str]]:
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(BLOCK.findall(page.read_text(encoding="utf-8"))):
            if "anyio.run(" in block:
                out.append((f"{page.name}#{i}", block))
    return out


PROGRAMS = programs()


def test_the_readme_and_the_docs_have_runnable_examples():
    assert any(name.startswith("README.md") for name, _ in PROGRAMS)
    assert any(name.startswith("embedding.md") for name, _ in PROGRAMS)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "code"), PROGRAMS, ids=[name for name, _ in PROGRAMS])
def test_example_runs(tiny_model, name, code):
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE.format(model=str(tiny_model)) + code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-3000:]}"


SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)


def test_example_files_are_included_whole_and_a_broken_marker_stops_the_build():
    """The pages that show an example program include it with a snippet marker that names a
    file of the repository; a marker a formatter mangled (``--8 < --"..."``) would render as a
    literal line, and the docs build's hook refuses such a page."""
    from mkdocs.exceptions import PluginError

    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    import plain_words

    included = {page.name: SNIPPET.findall(page.read_text(encoding="utf-8")) for page in (ROOT / "docs").glob("*.md")}
    assert included["embedding.md"] == ["examples/embed_app.py"]
    assert included["writing-a-policy.md"] == ["examples/custom_policy.py"]
    assert all((ROOT / path).is_file() for paths in included.values() for path in paths)

    class Page:
        class file:
            src_path = "embedding.md"

    said = '<p>Include a file with <code>--8&lt;-- "examples/embed_app.py"</code>.</p>'  # the marker, shown
    assert plain_words.on_page_content(said, Page, None, None) == said
    mangled = (  # as the highlighter renders it
        '<pre><span></span><code><span class="o">--</span><span class="mi">8</span> <span class="o">&lt;</span> '
        '<span class="o">--</span><span class="s2">&quot;examples/embed_app.py&quot;</span></code></pre>'
    )
    for left in (mangled, '<pre><code>--8&lt;-- "examples/embed_app.py"</code></pre>'):
        with pytest.raises(PluginError, match="snippet marker"):
            plain_words.on_page_content(left, Page, None, None)
