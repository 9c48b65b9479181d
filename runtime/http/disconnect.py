"""Waiting for work while watching the client: if it disconnects, the work is cancelled."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request

from llamactor.protocol.errors import RequestError

T = TypeVar("T")


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Await ``work()``; if the client leaves first, cancel it and raise RequestError."""
    outcome: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            outcome.append(await work())
        except Exception as exc:
            outcome.append(exc)
        tg.cancel_scope.cancel()
    if not outcome:
        raise RequestError("client disconnected")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    result: T = outcome[0]
    return result
