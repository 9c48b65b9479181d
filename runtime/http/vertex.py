"""Vertex AI's prediction protocol, as llama-server speaks it when ``AIP_MODE=PREDICTION``.

Google Cloud's custom containers are told their routes and port by the environment:
``AIP_HTTP_PORT`` (the port to listen on, 8080 by default: it overrides ``--port``),
``AIP_PREDICT_ROUTE`` (``/predict`` by default) and ``AIP_HEALTH_ROUTE`` (a second path for
``GET /health``). A predict request is ``{"instances": [...]}``; each instance names a route by
its ``@requestFormat`` (the camelCase form of a path, ``chatCompletions`` for
``/v1/chat/completions``, or the path itself) and is that route's body. The instances run at
once, each through the app itself (the caller's headers, the API key among them, go along);
the answer is ``{"predictions": [...]}`` in instance order, each the route's JSON answer or an
``{"error": ...}`` object. Streaming is not part of the protocol: ``stream`` is set to false.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp

from llamactor.protocol.errors import ConfigError
from llamactor.runtime.http.body import read_body
from llamactor.runtime.http.errors import BodyTooLarge

MAX_INSTANCES = 128  # llama-server's limit


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("AIP_MODE", "") == "PREDICTION"


def port(default: int, environ: Mapping[str, str] = os.environ) -> int:
    """The port to listen on: ``AIP_HTTP_PORT`` (8080 when unset) in prediction mode, else ``default``."""
    if not enabled(environ):
        return default
    try:
        return int(environ.get("AIP_HTTP_PORT") or 8080)
    except ValueError:
        raise ConfigError(f"AIP_HTTP_PORT must be a port number, got {environ['AIP_HTTP_PORT']!r}") from None


def request_format(path: str) -> str:
    """A path's ``@requestFormat`` alias, as llama-server derives it: ``/v1/chat/completions`` →
    ``chatCompletions``, ``/apply-template`` → ``applyTemplate`` (cut at a path parameter)."""
    name = path.removeprefix("/v1") if path.startswith("/v1") and len(path) > 3 else path
    name = name.removeprefix("/").split("{", 1)[0].split(":", 1)[0]
    out, cap = [], False
    for ch in name:
        if ch in "/-_":
            cap = True
        else:
            out.append(ch.upper() if cap else ch)
            cap = False
    return "".join(out)


def _error(message: str, kind: str = "invalid_request_error", code: int = 400) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "type": kind}}


def routes(
    prefix: str,
    paths: list[str],
    app: Callable[[], ASGIApp],
    health_endpoint: Callable[[Request], Any] | None,
    environ: Mapping[str, str] = os.environ,
) -> list[BaseRoute]:
    """The predict route (and the health alias, served by ``health_endpoint``) over the app
    ``app()`` returns, whose POST routes are ``paths`` (without ``prefix``); nothing when
    prediction mode is off."""
    if not enabled(environ):
        return []
    aliases: dict[str, str] = {}
    for path in paths:
        aliases.setdefault(request_format(path), path)
    predict_path = environ.get("AIP_PREDICT_ROUTE") or "/predict"

    async def predict(request: Request) -> Response:
        try:
            data = json.loads(await read_body(request))
        except BodyTooLarge as exc:
            return _json(_error(str(exc)), 413)
        except ValueError as exc:
            return _json(_error(f"the request body is not JSON: {exc}"), 400)
        if not isinstance(data, dict):
            return _json(_error("request body must be a JSON object"), 400)
        instances = data.get("instances")
        if not isinstance(instances, list):
            return _json(_error("request body must include an array field named instances"), 400)
        if len(instances) > MAX_INSTANCES:
            return _json(_error(f"instances array exceeds maximum size of {MAX_INSTANCES}"), 400)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("content-length", "host")}
        predictions: list[Any] = [None] * len(instances)
        transport = httpx.ASGITransport(app=app())
        async with httpx.AsyncClient(transport=transport, base_url="http://predict", timeout=None) as client:

            async def one(i: int, instance: Any) -> None:
                predictions[i] = await _instance(client, instance, headers)

            async with anyio.create_task_group() as tg:
                for i, instance in enumerate(instances):
                    tg.start_soon(one, i, instance)
        return _json({"predictions": predictions}, 200)

    async def _instance(client: httpx.AsyncClient, instance: Any, headers: dict[str, str]) -> Any:
        if not isinstance(instance, dict):
            return _error("each instance must be a JSON object")
        fmt = instance.get("@requestFormat")
        if not isinstance(fmt, str):
            return _error("each instance must include a string @requestFormat")
        path = aliases.get(fmt) or (fmt if fmt in paths else None)
        if path is None:
            return _error(f"no handler registered for @requestFormat: {fmt}")
        payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
        if "stream" in payload:
            payload["stream"] = False  # the predict route answers whole responses only
        r = await client.post(prefix + path, json=payload, headers=headers)
        try:
            return r.json()
        except ValueError:
            return r.text or None

    out: list[BaseRoute] = [Route(prefix + predict_path, predict, methods=["POST"])]
    health = environ.get("AIP_HEALTH_ROUTE")
    if health and health_endpoint is not None:  # GET /health at a second path
        out.append(Route(prefix + health, health_endpoint, methods=["GET"]))
    return out


def _json(body: Any, status: int) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status_code=status, media_type="application/json")
