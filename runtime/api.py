"""``Runtime``: the embedding API's class, ``RuntimeCore`` plus the HTTP app it can make.

It lives in the top layer, beside the HTTP app, so that the service layer below never imports
the HTTP layer (``rt.asgi_app()`` needs both). ``Runtime.open(config, isolate=True)`` (or
``config.isolate``) gives an ``IsolatedRuntime``: the same API with the engine in a child
process that may die without losing a request (issue 14, ``runtime.service.isolated``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from starlette.applications import Starlette

from llamactor.protocol.errors import ConfigError
from llamactor.runtime.engine.hooks import GroupHooks
from llamactor.runtime.http.app import build_app
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.core import RuntimeCore
from llamactor.runtime.service.isolated import IsolatedCore


class _AppMixin:
    def asgi_app(self) -> Starlette:
        """A Starlette app serving this runtime (mount it, or run it with any ASGI server)."""
        return build_app(self)  # type: ignore[arg-type]


class Runtime(_AppMixin, RuntimeCore):
    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig, *, hooks: GroupHooks | None = None,
                   isolate: bool | None = None) -> AsyncIterator[Any]:
        """Open a runtime for the ``async with`` block. ``isolate`` (default: ``config.isolate``)
        runs the engine in a child process; ``hooks`` need the engine in this process."""
        rt = make_runtime(config, hooks=hooks, isolate=isolate)
        async with rt:
            yield rt


class IsolatedRuntime(_AppMixin, IsolatedCore):
    pass


def make_runtime(config: RuntimeConfig, *, hooks: GroupHooks | None = None,
                 isolate: bool | None = None) -> Runtime | IsolatedRuntime:
    isolate = config.isolate if isolate is None else isolate
    if not isolate:
        return Runtime(replace(config, isolate=False), hooks=hooks)
    if hooks is not None:
        raise ConfigError("hooks cannot reach an engine in a child process: give them as "
                          "engine_hooks='module:Class' or open the runtime with isolate=False")
    return IsolatedRuntime(replace(config, isolate=True))
