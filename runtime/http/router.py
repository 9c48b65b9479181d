"""The router mode's HTTP app (many models, llama-server's router): each request goes to the
model it names, and the ``/models`` endpoints load and unload them.

    POST /v1/chat/completions {"model": "a", ...} ──► ModelSet.use("a"): loaded? else load it, wait
                                                  ──► model a's own ``Api.chat`` (the one-model app's)
    GET  /slots?model=a                           ──► the same, by the query parameter

A POST names its model in its JSON body's ``model`` field (or ``?model=``), a GET in ``?model=``;
``?autoload=true|false`` overrides --models-autoload for one request. A model's routes are the
one-model app's (``app.MODEL_ROUTES`` on the model's ``Api``), so each model answers exactly as a
server of that model alone would. The request holds its model (a ``ModelLease``) until its
response is sent, streamed or not: a model is never unloaded under a response.

The router's own answers, as llama-server's: ``GET /models`` (and ``/v1/models``) lists every
model with its status; ``POST /models/load`` and ``POST /models/unload`` take ``{"model"}`` and
return at once (the status says how it goes); ``GET /props`` without a model describes the
router; ``/health`` is the router's. llamactor's: ``GET /metrics`` without a model has every
loaded model's series, each labelled ``model``. Errors as llama-server's: no model named 400, an
unknown model 400 ("model 'x' not found"), a model not loaded with autoload off 400, loading an
unknown model 404, a model that failed to load 500 with the loader's message.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from llamactor.protocol.errors import NotSupported, RequestError, Unavailable
from llamactor.runtime.http.agent import Agent
from llamactor.runtime.http.app import MODEL_ROUTES, app_around, make_route
from llamactor.runtime.http.body import json_response, read_body
from llamactor.runtime.http.disconnect import until_disconnect
from llamactor.runtime.http.errors import error_response
from llamactor.runtime.http.generation import Api
from llamactor.runtime.http.transcriptions import parse_form
from llamactor.runtime.service.config import RuntimeConfig, route_prefix
from llamactor.runtime.service.core import RuntimeCore
from llamactor.runtime.service.modelset import ModelLease, ModelSet
from llamactor.runtime.service.modeltable import ModelView

Handler = Callable[[Request], Awaitable[Response]]
# Answers that do not keep their model loaded while they are sent: the live view's stream lasts
# as long as someone looks, and must not keep a model from being unloaded (nor the server from
# draining); once its model is gone it shows the model closed.
UNHELD = frozenset({"live"})


class _Named(msgspec.Struct):
    """The one field of a request body the router reads."""

    model: Any = None


def _model_in(body: bytes, content_type: str = "") -> str:
    """The ``model`` field of a JSON body ("" when there is none, or the body is no object), or
    of a ``multipart/form-data`` form (a transcription's, as llama-server's router reads it)."""
    if not body.strip():
        return ""
    if content_type.lower().startswith("multipart/form-data"):
        return parse_form(content_type, body)[0].get("model", "")
    try:
        name = msgspec.json.decode(body, type=_Named).model
    except msgspec.ValidationError:
        return ""  # not an object (POST /lora-adapters takes a list): ?model= may name it
    return name if isinstance(name, str) else ""


def _autoload(value: str | None) -> bool | None:
    """``?autoload=``: true or 1 loads, anything else does not; absent: the server's default."""
    return None if value is None else value in ("true", "1")


def _replayed(request: Request, body: bytes) -> Request:
    """``request`` again, its body (already read by the router) readable once more: the model's
    handler reads it as it would from the client; after it, the client's own messages (its
    disconnect) come through."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)


class _Leased(Response):
    """A model's response that holds its model until it is sent, or its client left."""

    def __init__(self, inner: Response, release: Callable[[], None]) -> None:
        # No Response.__init__: the inner response renders itself; its headers are these.
        self.inner = inner
        self.release = release
        self.status_code = inner.status_code
        self.raw_headers = inner.raw_headers
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.release()


class Router:
    def __init__(self, models: ModelSet, config: RuntimeConfig) -> None:
        self.models = models
        self.config = config
        self._apis: dict[str, tuple[RuntimeCore, Api]] = {}  # each loaded model's Api (its live feed)

    def _api(self, lease: ModelLease) -> Api:
        held = self._apis.get(lease.name)
        if held is None or held[0] is not lease.runtime:  # loaded again since: a new runtime
            held = self._apis[lease.name] = (lease.runtime, Api(lease.runtime))
        return held[1]

    # ---- the router's own ------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        state = self.models.health()
        if state == "ok":
            return json_response({"status": "ok"})
        if state == "draining":
            return error_response(Unavailable("the server is shutting down: it finishes the requests it has"))
        return error_response(Unavailable("the server is shutting down"))

    async def list_models(self, request: Request) -> Response:
        """GET /models, /v1/models: every model and its status, as llama-server lists them."""
        created = int(time.time())
        return json_response({"data": [_model_json(view, created) for view in self.models.views()], "object": "list"})

    async def load(self, request: Request) -> Response:
        """POST /models/load ``{"model"}``: start loading it (404 unknown, 400 already running)."""
        self.models.load(_model_in(await read_body(request)))
        return json_response({"success": True})

    async def unload(self, request: Request) -> Response:
        """POST /models/unload ``{"model"}``: unload it (400 unknown or not running)."""
        self.models.unload(_model_in(await read_body(request)))
        return json_response({"success": True})

    async def props(self, request: Request) -> Response:
        """GET /props: the model's with ``?model=``, else the router's (llama-server's fields)."""
        if request.query_params.get("model"):
            return await self._to_model(request, "props", body=False)
        return json_response(
            {
                "role": "router",
                "max_instances": self.models.models_max,
                "models_autoload": self.models.autoload,
                "model_alias": "llamactor",
                "model_path": "none",
                "default_generation_settings": {"params": None, "n_ctx": 0},
                "ui_settings": {},
                "build_info": "llamactor",
                "cors_proxy_enabled": self.config.ui_mcp_proxy,  # --ui-mcp-proxy: /cors-proxy forwards
            }
        )

    async def metrics(self, request: Request) -> Response:
        """GET /metrics: the model's with ``?model=`` (as its own server's), else every loaded
        model's, each series labelled ``model``. Started without --metrics: 501, as llama-server."""
        if not self.config.endpoint_metrics:
            raise NotSupported("This server does not support metrics endpoint. Start it with `--metrics`")
        if request.query_params.get("model"):
            return await self._to_model(request, "metrics", body=False)
        return Response(await self.models.metrics_text(), media_type="text/plain; version=0.0.4")

    # ---- a model's routes --------------------------------------------------------------------

    def to_model(self, method: str, *, body: bool) -> Handler:
        """The handler of a model's route: ``method`` of the named model's ``Api``."""

        async def handler(request: Request) -> Response:
            return await self._to_model(request, method, body=body)

        return handler

    async def _to_model(self, request: Request, method: str, *, body: bool) -> Response:
        data = await read_body(request) if body else None
        kind = request.headers.get("content-type", "")
        # a JSON body or a form of up to the body limit: read off the event loop
        name = (await anyio.to_thread.run_sync(_model_in, data, kind) if data else "") or request.query_params.get(
            "model", ""
        )
        if not name:
            raise RequestError("model name is missing from the request")
        autoload = _autoload(request.query_params.get("autoload"))
        lease = await until_disconnect(request, lambda: self.models.use(name, autoload=autoload))
        try:
            handler: Handler = getattr(self._api(lease), method)
            response = await handler(request if data is None else _replayed(request, data))
        except BaseException:
            lease.release()
            raise
        if method in UNHELD:
            lease.release()
            return response
        return _Leased(response, lease.release)


def _model_json(view: ModelView, created: int) -> dict[str, Any]:
    """One model of ``GET /models``, in llama-server's shape."""
    spec = view.spec
    status: dict[str, Any] = {"value": view.status.value, "args": list(spec.args), "preset": spec.preset}
    if view.failure and view.status.value == "unloaded":
        status.update(failed=True, exit_code=1, error=view.failure)  # "error": llamactor's, the loader's message
    return {
        "id": spec.name,
        "aliases": list(spec.aliases),
        "tags": list(spec.tags),
        "object": "model",
        "owned_by": "llamactor",
        "created": created,
        "status": status,
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "source": spec.source,
        "can_remove": False,  # no download cache: models are files
    }


def build_router_app(models: ModelSet, config: RuntimeConfig, *, lifespan: Any = None) -> Starlette:
    """The app of a router over ``models``; ``config`` (the command line's) gives what is the
    server's, not a model's: --api-key, --cors-*, --api-prefix. The built-in page serves one
    model's view: it is not served here."""
    router = Router(models, config)
    prefix = route_prefix(config.api_prefix)
    own: dict[tuple[str, str], Handler] = {
        ("/health", "GET"): router.health,
        ("/v1/health", "GET"): router.health,
        ("/models", "GET"): router.list_models,
        ("/v1/models", "GET"): router.list_models,
        ("/props", "GET"): router.props,
        ("/metrics", "GET"): router.metrics,
    }
    routes = [
        make_route(prefix, "/models/load", router.load, ["POST"]),
        make_route(prefix, "/models/unload", router.unload, ["POST"]),
    ]
    for path, method, verbs in MODEL_ROUTES:
        handler = own.get((path, verbs[0])) or router.to_model(method, body="POST" in verbs)
        routes.append(make_route(prefix, path, handler, verbs))
    agent = Agent(config, models.health)  # /tools and /cors-proxy: the server's, not a model's
    routes += agent.routes(prefix, make_route)
    return app_around(config, routes, lifespan=agent.lifespan(lifespan))
