"""llama-server's experimental agent features, wired into an app (``Agent``): ``/tools``
(``--tools``, ``--tools-runtime``, MCP servers: ``agent.endpoints``, ``agent.mcp``) and
``/cors-proxy`` (``--ui-mcp-proxy``: ``agent.corsproxy``). Both routes always exist, as
in llama-server: off, they answer 403 ``feature_disabled``. The lifespan starts the tools
(the MCP servers' tool lists, a ``--tools-runtime`` container) before the server answers and
stops them when it exits. The package's other modules: the tools (``agent.tools``,
``agent.files``, ``agent.edit``), what they read (``agent.params``), where their I/O happens
(``agent.hostio``, ``agent.isolate``), the MCP servers' configuration (``agent.mcpconfig``) and
the command line's values (``agent.flags``)."""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llamactor.runtime.http.agent.corsproxy import CorsProxy
from llamactor.runtime.http.agent.endpoints import AgentTools, feature_disabled
from llamactor.runtime.http.agent.flags import agent_enabled
from llamactor.runtime.http.agent.params import ToolFailure
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.egress import EgressPolicy, host_names

log = structlog.get_logger("llamactor.agent")

Handler = Callable[[Request], Awaitable[Response]]


async def _disabled(request: Request) -> Response:
    return feature_disabled(request)


STOPPING = frozenset({"draining", "closed"})  # the server's health while it shuts down


def host_allowed(host_header: str, names: tuple[str, ...]) -> bool:
    """Whether a request's Host names this server: an IP address, ``localhost`` (and names under
    it), or one of ``names`` (the --host names and --allowed-hosts). A web page whose own name
    was made to resolve to this server's address (DNS rebinding) sends its own name, and is
    refused; a page on another site cannot set the header at all."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[1 : host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    host = host.rstrip(".")
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return host == "localhost" or host.endswith(".localhost") or host in names


def _refused(status: int, message: str) -> Response:
    body = {
        "error": {
            "code": status,
            "message": message,
            "type": "permission_error" if status == 403 else "invalid_request_error",
        }
    }
    return Response(
        json.dumps(body, separators=(",", ":")), status_code=status, media_type="application/json; charset=utf-8"
    )


def _checked(handler: Handler, names: tuple[str, ...], json_only: bool = False) -> Handler:
    """``handler`` behind the checks that keep web pages out of the tools and the proxy: the
    Host header must name this server (``host_allowed``), and with ``json_only`` the body must
    be declared JSON: a cross-site form or ``text/plain`` POST, which a browser sends without
    asking the server first (no CORS preflight), is refused (415) before anything runs."""

    async def checked(request: Request) -> Response:
        host = request.headers.get("host", "")
        if not host_allowed(host, names):
            log.warning("host_refused", path=request.url.path, host=host)
            return _refused(
                403,
                f"the Host header {host!r} does not name this server (names it answers under: "
                "IP addresses, localhost, --host and --allowed-hosts)",
            )
        if json_only and request.method == "POST":
            kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return _refused(415, f"the request body must be sent as application/json, not {kind or 'no type'}")
        return await handler(request)

    return checked


class Agent:
    """``health``: the server's state (``Runtime.health``, ``ModelSet.health``): once it drains,
    MCP calls in flight return at once, so that shutdown does not wait for them."""

    def __init__(self, config: RuntimeConfig, health: Callable[[], str] = lambda: "ok") -> None:
        self.config = config
        self.tools = AgentTools(config, lambda: health() in STOPPING) if agent_enabled(config) else None
        policy = EgressPolicy(host_names(config.ui_mcp_proxy_allowed_hosts), config.ui_mcp_proxy_allow_private)
        self.proxy = CorsProxy(policy) if config.ui_mcp_proxy else None

    def routes(self, prefix: str, make_route: Callable[[str, str, Handler, list[str]], Route]) -> list[Route]:
        names = self.config.allowed_hosts
        get_tools: Handler = _checked(self.tools.get, names) if self.tools is not None else _disabled
        post_tools: Handler = _checked(self.tools.post, names, json_only=True) if self.tools is not None else _disabled
        proxy: Handler = _checked(self.proxy.handle, names) if self.proxy is not None else _disabled
        return [
            make_route(prefix, "/tools", get_tools, ["GET"]),
            make_route(prefix, "/tools", post_tools, ["POST"]),
            make_route(prefix, "/cors-proxy", proxy, ["GET"]),
            make_route(prefix, "/cors-proxy", proxy, ["POST"]),
        ]

    def features(self) -> list[str]:
        cfg, names = self.config, []
        if self.proxy is not None:
            names.append("MCP proxy (experimental)")
        if cfg.server_tools:
            names.append("server tools (experimental)")
        if cfg.tools_runtime:
            names.append("tools runtime (experimental)")
        if self.tools is not None and self.tools.mcp:
            names.append("MCP servers (experimental)")
        return names

    def lifespan(self, inner: Any) -> Any:
        """``inner`` (the server's lifespan, or None) inside the tools' start and stop."""

        @asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            if features := self.features():
                log.warning(
                    "security",
                    message=f"{', '.join(features)} enabled - do not expose to untrusted environments",
                    cors_origins=self.config.cors_origins,
                )
            try:
                if self.tools is not None:
                    try:
                        await self.tools.start()
                    except ToolFailure as exc:  # llama-server: "tools setup failed", exit 1
                        log.error("tools_setup_failed", error=str(exc))
                        await self.tools.close()
                        os._exit(1)
                if inner is None:
                    yield
                else:
                    async with inner(app):
                        yield
            finally:
                if self.tools is not None:
                    await self.tools.close()
                if self.proxy is not None:
                    await self.proxy.close()

        return lifespan
