"""Sleeping on idle: an engine process that has had nothing to do stops, and starts again when wanted.

With ``sleep_idle_seconds`` (llama-server's ``--sleep-idle-seconds``) an engine that has had
nothing to do for that long is stopped (SLEEPING: its process exits, its memory is freed) and
the next request or call starts it again (WAKING): requests are journaled meanwhile, exactly as
across a restart, so they only wait. A sleep is not a death: it counts toward no restart limit.
What wakes it is in ``runtime.service.processclient`` (``_touch``); ``ProcessEngine._run``
waits here (``_until_wanted``) instead of restarting a sleeping engine.
"""

from __future__ import annotations

import time

import anyio
import structlog

from llamactor.protocol import enginelink as link
from llamactor.protocol.errors import LlamactorError
from llamactor.runtime.service.processclient import EngineState, ProcessClient

log = structlog.get_logger("llamactor.isolated")

SLEEP_CHECK_S = 0.25  # the shortest wait between two looks at whether an engine may sleep


class IdleSleep(ProcessClient):
    """An engine process that goes to sleep when idle (``_sleep_when_idle`` runs for its life)."""

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
