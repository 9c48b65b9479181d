"""``EngineClient``: what the runtime facade asks of an engine, wherever the engine runs.

    Runtime (admission, chat templates, the embedding API) ──► EngineClient
        ├─ InProcessEngine   supervisor, groups, coordinator in this process (runtime.service.inprocess)
        ├─ ProcessEngine     the same in a child process, over a typed link, with a journal
        │                    that resumes every request after the engine dies (runtime.service.processengine)
        └─ ReplicaSet        N engines on Ray Serve, routed by what each has cached, with the same
                             journal resuming a request on another replica (runtime.service.replicas)

The facade holds one and does not know which. Requests arrive admitted: a ``Task`` carries its
prompt tokens, resolved settings and the send end of its result stream, and the engine is the
only writer of that stream from then on (tokens, one ``Done`` per choice, or one ``Failed``).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Protocol

import msgspec

from llamactor.protocol.build import BuildInfo
from llamactor.protocol.embedding import Embedded, EmbedderInfo
from llamactor.protocol.live import LiveSnapshot
from llamactor.protocol.messages import Task
from llamactor.protocol.slots import SlotActionResult, SlotKV, SlotState


class ReplicaStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One replica of a replica set (``GET /props``' ``engine.replicas``)."""

    id: str
    pid: int
    engine_pid: int  # the replica's engine runs in the replica's own process: the same pid
    state: str  # "up"
    restarts: int = 0  # replicas that died before this one took their place (the set's count)


# Set by the HTTP layer around one request: the replica set writes the replica that served it
# (the ``x-llamactor-replica`` response header); a plain engine leaves it alone.
served_by: ContextVar[list[str] | None] = ContextVar("served_by", default=None)


class EngineStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Where the engine runs and how it is (``GET /props``' ``engine``)."""

    isolated: bool  # in a child process
    state: str  # "starting" | "up" | "restarting" | "sleeping" | "waking" | "down"
    pid: int | None = None
    restarts: int = 0
    requests_resumed: int = 0
    watchdog_kills: int = 0
    last_exit: str = ""
    requests_in_flight: int = 0
    replicas: tuple[ReplicaStatus, ...] = ()  # a replica set's replicas (empty for one engine)
    build: BuildInfo | None = None  # the engine's llama.cpp build: CPU features, backend, devices


class Embedder(Protocol):
    """The engine's embedding context (``--embedding``)."""

    @property
    def info(self) -> EmbedderInfo: ...

    async def embed(self, inputs: list[list[int]], normalize: int) -> Embedded:
        """Embed admitted token-id inputs (each non-empty and at most ``max_input_tokens``)."""
        ...


class EngineClient(Protocol):
    @property
    def embedder(self) -> Embedder | None:
        """None when the engine was started without embeddings."""
        ...

    def submit(self, task: Task) -> None:
        """Queue an admitted task; its events go to ``task.sink``. Raises ``Overloaded`` when the
        engine cannot take it now (its mailbox or the restart queue is full) or ``Unavailable``
        when the engine is down; then nothing was queued and the caller still owns the stream."""
        ...

    def cancel(self, task_id: int) -> None:
        """The client left: stop the task and free its slots (nothing more is sent to its stream)."""
        ...

    async def slots(self) -> list[SlotState]: ...

    async def slot_action(self, slot: int, action: str, path: str = "", kv: SlotKV | None = None) -> SlotActionResult:
        """Erase, save (to ``path``), restore (from ``path``), export (the result's ``kv``) or
        import (``kv``) one idle slot (``SlotBusy`` if it serves a request)."""
        ...

    async def metrics_text(self) -> bytes:
        """The engine's Prometheus exposition text."""
        ...

    def live_snapshot(self) -> LiveSnapshot | None:
        """Groups, slots and counters now (None when the engine is not up)."""
        ...

    async def read_live(self) -> LiveSnapshot | None:
        """The same, read now, even from another process (None when the engine is not up)."""
        ...

    def health(self) -> str:
        """ "ok", "unhealthy" (down past its restart limit) or "restarting"."""
        ...

    def in_flight(self) -> int:
        """Requests queued or being served."""
        ...

    def status(self) -> EngineStatus: ...

    async def restart(self) -> None:
        """Start again an engine that gave up (down past its restart limit); a no-op otherwise."""
        ...
