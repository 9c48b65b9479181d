"""``ProcessEngine``: the engine in a child process, and the API process's side of it.

The engine (model weights, groups, coordinator, supervisor) runs in a child process
(``runtime.service.engineproc``); this process keeps admission, the HTTP app or the embedding
app's event loop, and the ``Journal`` of every request in flight (``runtime.service.journal``,
which holds the resume rules). This module is the I/O around them: start the process, read its
frames, and when it dies (an abort inside llama.cpp, a segfault, the OOM killer, the watchdog)
or stops answering, restart it with backoff and submit every journaled request again. Past
``engine_max_restarts`` deaths within ``restart_window_s`` the engine is DOWN: requests fail
with a clear error and ``/health`` stays 503 until ``restart()``.

What the runtime calls and how a call is answered are in ``runtime.service.processclient``; the
engine's socket in ``runtime.service.engineconn``; sleeping on idle (``sleep_idle_seconds``) in
``runtime.service.processsleep``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import Process, SocketStream, TaskGroup, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream

from llamactor.protocol import enginelink as link
from llamactor.protocol.errors import ConfigError, EngineError, LlamactorError
from llamactor.protocol.events import Failed
from llamactor.runtime.engine.blackbox import ENV as BLACKBOX_ENV
from llamactor.runtime.engine.blackbox import Blackbox
from llamactor.runtime.service.config import RuntimeConfig, config_to_wire
from llamactor.runtime.service.deathcause import CannotStart, startup_death
from llamactor.runtime.service.engineconn import EngineConnection, receive_frame
from llamactor.runtime.service.processclient import EngineState
from llamactor.runtime.service.processsleep import IdleSleep
from llamactor.runtime.service.remote import RemoteEmbedder, send

log = structlog.get_logger("llamactor.isolated")

READY_TIMEOUT_S = 600.0  # loading a large model over ggml-rpc takes a while
BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)  # before restart k (the first one at once)
SILENCE_S = 10.0  # no frame at all for this long (heartbeats come every second): the engine is stuck
KILL_GRACE_S = 0.5  # an engine whose socket closed gets this long to exit by itself
CLOSE_WAIT_S = 10.0  # a closing engine gets this long to stop its actors cleanly
RPC_PROBE_S = 0.5  # how often a missing ggml-rpc worker is probed
RPC_LOG_EVERY_S = 5.0
WATCHDOG_EXIT = 75  # engineproc's exit code when its watchdog ended it


def exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return "the watchdog (a decode step hung)" if code == WATCHDOG_EXIT else f"exit code {code}"


async def reachable(endpoint: str) -> bool:
    """Whether a ggml-rpc worker (HOST:PORT) accepts a connection now."""
    host, _, port = endpoint.rpartition(":")
    try:
        with anyio.fail_after(1.0):
            stream = await anyio.connect_tcp(host.strip("[]"), int(port))
    except (OSError, TimeoutError, ValueError):
        return False
    await stream.aclose()
    return True


class ProcessEngine(IdleSleep):
    """The ``EngineClient`` of an isolated runtime; made by ``open``."""

    def __init__(self, config: RuntimeConfig, folder: str) -> None:
        super().__init__(config)
        self.folder = folder
        self.blackbox = Blackbox(os.path.join(folder, "blackbox"), create=True)  # runtime.engine.blackbox
        self._config_path = Path(folder) / "config.msgpack"
        self._config_path.write_bytes(config_to_wire(replace(config, isolate=False)))
        self._local = False  # --rpc-fallback local took effect
        self._failures: list[float] = []
        self._tg: TaskGroup | None = None
        self._starts = 0  # processes started (names each one's socket)

    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig) -> AsyncIterator[ProcessEngine]:
        """Start the engine process (its first start's failure is the caller's: a config the
        engine cannot load will not load on retry either); stop it on the way out."""
        folder = tempfile.mkdtemp(prefix="llamactor-engine-")
        try:
            engine = cls(config, folder)
            async with anyio.create_task_group() as tg:
                engine._tg = tg
                await tg.start(engine._run)
                tg.start_soon(engine._refresh_live)
                if config.sleep_idle_seconds > 0:
                    tg.start_soon(engine._sleep_when_idle, float(config.sleep_idle_seconds))
                try:
                    yield engine
                finally:
                    await engine._close()
                    tg.cancel_scope.cancel()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    async def restart(self) -> None:
        """Start the engine again after it went DOWN (its death count starts over)."""
        if self.state is not EngineState.DOWN or self._tg is None:
            return
        self._failures = []
        self._set_state(EngineState.RESTARTING)
        log.info("engine_restart_asked")
        self._tg.start_soon(self._run)
        while self.state is EngineState.RESTARTING:
            await self._state_changed.wait()

    # ---- the process ------------------------------------------------------------------------

    async def _run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep an engine process serving until closed, or DOWN past the restart limit."""
        first = True
        while not self._closing:
            try:
                await self._serve_once(task_status if first else None)
            except Exception as exc:
                if self.state is EngineState.STARTING:
                    raise
                if isinstance(exc, CannotStart):  # the build or the machine: every restart would die so
                    self._set_state(EngineState.DOWN)
                    log.error("engine_down", reason=str(exc))
                    self.fail_journal(str(exc))
                    return
                log.error("engine_start_failed", error=f"{type(exc).__name__}: {exc}")
            first = False
            if self._closing:
                return
            if self.state is EngineState.SLEEPING:
                await self._until_wanted()
                continue
            now = time.monotonic()
            self._failures = [t for t in self._failures if now - t < self.config.restart_window_s] + [now]
            if len(self._failures) > self.config.engine_max_restarts:
                self._set_state(EngineState.DOWN)
                log.error("engine_down", restarts=len(self._failures) - 1, window_s=self.config.restart_window_s)
                self.fail_journal(
                    f"the engine process died {len(self._failures)} times within "
                    f"{self.config.restart_window_s:g} s; it is not restarted again "
                    f"(last: {self.counters.last_exit})"
                )
                return
            self._set_state(EngineState.RESTARTING)
            self.counters.restarts += 1
            delay = BACKOFF_S[min(len(self._failures) - 1, len(BACKOFF_S) - 1)]
            log.warning("engine_restarting", attempt=self.counters.restarts, delay_s=delay, in_flight=len(self.journal))
            await anyio.sleep(delay)
            if self.config.rpc_servers and not self._local:
                await self._wait_for_workers()

    async def _wait_for_workers(self) -> None:
        """ggml-rpc: a worker that went away takes the engine with it, and a new engine cannot
        load the model until it is back. Probe every worker until all answer, saying what we
        wait for; with ``--rpc-fallback local``, give up after ``--rpc-wait-s`` and load the
        whole model in the engine process instead."""
        servers = list(self.config.rpc_servers)
        started = time.monotonic()
        said = 0.0
        while True:
            missing = [s for s in servers if not await reachable(s)]
            if not missing:
                if said:
                    log.info("rpc_workers_back", waited_s=round(time.monotonic() - started, 2))
                return
            waited = time.monotonic() - started
            if self.config.rpc_fallback == "local" and waited >= self.config.rpc_wait_s:
                log.warning(
                    "rpc_fallback_local",
                    missing=missing,
                    waited_s=round(waited, 1),
                    action="the engine loads the whole model locally",
                )
                self._local = True
                local = replace(self.config, isolate=False, rpc_servers=(), devices=(), tensor_split=())
                self._config_path.write_bytes(config_to_wire(local))
                return
            if waited - said >= RPC_LOG_EVERY_S or not said:
                log.warning("waiting_for_rpc_workers", missing=missing, waited_s=round(waited, 1))
                said = max(waited, 1e-9)
            await anyio.sleep(RPC_PROBE_S)

    async def _serve_once(self, task_status: TaskStatus[None] | None) -> None:
        self._starts += 1
        sock = os.path.join(self.folder, f"engine-{self._starts}.sock")
        async with await anyio.create_unix_listener(sock) as listener:
            process = self.process = await anyio.open_process(
                [sys.executable, "-m", "llamactor.runtime.service.engineproc", sock, str(self._config_path)],
                stdin=None,
                stdout=None,
                stderr=None,
                env={**os.environ, BLACKBOX_ENV: str(self.blackbox.path)},
                start_new_session=True,  # signals to the terminal's or service's group go to the API only
            )
            try:
                stream, reader, hello = await self._accept(listener, process)
            except BaseException:
                await self._kill(process)
                raise
            conn = self._conn = EngineConnection(stream)
            if hello.embedder is not None:
                self.embedder = RemoteEmbedder(self._embed, hello.embedder)
            self.build = hello.build
            self._set_state(EngineState.UP)
            log.info("engine_ready", pid=hello.pid, restarts=self.counters.restarts)
            if task_status is not None:
                task_status.started()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(conn.write)
                    self._resubmit(conn)
                    await self._pump(conn, reader)
                    tg.cancel_scope.cancel()
            finally:
                self._conn = None
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                asleep = self.state is EngineState.SLEEPING
                if self._closing or asleep:  # it saw its socket close: let it stop its actors cleanly
                    with anyio.move_on_after(CLOSE_WAIT_S, shield=True):
                        await process.wait()
                else:
                    self._set_state(EngineState.RESTARTING)
                await self._kill(process)
                conn.fail_calls()
                # a sleep is no death: what was sent to the engine goes to the next one, uncounted
                suspects = set() if asleep else None if self._closing else self.blackbox.suspects()
                self.journal.lost(suspects, time.perf_counter())
                self.blackbox.clear()
                if asleep:
                    log.info("engine_asleep", pid=hello.pid, exit=exit_reason(process.returncode))
                elif not self._closing:
                    self._died(process.returncode, hello.pid)

    async def _accept(
        self, listener: Any, process: Process
    ) -> tuple[SocketStream, BufferedByteReceiveStream, link.Ready]:
        """The engine's connection and its ``Ready``, or the reason it ended before."""
        with anyio.fail_after(READY_TIMEOUT_S):
            accepted: list[SocketStream] = []
            async with anyio.create_task_group() as tg:

                async def accept() -> None:
                    accepted.append(await listener.accept())
                    tg.cancel_scope.cancel()

                async def died() -> None:
                    await process.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(accept)
                tg.start_soon(died)
            if not accepted:
                raise await self._not_ready(process)
            stream = accepted[0]
            reader = BufferedByteReceiveStream(stream)
            try:
                hello = link.decode_from_engine(await receive_frame(reader))
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                await stream.aclose()
                raise await self._not_ready(process) from None
        assert isinstance(hello, link.Ready)
        return stream, reader, hello

    def _died(self, code: int | None, pid: int) -> None:
        self.counters.last_exit = exit_reason(code)
        if code == WATCHDOG_EXIT:
            self.counters.watchdog_kills += 1
        log.error("engine_died", pid=pid, reason=self.counters.last_exit, in_flight=len(self.journal))

    async def _not_ready(self, process: Process) -> LlamactorError:
        """The engine ended (or is ending) before it said it was ready: why, as an error."""
        with anyio.move_on_after(CLOSE_WAIT_S):
            await process.wait()
        code = process.returncode
        self.counters.last_exit = exit_reason(code)
        cause = startup_death(code, in_warmup=self.blackbox.in_warmup())
        self.blackbox.clear()
        if cause is not None:
            self.counters.last_exit = cause
            log.error("engine_cannot_start", pid=process.pid, cause=cause)
            return CannotStart(cause)
        cls = ConfigError if code == 2 else EngineError
        return cls(f"the engine process ended before it was ready ({self.counters.last_exit}); see its log above")

    async def _pump(self, conn: EngineConnection, reader: BufferedByteReceiveStream) -> None:
        """Frames from the engine until it goes away (EOF) or falls silent past SILENCE_S."""
        while True:
            try:
                with anyio.fail_after(SILENCE_S):
                    body = await receive_frame(reader)
            except TimeoutError:
                log.error("engine_silent", seconds=SILENCE_S, action="killed")
                self.counters.watchdog_kills += 1
                return
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            match link.decode_from_engine(body):
                case link.Events() as events:
                    self.pass_on(events, events.ended)
                    if events.ended:
                        self._last_used = time.monotonic()  # the idle time counts from the last request's end
                case link.Beat(steps=steps):
                    self.steps_seen = steps
                case link.Ready():
                    pass
                case answer:
                    conn.answered(answer)

    def _resubmit(self, conn: EngineConnection) -> None:
        """After a (re)start: send every journaled request, resuming those that had started."""
        for entry, what in self.journal.unsent():
            if isinstance(what, Failed):
                self.journal.pop(entry.task.id)
                send(entry.task.sink, what)
                entry.task.sink.close()
                continue
            conn.send(link.Submit(what))
            if self.journal.submitted(entry, what):
                self.counters.resumed += 1

    async def _kill(self, process: Process) -> None:
        """Make sure the engine process is gone. One whose socket closed is usually exiting:
        give it a moment first (killing a zombie makes Python's ``Popen.send_signal`` reap it
        behind asyncio's back, which then reports exit code 255 instead of the real one)."""
        with anyio.move_on_after(KILL_GRACE_S, shield=True):
            await process.wait()
        if process.returncode is None:
            try:
                process.kill()
            except ProcessLookupError:
                pass
        with anyio.CancelScope(shield=True):
            await process.wait()

    async def _close(self) -> None:
        self._closing = True
        process, conn = self.process, self._conn
        if conn is not None:
            await conn.stream.aclose()  # the engine's reader ends: it stops its actors and exits
        if process is not None:
            with anyio.move_on_after(CLOSE_WAIT_S):
                await process.wait()
            await self._kill(process)
        self.fail_journal("the runtime is shutting down", "Closed")  # their engine is gone: none waits
