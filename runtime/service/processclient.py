"""``ProcessClient``: the API process's side of an engine in a child process, as an ``EngineClient``.

What the runtime asks of the engine (submit, cancel, slots, metrics, the live view, health) and
the call protocol over its socket, answered from this process's state of the engine
(``EngineState``). ``runtime.service.processsleep`` adds sleeping on idle, and
``runtime.service.processengine`` the process itself: start, supervise, restart.

Sends never wait: ``submit`` and ``cancel`` queue a message for the connection's writer, so
``EngineClient.submit`` is as synchronous as the in-process one; a connection's queue dies with
it, and the journal resubmits what the next engine needs. A request or a call that comes while
the engine sleeps wakes it (``_touch``): the request waits in the journal, the call for the engine.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import structlog
from anyio.abc import Process

from llamactor.protocol import enginelink as link
from llamactor.protocol.build import BuildInfo
from llamactor.protocol.errors import EngineError, LlamactorError, Overloaded, Unavailable, error_from
from llamactor.protocol.live import LiveSnapshot
from llamactor.protocol.messages import Task
from llamactor.protocol.slots import SlotActionResult, SlotKV, SlotState
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.engine import EngineStatus
from llamactor.runtime.service.engineconn import EngineConnection
from llamactor.runtime.service.journal import Resumed, wire
from llamactor.runtime.service.remote import JournaledEngine, metrics_text

log = structlog.get_logger("llamactor.isolated")

CALL_TIMEOUT_S = 60.0
LIVE_REFRESH_S = 0.25  # how often the live view's snapshot is read while someone looks
LIVE_WANTED_S = 5.0  # ... for this long after the last look
LIVE_READ_TIMEOUT_S = 2.0  # the live view's own read: a busy engine answers within a step

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


class ProcessClient(JournaledEngine):
    """The engine process's state in this process, and the ``EngineClient`` calls answered from it."""

    def __init__(self, config: RuntimeConfig) -> None:
        super().__init__(config)
        self.state = EngineState.STARTING
        self.counters = EngineCounters()
        self.process: Process | None = None
        self.build: BuildInfo | None = None  # the engine's build and devices, from its Ready
        self._conn: EngineConnection | None = None
        self._closing = False
        self._call_ids = 0
        self._live: LiveSnapshot | None = None
        self._live_wanted = 0.0
        self._state_changed = anyio.Event()
        self.steps_seen = 0
        self._last_used = time.monotonic()  # the last request or call (idle time counts from here)
        self._wake_asked = anyio.Event()  # set by what needs a sleeping engine
        self._sleep_metrics = b""  # the engine's metrics when it went to sleep, served while it sleeps

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

    async def slot_action(self, slot: int, action: str, path: str = "", kv: SlotKV | None = None) -> SlotActionResult:
        answer = await self.call(lambda cid: link.SlotAction(cid, slot, action, path, kv), link.SlotDone)
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

    def _set_state(self, state: EngineState) -> None:
        self.state = state
        self._state_changed.set()
        self._state_changed = anyio.Event()

    # ---- a use of the engine wakes it ------------------------------------------------------

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

    # ---- calls, and this process's own metrics ---------------------------------------------

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

    def resumed(self, r: Resumed) -> None:
        self.counters.resume_ms.append(r.pause_s * 1e3)

    async def _embed(self, make: Any) -> link.EmbedDone:
        return await self.call(make, link.EmbedDone, timeout_s=None)

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
