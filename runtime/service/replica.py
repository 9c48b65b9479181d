"""One replica of a replica set: a llamactor engine inside a Ray Serve replica, and the routers.

Imported only where Ray is installed (``pip install 'llamactor[cluster]'``): by the ingress
(``runtime.service.replicas``) and, through Ray, in each replica's worker process.

``ReplicaServer`` is the deployment. Its engine runs in the replica's own process (the replica
is the unit that dies and restarts: when Ray kills it, nothing of the engine outlives it).
``run`` takes a request as the engine link's ``WireTask`` (routed) and answers when it ended;
its events go on ``events``, one long stream per replica that the ingress keeps open, carrying
every request's events as the link's ``Events`` frames, one per decode step (one Ray item per
step, not per request and step), and an empty one each second of silence (the ingress's sign
of life); ``call`` answers
the link's calls (slots, metrics, the live view, embeddings); ``watch`` answers with the
routing stats when they change.

The routers that send requests to the replicas run in the ingress: ``runtime.service.replicarouters``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import msgspec
import structlog
from ray import serve

from llamactor.protocol import enginelink as link
from llamactor.protocol.errors import LlamactorError
from llamactor.protocol.events import Event, Failed
from llamactor.runtime.service.config import config_from_wire
from llamactor.runtime.service.engineproc import answer_call, load_hooks
from llamactor.runtime.service.inprocess import InProcessEngine
from llamactor.runtime.service.logging import configure_from
from llamactor.runtime.service.remote import RemoteSink
from llamactor.runtime.service.routing import BLOCK, Placed, Route, Served, block_hashes

REPORT_S = 0.1  # how often a replica checks whether its routing stats changed
REPORT_MIN_S = 0.4  # ... and the least time between two reports (each is a Ray call answered)
WATCH_S = 5.0  # a ``watch`` call answers after this long even when nothing changed
BEAT_S = 1.0  # an empty frame after this long without events: the replica is alive
MAX_HELD_BLOCKS = 65536  # reported block hashes, at most (the newest cached prompts first)

log = structlog.get_logger("llamactor.replica")
T = TypeVar("T")
_encoder = msgspec.msgpack.Encoder()
_calls: msgspec.msgpack.Decoder[link.Call] = msgspec.msgpack.Decoder(link.Call)
_wire_task = msgspec.msgpack.Decoder(link.WireTask)


class _Mux:
    """The replica's one stream to the ingress: every request's events in the order the groups
    sent them, taken a decode step's worth at a time by the ingress's ``events`` call (one Ray
    stream item per step, not one per request and step).

    Requests are submitted in an epoch; their events go to that epoch's stream, which may
    connect after they start (they wait here). When the stream ends (the ingress left, or took
    the replica for gone and resumed its requests elsewhere) the epoch ends: what is still live
    in it is cancelled, and its events are dropped. The engine's actors append from the engine's
    loop; the stream may read on another thread: the lock makes each take see whole steps."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.epoch = 0
        self.events: list[tuple[int, Event]] = []
        self.ended: list[int] = []
        self.live: dict[int, _Sink] = {}
        self.reader: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self.pending = False  # a wake is scheduled on the reader's loop

    def add(self, sink: _Sink) -> int:
        with self.lock:
            self.live[sink.task_id] = sink
            return self.epoch

    def send(self, sid: int, epoch: int, event: Event) -> None:
        with self.lock:
            if epoch != self.epoch:
                import anyio

                raise anyio.ClosedResourceError  # its stream is gone: the engine drops the request
            self.events.append((sid, event))
            self._wake()

    def end(self, sid: int, epoch: int) -> bool:
        """``sid``'s stream closed; False when its epoch had ended (its events are lost)."""
        with self.lock:
            if epoch != self.epoch or self.live.pop(sid, None) is None:
                return False
            self.ended.append(sid)
            self._wake()
            return True

    def forget(self, sid: int) -> None:
        with self.lock:
            self.live.pop(sid, None)

    def take(self) -> tuple[list[tuple[int, Event]], list[int]]:
        with self.lock:
            taken = self.events, self.ended
            self.events, self.ended = [], []
            return taken

    def attach(self) -> tuple[int, asyncio.Event]:
        """A stream starts reading: the current epoch's (what waits here is its)."""
        wake = asyncio.Event()
        with self.lock:
            self.reader = (asyncio.get_running_loop(), wake)
            self.pending = False
            if self.events or self.ended:
                wake.set()
            return self.epoch, wake

    def detach(self, epoch: int) -> list[_Sink]:
        """The stream of ``epoch`` ended: the next epoch starts; what was live is returned."""
        with self.lock:
            if epoch != self.epoch:
                return []
            live, self.live = list(self.live.values()), {}
            self.epoch += 1
            self.events, self.ended = [], []
            self.reader = None
            return live

    def _wake(self) -> None:
        if self.reader is not None and not self.pending:
            self.pending = True
            loop, wake = self.reader
            loop.call_soon_threadsafe(self._set, wake)

    def _set(self, wake: asyncio.Event) -> None:
        self.pending = False
        wake.set()


def _serve_grpc_on_loopback() -> None:
    """On a Ray node whose address is loopback (the instance llamactor starts itself: see
    ``raycluster.start_local_ray``), bind the inter-deployment gRPC server Ray Serve starts in each
    replica to 127.0.0.1 too: Serve writes its address as ``[::]:0`` (every interface) with no
    setting, after the replica's constructor (this one) has run. It takes the replica's handle
    calls, which no other machine should reach. A cluster's node keeps Serve's binding."""
    try:
        import ray
        from ray.serve._private import replica as serve_replica
    except ImportError:
        return
    if not ray.util.get_node_ip_address().startswith("127."):
        return
    add_port = getattr(serve_replica, "add_port_to_grpc_server", None)
    if add_port is None or getattr(add_port, "loopback_only", False):
        return

    def loopback(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.removeprefix("[::]:")
        return add_port(server, address)

    loopback.loopback_only = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = loopback


class ReplicaServer:
    """A Ray Serve replica serving one llamactor engine (see the module)."""

    async def __init__(self, config: bytes) -> None:  # type: ignore[misc]  # Ray Serve awaits it
        cfg = config_from_wire(config)
        configure_from(cfg)
        _serve_grpc_on_loopback()
        self.engine: InProcessEngine | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()  # the engine's actors run here
        self._runner = asyncio.ensure_future(self._run(cfg))
        ready = asyncio.ensure_future(self._ready.wait())
        await asyncio.wait((self._runner, ready), return_when=asyncio.FIRST_COMPLETED)
        if not self._ready.is_set():  # the engine did not start: the replica's error, as is
            ready.cancel()
            self._runner.result()
            raise RuntimeError("the engine stopped before it was ready")
        self._mux = _Mux()
        self._serving: dict[int, Any] = {}  # the prompts of the requests in it (their slots hold them)
        self._me = serve.get_replica_context().replica_id.unique_id
        self._stats: dict[str, Any] = {}
        self._changed = asyncio.Event()
        self._reporter = asyncio.ensure_future(self._report())
        self._reporter.add_done_callback(_reporter_ended)

    async def _run(self, cfg: Any) -> None:
        hooks = load_hooks(cfg.engine_hooks) if cfg.engine_hooks else None  # tests, chaos
        async with InProcessEngine.open(cfg, hooks=hooks) as engine:
            self.engine = engine
            self._ready.set()
            await self._stop.wait()

    def _engine(self) -> InProcessEngine:
        assert self.engine is not None
        return self.engine

    async def hello(self, route: Route) -> dict[str, Any]:
        """Who this replica is (the ingress asks each once)."""
        engine = self._engine()
        embedder = engine.embedder
        return {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "pid": os.getpid(),
            "embedder": _encoder.encode(embedder.info) if embedder else b"",
        }

    async def run(self, task: bytes, route: Route) -> bytes:
        """Serve one request (the link's ``WireTask``, its id unique to the ingress): its events
        go on the events stream of the epoch it came in; this answers (``Served``) when its
        stream closed here, so Ray counts it as ongoing while it is (routing, autoscaling).
        Cancelled (the client left), it is cancelled in the engine."""
        engine = self._engine()
        wire = _wire_task.decode(task)
        sink: Any = _Sink(self._mux, wire.id)
        self._serving[wire.id] = wire.tokens()

        def submit() -> None:
            try:
                engine.submit(wire.task(sink))
            except LlamactorError as exc:
                sink.send_nowait(Failed.of(exc))
                sink.close()

        self._loop.call_soon_threadsafe(submit)
        try:
            await sink.finished.wait()
        finally:
            del self._serving[wire.id]
            if not sink.finished.is_set():
                self._mux.forget(wire.id)
                self._loop.call_soon_threadsafe(engine.cancel, wire.id)
        return _encoder.encode(Served(self._me, os.getpid(), sink.epoch, sink.delivered))

    async def events(self, route: Route) -> AsyncIterator[bytes]:
        """Every request's events (``Events`` frames, one per decode step that had any), after a
        first ``Placed`` frame naming the epoch; an empty frame each second of silence (the
        ingress's sign of life). When the ingress leaves, what it was served is cancelled."""
        engine = self._engine()
        epoch, wake = self._mux.attach()
        try:
            yield _encoder.encode(Placed(self._me, os.getpid(), epoch))
            while True:
                try:
                    await asyncio.wait_for(wake.wait(), BEAT_S)
                except TimeoutError:
                    pass
                wake.clear()
                events, ended = self._mux.take()
                yield _encoder.encode(link.Events(tuple(events), tuple(ended)))
        finally:
            for sink in self._mux.detach(epoch):  # their events are lost: the ingress resumes them
                self._loop.call_soon_threadsafe(engine.cancel, sink.task_id)
                sink.finish(delivered=False)

    async def call(self, call: bytes, route: Route) -> bytes:
        msg = _calls.decode(call)
        try:
            answer = await self._on_engine(answer_call(self._engine(), msg))
        except Exception as exc:
            answer = link.CallFailed(msg.call_id, Failed.of(exc))
        return _encoder.encode(answer)

    async def _report(self) -> None:
        """Keep the routing stats current: recomputed when what the slots hold, the queue or
        the RAM cache changed (checked every ``REPORT_S``, cheaply), waking ``watch``."""
        last: Any = None
        while True:
            engine = self.engine
            if engine is not None:
                snap = engine.supervisor.snapshot()
                cache = engine.prompt_cache.statistics() if engine.prompt_cache is not None else None
                held = tuple(len(e.cached) // BLOCK for e in engine.supervisor.table)  # whole blocks only
                now = (snap.busy, snap.queue_depth, held, cache.entries if cache is not None else 0)
                if now != last:
                    last = now
                    self._stats = self.routing_stats()
                    self._changed.set()
                    self._changed = asyncio.Event()
                    await asyncio.sleep(REPORT_MIN_S)  # at most this often
            await asyncio.sleep(REPORT_S)

    async def _on_engine(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the engine's loop (Ray Serve may call a method on another)."""
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def watch(self, seen: float, route: Route) -> dict[str, Any]:
        """The routing stats as soon as they are newer than ``seen`` (their ``at``), or after
        ``WATCH_S`` as they are: the ingress's router follows each replica with this call."""
        return await self._on_engine(self._watch(seen))

    async def _watch(self, seen: float) -> dict[str, Any]:
        if self._stats.get("at") == seen:
            try:
                await asyncio.wait_for(self._changed.wait(), WATCH_S)
            except TimeoutError:
                pass
        return self._stats

    def routing_stats(self) -> dict[str, Any]:
        """What the router knows of this replica."""
        engine = self.engine
        if engine is None:
            return {}
        snap = engine.supervisor.snapshot()
        blocks: list[int] = []
        # the prompts of the requests in it (their slots' tokens are known only once each ends),
        # then what its slots and its RAM cache hold, the newest first
        for tokens in [*list(self._serving.values()), *reversed(engine.held_prompts())]:
            blocks += block_hashes(tokens)
            if len(blocks) >= MAX_HELD_BLOCKS:
                break
        cfg = engine.config
        used = sum(len(e.cached) for e in engine.supervisor.table)
        rates = [g.costs.ms_per_prompt_token for g in engine.supervisor.groups if g is not None]
        return {
            "at": time.time(),
            "pid": os.getpid(),
            "slots": len(snap.busy),
            "busy": sum(snap.busy),
            "queued": snap.queue_depth,
            "kv_used": min(1.0, used / max(1, cfg.total_kv_cells)),
            "blocks": blocks,
            "loras": list(range(len(cfg.lora))),
            "prefill_ms_per_token": max(rates, default=0.0),  # learned from its steps (0: none yet)
        }

    def check_health(self) -> None:
        engine = self.engine
        if engine is not None and engine.health() != "ok":
            raise RuntimeError("the replica's engine is unhealthy (a group is down past its restart limit)")

    async def __del__(self) -> None:
        self._loop.call_soon_threadsafe(self._reporter.cancel)
        self._loop.call_soon_threadsafe(self._stop.set)
        await self._on_engine(asyncio.wait((self._runner,), timeout=10))


def _reporter_ended(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("routing_stats_reporter_failed", error=repr(task.exception()))


class _Sink(RemoteSink):
    """One request's stream inside a replica: into the replica's ``_Mux``; ``finished`` is set
    (on the loop of the ``run`` call serving it) when it closed or its epoch ended."""

    __slots__ = ("delivered", "epoch", "finished", "loop", "mux")

    def __init__(self, mux: _Mux, sid: int) -> None:
        super().__init__(sid)
        self.mux = mux
        self.delivered = False
        self.finished = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.epoch = mux.add(self)

    def put(self, event: Event) -> None:
        self.mux.send(self.task_id, self.epoch, event)

    def end(self) -> None:
        self.finish(delivered=self.mux.end(self.task_id, self.epoch))

    def finish(self, *, delivered: bool) -> None:
        self.delivered = delivered
        self.loop.call_soon_threadsafe(self.finished.set)
