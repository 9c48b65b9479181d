"""The bundled HTTP app: Starlette routes over one ``Runtime``.

The routes of one model (``MODEL_ROUTES``) are methods of ``Api`` (``runtime.http.generation``
and its base ``runtime.http.utility``); this module serves them under the --api-prefix with the
server's middleware (CORS, the API key), the page or --path's static files, the agent's routes
and Vertex AI's. Errors are shaped by ``runtime.http.errors`` (``errors_for``: Anthropic's shape
on its endpoints, OpenAI's elsewhere).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from llamactor.protocol.errors import NotFound, RequestError, Unauthorized
from llamactor.runtime.http import vertex
from llamactor.runtime.http.agent import Agent
from llamactor.runtime.http.cors import Cors
from llamactor.runtime.http.errors import anthropic_error_response, error_response
from llamactor.runtime.http.generation import Api
from llamactor.runtime.http.page import ASSET_PATH, PAGE_PATHS, PUBLIC_PAGE_PATHS, Page
from llamactor.runtime.service.config import RuntimeConfig, route_prefix
from llamactor.runtime.service.engine import served_by

if TYPE_CHECKING:
    from llamactor.runtime.service.core import RuntimeCore as Runtime

PUBLIC_PATHS = frozenset({"/health", "/v1/health", *PUBLIC_PAGE_PATHS})  # the page asks for the key itself
ANTHROPIC_PATH = "/v1/messages"  # this path and the ones under it answer errors in Anthropic's shape


def errors_for(path: str) -> Callable[[BaseException], Response]:
    """How a request to ``path`` answers an error: Anthropic's shape on the Anthropic endpoints
    (their SDKs read no other), OpenAI's everywhere else."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return anthropic_error_response
    return error_response


class _ApiKey:
    """401 for a missing or wrong key on every path but /health and the page (constant-time
    compare). ``prefix`` is the app's --api-prefix: the public paths are under it."""

    def __init__(self, app: ASGIApp, key: str | None, more: tuple[str, ...] = (), prefix: str = "") -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in ((key,) if key else ()) + more)  # --api-key a,b / --api-key-file
        # the bare prefix too: it redirects to the page at prefix + "/"
        self.public = frozenset({prefix + path for path in PUBLIC_PATHS} | ({prefix} if prefix else set()))
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.keys or scope["type"] != "http" or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if given.lower().startswith(b"bearer "):
            given = given[7:].strip()
        else:
            given = headers.get(b"x-api-key", b"")
        if not sum(hmac.compare_digest(given, k) for k in self.keys):  # every key compared: no early exit
            errors = errors_for(scope["path"].removeprefix(self.prefix))
            await errors(Unauthorized("invalid or missing API key"))(scope, receive, send)
            return
        await self.app(scope, receive, send)


# The routes of one model: (path, the ``Api`` method that serves it, its HTTP methods). The
# router mode serves the same table, each request sent to the Api of the model it names
# (``runtime.http.router``).
MODEL_ROUTES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("/health", "health", ("GET",)),
    ("/v1/health", "health", ("GET",)),
    ("/v1/models", "models", ("GET",)),
    ("/models", "models", ("GET",)),
    ("/props", "props", ("GET",)),
    ("/props", "set_props", ("POST",)),
    ("/lora-adapters", "lora_adapters", ("GET",)),
    ("/lora-adapters", "set_lora_adapters", ("POST",)),
    ("/infill", "infill", ("POST",)),
    ("/completion", "completion", ("POST",)),
    ("/completions", "completion", ("POST",)),
    ("/v1/completions", "completions", ("POST",)),
    ("/v1/chat/completions", "chat", ("POST",)),
    ("/chat/completions", "chat", ("POST",)),
    ("/v1/responses", "responses", ("POST",)),
    ("/responses", "responses", ("POST",)),
    ("/v1/messages", "messages", ("POST",)),
    ("/v1/messages/count_tokens", "count_tokens", ("POST",)),
    ("/v1/audio/transcriptions", "transcriptions", ("POST",)),
    ("/audio/transcriptions", "transcriptions", ("POST",)),
    ("/apply-template", "apply_template", ("POST",)),
    ("/v1/chat/completions/input_tokens", "chat_input_tokens", ("POST",)),
    ("/chat/completions/input_tokens", "chat_input_tokens", ("POST",)),
    ("/v1/responses/input_tokens", "responses_input_tokens", ("POST",)),
    ("/responses/input_tokens", "responses_input_tokens", ("POST",)),
    ("/tokenize", "tokenize", ("POST",)),
    ("/detokenize", "detokenize", ("POST",)),
    ("/slots", "slots", ("GET",)),
    ("/slots/{id}", "slot_action", ("POST",)),
    ("/replicas/scale", "scale_replicas", ("POST",)),
    ("/replicas/{id}/drain", "drain_replica", ("POST",)),
    ("/metrics", "metrics", ("GET",)),
    ("/v1/embeddings", "embeddings_oai", ("POST",)),
    ("/embeddings", "embeddings_native", ("POST",)),
    ("/embedding", "embeddings_native", ("POST",)),
    ("/rerank", "rerank", ("POST",)),
    ("/reranking", "rerank", ("POST",)),
    ("/v1/rerank", "rerank", ("POST",)),
    ("/v1/reranking", "rerank", ("POST",)),
    ("/live", "live", ("GET",)),
)


def make_route(prefix: str, path: str, fn: Callable[[Request], Awaitable[Response]], methods: Sequence[str]) -> Route:
    """``fn`` served at ``prefix + path``: any error it raises answered in the path's shape
    (``errors_for``), and the replica that served it (a replica set's) in a response header."""
    errors = errors_for(path)

    async def endpoint(request: Request) -> Response:
        placement: list[str] = []
        token = served_by.set(placement)  # a replica set writes the replica that serves
        try:
            response = await fn(request)
        except Exception as exc:
            return errors(exc)
        finally:
            served_by.reset(token)
        if placement:
            response.headers["x-llamactor-replica"] = placement[0]
        return response

    return Route(prefix + path, endpoint, methods=list(methods))


def app_around(config: RuntimeConfig, routes: Sequence[BaseRoute], *, lifespan: Any = None) -> Starlette:
    """A Starlette app of ``routes`` with the server's middleware (CORS, the API key) and its
    404/405 answers, as ``config`` (--cors-*, --api-key, --api-prefix) asks."""
    prefix = route_prefix(config.api_prefix)

    async def not_found(request: Request, exc: Exception) -> Response:
        path = request.url.path
        return errors_for(path.removeprefix(prefix))(NotFound(f"no route for {request.method} {path}"))

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        err = RequestError(f"method {request.method} is not allowed on {request.url.path}")
        err.status = 405
        return errors_for(request.url.path.removeprefix(prefix))(err)

    app = Starlette(
        routes=routes,
        middleware=[  # CORS first: a preflight needs no key, and a 401 still carries Allow-Origin
            Middleware(
                Cors,
                origins=config.cors_origins,
                methods=config.cors_methods,
                headers=config.cors_headers,
                credentials=config.cors_credentials,
            ),
            Middleware(_ApiKey, key=config.api_key, more=config.api_keys, prefix=prefix),
        ],
        exception_handlers={404: not_found, 405: method_not_allowed},
        lifespan=lifespan,
    )
    # AIP_MODE=PREDICTION (Vertex AI): the predict route over this very app, as llama-server
    posts = [r.path.removeprefix(prefix) for r in routes if isinstance(r, Route) and "POST" in (r.methods or ())]
    health = next((r.endpoint for r in routes if isinstance(r, Route) and r.path == prefix + "/health"), None)
    app.router.routes.extend(vertex.routes(prefix, posts, lambda: app, health))
    return app


def build_app(rt: Runtime, *, lifespan: Any = None) -> Starlette:
    """The app of ``rt``; every route is under ``config.api_prefix`` (llama-server prepends its
    --api-prefix to each path, the page's included; the page asks for the rest by relative URLs)."""
    api = Api(rt)
    prefix = route_prefix(rt.config.api_prefix)
    routes: list[BaseRoute] = [
        make_route(prefix, path, getattr(api, name), methods) for path, name, methods in MODEL_ROUTES
    ]
    if rt.config.webui and rt.config.static_path:  # --path: its files instead of the page
        routes.append(Mount(prefix or "/", app=_StaticFiles(directory=rt.config.static_path, html=True)))
    elif rt.config.webui:  # --no-webui: GET / is a 404, as in llama-server
        page = Page()
        routes += [make_route(prefix, path, page.index, ["GET"]) for path in PAGE_PATHS]
        routes.append(make_route(prefix, ASSET_PATH, page.asset, ["GET"]))
    agent = Agent(rt.config, rt.health)  # /tools and /cors-proxy (403 when off)
    routes += agent.routes(prefix, make_route)
    return app_around(rt.config, routes, lifespan=agent.lifespan(lifespan))


class _StaticFiles(StaticFiles):
    """--path: llama-server's static files (its ``set_mount_point``): GET and HEAD of the files
    under the directory, ``index.html`` for a directory; the API's routes are matched first, and
    another method, or a path with no file, answers the server's 404 like any unknown route."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        if scope["method"] not in ("GET", "HEAD"):
            raise HTTPException(status_code=404)
        return await super().get_response(path, scope)
