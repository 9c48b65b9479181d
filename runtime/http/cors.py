"""CORS as llama-server does it (same defaults and flags), before the API key check.

llama-server's pre-routing handler (``server-http.cpp``): every response carries
``Access-Control-Allow-Origin`` — the ``--cors-origins`` value as given, the request's Origin
when credentials are on and origins is ``*`` (its defaults), or, for ``localhost``, the Origin
only when it is a localhost one. ``OPTIONS`` on any path is answered at once, with no key
needed (browsers send none on a preflight): 200, an empty text/html body and the
Allow-Credentials/-Methods/-Headers headers. Starlette's CORSMiddleware cannot say this (it
answers only preflights with Access-Control-Request-Method and refuses unknown origins), so
this is a small ASGI middleware of its own.

Header names go out in llama-server's casing (``Access-Control-Allow-Origin``), not lowercased:
HTTP says names are case-insensitive, but clients that copy the headers into a plain dict (as
llama.cpp's own server tests do) look them up by that exact spelling.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOCALHOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def origin_is_localhost(origin: str) -> bool:
    try:
        return (urlsplit(origin).hostname or "") in LOCALHOSTS
    except ValueError:
        return False


class Cors:
    def __init__(
        self,
        app: ASGIApp,
        origins: str = "*",
        methods: str = "GET, POST, DELETE, OPTIONS",
        headers: str = "*",
        credentials: bool = True,
    ) -> None:
        self.app = app
        self.origins = origins
        self.preflight = [
            (b"Access-Control-Allow-Credentials", b"true" if credentials else b"false"),
            (b"Access-Control-Allow-Methods", methods.encode("latin-1")),
            (b"Access-Control-Allow-Headers", headers.encode("latin-1")),
        ]
        self.credentials = credentials

    def allow_origin(self, scope: Scope) -> str | None:
        origin = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"), "")
        if self.credentials and self.origins == "*":
            return origin  # llama-server echoes the Origin (empty when the request sends none)
        if self.origins == "localhost":
            return origin if origin and origin_is_localhost(origin) else None
        return self.origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        allow = self.allow_origin(scope)
        extra = [] if allow is None else [(b"Access-Control-Allow-Origin", allow.encode("latin-1"))]
        if scope["method"] == "OPTIONS":
            headers = [*extra, *self.preflight, (b"Content-Type", b"text/html"), (b"Content-Length", b"0")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        if not extra:
            await self.app(scope, receive, send)
            return

        async def send_with_origin(message: Message) -> None:
            if message["type"] == "http.response.start":
                # Appended raw: MutableHeaders.append would lowercase the name.
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_origin)
