"""``Runtime``: the embedding API's class, ``RuntimeCore`` plus the HTTP app it can make.

It lives in the top layer, beside the HTTP app, so that the service layer below never imports
the HTTP layer (``rt.asgi_app()`` needs both). ``Runtime(config)`` and ``Runtime.open(config)``
give an ``IsolatedRuntime`` unless ``config.isolate`` (or ``isolate=``) is False: the same API
with the engine in a child process that may die without losing a request (issue 14,
``runtime.service.isolated``).
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


class Runtime(RuntimeCore):
    def __new__(cls, config: RuntimeConfig, *, hooks: GroupHooks | None = None,
                isolate: bool | None = None) -> Any:
        if cls is Runtime and (config.isolate if isolate is None else isolate):
            if hooks is not None:
                raise ConfigError("hooks cannot reach an engine in a child process: give them as "
                                  "engine_hooks='module:Class' or open the runtime with isolate=False")
            cls = IsolatedRuntime
        return object.__new__(cls)

    def __init__(self, config: RuntimeConfig, *, hooks: GroupHooks | None = None,
                 isolate: bool | None = None) -> None:
        isolated = isinstance(self, IsolatedCore)
        super().__init__(replace(config, isolate=isolated), hooks=hooks)

    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig, *, hooks: GroupHooks | None = None,
                   isolate: bool | None = None) -> AsyncIterator[Any]:
        """Open a runtime for the ``async with`` block. ``isolate`` (default: ``config.isolate``)
        runs the engine in a child process; ``hooks`` need the engine in this process."""
        rt = cls(config, hooks=hooks, isolate=isolate)
        async with rt:
            yield rt

    def asgi_app(self) -> Starlette:
        """A Starlette app serving this runtime (mount it, or run it with any ASGI server)."""
        return build_app(self)


class IsolatedRuntime(IsolatedCore, Runtime):
    """``Runtime`` with its engine in a child process (what ``Runtime(config)`` gives by default)."""


def make_runtime(config: RuntimeConfig, *, hooks: GroupHooks | None = None, isolate: bool | None = None) -> Runtime:
    return Runtime(config, hooks=hooks, isolate=isolate)
