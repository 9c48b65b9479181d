"""``Runtime``: the embedding API's class, ``RuntimeCore`` plus the HTTP app it can make.

It lives in the top layer, beside the HTTP app, so that the service layer below never imports
the HTTP layer (``rt.asgi_app()`` needs both). Whether the engine runs in a child process
(``config.isolate``, the default, or ``isolate=``) changes nothing of this API.
"""

from __future__ import annotations

from starlette.applications import Starlette

from llamactor.runtime.http.app import build_app
from llamactor.runtime.service.core import RuntimeCore


class Runtime(RuntimeCore):
    """A runtime: open it with ``async with Runtime.open(config) as rt`` (or ``async with rt``)."""

    def asgi_app(self) -> Starlette:
        """A Starlette app serving this runtime (mount it, or run it with any ASGI server)."""
        return build_app(self)
