"""A lean HTTP/1.1 client for the measured requests (asyncio only; keep-alive pool).

Why not httpx here: the harness shares a small machine with the server it measures, and a
general client spends ~80 us of CPU per streamed event in its layers (h11, anyio, httpcore),
several task switches apart from the socket read. This client is an ``asyncio.Protocol``: the
event loop hands it each received chunk directly, it stamps the chunk with
``time.perf_counter()`` before anything else, undoes chunked framing and passes the bytes on.
httpx is still used for the probes (/metrics, /tokenize), where cost does not matter.

Supports exactly what the servers under test send back: a status line, headers, and a body
framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or connection close. No TLS, no
redirects, no ``Expect: 100-continue``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

BodySink = Callable[[int, bytes, float], None]  # (status, bytes, receive time) per body piece

MAX_HEAD_BYTES = 64 * 1024  # status line and headers; a longer head is a protocol error


class ProtocolError(Exception):
    """The server's response is not HTTP/1.1 this client understands."""


class _Connection(asyncio.Protocol):
    """One TCP connection; serves one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False  # the connection is closed; never reuse it
        self._done: asyncio.Future[int] | None = None  # the response in progress, if any
        self._sink: BodySink | None = None
        self._reset()

    def _reset(self) -> None:
        """Parser state for a new response."""
        self.reusable = False  # known once the head is parsed: keep-alive and a framed body
        self._buf = b""  # bytes of an incomplete head or chunk-size line
        self._status = 0
        self._in_head = True
        self._remaining = -1  # bytes left of the body (content-length) or of the current chunk
        self._chunked = False
        self._chunk_state = "size"  # "size", "data", "data-crlf", "trailer"
        self._until_close = False

    # ---- request side -------------------------------------------------------------------

    def send(self, head_and_body: bytes, sink: BodySink) -> asyncio.Future[int]:
        """Write one request; the future resolves to the status once the body has ended."""
        assert self.transport is not None and self._done is None
        self._reset()
        self._done = asyncio.get_running_loop().create_future()
        self._sink = sink
        self.transport.write(head_and_body)
        return self._done

    @property
    def nothing_received(self) -> bool:
        """No byte of the current response has arrived."""
        return self._in_head and not self._buf

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    # ---- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._done is None or self._done.done():
            return  # bytes after a complete response: nothing is expected
        try:
            self._feed(data, now)
        except ProtocolError as exc:
            self._finish(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._done is not None and not self._done.done():
            if self._until_close and not self._in_head:
                self._finish(None)
            else:
                self._finish(exc or ConnectionResetError("the server closed the connection mid-response"))

    # ---- parsing ------------------------------------------------------------------------

    def _finish(self, exc: BaseException | None) -> None:
        assert self._done is not None
        if exc is None:
            self._done.set_result(self._status)
        else:
            self.reusable = False
            self._done.set_exception(exc)
        self._done = None

    def _feed(self, data: bytes, now: float) -> None:
        buf = self._buf + data if self._buf else data
        self._buf = b""
        if self._in_head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise ProtocolError("response head too long")
                self._buf = buf
                return
            self._parse_head(buf[:end])
            buf = buf[end + 4 :]
            if self._done is None:
                return  # an empty body: the response already ended
        if self._chunked:
            self._feed_chunked(buf, now)
        elif self._until_close:
            if buf:
                self._emit(buf, now)
        else:
            piece = buf[: self._remaining]
            if piece:
                self._emit(piece, now)
            self._remaining -= len(piece)
            if self._remaining == 0:
                self._finish(None)

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"bad status line {lines[0][:80]!r}")
        self._status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        self._in_head = False
        keep_alive = headers.get(b"connection") != b"close" and parts[0] == b"HTTP/1.1"
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            self._chunked = True
        elif b"content-length" in headers:
            self._remaining = int(headers[b"content-length"])
        else:
            self._until_close = True
            keep_alive = False
        self.reusable = keep_alive
        if not self._chunked and not self._until_close and self._remaining == 0:
            self._finish(None)

    def _feed_chunked(self, buf: bytes, now: float) -> None:
        pos = 0
        while pos < len(buf) and self._done is not None:
            if self._chunk_state == "data":
                piece = buf[pos : pos + self._remaining]
                self._emit(piece, now)
                pos += len(piece)
                self._remaining -= len(piece)
                if self._remaining == 0:
                    self._chunk_state = "data-crlf"
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                self._buf = buf[pos:]
                return
            line = buf[pos:end]
            pos = end + 2
            if self._chunk_state == "size":
                try:
                    self._remaining = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {line[:40]!r}") from None
                self._chunk_state = "data" if self._remaining else "trailer"
            elif self._chunk_state == "data-crlf":
                self._chunk_state = "size"
            elif not line:  # the empty line that ends the trailers
                self._finish(None)

    def _emit(self, piece: bytes, now: float) -> None:
        assert self._sink is not None
        self._sink(self._status, piece, now)


class Http1Pool:
    """Keep-alive connections to one ``http://host:port``; one request per connection at a time.

    Created once per run and used by every simulated user; idle connections are reused, so the
    warm-up leaves one open connection per user and the measured phase opens none.
    """

    def __init__(self, url: str, headers: Mapping[str, str] | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only http:// URLs are supported, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.extra_head = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())  # every request
        self._idle: list[_Connection] = []
        self._all: list[_Connection] = []

    async def _acquire(self) -> tuple[_Connection, bool]:
        """An idle connection (reused: True) or a new one."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost:
                return conn, True
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self.host, self.port)
        self._all.append(conn)
        return conn, False

    async def post(self, path: str, body: bytes, sink: BodySink, on_sent: Callable[[], None], timeout_s: float) -> int:
        """POST ``body`` as JSON; ``sink`` gets the response body as it arrives; the status is
        returned once it has ended. ``on_sent`` is called right before the request is written
        (after any connect, so TTFT never includes connection set-up).

        A kept-alive connection that the server closed while it sat idle fails before a single
        response byte; that request is sent again once, on a new connection.
        """
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{self.extra_head}"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        conn, reused = await self._acquire()
        while True:
            on_sent()
            try:
                status = await asyncio.wait_for(conn.send(head + body, sink), timeout_s)
                break
            except ConnectionError:
                conn.close()
                if not (reused and conn.nothing_received):
                    raise
                conn, reused = await self._acquire()
            except BaseException:
                conn.close()
                raise
        if conn.reusable and not conn.lost:
            self._idle.append(conn)
        else:
            conn.close()
        return status

    def close(self) -> None:
        """Close every connection; called once when the run ends."""
        for conn in self._all:
            conn.close()
        self._idle.clear()
        self._all.clear()


__all__ = ["Http1Pool", "ProtocolError"]
