"""Request handles: the receive end of one request's event stream.

A handle yields ``Token`` and ``Done`` events and raises the request's error; closing it (or
leaving its ``async with``, or leaving an ``async for`` over it early) cancels the request,
which frees its slot at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any, Self

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from llamactor.protocol.errors import error_from
from llamactor.protocol.events import Done, Event, Failed, Progress, Token
from llamactor.protocol.messages import Task
from llamactor.runtime.service.chatturn import ChatTurn
from llamactor.runtime.service.results import Completion, collect_events

StreamEvent = Token | Done | Progress


class RequestHandle:
    """The receive end of one request: iterate it for its events; closing it cancels the request.

    Events are ``Token`` and ``Progress`` events and one ``Done`` per choice; a failure of the
    whole request is raised as its error. Leaving an ``async for`` over it early (``break``,
    an exception) cancels the request at once, as does ``close()`` or leaving its ``async
    with``: its slots are freed and nothing more is generated for it.
    """

    def __init__(
        self,
        task: Task,
        events: MemoryObjectReceiveStream[Event],
        cancel: Callable[[int], None],
        turn: ChatTurn | None = None,
    ) -> None:
        self.task = task
        self.events = events
        self.turn = turn  # a chat request's rendered turn (how its answer is parsed)
        self._cancel = cancel
        self._closed = False

    @property
    def id(self) -> int:
        return self.task.id

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return _Events(self)

    async def first(self) -> StreamEvent | None:
        """Wait for the first event (raises the request's error): lets HTTP pick a status.
        None when the stream ended without any event (the request was cancelled)."""
        try:
            event = await self.events.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self.close()
            return None
        if isinstance(event, Failed):
            self.close()
            raise error_from(event.error, event.message)
        return event

    async def result(self) -> Completion:
        """Wait for the end and return every choice (``collect``)."""
        return await collect(self)

    def close(self) -> None:
        """Cancel (if still running) and drop the stream; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self.events.close()
        self._cancel(self.task.id)

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class _Events:
    """One ``async for`` over a handle. The loop holds the only reference to it, so when the
    loop is left early (``break``, an exception) it is released at once and the request is
    cancelled (an async generator would be closed only when the garbage collector gets to it)."""

    __slots__ = ("done", "handle")

    def __init__(self, handle: RequestHandle) -> None:
        self.handle = handle
        self.done = False

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> StreamEvent:
        handle = self.handle
        try:
            event = await handle.events.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self.done = True
            handle.close()
            raise StopAsyncIteration from None
        except BaseException:
            self.done = True
            handle.close()
            raise
        if isinstance(event, Failed):
            self.done = True
            handle.close()
            raise error_from(event.error, event.message)
        return event

    def __del__(self) -> None:
        if not self.done:
            self.handle.close()


class EventStream:
    """What ``Runtime.stream`` returns: await it for the request's ``RequestHandle`` (request
    errors known before the first event are raised there, so a web route can still answer
    400), or iterate it directly (they are raised at the first iteration then)."""

    def __init__(self, start: Callable[[], Awaitable[RequestHandle]]) -> None:
        self._start = start

    def __await__(self) -> Generator[Any, None, RequestHandle]:
        return self._start().__await__()

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return _LazyEvents(self._start)


class _LazyEvents:
    """``async for ev in rt.stream(...)``: submits at the first iteration, then as ``_Events``."""

    __slots__ = ("events", "start")

    def __init__(self, start: Callable[[], Awaitable[RequestHandle]]) -> None:
        self.start: Callable[[], Awaitable[RequestHandle]] | None = start
        self.events: _Events | None = None

    def __aiter__(self) -> _LazyEvents:
        return self

    async def __anext__(self) -> StreamEvent:
        if self.events is None:
            if self.start is None:
                raise StopAsyncIteration
            start, self.start = self.start, None
            self.events = _Events(await start())
        return await self.events.__anext__()


async def collect(handle: RequestHandle) -> Completion:
    """Drain a request's events into a ``Completion``."""
    async with handle:
        return await collect_events(handle, len(handle.task.prompt))
