"""The bundled HTTP server: its listening sockets, and serving a runtime on them until a signal.

``runtime.cli`` binds the sockets (``bind_listeners``) before the model loads, so that an address
in use stops startup with one line, then runs ``serve``: Hypercorn with the app of one model or
the router's, draining on the first SIGINT/SIGTERM.
"""

from __future__ import annotations

import errno
import signal
import socket
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog

from llamactor.protocol.errors import ConfigError
from llamactor.runtime.http.deadlines import DEFAULT_TIMEOUT_S
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.modelset import ModelSet

log = structlog.get_logger("llamactor.cli")  # the logger its lines had before they moved here

# llama-server's keep-alive timeout (cpp-httplib's): an idle connection, or one that has not
# sent a whole request head, is closed after this long
KEEP_ALIVE_TIMEOUT_S = 5


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_listener(host: str, port: int, *, v6only: bool = False, timeout_s: int = 0) -> socket.socket:
    """One listening socket of the server, bound as Hypercorn binds one (``SO_REUSEADDR``, IPv6
    for a host with a colon) and listening at once, so that the same address given twice fails
    here too. Bound before the model loads or anything logs "listening", so that an address in
    use is a ConfigError naming it; Hypercorn is handed this socket (``fd://``) rather than
    binding the address a second time. ``v6only``: an IPv6 address takes IPv6 only.

    ``timeout_s`` (--timeout) is also the kernel's limit on data a client leaves unacknowledged
    (``TCP_USER_TIMEOUT``, which the accepted connections inherit): a client that stops reading
    cannot keep a connection, and the answer buffered for it, past it once the server gave up."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if timeout_s > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, timeout_s * 1000)
        if v6only and sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen()  # Hypercorn listens again with its own backlog
    except OSError as exc:
        sock.close()
        why = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise ConfigError(f"cannot listen on {_address(host, port)}: {why}") from None
    return sock


def bind_listeners(hosts: Sequence[str], port: int, timeout_s: int = 0) -> list[socket.socket]:
    """A listening socket for each --host address, as llama-server listens on each; with several,
    an IPv6 address takes IPv6 only (as in llama-server: ``::`` must not also claim ``0.0.0.0``).
    The first address that cannot be bound is a ConfigError naming it, the others are closed."""
    sockets: list[socket.socket] = []
    try:
        for host in hosts:
            sockets.append(bind_listener(host, port, v6only=len(hosts) > 1, timeout_s=timeout_s))
    except ConfigError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def serve(
    cfg: RuntimeConfig,
    hosts: Sequence[str],
    port: int,
    ssl: tuple[str, str] | None = None,
    listeners: Sequence[socket.socket] = (),
    models: ModelSet | None = None,
    timeout_s: int = DEFAULT_TIMEOUT_S,
) -> int:
    """Serve until SIGINT/SIGTERM. /health answers 503 while the model loads. ``listeners``
    (``bind_listeners``) are the bound sockets to serve on; without them Hypercorn binds each
    of ``hosts``. With ``models`` (the router mode) it serves those, each loaded when used,
    and ``cfg`` is the command line's (the server's own settings: keys, CORS, prefix).
    ``timeout_s`` (--timeout): a request body's deadline and one write's limit
    (``runtime.http.deadlines``)."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from llamactor.runtime.api import Runtime
    from llamactor.runtime.http.app import build_app
    from llamactor.runtime.http.deadlines import ClientDeadlines
    from llamactor.runtime.http.router import build_router_app

    rt: Runtime | ModelSet = Runtime(cfg) if models is None else models
    stop = anyio.Event()
    failed: list[BaseException] = []

    async def run_runtime() -> None:
        try:
            async with rt:
                await stop.wait()
        except Exception as exc:
            log.error("startup_failed", error=str(exc))
            failed.append(exc)
            stop.set()

    @asynccontextmanager
    async def lifespan(app: Any):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_runtime)
            yield
            stop.set()

    async def shutdown_trigger() -> None:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                """The first SIGTERM/SIGINT drains: no new requests (503), the ones in flight get
                up to --shutdown-timeout to finish; a second signal stops at once."""
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        break
                    async with anyio.create_task_group() as drain:

                        async def drain_then_stop() -> None:
                            await rt.drain(cfg.shutdown_timeout)
                            drain.cancel_scope.cancel()

                        drain.start_soon(drain_then_stop)
                        async for _ in signals:
                            log.warning("stopping_now", reason="second signal")
                            drain.cancel_scope.cancel()
                stop.set()

            tg.start_soon(on_signal)
            await stop.wait()
            tg.cancel_scope.cancel()

    # what each socket is bound to, read before it is handed over (--port 0: the port chosen)
    addresses = [sock.getsockname()[:2] for sock in listeners] or [(host, port) for host in hosts]
    hc = Config()
    hc.bind = [f"fd://{sock.detach()}" for sock in listeners] or [_address(host, port) for host in hosts]
    hc.accesslog = None
    hc.errorlog = None
    hc.graceful_timeout = 3.0
    # What a slow or silent client may hold: a connection without a whole request head, or idle
    # between requests, KEEP_ALIVE_TIMEOUT_S; a TLS handshake at most --timeout (and 60 s); a
    # request head at most Hypercorn's 16 KiB; a request body --timeout (ClientDeadlines).
    # Hypercorn's per-read socket timeout (read_timeout) stays off: it would also cut a stream
    # whose client listens in silence.
    hc.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    hc.ssl_handshake_timeout = min(60, timeout_s)
    if ssl is not None:
        hc.certfile, hc.keyfile = ssl
    for host, bound in addresses:
        if models is None:
            log.info("listening", host=host, port=bound, model=str(cfg.model))
        else:
            log.info("listening", host=host, port=bound, models=len(models.views()), mode="router")
    # an ASGI app; hypercorn's stub names its own scope types
    app: Any = ClientDeadlines(
        build_app(rt, lifespan=lifespan) if isinstance(rt, Runtime) else build_router_app(rt, cfg, lifespan=lifespan),
        timeout_s,
    )
    await hypercorn_serve(app, hc, shutdown_trigger=shutdown_trigger)
    if any(isinstance(exc, ConfigError) for exc in failed):
        return 2  # found only while loading (a model or LoRA file llama.cpp refuses): as a bad flag
    return 1 if failed else 0


__all__ = ["KEEP_ALIVE_TIMEOUT_S", "bind_listener", "bind_listeners", "serve"]
