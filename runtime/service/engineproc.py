"""The engine process: an ``InProcessEngine`` serving one API process over a Unix socket.

    python -m llamactor.runtime.service.engineproc SOCKET CONFIG_FILE

The config file holds the API process's ``RuntimeConfig`` as msgpack (``config_to_wire``). A
request arrives as a ``WireTask`` and gets a ``RemoteSink`` for a stream: the group that serves
it "sends" its events into one outbox, which a writer task flushes as one ``Events`` frame
after each step (the groups send a whole step's events without yielding, so one frame carries
them all). Each call of the link (``protocol.enginelink``) has its own handler and answer.

A watchdog ends the process (exit code ``WATCHDOG_EXIT``) when a decode step has run longer
than ``--watchdog-s``: a hung ggml-rpc worker or driver never returns, and a thread cannot be
interrupted. The API process sees the exit, restarts the engine and resumes the requests.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import structlog
from anyio.abc import SocketStream, TaskGroup
from anyio.streams.buffered import BufferedByteReceiveStream

from llamactor.actors.policies import load_object
from llamactor.protocol import enginelink as link
from llamactor.protocol.errors import LlamactorError
from llamactor.protocol.events import Event, Failed
from llamactor.runtime.service.config import RuntimeConfig, config_from_wire
from llamactor.runtime.service.inprocess import InProcessEngine
from llamactor.runtime.service.logging import configure_from
from llamactor.runtime.service.remote import RemoteSink

log = structlog.get_logger("llamactor.engine")

WATCHDOG_EXIT = 75  # the exit code of an engine the watchdog ended
BEAT_S = 1.0
PARENT_POLL_S = 1.0  # how often the engine looks for its API process (besides the kernel's signal)


class _Sink(RemoteSink):
    """A request's stream in the engine process: events go to the API process's outbox."""

    __slots__ = ("side",)

    def __init__(self, task_id: int, side: EngineSide) -> None:
        super().__init__(task_id)
        self.side = side

    def put(self, event: Event) -> None:
        self.side.outbox.append((self.task_id, event))
        self.side.wake()

    def end(self) -> None:
        self.side.ended.append(self.task_id)
        self.side.wake()


class EngineSide:
    def __init__(self, engine: InProcessEngine, stream: SocketStream) -> None:
        self.engine = engine
        self.stream = stream
        self.outbox: list[tuple[int, Event]] = []
        self.ended: list[int] = []
        self._flush = anyio.Event()
        self._send_lock = anyio.Lock()

    def wake(self) -> None:
        self._flush.set()

    async def run(self) -> None:
        embedder = self.engine.embedder
        ready = link.Ready(os.getpid(), embedder.info if embedder else None, self.engine.build)
        await self.stream.send(link.frame(ready))
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write)
            tg.start_soon(self._beat)
            if self.engine.config.watchdog_s > 0:
                tg.start_soon(self._watchdog, self.engine.config.watchdog_s)
            await self._read(tg)
            tg.cancel_scope.cancel()

    async def _read(self, tg: TaskGroup) -> None:
        reader = BufferedByteReceiveStream(self.stream)
        while True:
            try:
                header = await reader.receive_exactly(link.HEADER.size)
                body = await reader.receive_exactly(link.HEADER.unpack(header)[0])
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                return  # the API process went away: stop
            match link.decode_to_engine(body):
                case link.Submit(task=wire):
                    self._submit(wire)
                case link.Cancel(task_id=task_id):
                    self.engine.cancel(task_id)
                case call:
                    tg.start_soon(self._answer, call)

    def _submit(self, wire: link.WireTask) -> None:
        sink: Any = _Sink(wire.id, self)  # duck-types the stream's send_nowait/close
        try:
            self.engine.submit(wire.task(sink))
        except LlamactorError as exc:
            sink.send_nowait(Failed.of(exc))
            sink.close()

    async def _answer(self, call: link.Call) -> None:
        try:
            answer = await self._run(call)
        except Exception as exc:
            answer = link.CallFailed(call.call_id, Failed.of(exc))
        await self._send(link.frame(answer))

    async def _run(self, call: link.Call) -> link.Answer:
        return await answer_call(self.engine, call)

    async def _write(self) -> None:
        while True:
            await self._flush.wait()
            self._flush = anyio.Event()
            events, self.outbox = self.outbox, []
            ended, self.ended = self.ended, []
            await self._send(link.frame(link.Events(tuple(events), tuple(ended))))

    async def _send(self, data: bytes) -> None:
        try:
            async with self._send_lock:  # writer, beats, answers: one frame at a time
                await self.stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the reader sees the end and stops the process

    async def _beat(self) -> None:
        while True:
            await anyio.sleep(BEAT_S)
            await self._send(link.frame(link.Beat(self.engine.steps())))

    async def _watchdog(self, limit_s: float) -> None:
        """End the process when a group's decode step has been running for ``limit_s``."""
        while True:
            await anyio.sleep(min(0.25, limit_s / 4))
            now = time.perf_counter()
            for g, started in enumerate(self.engine.step_started()):
                if started and now - started > limit_s:
                    log.error(
                        "watchdog",
                        group=g,
                        step_s=round(now - started, 2),
                        limit_s=limit_s,
                        action="the engine process exits; the API process restarts it",
                    )
                    sys.stderr.flush()
                    os._exit(WATCHDOG_EXIT)


async def answer_call(engine: InProcessEngine, call: link.Call) -> link.Answer:
    """A call of the link answered by ``engine`` (here, or in a replica of a replica set)."""
    match call:
        case link.GetSlots(call_id=cid):
            return link.Slots(cid, tuple(await engine.slots()))
        case link.SlotAction(call_id=cid, slot=slot, action=action, path=path, kv=kv):
            return link.SlotDone(cid, await engine.slot_action(slot, action, path, kv))
        case link.GetMetrics(call_id=cid):
            return link.MetricsText(cid, await engine.metrics_text())
        case link.GetLive(call_id=cid):
            return link.Live(cid, engine.live_snapshot())
        case link.Embed(call_id=cid, inputs=inputs, normalize=normalize):
            assert engine.embedder is not None
            tokens = [np.frombuffer(b, dtype=np.int32).tolist() for b in inputs]
            done = await engine.embedder.embed(tokens, normalize)
            vectors = tuple(
                (np.ascontiguousarray(v, dtype=np.float32).tobytes(), tuple(np.shape(v))) for v in done.vectors
            )
            return link.EmbedDone(cid, vectors, done.n_tokens, done.pooling)
    raise TypeError(f"not a call: {call!r}")


def load_hooks(spec: str) -> Any:
    """``--engine-hooks module:Class`` or ``file.py:Class``: test and chaos hooks for the groups,
    made in the engine process (hooks cannot cross a process)."""
    return load_object(spec, "engine hooks")()


async def serve(socket_path: str, config: RuntimeConfig) -> None:
    stream = await anyio.connect_unix(socket_path)
    hooks = load_hooks(config.engine_hooks) if config.engine_hooks else None
    async with InProcessEngine.open(config, hooks=hooks) as engine:
        await EngineSide(engine, stream).run()


def die_with_parent(folder: str) -> None:
    """End this process, removing the API process's ``folder`` (its socket, config and black
    box), when the API process that started it dies, however it dies (SIGKILL, the OOM killer):
    an engine busy inside llama.cpp would not see its socket close and would keep its memory and
    cores. Linux tells it with a signal (``PR_SET_PDEATHSIG``); everywhere a thread also watches
    for the parent to change (a dead parent's children are adopted), once a second."""
    parent = os.getppid()

    def gone(*_: object) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        gone()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    try:
        import ctypes

        signal.signal(signal.SIGUSR2, gone)
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGUSR2, 0, 0, 0)
    except (OSError, AttributeError, ValueError):
        pass
    if os.getppid() != parent:  # the parent died before the call: nobody will read our socket
        gone()


def main(argv: list[str]) -> int:
    socket_path, config_path = argv
    die_with_parent(os.path.dirname(socket_path))
    # The API process decides when the engine stops (it closes the socket); a Ctrl-C or a
    # service manager's SIGTERM meant for the server must not cut the requests it drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        config = config_from_wire(Path(config_path).read_bytes())  # written by the API process that started us
        configure_from(config)
        anyio.run(serve, socket_path, config)
    except LlamactorError as exc:  # a config the engine cannot run (e.g. a missing draft model)
        print(f"llamactor engine: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
