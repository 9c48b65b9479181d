"""``ProcessEngine``: the engine in a child process, and the API process's side of it.

The engine (model weights, groups, coordinator, supervisor) runs in a child process
(``runtime.service.engineproc``); this process keeps admission, the HTTP app or the embedding
app's event loop, and the ``Journal`` of every request in flight (``runtime.service.journal``,
which holds the resume rules). This module is the I/O around them: start the process, read its
frames, answer calls, and when it dies (an abort inside llama.cpp, a segfault, the OOM killer,
the watchdog) or stops answering, restart it with backoff and submit every journaled request
again. Past ``engine_max_restarts`` deaths within ``restart_window_s`` the engine is DOWN:
requests fail with a clear error and ``/health`` stays 503 until ``restart()``.

With ``sleep_idle_seconds`` (llama-server's ``--sleep-idle-seconds``) an engine that has had
nothing to do for that long is stopped (SLEEPING: its process exits, its memory is freed) and
the next request or call starts it again (WAKING): requests are journaled meanwhile, exactly as
across a restart, so they only wait. A sleep is not a death: it counts toward no restart limit.

Sends never wait: ``submit`` and ``cancel`` queue a message for the connection's writer, so
``EngineClient.submit`` is as synchronous as the in-process one; a connection's queue dies with
it, and the journal resubmits what the next engine needs.
"""

from __future__ import annotations

import enum
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import anyio
import structlog
from anyio.abc import Process, SocketStream, TaskGroup, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream

from llamactor.protocol import enginelink as link
from llamactor.protocol.build import BuildInfo
from llamactor.protocol.errors import ConfigError, EngineError, LlamactorError, Overloaded, Unavailable, error_from
from llamactor.protocol.events import Failed
from llamactor.protocol.live import LiveSnapshot
from llamactor.protocol.messages import Task
from llamactor.protocol.slots import SlotActionResult, SlotState
from llamactor.runtime.engine.blackbox import ENV as BLACKBOX_ENV
from llamactor.runtime.engine.blackbox import Blackbox
from llamactor.runtime.service.config import RuntimeConfig, config_to_wire
from llamactor.runtime.service.deathcause import CannotStart, startup_death
from llamactor.runtime.service.engine import EngineStatus
from llamactor.runtime.service.journal import Resumed, wire
from llamactor.runtime.service.remote import JournaledEngine, RemoteEmbedder, metrics_text, send

log = structlog.get_logger("llamactor.isolated")

READY_TIMEOUT_S = 600.0  # loading a large model over ggml-rpc takes a while
CALL_TIMEOUT_S = 60.0
BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)  # before restart k (the first one at once)
SILENCE_S = 10.0  # no frame at all for this long (heartbeats come every second): the engine is stuck
LIVE_REFRESH_S = 0.25  # how often the live view's snapshot is read while someone looks
LIVE_WANTED_S = 5.0  # ... for this long after the last look
LIVE_READ_TIMEOUT_S = 2.0  # the live view's own read: a busy engine answers within a step
KILL_GRACE_S = 0.5  # an engine whose socket closed gets this long to exit by itself
CLOSE_WAIT_S = 10.0  # a closing engine gets this long to stop its actors cleanly
SLEEP_CHECK_S = 0.25  # the shortest wait between two looks at whether an engine may sleep
RPC_PROBE_S = 0.5  # how often a missing ggml-rpc worker is probed
RPC_LOG_EVERY_S = 5.0
WATCHDOG_EXIT = 75  # engineproc's exit code when its watchdog ended it

A = TypeVar("A", bound=link.Answer)


class EngineState(enum.Enum):
    STARTING = "starting"  # the first engine process is loading
    UP = "up"  # serving
    RESTARTING = "restarting"  # it died; a new one is being started
    SLEEPING = "sleeping"  # idle past sleep_idle_seconds: its process exited; the next request starts one
    WAKING = "waking"  # a request came while it slept: a new process is loading, requests wait for it
    DOWN = "down"  # past the restart limit: requests fail until restart()


@dataclass
class EngineCounters:
    restarts: int = 0
    resumed: int = 0  # requests submitted again after a restart
    watchdog_kills: int = 0
    last_exit: str = ""
    resume_ms: list[float] = field(default_factory=list)  # per resumed request: death to next token


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


class _Connection:
    """One engine process's socket: its writer queue and its calls waiting for answers."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.outbox: list[bytes] = []
        self.wake = anyio.Event()
        self.waiting: dict[int, tuple[anyio.Event, list[link.Answer]]] = {}

    def send(self, msg: link.ToEngine) -> None:
        self.outbox.append(link.frame(msg))
        self.wake.set()

    async def write(self) -> None:
        """Send what is queued, all of it in one write, until the socket breaks."""
        while True:
            await self.wake.wait()
            self.wake = anyio.Event()
            data, self.outbox = b"".join(self.outbox), []
            try:
                await self.stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the reader sees the end

    def answered(self, answer: link.Answer) -> None:
        waiter = self.waiting.pop(answer.call_id, None)
        if waiter is not None:
            waiter[1].append(answer)
            waiter[0].set()

    def fail_calls(self) -> None:
        waiting, self.waiting = self.waiting, {}
        for done, _ in waiting.values():
            done.set()


class ProcessEngine(JournaledEngine):
    """The ``EngineClient`` of an isolated runtime; made by ``open``."""

    def __init__(self, config: RuntimeConfig, folder: str) -> None:
        super().__init__(config)
        self.folder = folder
        self.state = EngineState.STARTING
        self.counters = EngineCounters()
        self.process: Process | None = None
        self.blackbox = Blackbox(os.path.join(folder, "blackbox"), create=True)  # runtime.engine.blackbox
        self.build: BuildInfo | None = None  # the engine's build and devices, from its Ready
        self._config_path = Path(folder) / "config.msgpack"
        self._config_path.write_bytes(config_to_wire(replace(config, isolate=False)))
        self._conn: _Connection | None = None
        self._closing = False
        self._local = False  # --rpc-fallback local took effect
        self._failures: list[float] = []
        self._call_ids = 0
        self._tg: TaskGroup | None = None
        self._live: LiveSnapshot | None = None
        self._live_wanted = 0.0
        self._state_changed = anyio.Event()
        self.steps_seen = 0
        self._last_used = time.monotonic()  # the last request or call (idle time counts from here)
        self._wake_asked = anyio.Event()  # set by what needs a sleeping engine
        self._sleep_metrics = b""  # the engine's metrics when it went to sleep, served while it sleeps
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

    # ---- EngineClient -------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self.state is EngineState.UP and self._conn is not None

    def submit(self, task: Task) -> None:
        if self.state is EngineState.DOWN:
            raise Unavailable(f"the engine process is down ({self.counters.last_exit}); restart the runtime's engine")
        waiting = self.journal.waiting()
        if not self.up and waiting >= self.config.queue_size:
            raise Overloaded(f"the engine is restarting and {waiting} requests wait for it")
        entry = self.journal.add(task)
        self._touch()
        if self._conn is not None:  # else the next engine gets it (``_resubmit``)
            first = wire(task, entry.delivered, 0)
            self._conn.send(link.Submit(first))
            self.journal.submitted(entry, first)

    def cancel(self, task_id: int) -> None:
        entry = self.journal.pop(task_id)
        if entry is None:
            return
        entry.task.sink.close()  # no event goes to a stream the client left (nor leaks unclosed)
        if entry.sent and self._conn is not None:
            self._conn.send(link.Cancel(task_id))

    async def slots(self) -> list[SlotState]:
        return list((await self.call(link.GetSlots, link.Slots)).slots)

    async def slot_action(self, slot: int, action: str, path: str = "") -> SlotActionResult:
        answer = await self.call(lambda cid: link.SlotAction(cid, slot, action, path), link.SlotDone)
        return answer.result

    async def metrics_text(self) -> bytes:
        """The engine's metrics and this process's own; a sleeping engine's are those it had when
        it went to sleep (a scrape does not wake it, as in llama-server)."""
        body = b""
        if self.up:
            try:
                body = (await self.call(link.GetMetrics, link.MetricsText, touch=False)).text
            except LlamactorError:
                body = b""
        elif self.state is EngineState.SLEEPING:
            body = self._sleep_metrics
        return body + self.own_metrics()

    def live_snapshot(self) -> LiveSnapshot | None:
        """The engine's snapshot as last read (at most ``LIVE_REFRESH_S`` old while asked for;
        None on the first ask after a pause: what was read then is long stale)."""
        now = time.monotonic()
        if now - self._live_wanted > LIVE_WANTED_S:
            self._live = None
        self._live_wanted = now
        return self._live if self.up else None

    async def read_live(self) -> LiveSnapshot | None:
        """The engine's snapshot, asked for now (None when it is down or does not answer in time)."""
        if not self.up:
            return None
        try:
            with anyio.fail_after(LIVE_READ_TIMEOUT_S):
                self._live = (await self.call(link.GetLive, link.Live, touch=False)).snapshot
        except (LlamactorError, TimeoutError):
            return None
        self._live_wanted = time.monotonic()
        return self._live

    def health(self) -> str:
        if self.state is EngineState.DOWN:
            return "unhealthy"
        if self.state in (EngineState.SLEEPING, EngineState.WAKING):
            return "ok"  # as llama-server's /health while it sleeps: a request only waits
        return "ok" if self.up else "restarting"

    def status(self) -> EngineStatus:
        c = self.counters
        return EngineStatus(
            isolated=True,
            state=self.state.value,
            pid=self.process.pid if self.process is not None and self.state is not EngineState.SLEEPING else None,
            restarts=c.restarts,
            requests_resumed=c.resumed,
            watchdog_kills=c.watchdog_kills,
            last_exit=c.last_exit,
            requests_in_flight=len(self.journal),
            build=self.build,
        )

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

    def _set_state(self, state: EngineState) -> None:
        self.state = state
        self._state_changed.set()
        self._state_changed = anyio.Event()

    # ---- sleeping on idle ---------------------------------------------------------------

    def _touch(self) -> None:
        """A request or a call came: the idle time starts over; a sleeping engine is woken."""
        self._last_used = time.monotonic()
        if self.state is EngineState.SLEEPING:
            self._wake_asked.set()

    async def _woken(self) -> None:
        """Wait until a sleeping or waking engine is up again (or gave up)."""
        while self.state in (EngineState.SLEEPING, EngineState.WAKING):
            changed = self._state_changed
            self._wake_asked.set()
            await changed.wait()

    def _idle(self) -> bool:
        conn = self._conn
        return self.up and conn is not None and not self.journal and not conn.waiting

    async def _sleep_when_idle(self, idle_s: float) -> None:
        """Put the engine to sleep once it has had nothing to do for ``idle_s``: no request in
        flight, no call waiting, none of either for that long. Runs for the engine's life."""
        while not self._closing:
            changed = self._state_changed
            if self.state is not EngineState.UP:
                await changed.wait()
                continue
            left = idle_s - (time.monotonic() - self._last_used)
            if left > 0 or not self._idle():
                await anyio.sleep(max(left, SLEEP_CHECK_S))
                continue
            try:  # what a scrape reads while it sleeps (llama-server serves the same snapshot)
                metrics = (await self.call(link.GetMetrics, link.MetricsText, touch=False)).text
            except LlamactorError:
                metrics = b""
            if not self._idle() or time.monotonic() - self._last_used < idle_s:
                continue  # something came while the metrics were read
            self._sleep_metrics = metrics
            await self._sleep(idle_s)

    async def _sleep(self, idle_s: float) -> None:
        """Stop the engine process as a close does; ``_serve_once`` sees SLEEPING and ``_run``
        waits for ``_wake_asked`` instead of restarting it."""
        conn, process = self._conn, self.process
        assert conn is not None
        self._wake_asked = anyio.Event()
        self._set_state(EngineState.SLEEPING)
        self._conn = None  # what is submitted from now on waits in the journal for the next engine
        log.info("engine_sleeping", pid=process.pid if process is not None else None, idle_s=idle_s)
        await conn.stream.aclose()  # its reader ends: it stops its actors and exits, freeing its memory

    async def _until_wanted(self) -> None:
        """While SLEEPING: return when a request or a call wants the engine (both set
        ``_wake_asked``; a request journaled while it fell asleep is wanted already)."""
        if not self.journal:
            await self._wake_asked.wait()
        self._set_state(EngineState.WAKING)
        log.info("engine_waking", in_flight=len(self.journal))

    def own_metrics(self) -> bytes:
        """This process's metrics of the engine process (restarts, resumes, journal)."""
        c, journaled, kills = self.counters, len(self.journal), self.counters.watchdog_kills
        sleeping = int(self.state is EngineState.SLEEPING)
        return metrics_text(
            [
                ("llamactor:engine_restarts_total", "counter", "Restarts of the engine process", c.restarts),
                ("llamactor:requests_resumed_total", "counter", "Requests resumed after an engine restart", c.resumed),
                ("llamactor:watchdog_kills_total", "counter", "Engine processes ended by the watchdog", kills),
                ("llamactor:engine_up", "gauge", "1 while the engine process serves", int(self.up)),
                ("llamactor:engine_sleeping", "gauge", "1 while it sleeps", sleeping),
                ("llamactor:requests_journaled", "gauge", "Requests in flight, kept by the API process", journaled),
            ]
        )

    async def call(
        self, make: Any, answer_type: type[A], *, timeout_s: float | None = CALL_TIMEOUT_S, touch: bool = True
    ) -> A:
        """Send the call ``make(call_id)`` and wait for its answer (raising the engine's error).
        A call that ``touch``es (all but the scrapes and the live view's reads) counts as use:
        it wakes a sleeping engine, waiting for it, and restarts the idle time."""
        if touch:
            self._touch()
            if self.state in (EngineState.SLEEPING, EngineState.WAKING):
                await self._woken()
        conn = self._conn
        if conn is None or not self.up:
            raise Unavailable(f"the engine is {self.state.value}")
        self._call_ids += 1
        cid = self._call_ids
        done = anyio.Event()
        out: list[link.Answer] = []
        conn.waiting[cid] = (done, out)
        conn.send(make(cid))
        try:
            with anyio.fail_after(timeout_s):
                await done.wait()
        finally:
            conn.waiting.pop(cid, None)
        if not out:
            raise Unavailable("the engine process died during the call; retry")
        answer = out[0]
        if isinstance(answer, link.CallFailed):
            raise error_from(answer.error.error, answer.error.message)
        if not isinstance(answer, answer_type):
            raise EngineError(f"the engine answered {type(answer).__name__} to a call for {answer_type.__name__}")
        return answer

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
            conn = self._conn = _Connection(stream)
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
                hello = link.decode_from_engine(await _receive(reader))
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

    async def _pump(self, conn: _Connection, reader: BufferedByteReceiveStream) -> None:
        """Frames from the engine until it goes away (EOF) or falls silent past SILENCE_S."""
        while True:
            try:
                with anyio.fail_after(SILENCE_S):
                    body = await _receive(reader)
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

    def resumed(self, r: Resumed) -> None:
        self.counters.resume_ms.append(r.pause_s * 1e3)

    async def _embed(self, make: Any) -> link.EmbedDone:
        return await self.call(make, link.EmbedDone, timeout_s=None)

    def _resubmit(self, conn: _Connection) -> None:
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

    async def _refresh_live(self) -> None:
        """Read the engine's live snapshot every ``LIVE_REFRESH_S`` while the live view is looked at."""
        while True:
            await anyio.sleep(LIVE_REFRESH_S)
            if not self.up or time.monotonic() - self._live_wanted > LIVE_WANTED_S:
                if not self.up:
                    self._live = None
                continue
            try:
                self._live = (await self.call(link.GetLive, link.Live, touch=False)).snapshot
            except (LlamactorError, TimeoutError):
                self._live = None

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


async def _receive(reader: BufferedByteReceiveStream) -> bytes:
    header = await reader.receive_exactly(link.HEADER.size)
    return await reader.receive_exactly(link.HEADER.unpack(header)[0])
