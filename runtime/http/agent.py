"""llama-server's experimental agent features, wired into an app: ``/tools`` (``--tools``,
``--tools-runtime``, MCP servers: ``runtime.http.tools``, ``runtime.http.mcp``) and
``/cors-proxy`` (``--ui-mcp-proxy``: ``runtime.http.corsproxy``). Both routes always exist, as
in llama-server: off, they answer 403 ``feature_disabled``. The lifespan starts the tools
(the MCP servers' tool lists, a ``--tools-runtime`` container) before the server answers and
stops them when it exits."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llamactor.runtime.http.corsproxy import CorsProxy
from llamactor.runtime.http.tools import AgentTools, ToolFailure, agent_enabled, feature_disabled
from llamactor.runtime.service.config import RuntimeConfig

log = structlog.get_logger("llamactor.agent")

Handler = Callable[[Request], Awaitable[Response]]


async def _disabled(request: Request) -> Response:
    return feature_disabled(request)


STOPPING = frozenset({"draining", "closed"})  # the server's health while it shuts down


class Agent:
    """``health``: the server's state (``Runtime.health``, ``ModelSet.health``): once it drains,
    MCP calls in flight return at once, so that shutdown does not wait for them."""

    def __init__(self, config: RuntimeConfig, health: Callable[[], str] = lambda: "ok") -> None:
        self.config = config
        self.tools = AgentTools(config, lambda: health() in STOPPING) if agent_enabled(config) else None
        self.proxy = CorsProxy() if config.ui_mcp_proxy else None

    def routes(self, prefix: str, make_route: Callable[[str, str, Handler, list[str]], Route]) -> list[Route]:
        get_tools: Handler = self.tools.get if self.tools is not None else _disabled
        post_tools: Handler = self.tools.post if self.tools is not None else _disabled
        proxy: Handler = self.proxy.handle if self.proxy is not None else _disabled
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
