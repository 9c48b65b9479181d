"""``--timeout``: how long a client may take to send a request and to take an answer.

llama-server's ``--timeout N`` (default 600 s) is its HTTP library's read and write timeout.
Here, around the whole ASGI app (``llamactor serve`` puts it there):

- **the body**: a request's whole body must arrive within N seconds of its headers, however it
  trickles in (a client that sends one byte a second is cut at N seconds, not N seconds after
  its last byte); past it the answer is 408 and the connection is closed. Reading the body is
  the only time the server waits on a client's bytes: the per-read socket timeout of Hypercorn
  would also end a stream whose client listens in silence, so it is not used;
- **each write**: one piece of an answer (a stream's frame included) may wait at most N
  seconds for the client to take it (a client that stops reading fills the socket's buffers);
  past it the answer is abandoned, its request cancelled (its slot freed) and the connection
  closed. A stream whose client reads is never cut, however long it runs.

Before a request's headers, Hypercorn's keep-alive timeout applies (``runtime.server.serve`` sets it): a
connection that sends no complete request head within it is closed, so a slow trickle of
header bytes holds nothing for long either.
"""

from __future__ import annotations

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llamactor.protocol.errors import RequestError
from llamactor.runtime.http.errors import error_response

DEFAULT_TIMEOUT_S = 600  # llama-server's --timeout


class BodyTimeout(RequestError):
    status = 408
    kind = "timeout_error"


class _WriteTimeout(Exception):
    """A write that waited past the timeout: the answer is abandoned."""


class ClientDeadlines:
    def __init__(self, app: ASGIApp, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        timeout_s = self.timeout_s
        deadline = anyio.current_time() + timeout_s
        body_done = False
        started = False

        async def receive_by_deadline() -> Message:
            nonlocal body_done
            if body_done:  # past the body: only a disconnect is left to wait for (during a stream)
                return await receive()
            left = deadline - anyio.current_time()
            with anyio.move_on_after(max(left, 0)):
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    body_done = True
                return message
            raise BodyTimeout(f"the request body did not arrive whole within {timeout_s:g} s")

        async def send_in_time(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            with anyio.move_on_after(timeout_s):
                await send(message)
                return
            raise _WriteTimeout

        try:
            await self.app(scope, receive_by_deadline, send_in_time)
        except (BodyTimeout, _WriteTimeout, BaseExceptionGroup) as exc:
            # a task group (a streaming answer's) may carry it inside a group
            found: BaseException = exc
            if isinstance(exc, BaseExceptionGroup):
                ours, rest = exc.split((BodyTimeout, _WriteTimeout))
                if rest is not None or ours is None:
                    raise
                found = _first(ours)
            # a write that timed out: nothing more is sent, the connection is closed (its answer
            # did not end, so Hypercorn cannot reuse it); a body that timed out where the app did
            # not answer it itself: 408, if nothing was sent yet
            if isinstance(found, BodyTimeout) and not started:
                await error_response(found)(scope, receive, send)


def _first(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


__all__ = ["DEFAULT_TIMEOUT_S", "BodyTimeout", "ClientDeadlines"]
