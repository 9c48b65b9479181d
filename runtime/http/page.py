"""The built-in page (chat playground and live view): ``GET /`` and its two assets, shipped in ``runtime/http/webui/``.

Hand-written HTML, CSS and JavaScript, no build step and no third-party code; the files are
package data (pyproject ``[tool.setuptools.package-data]``), read once when the app is built.
The page and its assets are public, as llama-server's are, so that it can load and ask for
the API key; everything it fetches afterwards (/props, /v1/chat/completions, /live) carries
the key as a Bearer header. Its Content-Security-Policy allows this origin only: the page
cannot load anything from elsewhere, and a test checks that it never tries.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

from llamactor.protocol.errors import NotFound

ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
}
PAGE_PATHS = ("/", "/index.html")
ASSET_PATH = "/webui/{name}"
PUBLIC_PAGE_PATHS = frozenset({*PAGE_PATHS, *(f"/webui/{name}" for name in ASSETS if name != "index.html")})
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def load_assets() -> dict[str, bytes]:
    """Every file of the page, from the installed package (works without the source tree)."""
    folder = resources.files("llamactor.runtime.http") / "webui"
    return {name: (folder / name).read_bytes() for name in ASSETS}


class Page:
    def __init__(self) -> None:
        self.assets = load_assets()

    async def index(self, request: Request) -> Response:
        return self._send("index.html")

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name == "index.html" or name not in self.assets:
            raise NotFound(f"no page asset named {name!r}")
        return self._send(name)

    def _send(self, name: str) -> Response:
        headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        if name == "index.html":
            headers["Content-Security-Policy"] = CSP
        return Response(self.assets[name], media_type=ASSETS[name], headers=headers)
