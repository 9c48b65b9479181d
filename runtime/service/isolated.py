"""The engine in a child process (issue 14): the API side.

``IsolatedCore`` is a ``RuntimeCore`` whose engine (model weights, groups, coordinator,
supervisor) runs in a child process (``runtime.service.engineproc``); this process keeps
admission (a vocabulary-only copy of the model tokenizes and checks requests), the HTTP app or
the embedding app's event loop, and a **journal** of every request in flight: its task (prompt
tokens, sampling settings, budget) and, per choice, the tokens already delivered.

When the engine process dies (an abort inside llama.cpp, a segfault, the OOM killer, the
watchdog) or stops answering, nothing in flight fails: ``/health`` says 503 "engine
restarting", new requests wait in the journal (bounded by ``--queue-size``: 503 + Retry-After
past it), the engine is started again (backoff; past ``engine_max_restarts`` within
``restart_window_s`` requests fail with a clear error and /health stays 503), and every
journaled request is submitted again with ``replay``: the tokens already delivered, which the
group replays after the prompt one decode step at a time (teacher forcing) without sending
them again, so the client's stream only pauses and a greedy stream continues byte for byte.
A seeded request continues with a seed derived from its seed and its delivered count. A
request resumes at most ``resume_max`` times.
"""

from __future__ import annotations

import enum
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import msgspec
import numpy as np
import structlog
from anyio.abc import Process, SocketStream, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream

from llamactor.protocol import enginelink as link
from llamactor.protocol import errors
from llamactor.protocol.errors import (
    ConfigError, EngineError, LlamactorError, Overloaded, RequestError, Unavailable,
)
from llamactor.protocol.events import Done, Event, Failed, Progress, Token
from llamactor.protocol.live import LiveSnapshot
from llamactor.protocol.embedding import EmbedJob, Embedded
from llamactor.protocol.messages import REQUEST_FIELDS, Task
from llamactor.protocol.sampling import DEFAULT_SEED
from llamactor.runtime.engine.blackbox import ENV as BLACKBOX_ENV
from llamactor.runtime.engine.blackbox import Blackbox
from llamactor.runtime.engine.model import LoadOptions, Model
from llamactor.runtime.service import live
from llamactor.runtime.service.admission import Admission
from llamactor.runtime.service.chat import ChatTemplate
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.core import RuntimeCore, RuntimeState, chat_template_source
from llamactor.runtime.service.embeddings import EmbeddingService
from llamactor.runtime.service.handles import RequestHandle
from llamactor.runtime.service.lora import LoraAdapters

log = structlog.get_logger("llamactor.isolated")

READY_TIMEOUT_S = 600.0  # loading a large model over ggml-rpc takes a while
CALL_TIMEOUT_S = 60.0
BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)  # before restart k (the first one at once)
SILENCE_S = 10.0  # no frame at all for this long (heartbeats come every second): the engine is stuck
LIVE_REFRESH_S = 0.25
KILL_GRACE_S = 0.5  # an engine whose socket closed gets this long to exit by itself
RPC_PROBE_S = 0.5  # how often a missing ggml-rpc worker is probed
RPC_LOG_EVERY_S = 5.0


class EngineState(enum.Enum):
    STARTING = "starting"
    UP = "up"
    RESTARTING = "restarting"
    DOWN = "down"  # past the restart limit


@dataclass
class Entry:
    """One request in flight, as the journal keeps it."""

    task: Task  # with this process's stream
    delivered: list[list[int]]  # per choice: token ids sent to the client
    done: set[int] = field(default_factory=set)  # choices whose Done was sent
    resumes: int = 0
    deaths: int = 0  # engine processes that died while this request was in them
    sent: bool = False  # submitted to the current engine process
    lost_at: float = 0.0  # perf_counter() when its engine died: its next token ends the pause


@dataclass
class EngineCounters:
    restarts: int = 0
    resumed: int = 0  # requests submitted again after a restart
    watchdog_kills: int = 0
    last_exit: str = ""
    resume_ms: list[float] = field(default_factory=list)  # per resumed request: resubmit to next token


def wire(task: Task, delivered: list[list[int]], resumes: int, fast: bool = False) -> link.WireTask:
    """The task as the engine gets it; a resumed one replays what was delivered (``fast``, one
    choice only: as part of its prompt)."""
    params = task.params
    fast = fast and resumes > 0 and task.n == 1
    prompt = np.concatenate([task.prompt, np.asarray(delivered[0], dtype=np.int32)]) if fast else task.prompt
    if resumes and params.seed != DEFAULT_SEED and not params.greedy:
        # seeded sampling goes on with a seed of its own: the replay does not advance the RNG
        params = msgspec.structs.replace(params, seed=(params.seed * 1_000_003 + sum(map(len, delivered))) % 2**32)
    fields = {name: getattr(task, name) for name in REQUEST_FIELDS}
    fields.update(params=params, return_progress=task.return_progress and not resumes,
                  replay=tuple(tuple(d) for d in delivered) if resumes else (), replay_in_prompt=fast)
    return link.WireTask(id=task.id, prompt=prompt.tobytes(), **fields)


def error_class(kind: str) -> type[LlamactorError]:
    """The llamactor error class an engine reply names (so HTTP answers with its status)."""
    cls = getattr(errors, kind, None)
    return cls if isinstance(cls, type) and issubclass(cls, LlamactorError) else EngineError


def exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    from llamactor.runtime.service.engineproc import WATCHDOG_EXIT

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


class EngineProcess:
    """Starts the engine process, talks to it, restarts it when it dies."""

    def __init__(self, core: IsolatedCore) -> None:
        self.core = core
        self.config = core.config
        self.state = EngineState.STARTING
        self.counters = EngineCounters()
        self.process: Process | None = None
        self.stream: SocketStream | None = None
        self._calls: dict[int, tuple[anyio.Event, list[Any]]] = {}
        self._embeds: dict[int, tuple[anyio.Event, list[Any]]] = {}
        self.embedder: link.EmbedderInfo | None = None  # from the engine's Ready
        self._call_ids = 0
        self.folder = tempfile.mkdtemp(prefix="llamactor-engine-")
        self.blackbox = Blackbox(os.path.join(self.folder, "blackbox"), create=True)  # engine.blackbox
        self._config_path = os.path.join(self.folder, "config.pickle")
        with open(self._config_path, "wb") as f:
            pickle.dump(replace(self.config, isolate=False), f)
        self._closing = False
        self._send_lock = anyio.Lock()
        self._local = False  # --rpc-fallback local took effect
        self._failures: list[float] = []
        self.steps_seen = 0

    # ---- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep an engine process serving until ``close``. The first start's failure is the
        runtime's (a config the engine cannot load will not load on retry either)."""
        first = True
        while not self._closing:
            try:
                await self._serve_once(task_status if first else None)
            except Exception as exc:  # noqa: BLE001 - a restart that fails counts as a death
                if first:
                    raise
                log.error("engine_start_failed", error=f"{type(exc).__name__}: {exc}")
            first = False
            if self._closing:
                return
            now = time.monotonic()
            self._failures = [t for t in self._failures if now - t < self.config.restart_window_s] + [now]
            if len(self._failures) > self.config.engine_max_restarts:
                self.state = EngineState.DOWN
                log.error("engine_down", restarts=len(self._failures) - 1, window_s=self.config.restart_window_s)
                self.core.fail_journal(f"the engine process died {len(self._failures)} times within "
                                       f"{self.config.restart_window_s:g} s; it is not restarted again "
                                       f"(last: {self.counters.last_exit})")
                return
            self.state = EngineState.RESTARTING
            self.counters.restarts += 1
            delay = BACKOFF_S[min(len(self._failures) - 1, len(BACKOFF_S) - 1)]
            log.warning("engine_restarting", attempt=self.counters.restarts, delay_s=delay,
                        in_flight=len(self.core.journal))
            await anyio.sleep(delay)
            if self.config.rpc_servers and not self._local:
                await self._wait_for_workers()

    async def _wait_for_workers(self) -> None:
        """ggml-rpc (issue 14): a worker that went away takes the engine with it, and a new
        engine cannot load the model until it is back. Probe every worker until all answer,
        saying what we wait for; with ``--rpc-fallback local``, give up after ``--rpc-wait-s``
        and load the whole model in the engine process instead."""
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
                log.warning("rpc_fallback_local", missing=missing, waited_s=round(waited, 1),
                            action="the engine loads the whole model locally")
                self._local = True
                with open(self._config_path, "wb") as f:
                    pickle.dump(replace(self.config, isolate=False, rpc_servers=(), devices=(), tensor_split=()), f)
                return
            if waited - said >= RPC_LOG_EVERY_S or not said:
                log.warning("waiting_for_rpc_workers", missing=missing, waited_s=round(waited, 1))
                said = max(waited, 1e-9)
            await anyio.sleep(RPC_PROBE_S)

    async def _serve_once(self, task_status: TaskStatus[None] | None) -> None:
        sock = os.path.join(self.folder, f"engine-{self.counters.restarts}.sock")
        async with await anyio.create_unix_listener(sock) as listener:
            process = self.process = await anyio.open_process(
                [sys.executable, "-m", "llamactor.runtime.service.engineproc", sock, self._config_path],
                stdin=None, stdout=None, stderr=None, env={**os.environ, BLACKBOX_ENV: str(self.blackbox.path)},
                start_new_session=True,  # signals to the terminal's or service's group go to the API only
            )
            try:
                with anyio.fail_after(READY_TIMEOUT_S):
                    async with anyio.create_task_group() as tg:
                        accepted: list[SocketStream] = []

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
                        hello = link.decode_from_engine(await self._receive(reader))
                    except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                        await stream.aclose()
                        raise await self._not_ready(process) from None
                    assert isinstance(hello, link.Ready)
            except BaseException:
                await self._kill(process)
                raise
            self.stream = stream
            self.embedder = hello.embedder
            self.state = EngineState.UP
            log.info("engine_ready", pid=hello.pid, restarts=self.counters.restarts)
            if task_status is not None:
                task_status.started()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self.core.resubmit)  # while the engine's frames are read
                    await self._pump(reader, process)
                    tg.cancel_scope.cancel()
            finally:
                self.stream = None
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                if self._closing:  # it saw its socket close: let it stop its runtime cleanly
                    with anyio.move_on_after(10, shield=True):
                        await process.wait()
                else:
                    self.state = EngineState.RESTARTING
                await self._kill(process)
                self._fail_calls()
                self.core.engine_lost(None if self._closing else self.blackbox.suspects())
                self.blackbox.clear()
                if not self._closing:
                    self._died(process.returncode, hello.pid)

    def _died(self, code: int | None, pid: int) -> None:
        from llamactor.runtime.service.engineproc import WATCHDOG_EXIT

        self.counters.last_exit = exit_reason(code)
        if code == WATCHDOG_EXIT:
            self.counters.watchdog_kills += 1
        log.error("engine_died", pid=pid, reason=self.counters.last_exit, in_flight=len(self.core.journal))

    async def _not_ready(self, process: Process) -> LlamactorError:
        """The engine ended (or is ending) before it said it was ready: why, as an error."""
        with anyio.move_on_after(10):
            await process.wait()
        code = process.returncode
        self.counters.last_exit = exit_reason(code)
        cls = ConfigError if code == 2 else EngineError
        return cls(f"the engine process ended before it was ready ({self.counters.last_exit}); see its log above")

    async def _pump(self, reader: BufferedByteReceiveStream, process: Process) -> None:
        """Frames from the engine until it goes away (EOF) or falls silent past SILENCE_S."""
        while True:
            try:
                with anyio.fail_after(SILENCE_S):
                    body = await self._receive(reader)
            except TimeoutError:
                log.error("engine_silent", seconds=SILENCE_S, action="killed")
                self.counters.watchdog_kills += 1
                return
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            msg = link.decode_from_engine(body)
            if isinstance(msg, link.Events):
                self.core.on_events(msg)
            elif isinstance(msg, link.Reply):
                waiter = self._calls.pop(msg.call_id, None)
                if waiter is not None:
                    waiter[1].append(msg)
                    waiter[0].set()
            elif isinstance(msg, link.EmbedDone):
                waiter = self._embeds.pop(msg.job_id, None)
                if waiter is not None:
                    waiter[1].append(msg)
                    waiter[0].set()
            elif isinstance(msg, link.Beat):
                self.steps_seen = msg.steps

    @staticmethod
    async def _receive(reader: BufferedByteReceiveStream) -> bytes:
        header = await reader.receive_exactly(link.HEADER.size)
        return await reader.receive_exactly(link.HEADER.unpack(header)[0])

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

    async def close(self) -> None:
        self._closing = True
        process, stream = self.process, self.stream
        if stream is not None:
            await stream.aclose()  # the engine's reader ends: it stops its runtime and exits
        if process is not None:
            with anyio.move_on_after(10):
                await process.wait()
            await self._kill(process)
        self.core.fail_journal("the runtime is shutting down")  # their engine is gone: none waits

    # ---- talking to it ---------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self.state is EngineState.UP and self.stream is not None

    async def send(self, msg: link.ToEngine) -> bool:
        """Send one message; False when there is no engine to send it to (it is restarting)."""
        stream = self.stream
        if stream is None:
            return False
        try:
            async with self._send_lock:  # one frame at a time: concurrent sends would interleave
                await stream.send(link.frame(msg))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True

    async def call(self, method: str, *args: Any) -> Any:
        if not self.up:
            raise Unavailable(f"the engine is {self.state.value}")
        self._call_ids += 1
        cid = self._call_ids
        done = anyio.Event()
        out: list[Any] = []
        self._calls[cid] = (done, out)
        if not await self.send(link.Call(cid, method, tuple(args))):
            self._calls.pop(cid, None)
            raise Unavailable(f"the engine is {self.state.value}")
        with anyio.fail_after(CALL_TIMEOUT_S):
            await done.wait()
        if not out:
            raise Unavailable("the engine process died during the call")
        reply: link.Reply = out[0]
        if reply.error:
            raise error_class(reply.kind)(reply.error)
        return reply.value

    async def embed(self, msg: link.Embed) -> link.EmbedDone:
        """Send an ``Embed`` and wait for its answer (Unavailable when the engine dies meanwhile)."""
        done = anyio.Event()
        out: list[Any] = []
        self._embeds[msg.job_id] = (done, out)
        if not await self.send(msg):
            self._embeds.pop(msg.job_id, None)
            raise Unavailable(f"the engine is {self.state.value}")
        await done.wait()
        if not out:
            raise Unavailable("the engine process died while embedding; retry")
        return out[0]

    def _fail_calls(self) -> None:
        calls, self._calls = self._calls, {}
        embeds, self._embeds = self._embeds, {}
        for done, _ in [*calls.values(), *embeds.values()]:
            done.set()


class RemoteEmbedder:
    """The engine process's embedding actor, as ``EmbeddingService`` uses it (``try_tell`` a
    job, the answer on the job's stream). Embeddings are not journaled: one whose engine dies
    fails with a 503, and the client retries (they are cheap and have no stream to resume)."""

    def __init__(self, engine: EngineProcess, info: link.EmbedderInfo, tg: Any) -> None:
        self.engine = engine
        self.pooling = info.pooling
        self.n_embd = info.n_embd
        self.max_input_tokens = info.max_input_tokens
        self._tg = tg

    def try_tell(self, job: EmbedJob) -> None:
        if not self.engine.up:
            raise Unavailable(f"the engine is {self.engine.state.value}")
        self._tg.start_soon(self._run, job)

    async def _run(self, job: EmbedJob) -> None:
        sink = job.sink
        try:
            done = await self.engine.embed(link.Embed(job.id, tuple(np.asarray(t, dtype=np.int32).tobytes()
                                                                    for t in job.inputs), job.normalize))
            if done.error:
                raise error_class(done.kind)(done.error)
            vectors = tuple(np.frombuffer(b, dtype=np.float32).reshape(shape) for b, shape in done.vectors)
            event: Any = Embedded(vectors, done.n_tokens, done.pooling)
        except LlamactorError as exc:
            event = Failed(str(exc), exc.kind)
        try:
            sink.send_nowait(event)
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        sink.close()


class IsolatedCore(RuntimeCore):
    """``RuntimeCore`` with its engine in a child process (``Runtime.open(..., isolate=True)``)."""

    def __init__(self, config: RuntimeConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.journal: dict[int, Entry] = {}
        self.engine: EngineProcess | None = None
        self._cache: dict[str, Any] = {}  # engine answers that sync methods return (``_refresh``)
        self._wanted: dict[str, float] = {}
        self._tg: Any = None

    async def _start(self) -> None:
        cfg = self.config = self.config.validated()
        self._stack = AsyncExitStack()
        assert cfg.model is not None
        model = await anyio.to_thread.run_sync(Model, cfg.model, LoadOptions(vocab_only=True))
        self.model = model
        self._stack.callback(model.close)
        self.adapters = LoraAdapters(cfg.lora, init_without_apply=cfg.lora_init_without_apply)
        self.admission = Admission(model, cfg, self.tokenize, self.adapters)
        await self.admission.check_defaults()
        self.chat_template = ChatTemplate(
            chat_template_source(cfg, model), bos_token=model.token_text(model.bos), eos_token=model.token_text(model.eos)
        )
        engine = self.engine = EngineProcess(self)
        self._stack.callback(shutil.rmtree, engine.folder, True)
        tg = self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.callback(tg.cancel_scope.cancel)
        self._stack.push_async_callback(engine.close)  # first on the way out: the engine stops cleanly
        await tg.start(engine.run)
        remote = RemoteEmbedder(engine, engine.embedder, tg) if engine.embedder is not None else None
        self.embeddings = EmbeddingService(model, remote, normalize=cfg.embd_normalize)  # type: ignore[arg-type]
        tg.start_soon(self._refresh)
        self.started_at = time.time()

    # ---- state -----------------------------------------------------------------------------

    def health(self) -> str:
        state = super().health() if self.state is not RuntimeState.READY or self.draining else "ok"
        if state != "ok":
            return state
        assert self.engine is not None
        if self.engine.state is EngineState.DOWN:
            return "unhealthy"
        return "ok" if self.engine.up else "restarting"

    def in_flight(self) -> int:
        return len(self.journal)

    def engine_status(self) -> dict[str, Any]:
        assert self.engine is not None
        e = self.engine
        process = e.process
        return {"isolated": True, "state": e.state.value, "pid": process.pid if process is not None else None,
                "restarts": e.counters.restarts, "requests_resumed": e.counters.resumed,
                "watchdog_kills": e.counters.watchdog_kills, "last_exit": e.counters.last_exit,
                "requests_in_flight": len(self.journal)}

    # ---- requests --------------------------------------------------------------------------

    async def submit(self, prompt: str | Sequence[int], **kwargs: Any) -> RequestHandle:
        self._require_admitting()
        assert self.admission is not None and self.engine is not None
        self._check_admission()
        task, recv = await self.admission.admit(
            prompt, max_tokens=kwargs.pop("max_tokens", -1), n=kwargs.pop("n", 1), stop=kwargs.pop("stop", None),
            id_slot=kwargs.pop("id_slot", -1), cache_prompt=kwargs.pop("cache_prompt", None),
            ignore_eos=kwargs.pop("ignore_eos", None), add_special=kwargs.pop("add_special", True),
            params=kwargs.pop("params", None), n_keep=kwargs.pop("n_keep", None), n_discard=kwargs.pop("n_discard", 0),
            return_progress=kwargs.pop("return_progress", False), lora=kwargs.pop("lora", None), sampling=kwargs,
        )
        if task.n_predict == 0:
            task.sink.close()
            return RequestHandle(task, recv, self._cancel)
        try:  # again: the engine may have gone down, or others filled the queue, during admission
            self._check_admission()
        except LlamactorError:
            task.sink.close()
            recv.close()
            raise
        entry = Entry(task, [[] for _ in range(task.n)])
        self.journal[task.id] = entry
        handle = RequestHandle(task, recv, self._cancel)
        if self.engine.up:
            entry.sent = True  # claimed before the await: a resubmit running meanwhile skips it
            try:
                entry.sent = await self.engine.send(link.Submit(wire(task, entry.delivered, 0)))
            except BaseException:
                handle.close()  # cancelled meanwhile: nothing is left behind in the journal
                raise
        return handle

    def _check_admission(self) -> None:
        assert self.engine is not None
        if self.engine.state is EngineState.DOWN:
            raise Unavailable(f"the engine process is down ({self.engine.counters.last_exit})")
        waiting = sum(1 for e in self.journal.values() if not e.sent)
        if not self.engine.up and waiting >= self.config.queue_size:
            raise Overloaded(f"the engine is restarting and {waiting} requests wait for it")

    def _cancel(self, task_id: int) -> None:
        entry = self.journal.pop(task_id, None)
        if entry is None:
            return
        entry.task.sink.close()  # no event goes to a stream the client left (nor leaks unclosed)
        if not entry.sent or self.engine is None or self._tg is None:
            return
        if self.state is RuntimeState.READY and self.engine.up:
            try:
                self._tg.start_soon(self.engine.send, link.Cancel(task_id))
            except RuntimeError:
                pass  # the runtime is closing: its engine goes with it

    def on_events(self, msg: link.Events) -> None:
        """One engine step's events: journal them, then pass them on to each request's stream."""
        journal = self.journal
        for task_id, event in msg.events:
            entry = journal.get(task_id)
            if entry is None:
                continue  # cancelled meanwhile
            if isinstance(event, Token):
                if event.index in entry.done:
                    continue  # a resumed choice that had finished (n > 1) sends nothing more
                entry.delivered[event.index].append(event.token)
                if entry.lost_at:
                    self._resumed(entry)
            elif isinstance(event, Done):
                if event.index in entry.done:
                    continue  # a resumed choice that had finished ends again: sent once already
                entry.done.add(event.index)
                if entry.resumes and event.n_prompt != len(entry.task.prompt):  # --resume fast
                    event = msgspec.structs.replace(event, n_prompt=len(entry.task.prompt))
            elif isinstance(event, Progress) and entry.resumes:
                continue
            try:
                entry.task.sink.send_nowait(event)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._cancel(task_id)  # the client left
                entry.task.sink.close()
        for task_id in msg.ended:
            entry = journal.pop(task_id, None)
            if entry is not None:
                entry.task.sink.close()

    def _resumed(self, entry: Entry) -> None:
        """A resumed request's first new token: how long its stream paused (restart, prompt, replay)."""
        pause_ms = (time.perf_counter() - entry.lost_at) * 1e3
        entry.lost_at = 0.0
        assert self.engine is not None
        self.engine.counters.resume_ms.append(pause_ms)
        log.info("request_resumed", task=entry.task.id, mode=self.config.resume, resumes=entry.resumes,
                 replayed=sum(map(len, entry.delivered)), pause_ms=round(pause_ms, 1))

    def engine_lost(self, suspects: set[int] | None = None) -> None:
        """The engine died: what was sent to it is unsent now; it goes again after the restart.
        The death counts toward ``--resume-max`` for ``suspects`` (what it died inside, from the
        blackbox), or for every request it held when it cannot tell."""
        now = time.perf_counter()
        for task_id, entry in self.journal.items():
            entry.deaths += entry.sent and (suspects is None or task_id in suspects)
            entry.sent = False
            if any(entry.delivered) and not entry.lost_at:
                entry.lost_at = now  # its stream pauses from here until its next token

    async def resubmit(self) -> None:
        """After a (re)start: send every journaled request, resuming those that were running."""
        assert self.engine is not None
        for task_id, entry in list(self.journal.items()):
            if entry.sent or task_id not in self.journal:
                continue
            started = any(entry.delivered) or entry.done
            # Counted whether or not it had started: a request that aborts the engine before its
            # first token would otherwise go back in after every restart until the restart budget
            # is spent and the engine stays down for everyone.
            if entry.deaths > self.config.resume_max:
                self._end(task_id, Failed(f"the engine process died {entry.deaths} times while serving "
                                          f"this request; it is not resumed again", "server_error"))
                continue
            resumes = entry.resumes + 1 if started else entry.resumes
            entry.sent = True  # claimed before the await (see submit)
            entry.sent = await self.engine.send(link.Submit(wire(entry.task, entry.delivered, resumes,
                                                                 self.config.resume == "fast")))
            if not entry.sent:
                return  # it died again: the next start sends the rest
            if started:
                entry.resumes = resumes
                self.engine.counters.resumed += 1

    def fail_journal(self, message: str) -> None:
        for task_id in list(self.journal):
            self._end(task_id, Failed(message, "unavailable_error"))

    def _end(self, task_id: int, event: Failed) -> None:
        entry = self.journal.pop(task_id, None)
        if entry is None:
            return
        try:
            entry.task.sink.send_nowait(event)
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        entry.task.sink.close()

    # ---- what the engine knows -------------------------------------------------------------

    def slots(self) -> list[dict[str, Any]]:
        """The slot rows as last read from the engine (at most ``LIVE_REFRESH_S`` old while they
        are asked for; the first call may see none): ``await rt.fetch_slots()`` reads them now."""
        self._require_ready()
        return list(self._cached("slots") or [])

    async def fetch_slots(self) -> list[dict[str, Any]]:
        self._require_ready()
        assert self.engine is not None
        return await self.engine.call("slots")

    async def slot_action(self, slot: int, action: str, path: str = "") -> dict[str, Any]:
        self._require_ready()
        assert self.engine is not None
        return await self.engine.call("slot_action", slot, action, path)

    async def fetch_metrics(self) -> bytes:
        assert self.engine is not None
        body = b""
        if self.engine.up:
            try:
                body = await self.engine.call("metrics_text")
            except LlamactorError:
                body = b""
        return body + self.engine_metrics()

    def metrics_text(self) -> bytes:
        """The engine's metrics as last read (see ``slots``) and this process's; ``await
        rt.fetch_metrics()`` reads the engine's now (the HTTP app does)."""
        return (self._cached("metrics_text") or b"") + self.engine_metrics()

    def engine_metrics(self) -> bytes:
        assert self.engine is not None
        c = self.engine.counters
        lines = [
            ("llamactor:engine_restarts_total", "counter", "Restarts of the engine process", c.restarts),
            ("llamactor:requests_resumed_total", "counter", "Requests resumed after an engine restart", c.resumed),
            ("llamactor:watchdog_kills_total", "counter", "Engine processes ended by the watchdog", c.watchdog_kills),
            ("llamactor:engine_up", "gauge", "1 while the engine process serves", int(self.engine.up)),
            ("llamactor:requests_journaled", "gauge", "Requests in flight, kept by the API process",
             len(self.journal)),
        ]
        out = []
        for name, kind, doc, value in lines:
            base = name.removesuffix("_total")
            out.append(f"# HELP {base} {doc}\n# TYPE {base} {kind}\n{name} {float(value)}\n")
        return "".join(out).encode()

    def live_snapshot(self) -> LiveSnapshot:
        snap = self._cached("live_snapshot")
        if snap is None or self.engine is None or not self.engine.up:
            return live.idle_snapshot(self.config, self.health())
        return snap

    def _cached(self, method: str) -> Any:
        """The last answer of an engine call that sync callers read; asking keeps it fresh."""
        self._wanted[method] = time.monotonic()
        return self._cache.get(method)

    async def _refresh(self) -> None:
        """Re-read, every ``LIVE_REFRESH_S``, the engine answers sync callers asked for in the
        last 5 s (the live view's snapshot, slots, metrics)."""
        while True:
            await anyio.sleep(LIVE_REFRESH_S)
            if self.engine is None or not self.engine.up:
                self._cache.clear()
                continue
            now = time.monotonic()
            for method, asked in list(self._wanted.items()):
                if now - asked > 5.0:
                    continue
                try:
                    value = await self.engine.call(method)
                    self._cache[method] = msgspec.convert(value, LiveSnapshot) if method == "live_snapshot" else value
                except (LlamactorError, msgspec.ValidationError, TimeoutError):
                    self._cache.pop(method, None)
