"""The engine process (issue 14): the model, the groups, the coordinator and the supervisor,
serving one API process over a Unix socket (``protocol.enginelink``).

    python -m llamactor.runtime.service.engineproc SOCKET CONFIG_PICKLE

It runs an ordinary in-process ``RuntimeCore``. A request arrives as a ``WireTask`` and gets a
``RemoteSink`` for a stream: the group that serves it "sends" its events into one outbox,
which a writer task flushes as one ``Events`` frame after each step (the groups send a whole
step's events without yielding, so one frame carries them all). Anything else the API process
needs (slots, metrics, the live view, slot files, LoRA scales) is a ``Call`` by method name.

A watchdog ends the process (exit code ``WATCHDOG_EXIT``) when a decode step has run longer
than ``--watchdog-s``: a hung ggml-rpc worker or driver never returns, and a thread cannot be
interrupted. The API process sees the exit, restarts the engine and resumes the requests.
"""

from __future__ import annotations

import inspect
import os
import pickle
import signal
import sys
import time
from typing import Any

import anyio
import numpy as np
import structlog
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from llamactor.actors.policies import load_object
from llamactor.protocol import enginelink as link
from llamactor.protocol.errors import LlamactorError
from llamactor.protocol.events import Event, Failed
from llamactor.protocol.messages import Submit as SupSubmit
from llamactor.protocol.messages import Task
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.core import RuntimeCore
from llamactor.runtime.service.logging import configure_logging

log = structlog.get_logger("llamactor.engine")

WATCHDOG_EXIT = 75  # the exit code of an engine the watchdog ended
BEAT_S = 1.0
CALLS = frozenset({"slots", "slot_action", "metrics_text", "live_snapshot", "set_lora_adapters", "in_flight", "health"})


class RemoteSink:
    """A request's stream in the engine process: events go to the API process's outbox."""

    __slots__ = ("task_id", "side", "closed")

    def __init__(self, task_id: int, side: EngineSide) -> None:
        self.task_id = task_id
        self.side = side
        self.closed = False

    def send_nowait(self, event: Event) -> None:
        if self.closed:
            raise anyio.ClosedResourceError
        self.side.outbox.append((self.task_id, event))
        self.side.wake()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.side.ended.append(self.task_id)
            self.side.wake()


class EngineSide:
    def __init__(self, rt: RuntimeCore, stream: SocketStream) -> None:
        self.rt = rt
        self.stream = stream
        self.outbox: list[tuple[int, Event]] = []
        self.ended: list[int] = []
        self._flush = anyio.Event()
        self._send_lock = anyio.Lock()

    def wake(self) -> None:
        self._flush.set()

    async def run(self) -> None:
        actor = self.rt.embeddings.actor if self.rt.embeddings is not None else None
        info = link.EmbedderInfo(actor.pooling, actor.n_embd, actor.max_input_tokens) if actor is not None else None
        await self.stream.send(link.frame(link.Ready(os.getpid(), info)))
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write)
            tg.start_soon(self._beat)
            if self.rt.config.watchdog_s > 0:
                tg.start_soon(self._watchdog, self.rt.config.watchdog_s)
            await self._read(tg)
            tg.cancel_scope.cancel()

    async def _read(self, tg: Any) -> None:
        reader = BufferedByteReceiveStream(self.stream)
        while True:
            try:
                header = await reader.receive_exactly(link.HEADER.size)
                body = await reader.receive_exactly(link.HEADER.unpack(header)[0])
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                return  # the API process went away: stop
            msg = link.decode_to_engine(body)
            if isinstance(msg, link.Submit):
                self._submit(msg.task)
            elif isinstance(msg, link.Cancel):
                self._cancel(msg)
            elif isinstance(msg, link.Embed):
                tg.start_soon(self._embed, msg)
            else:
                tg.start_soon(self._call, msg)

    def _submit(self, w: link.WireTask) -> None:
        sink: Any = RemoteSink(w.id, self)  # duck-types the stream's send_nowait/close
        task = Task(id=w.id, prompt=w.tokens(), sink=sink, arrived=time.perf_counter(), **w.fields())
        assert self.rt.supervisor is not None
        try:
            self.rt.supervisor.try_tell(SupSubmit(task))
        except LlamactorError as exc:
            sink.send_nowait(Failed(str(exc), "unavailable_error"))
            sink.close()

    def _cancel(self, msg: link.Cancel) -> None:
        if self.rt.supervisor is not None:
            try:
                self.rt.supervisor.try_tell(msg)
            except LlamactorError:
                pass

    async def _call(self, msg: link.Call) -> None:
        try:
            if msg.method not in CALLS:
                raise LlamactorError(f"no such engine call: {msg.method}")
            value = getattr(self.rt, msg.method)(*msg.args)
            if inspect.isawaitable(value):
                value = await value
            reply = link.Reply(msg.call_id, value)
        except Exception as exc:  # noqa: BLE001 - the caller gets it back
            reply = link.Reply(msg.call_id, None, str(exc), type(exc).__name__)
        await self._send(link.frame(reply))

    async def _embed(self, msg: link.Embed) -> None:
        service = self.rt.embeddings
        try:
            assert service is not None and service.actor is not None
            inputs = [np.frombuffer(b, dtype=np.int32).tolist() for b in msg.inputs]
            done = await service.run_tokens(service.actor, inputs, msg.normalize)
            vectors = tuple((np.ascontiguousarray(v, dtype=np.float32).tobytes(), tuple(np.shape(v)))
                            for v in done.vectors)
            reply = link.EmbedDone(msg.job_id, vectors, done.n_tokens, done.pooling)
        except Exception as exc:  # noqa: BLE001 - the API process raises it for its request
            reply = link.EmbedDone(msg.job_id, error=str(exc), kind=type(exc).__name__)
        await self._send(link.frame(reply))

    async def _write(self) -> None:
        while True:
            await self._flush.wait()
            self._flush = anyio.Event()
            events, self.outbox = self.outbox, []
            ended, self.ended = self.ended, []
            await self._send(link.frame(link.Events(tuple(events), tuple(ended))))

    async def _send(self, data: bytes) -> None:
        try:
            async with self._send_lock:  # writer, beats, replies: one frame at a time
                await self.stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the reader sees the end and stops the process

    async def _beat(self) -> None:
        while True:
            await anyio.sleep(BEAT_S)
            metrics = self.rt.metrics
            steps = sum(c.n_decode for c in metrics.groups) if metrics is not None else 0
            await self._send(link.frame(link.Beat(steps)))

    async def _watchdog(self, limit_s: float) -> None:
        """End the process when a group's decode step has been running for ``limit_s``."""
        sup = self.rt.supervisor
        assert sup is not None
        while True:
            await anyio.sleep(min(0.25, limit_s / 4))
            now = time.perf_counter()
            for group in sup.groups:
                started = group.step_started if group is not None else 0.0
                if started and now - started > limit_s:
                    log.error("watchdog", group=group.group if group else -1, step_s=round(now - started, 2),
                              limit_s=limit_s, action="the engine process exits; the API process restarts it")
                    sys.stderr.flush()
                    os._exit(WATCHDOG_EXIT)


def load_hooks(spec: str) -> Any:
    """``--engine-hooks module:Class`` or ``file.py:Class``: test and chaos hooks for the groups,
    made in the engine process (hooks cannot cross a process)."""
    return load_object(spec, "engine hooks")()


async def serve(socket_path: str, config: RuntimeConfig) -> None:
    stream = await anyio.connect_unix(socket_path)
    hooks = load_hooks(config.engine_hooks) if config.engine_hooks else None
    async with RuntimeCore.open(config, hooks=hooks) as rt:
        await EngineSide(rt, stream).run()


def die_with_parent() -> None:
    """Linux: the kernel ends this process when the API process that started it dies, however
    it dies (SIGKILL, the OOM killer): an engine busy inside llama.cpp would not see its socket
    close and would keep its memory and cores. Elsewhere the socket's end stops it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call: nobody will read our socket
        os._exit(1)


def main(argv: list[str]) -> int:
    socket_path, config_path = argv
    die_with_parent()
    # The API process decides when the engine stops (it closes the socket); a Ctrl-C or a
    # service manager's SIGTERM meant for the server must not cut the requests it drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(config_path, "rb") as f:
        config: RuntimeConfig = pickle.load(f)  # written by the API process that started us
    configure_logging()
    try:
        anyio.run(serve, socket_path, config)
    except LlamactorError as exc:  # a config the engine cannot run (e.g. a missing draft model)
        print(f"llamactor engine: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
