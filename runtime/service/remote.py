"""What the two engines out of this process share: ``ProcessEngine`` (a child process) and
``ReplicaSet`` (Ray Serve replicas).

On the API's side, both keep, in this process, the ``Journal`` of every request in flight (its resume rules live
there) and pass each engine step's events on to the requests' streams; both answer
embeddings by a call to the engine and add a few metrics of their own to the engine's. The
I/O that differs (a socket and a restarted child, or Ray calls and a router) stays in their
modules; what is the same is here, once. On the engine's side, a request's stream is a
``RemoteSink`` whose events go to the link's outbox.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio
import numpy as np
import structlog

from llamactor.protocol import enginelink as link
from llamactor.protocol.embedding import Embedded, EmbedderInfo
from llamactor.protocol.events import Event, Failed
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.journal import Journal, Resumed

log = structlog.get_logger("llamactor.remote")

EmbedCall = Callable[[Callable[[int], link.Embed]], Awaitable[link.EmbedDone]]


def send(sink: Any, event: Event) -> bool:
    """Put ``event`` on a request's stream; False when the client left (or fell behind)."""
    try:
        sink.send_nowait(event)
    except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
        return False
    return True


def metrics_text(lines: Iterable[tuple[str, str, str, float]]) -> bytes:
    """Prometheus text of ``(name, kind, help, value)`` samples (a counter's family drops ``_total``)."""
    out = []
    for name, kind, doc, value in lines:
        base = name.removesuffix("_total")
        out.append(f"# HELP {base} {doc}\n# TYPE {base} {kind}\n{name} {float(value)}\n")
    return "".join(out).encode()


class RemoteEmbedder:
    """The engine's embedding actor, reached by a call. Embeddings are not journaled: one whose
    engine dies fails with a 503, and the client retries (they are cheap and have no stream)."""

    def __init__(self, call: EmbedCall, info: EmbedderInfo) -> None:
        self._call = call
        self.info = info

    async def embed(self, inputs: list[list[int]], normalize: int) -> Embedded:
        blobs = tuple(np.asarray(t, dtype=np.int32).tobytes() for t in inputs)
        done = await self._call(lambda cid: link.Embed(cid, blobs, normalize))
        vectors = tuple(np.frombuffer(b, dtype=np.float32).reshape(shape) for b, shape in done.vectors)
        return Embedded(vectors, done.n_tokens, done.pooling)


class JournaledEngine:
    """The journal and the way events go from it to the requests' streams. Subclasses cancel
    (``cancel``: the engine's side of a client that left) and may count resumes (``resumed``)."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.journal = Journal(resume_max=config.resume_max, fast=config.resume == "fast")
        self.embedder: RemoteEmbedder | None = None

    def cancel(self, task_id: int) -> None:
        raise NotImplementedError

    def resumed(self, r: Resumed) -> None:
        """A resumed request's first new token came (``r.pause_s`` after its engine was lost)."""

    def in_flight(self) -> int:
        return len(self.journal)

    def pass_on(self, events: link.Events, ended: Iterable[int] = ()) -> None:
        """One engine step's events: journal them, then send each to its request's stream (a
        client that left is cancelled); the streams of the requests in ``ended`` are closed."""
        deliveries, resumed = self.journal.deliver(events, time.perf_counter())
        for r in resumed:
            self.resumed(r)
            log.info(
                "request_resumed",
                task=r.task_id,
                mode=self.config.resume,
                resumes=r.resumes,
                replayed=r.replayed,
                pause_ms=round(r.pause_s * 1e3, 1),
            )
        for entry, event in deliveries:
            if entry.task.id in self.journal and not send(entry.task.sink, event):
                self.cancel(entry.task.id)  # the client left
        for task_id in ended:
            done = self.journal.pop(task_id)
            if done is not None:
                done.task.sink.close()

    def end(self, task_id: int, failed: Failed) -> None:
        """End one request with an error (its stream gets it, then closes)."""
        entry = self.journal.pop(task_id)
        if entry is not None:
            send(entry.task.sink, failed)
            entry.task.sink.close()

    def fail_journal(self, message: str, error: str = "Unavailable") -> None:
        """End every request in flight with the same error."""
        for entry in self.journal.ends():
            send(entry.task.sink, Failed(message, error))
            entry.task.sink.close()


class RemoteSink:
    """A request's stream inside an engine whose client is in another process: ``send_nowait``
    and ``close`` as an anyio stream's, the events put in the link's outbox by the subclass
    (``put``; ``end`` when the stream closes)."""

    __slots__ = ("closed", "task_id")

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self.closed = False

    def send_nowait(self, event: Event) -> None:
        if self.closed:
            raise anyio.ClosedResourceError
        self.put(event)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.end()

    def put(self, event: Event) -> None:
        raise NotImplementedError

    def end(self) -> None:
        raise NotImplementedError
