"""``ModelSet``: many models in one server (llama-server's router mode), each a runtime of its own.

    HTTP (runtime.http.router) ── use(name) ──► ModelSet ──► a RuntimeCore per loaded model
                                                              (its vocabulary and admission here,
                                                               its engine in a child process)

Every model is known from the start (a ``ModelSpec``: its name, its config, where it came from)
and loaded when a request first wants it (``autoload``) or when asked (``load``). Loading opens
its runtime in a task of the set's own, which holds it open until the model is unloaded: asked
(``unload``), given up for another model past ``models_max``, or at shutdown. A request holds a
``ModelLease`` while it uses a model's runtime, so a model serving a request is never unloaded
under it; an unload waits up to the model's ``stop_timeout_s`` for the leases to end.

Waiting for a model is llama-server's ``server_lru_sched``: a request for a model that is not
loaded joins that model's place in one queue (the requests for one model share it, so one load
serves them all); the model at the head loads when a slot is free, and while the queued models
outnumber the slots free or being freed, idle models are unloaded, least recently used first
(``evictions``: a pure function of a snapshot). A model whose load fails fails the requests that
waited for that load with the loader's message and is listed as failed; the next request for it
tries again.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from typing import Self

import anyio
import structlog
from anyio.abc import TaskGroup

from llamactor.protocol.errors import (
    Closed,
    ConfigError,
    LlamactorError,
    ModelLoadFailed,
    NotFound,
    RequestError,
    Unavailable,
)
from llamactor.runtime.service import modelmetrics
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.core import RuntimeCore

log = structlog.get_logger("llamactor.models")

DEFAULT_MODELS_MAX = 4  # llama-server's --models-max default
DEFAULT_STOP_TIMEOUT_S = 10.0  # llama-server's stop-timeout default
DRAIN_POLL_S = 0.05  # how often a drain looks whether the last request has finished

OpenRuntime = Callable[[RuntimeConfig], AbstractAsyncContextManager[RuntimeCore]]


class ModelStatus(enum.Enum):
    """A model's lifecycle, with llama-server's names (``GET /models``' ``status.value``)."""

    UNLOADED = "unloaded"  # not running: never loaded, unloaded, or its last load failed (``failure``)
    LOADING = "loading"  # its runtime is opening: vocabulary, chat template, engine process
    LOADED = "loaded"  # serving
    SLEEPING = "sleeping"  # loaded, its engine process stopped after --sleep-idle-seconds without a request


@dataclass(frozen=True)
class ModelSpec:
    """One model the server may load: what the models folder and the preset file say of it."""

    name: str
    config: RuntimeConfig  # its runtime's: the model file, the preset's flags under the command line's
    source: str = "preset"  # "models_dir" | "preset", as llama-server reports it
    aliases: tuple[str, ...] = ()  # further names that route to it
    tags: tuple[str, ...] = ()  # listed, used for nothing
    args: tuple[str, ...] = ()  # the command line its flags amount to (GET /models' status.args)
    preset: str = ""  # its flags as an INI section (GET /models' status.preset)
    load_on_startup: bool = False
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S  # an unload waits this long for its requests


@dataclass(frozen=True)
class ModelView:
    """A model as it is now: what ``GET /models`` lists and what ``evictions`` decides from."""

    spec: ModelSpec
    status: ModelStatus
    in_use: int = 0  # leases held: requests using it now
    last_used: float = 0.0  # time.monotonic() of the last lease taken or released
    stopping: bool = False  # asked to unload, not gone yet (it takes no new request)
    failure: str = ""  # why its last load failed ("" when it did not)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def running(self) -> bool:
        """Holding (or taking) one of the ``models_max`` slots."""
        return self.status is not ModelStatus.UNLOADED


def evictions(models: Sequence[ModelView], wanted: Sequence[str], models_max: int) -> list[str]:
    """The idle models to unload so that the models waiting to load get slots: while the waiting
    models outnumber the slots free or being freed, the least recently used model that serves no
    request, is not stopping already and is not waited for itself (llama-server's
    ``server_lru_sched::tick``). Empty when nothing waits or there is no limit (``models_max`` <= 0)."""
    if models_max <= 0 or not wanted:
        return []
    by_name = {m.name: m for m in models}
    running = [m for m in models if m.running]
    free = models_max - len(running) + sum(m.stopping for m in running)
    needed = sum(1 for name in wanted if not by_name[name].running or by_name[name].stopping)
    waited = set(wanted)
    idle = sorted(
        (
            m
            for m in running
            if m.status in (ModelStatus.LOADED, ModelStatus.SLEEPING)
            and not m.in_use
            and not m.stopping
            and m.name not in waited
        ),
        key=lambda m: m.last_used,
    )
    out: list[str] = []
    for m in idle:
        if free >= needed:
            break
        out.append(m.name)
        free += 1
    return out


@dataclass(eq=False)
class _Model:
    """A model's mutable state; only the set touches it, on the event loop."""

    spec: ModelSpec
    status: ModelStatus = ModelStatus.UNLOADED  # UNLOADED, LOADING or LOADED (SLEEPING is read off the engine)
    runtime: RuntimeCore | None = None  # while LOADED
    in_use: int = 0
    last_used: float = 0.0
    failure: str = ""
    stop: anyio.Event | None = None  # while running: set to unload it
    stop_reason: str = ""
    scope: anyio.CancelScope | None = None  # its host task's: cancelled to stop a load
    loads: int = 0
    load_failures: int = 0
    unloads: int = 0

    @property
    def stopping(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def view(self) -> ModelView:
        status = self.status
        if self.runtime is not None and self.runtime.engine_status().state == "sleeping":
            status = ModelStatus.SLEEPING
        return ModelView(
            spec=self.spec,
            status=status,
            in_use=self.in_use,
            last_used=self.last_used,
            stopping=self.stopping,
            failure=self.failure,
        )


class ModelLease:
    """One request's use of a loaded model: its runtime stays loaded until ``release()``."""

    def __init__(self, models: ModelSet, model: _Model) -> None:
        assert model.runtime is not None
        self.name = model.spec.name
        self.runtime: RuntimeCore = model.runtime
        self._models = models
        self._model: _Model | None = model

    def release(self) -> None:
        """Done with the model (idempotent): it may be unloaded from now on."""
        model, self._model = self._model, None
        if model is not None:
            self._models._release(model)


class ModelSet:
    """The router mode's models; open it with ``async with ModelSet(specs, ...)``."""

    def __init__(
        self,
        specs: Sequence[ModelSpec],
        *,
        models_max: int = DEFAULT_MODELS_MAX,
        autoload: bool = True,
        open_runtime: OpenRuntime = RuntimeCore,
    ) -> None:
        self.models_max = models_max
        self.autoload = autoload
        self._open_runtime = open_runtime
        self._models: dict[str, _Model] = {}
        self._names: dict[str, _Model] = {}  # every name and alias
        for spec in specs:
            model = _Model(spec)
            for name in (spec.name, *spec.aliases):
                if name in self._names:
                    raise ConfigError(f"model name {name!r} is given twice (a model's name or alias)")
                self._names[name] = model
            self._models[spec.name] = model
        startup = [s.name for s in specs if s.load_on_startup]
        if models_max > 0 and len(startup) > models_max:
            raise ConfigError(
                f"{len(startup)} models are to load on startup ({', '.join(startup)}), "
                f"more than --models-max {models_max}"
            )
        self._wanted: dict[str, int] = {}  # the queue: model -> requests waiting for it to load, in arrival order
        self._change: anyio.Event | None = None  # made when opened: an event needs the running loop
        self._tg: TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self.draining = False
        self._closing = False
        self.started_at = 0.0

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("this model set is open already")
        stack = self._stack = AsyncExitStack()
        self._change = anyio.Event()
        self._tg = await stack.enter_async_context(anyio.create_task_group())
        self.started_at = time.time()
        log.info(
            "models_available",
            models=[m.spec.name for m in self._models.values()],
            models_max=self.models_max,
            autoload=self.autoload,
        )
        for model in self._models.values():
            if model.spec.load_on_startup:
                self._load_now_or_queue(model, "startup")
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Unload every model (each after its requests, up to its stop timeout) and close."""
        self._closing = True  # from here no load starts and no request gets a model
        stack, tg = self._stack, self._tg
        for model in self._models.values():
            self._stop(model, "shutdown")
        self._changed()
        try:
            with anyio.CancelScope(shield=True):
                while self._running():
                    await self._wait_change()
        finally:
            self._stack, self._tg = None, None
            self._changed()  # the requests still waiting see the set closed
            if tg is not None:
                tg.cancel_scope.cancel()  # the loads still queued have nothing left to wait for
            if stack is not None:
                await stack.aclose()
            self._closing = False

    # ---- what the HTTP layer asks ------------------------------------------------------------

    def views(self) -> list[ModelView]:
        """Every model as it is now, sorted by name (``GET /models``)."""
        return [self._models[name].view() for name in sorted(self._models)]

    def health(self) -> str:
        """ "ok", "draining" or "closed" (the router answers /health itself, as llama-server's)."""
        if self._tg is None or self._closing:
            return "closed"
        return "draining" if self.draining else "ok"

    async def use(self, name: str, *, autoload: bool | None = None) -> ModelLease:
        """The model ``name`` (or an alias) loaded, for one request, loading it first when it is
        not and ``autoload`` (default: the set's) allows; waits while it loads or waits for a
        slot. Hold the lease while the request uses its runtime, then ``release()`` it.

        Raises RequestError for an unknown model ("model 'x' not found") or one not loaded with
        autoload off (both 400, as llama-server), ModelLoadFailed with the loader's message when
        the load it waited for failed, Unavailable while draining, Closed after shutdown.
        """
        return await self._use(self._find(name, RequestError(f"model '{name}' not found")), autoload, "request")

    def load(self, name: str) -> None:
        """Start loading ``name`` (``POST /models/load``): at once when a slot is free and no
        model waits before it, else once its turn comes (an idle model is unloaded for it, as
        for a request). Returns without waiting: ``views()`` says how the load goes."""
        self._require_open()
        model = self._find(name, NotFound("model is not found"))
        if model.status is not ModelStatus.UNLOADED:
            raise RequestError("model is already running")
        self._load_now_or_queue(model, "load")

    def unload(self, name: str) -> None:
        """Unload ``name`` (``POST /models/unload``): a loading model stops at once, a loaded one
        after its requests end (up to its ``stop_timeout_s``). Returns without waiting."""
        self._require_open()
        model = self._find(name, RequestError("model is not found"))
        if model.status is ModelStatus.UNLOADED:
            raise RequestError("model is not running")
        self._stop(model, "unload")
        self._changed()

    def in_flight(self) -> int:
        """Requests using a model now."""
        return sum(m.in_use for m in self._models.values())

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting (requests get 503) and wait up to ``timeout_s`` for the requests using a
        model to end. True when they all did."""
        self.draining = True
        self._changed()  # the requests waiting for a model get their 503 now
        log.info("draining", in_flight=self.in_flight(), timeout_s=timeout_s)
        with anyio.move_on_after(timeout_s):
            while self.in_flight():
                with anyio.move_on_after(DRAIN_POLL_S):
                    await self._wait_change()
        left = self.in_flight()
        log.info("drained" if not left else "drain_timeout", in_flight=left)
        return not left

    async def metrics_text(self) -> bytes:
        """Every loaded model's Prometheus text, each series labelled ``model``, and the set's own
        series per model (loaded, sleeping, loads, failed loads, unloads). A sleeping model is not
        woken: its engine's series are those it had when it went to sleep."""
        texts: list[tuple[str, bytes]] = []
        for model in list(self._models.values()):
            runtime = model.runtime
            if runtime is None or model.stopping:
                continue
            try:
                texts.append((model.spec.name, await runtime.metrics_text()))
            except LlamactorError:
                continue  # unloaded or failing while read: its series are missing from this scrape
        views = {m.spec.name: (m, m.view()) for m in self._models.values()}
        own = [
            modelmetrics.gauge(
                "llamactor:model_loaded",
                "1 while the model is loaded (sleeping or not)",
                {name: float(v.status in (ModelStatus.LOADED, ModelStatus.SLEEPING)) for name, (_, v) in views.items()},
            ),
            modelmetrics.gauge(
                "llamactor:model_sleeping",
                "1 while the model's engine sleeps (--sleep-idle-seconds)",
                {name: float(v.status is ModelStatus.SLEEPING) for name, (_, v) in views.items()},
            ),
            modelmetrics.counter(
                "llamactor:model_loads", "Loads of the model", {n: float(m.loads) for n, (m, _) in views.items()}
            ),
            modelmetrics.counter(
                "llamactor:model_load_failures",
                "Loads of the model that failed",
                {n: float(m.load_failures) for n, (m, _) in views.items()},
            ),
            modelmetrics.counter(
                "llamactor:model_unloads",
                "Unloads of the model (asked, for another model, sleeping excluded)",
                {n: float(m.unloads) for n, (m, _) in views.items()},
            ),
        ]
        return modelmetrics.labelled(texts, own)

    # ---- waiting for a model --------------------------------------------------------------

    async def _use(self, model: _Model, autoload: bool | None, reason: str) -> ModelLease:
        self._require_admitting()
        autoload = self.autoload if autoload is None else autoload
        if not autoload and (model.status is ModelStatus.UNLOADED or model.stopping):
            raise RequestError("model is not loaded")
        saw_load = False  # a load this request waited for (its failure is this request's)
        queued = False
        try:
            while True:
                self._require_admitting()
                if model.status is ModelStatus.LOADED and not model.stopping:
                    return self._lease(model)
                if model.status is ModelStatus.LOADING:
                    saw_load = True
                elif model.status is ModelStatus.UNLOADED:
                    if saw_load and model.failure:
                        raise ModelLoadFailed(f"model '{model.spec.name}' failed to load: {model.failure}")
                    if not autoload:
                        raise RequestError("model is not loaded")  # unloaded while it waited
                if not queued and (model.status is ModelStatus.UNLOADED or model.stopping):
                    self._join(model)  # a stopping model takes no new request: its next load serves it
                    queued = True
                if self._may_start(model):
                    self._start(model, reason)
                    saw_load = True
                    continue
                self._tick()
                await self._wait_change()
        finally:
            if queued:
                self._leave(model)

    def _load_now_or_queue(self, model: _Model, reason: str) -> None:
        if self._may_start(model):
            self._start(model, reason)
            self._changed()
        else:
            assert self._tg is not None
            self._tg.start_soon(self._load_when_possible, model, reason)

    async def _load_when_possible(self, model: _Model, reason: str) -> None:
        """Wait in the queue as a request would, for a load asked without a request."""
        try:
            lease = await self._use(model, True, reason)
        except LlamactorError:
            return  # a failed load is logged and listed; nobody else waits for this one
        lease.release()

    def _may_start(self, model: _Model) -> bool:
        """Whether ``model`` may start loading now: it is not running, a slot is free, and no model
        queued before it waits for one (the queue is served in arrival order)."""
        if model.status is not ModelStatus.UNLOADED or self._tg is None or self._closing:
            return False
        if self.models_max > 0 and sum(m.status is not ModelStatus.UNLOADED for m in self._models.values()) >= (
            self.models_max
        ):
            return False
        for name in self._wanted:
            waiting = self._models[name]
            if waiting.status is ModelStatus.UNLOADED or waiting.stopping:
                return waiting is model
        return True

    def _join(self, model: _Model) -> None:
        self._wanted[model.spec.name] = self._wanted.get(model.spec.name, 0) + 1

    def _leave(self, model: _Model) -> None:
        name = model.spec.name
        left = self._wanted.get(name, 0) - 1
        if left > 0:
            self._wanted[name] = left
        else:
            self._wanted.pop(name, None)
        self._changed()  # a slot that was kept for it goes to the next in the queue

    def _tick(self) -> None:
        """Unload idle models while the queued ones outnumber the free slots."""
        views = [m.view() for m in self._models.values()]
        for name in evictions(views, list(self._wanted), self.models_max):
            log.info("model_evicting", model=name, models_max=self.models_max, waiting=list(self._wanted))
            self._stop(self._models[name], "lru")

    def _lease(self, model: _Model) -> ModelLease:
        model.in_use += 1
        model.last_used = time.monotonic()
        return ModelLease(self, model)

    def _release(self, model: _Model) -> None:
        model.in_use -= 1
        model.last_used = time.monotonic()
        self._changed()

    # ---- a model's life ---------------------------------------------------------------------

    def _start(self, model: _Model, reason: str) -> None:
        assert self._tg is not None
        model.status = ModelStatus.LOADING
        model.failure = ""
        model.stop, model.stop_reason = anyio.Event(), ""
        model.last_used = time.monotonic()
        self._tg.start_soon(self._host, model, model.stop, reason)

    def _stop(self, model: _Model, reason: str) -> None:
        if model.stop is None or model.stop.is_set():
            return
        model.stop_reason = reason
        model.stop.set()
        if model.status is ModelStatus.LOADING and model.scope is not None:
            model.scope.cancel()  # as llama-server kills a loading instance: nothing to finish yet

    async def _host(self, model: _Model, stop: anyio.Event, reason: str) -> None:
        """Open the model's runtime and hold it open until ``stop`` is set; the task of one load."""
        spec = model.spec
        started = time.monotonic()
        log.info("model_loading", model=spec.name, source=spec.source, reason=reason, file=str(spec.config.model))
        loaded = False
        try:
            with anyio.CancelScope() as scope:
                model.scope = scope
                if stop.is_set():
                    scope.cancel()
                async with self._open_runtime(spec.config) as rt:
                    loaded = True
                    model.runtime, model.status = rt, ModelStatus.LOADED
                    model.loads += 1
                    log.info(
                        "model_loaded",
                        model=spec.name,
                        load_s=round(time.monotonic() - started, 3),
                        pid=rt.engine_status().pid,
                    )
                    self._changed()
                    await stop.wait()
                    log.info("model_unloading", model=spec.name, reason=model.stop_reason, in_use=model.in_use)
                    with anyio.move_on_after(spec.stop_timeout_s):
                        while model.in_use:
                            await self._wait_change()
            if not loaded:
                log.info("model_load_cancelled", model=spec.name, reason=model.stop_reason)
        except Exception as exc:
            if not loaded:
                model.failure = _reason(exc)
                model.load_failures += 1
                log.error("model_load_failed", model=spec.name, error=model.failure)
            else:
                log.error("model_close_failed", model=spec.name, error=_reason(exc))
        finally:
            model.scope = None
            model.runtime, model.status, model.stop = None, ModelStatus.UNLOADED, None
            if loaded:
                model.unloads += 1
                log.info("model_unloaded", model=spec.name, reason=model.stop_reason)
            self._changed()

    # ---- plumbing ---------------------------------------------------------------------------

    def _find(self, name: str, missing: LlamactorError) -> _Model:
        model = self._names.get(name)
        if model is None:
            raise missing
        return model

    def _require_open(self) -> None:
        if self._tg is None or self._closing:
            raise Closed("the server is shutting down")

    def _require_admitting(self) -> None:
        self._require_open()
        if self.draining:
            raise Unavailable("the server is shutting down: it finishes the requests it has and takes no new ones")

    def _running(self) -> bool:
        return any(m.status is not ModelStatus.UNLOADED for m in self._models.values())

    def _changed(self) -> None:
        """Something a waiter may wait for changed: unload for the queue if needed, wake them all."""
        if self._tg is not None and not self.draining and not self._closing:
            self._tick()
        change, self._change = self._change, anyio.Event()
        if change is not None:
            change.set()

    async def _wait_change(self) -> None:
        assert self._change is not None
        await self._change.wait()


def _reason(exc: BaseException) -> str:
    """The message of what failed a load: the one llamactor error inside the task groups'
    exception groups (the loader's own words), else the exception's type and message."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, LlamactorError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
