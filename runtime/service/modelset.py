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
(``modeltable.evictions``: a pure function of a snapshot). A model whose load fails fails the
requests that waited for that load with the loader's message and is listed as failed; the next
request for it tries again. What the set knows of each model, and decides from, is its
``ModelTable`` (``runtime.service.modeltable``); here is what waits and what opens runtimes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
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
from llamactor.runtime.service.modeltable import (
    DEFAULT_MODELS_MAX,
    ModelEntry,
    ModelSpec,
    ModelStatus,
    ModelTable,
    ModelView,
)

log = structlog.get_logger("llamactor.models")

DRAIN_POLL_S = 0.05  # how often a drain looks whether the last request has finished

OpenRuntime = Callable[[RuntimeConfig], AbstractAsyncContextManager[RuntimeCore]]


class ModelLease:
    """One request's use of a loaded model: its runtime stays loaded until ``release()``."""

    def __init__(self, models: ModelSet, model: ModelEntry) -> None:
        assert model.runtime is not None
        self.name = model.spec.name
        self.runtime: RuntimeCore = model.runtime
        self._models = models
        self._model: ModelEntry | None = model

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
        self._table = ModelTable(specs)
        startup = [s.name for s in specs if s.load_on_startup]
        if models_max > 0 and len(startup) > models_max:
            raise ConfigError(
                f"{len(startup)} models are to load on startup ({', '.join(startup)}), "
                f"more than --models-max {models_max}"
            )
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
            models=[m.spec.name for m in self._table.models.values()],
            models_max=self.models_max,
            autoload=self.autoload,
        )
        for model in self._table.models.values():
            if model.spec.load_on_startup:
                self._load_now_or_queue(model, "startup")
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Unload every model (each after its requests, up to its stop timeout) and close."""
        self._closing = True  # from here no load starts and no request gets a model
        stack, tg = self._stack, self._tg
        for model in self._table.models.values():
            self._stop(model, "shutdown")
        self._changed()
        try:
            with anyio.CancelScope(shield=True):
                while self._table.running():
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
        return self._table.views()

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
        return await self._use(self._table.find(name, RequestError(f"model '{name}' not found")), autoload, "request")

    def load(self, name: str) -> None:
        """Start loading ``name`` (``POST /models/load``): at once when a slot is free and no
        model waits before it, else once its turn comes (an idle model is unloaded for it, as
        for a request). Returns without waiting: ``views()`` says how the load goes."""
        self._require_open()
        model = self._table.find(name, NotFound("model is not found"))
        if model.status is not ModelStatus.UNLOADED:
            raise RequestError("model is already running")
        self._load_now_or_queue(model, "load")

    def unload(self, name: str) -> None:
        """Unload ``name`` (``POST /models/unload``): a loading model stops at once, a loaded one
        after its requests end (up to its ``stop_timeout_s``). Returns without waiting."""
        self._require_open()
        model = self._table.find(name, RequestError("model is not found"))
        if model.status is ModelStatus.UNLOADED:
            raise RequestError("model is not running")
        self._stop(model, "unload")
        self._changed()

    def in_flight(self) -> int:
        """Requests using a model now."""
        return self._table.in_flight()

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
        for model in list(self._table.models.values()):
            runtime = model.runtime
            if runtime is None or model.stopping:
                continue
            try:
                texts.append((model.spec.name, await runtime.metrics_text()))
            except LlamactorError:
                continue  # unloaded or failing while read: its series are missing from this scrape
        return modelmetrics.labelled(texts, self._table.series())

    # ---- waiting for a model --------------------------------------------------------------

    async def _use(self, model: ModelEntry, autoload: bool | None, reason: str) -> ModelLease:
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
                    self._table.join(model)  # a stopping model takes no new request: its next load serves it
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

    def _load_now_or_queue(self, model: ModelEntry, reason: str) -> None:
        if self._may_start(model):
            self._start(model, reason)
            self._changed()
        else:
            assert self._tg is not None
            self._tg.start_soon(self._load_when_possible, model, reason)

    async def _load_when_possible(self, model: ModelEntry, reason: str) -> None:
        """Wait in the queue as a request would, for a load asked without a request."""
        try:
            lease = await self._use(model, True, reason)
        except LlamactorError:
            return  # a failed load is logged and listed; nobody else waits for this one
        lease.release()

    def _may_start(self, model: ModelEntry) -> bool:
        """Whether ``model`` may start loading now: it is not running, a slot is free, and no model
        queued before it waits for one (the queue is served in arrival order)."""
        return self._tg is not None and not self._closing and self._table.may_start(model, self.models_max)

    def _leave(self, model: ModelEntry) -> None:
        self._table.leave(model)
        self._changed()  # a slot that was kept for it goes to the next in the queue

    def _tick(self) -> None:
        """Unload idle models while the queued ones outnumber the free slots."""
        for name in self._table.evictions(self.models_max):
            log.info("model_evicting", model=name, models_max=self.models_max, waiting=list(self._table.wanted))
            self._stop(self._table.models[name], "lru")

    def _lease(self, model: ModelEntry) -> ModelLease:
        model.in_use += 1
        model.last_used = time.monotonic()
        return ModelLease(self, model)

    def _release(self, model: ModelEntry) -> None:
        model.in_use -= 1
        model.last_used = time.monotonic()
        self._changed()

    # ---- a model's life ---------------------------------------------------------------------

    def _start(self, model: ModelEntry, reason: str) -> None:
        assert self._tg is not None
        model.status = ModelStatus.LOADING
        model.failure = ""
        model.stop, model.stop_reason = anyio.Event(), ""
        model.last_used = time.monotonic()
        self._tg.start_soon(self._host, model, model.stop, reason)

    def _stop(self, model: ModelEntry, reason: str) -> None:
        if model.stop is None or model.stop.is_set():
            return
        model.stop_reason = reason
        model.stop.set()
        if model.status is ModelStatus.LOADING and model.scope is not None:
            model.scope.cancel()  # as llama-server kills a loading instance: nothing to finish yet

    async def _host(self, model: ModelEntry, stop: anyio.Event, reason: str) -> None:
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

    def _require_open(self) -> None:
        if self._tg is None or self._closing:
            raise Closed("the server is shutting down")

    def _require_admitting(self) -> None:
        self._require_open()
        if self.draining:
            raise Unavailable("the server is shutting down: it finishes the requests it has and takes no new ones")

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
