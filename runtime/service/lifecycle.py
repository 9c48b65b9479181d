"""The lifecycle of a runtime: opening it (model, admission and engine, the engine in this
process or in a child process), serving, a graceful drain, closing; and the state checks a
call passes before it reaches the engine.

``RuntimeLifecycle`` is the base of ``RuntimeCore`` (``service.core``, the requests), kept
apart by concept.
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Self

import anyio
import structlog

from llamactor.actors.policies import policy_name
from llamactor.protocol.errors import Closed, ConfigError, LlamactorError, Unavailable
from llamactor.runtime.engine.hooks import GroupHooks
from llamactor.runtime.engine.model import LoadOptions, Model
from llamactor.runtime.service.admission import Admission
from llamactor.runtime.service.chat import ChatTemplate
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.embeddings import EmbeddingService
from llamactor.runtime.service.engine import EngineClient, EngineStatus
from llamactor.runtime.service.inprocess import InProcessEngine
from llamactor.runtime.service.lora import LoraAdapters
from llamactor.runtime.service.mediaproc import InThread, MediaProcess, MediaTokenizer
from llamactor.runtime.service.processengine import ProcessEngine
from llamactor.runtime.service.templatechoice import load_chat_template

log = structlog.get_logger("llamactor.runtime")

DRAIN_POLL_S = 0.05  # how often a drain looks whether the last request has finished
NOT_OPEN = "the runtime is not open: use 'async with Runtime.open(config) as rt:' (or 'async with rt:')"


class RuntimeState(enum.Enum):
    """Lifecycle of a runtime; using it when it is not READY raises an error saying why."""

    CREATED = "created"  # constructed, nothing loaded
    LOADING = "loading"  # model loading, engine starting
    READY = "ready"  # serving
    STOPPING = "stopping"  # engine stopping, requests failing with Closed
    CLOSED = "closed"  # everything released; it may be opened again


class RuntimeLifecycle:
    """Opening, serving, draining and closing a runtime (the base of ``RuntimeCore``)."""

    def __init__(self, config: RuntimeConfig, *, hooks: GroupHooks | None = None, isolate: bool | None = None) -> None:
        self.config = config
        self.isolate = config.isolate if isolate is None else isolate
        if hooks is not None and self.isolate:
            raise ConfigError(
                "hooks cannot reach an engine in a child process: give them as "
                "engine_hooks='module:Class' or open the runtime with isolate=False"
            )
        self.hooks = hooks  # injected into every group (tests, chaos): see runtime.engine.hooks
        self.state = RuntimeState.CREATED
        self.model: Model | None = None
        self.chat_template: ChatTemplate | None = None
        self.admission: Admission | None = None
        self.engine: EngineClient | None = None
        self.embeddings: EmbeddingService | None = None
        self.vision: MediaTokenizer | None = None  # --mmproj: what admission tokenizes media with
        self.adapters = LoraAdapters()  # LoRA adapters and their global scales
        self.started_at = 0.0
        self.draining = False  # drain(): no new requests, the ones in flight finish
        self._stack: AsyncExitStack | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def open(
        cls, config: RuntimeConfig, *, hooks: GroupHooks | None = None, isolate: bool | None = None
    ) -> AsyncIterator[Self]:
        """Open a runtime for the ``async with`` block. ``isolate`` (default: ``config.isolate``)
        runs the engine in a child process; ``hooks`` need the engine in this process."""
        async with cls(config, hooks=hooks, isolate=isolate) as rt:
            yield rt

    async def __aenter__(self) -> Self:
        if self.state not in (RuntimeState.CREATED, RuntimeState.CLOSED):
            raise RuntimeError(f"this runtime is {self.state.value}: close it before opening it again")
        self.state = RuntimeState.LOADING
        self.draining = False
        try:
            await self._start()
        except BaseException as exc:
            await self._close_stack()
            self.state = RuntimeState.CLOSED
            alone = _only_error(exc)
            if alone is not None:
                raise alone from None  # the actors' task groups wrap what failed the start
            raise
        self.state = RuntimeState.READY
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.state = RuntimeState.STOPPING
        await self._close_stack()
        self.state = RuntimeState.CLOSED

    async def _close_stack(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.aclose()

    async def _start(self) -> None:
        cfg = self.config = self.config.validated()
        if cfg.sleep_idle_seconds > 0 and not self.isolate:  # validated() saw config.isolate only
            raise ConfigError("--sleep-idle-seconds needs the engine in its own process (isolate)")
        stack = self._stack = AsyncExitStack()
        assert cfg.model is not None  # validated() refuses a config without a model
        if cfg.replicas or self.isolate:  # admission needs the vocabulary only; the weights load elsewhere
            # the tokenizer the engine has, special tokens rendered as its are (-sp)
            vocab = LoadOptions(vocab_only=True, kv_overrides=cfg.kv_overrides, special=cfg.special)
            model = await anyio.to_thread.run_sync(Model, cfg.model, vocab)
            stack.callback(model.close)
            if cfg.mmproj is not None:  # tokenizing media decodes it: in a child process of its own
                self.vision = await stack.enter_async_context(MediaProcess.open(cfg))
            admission = await self._admission(model)
            if cfg.replicas:  # on Ray Serve (an optional extra: imported only here)
                from llamactor.runtime.service.replicas import ReplicaSet

                engine: EngineClient = await stack.enter_async_context(ReplicaSet.open(cfg))
            else:
                engine = await stack.enter_async_context(ProcessEngine.open(cfg))
        else:
            engine = inprocess = await stack.enter_async_context(InProcessEngine.open(cfg, hooks=self.hooks))
            model = inprocess.model
            self.vision = InThread(inprocess.vision) if inprocess.vision is not None else None
            admission = await self._admission(model)
        self.model, self.admission, self.engine = model, admission, engine
        self.embeddings = EmbeddingService(model, engine.embedder, normalize=cfg.embd_normalize)
        self.started_at = time.time()
        log.info(
            "runtime_ready",
            model=str(cfg.model),
            isolated=self.isolate,
            groups=cfg.pipeline_groups,
            slots=cfg.parallel,
            kv="unified" if cfg.kv_unified else "split",
            ctx_per_request=cfg.ctx_per_request,
            total_kv_cells=cfg.total_kv_cells,
            scheduler=policy_name(cfg.scheduler),
        )

    async def _admission(self, model: Model) -> Admission:
        cfg = self.config
        self.adapters = LoraAdapters(cfg.lora, init_without_apply=cfg.lora_init_without_apply)
        self.chat_template = load_chat_template(cfg, model)
        log.info("chat_template", template=self.chat_template.name, source=self.chat_template.origin)
        admission = Admission(model, cfg, self.chat_template, self.adapters, self.vision)
        await admission.check_defaults()  # --temp, --grammar, -l ...: ConfigError before serving
        return admission

    def require_ready(self) -> None:
        """Raise what a request gets while the runtime cannot serve: Unavailable (503) while the
        model loads or before it is opened, Closed once it is shutting down."""
        if self.state is RuntimeState.READY:
            return
        if self.state is RuntimeState.LOADING:
            raise Unavailable("Loading model")
        if self.state is RuntimeState.CREATED:
            raise Unavailable(NOT_OPEN)
        raise Closed("the runtime is shutting down" if self.state is RuntimeState.STOPPING else NOT_OPEN)

    def _require_admitting(self) -> None:
        self.require_ready()
        if self.draining:
            raise Unavailable("the server is shutting down: it finishes the requests it has and takes no new ones")

    def _ready_engine(self) -> EngineClient:
        self.require_ready()
        assert self.engine is not None
        return self.engine

    def health(self) -> str:
        """ "loading", "ok", "unhealthy", "restarting", "draining" or "closed"."""
        if self.state in (RuntimeState.CREATED, RuntimeState.LOADING):
            return "loading"
        if self.state is not RuntimeState.READY or self.engine is None:
            return "closed"
        if self.draining:
            return "draining"
        return self.engine.health()

    def engine_status(self) -> EngineStatus:
        """Where the engine runs and how it is (``GET /props``' ``engine``)."""
        if self.engine is None:
            return EngineStatus(isolated=self.isolate, state=self.state.value)
        return self.engine.status()

    async def restart(self) -> None:
        """Start the engine again after it gave up (it died, or a group failed, too often in a
        row: the runtime answered "unhealthy" and failed requests). A no-op while it is well."""
        await self._ready_engine().restart()

    # ---- graceful drain --------------------------------------------------------------------

    def in_flight(self) -> int:
        """Requests queued or being served (0 when nothing is left to finish)."""
        if self.engine is None or self.state is not RuntimeState.READY:
            return 0
        return self.engine.in_flight()

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting (new requests get 503, /health says so) and wait up to ``timeout_s``
        for the requests in flight to finish. True when they all did."""
        self.draining = True
        log.info("draining", in_flight=self.in_flight(), timeout_s=timeout_s)
        with anyio.move_on_after(timeout_s):
            while self.in_flight():
                await anyio.sleep(DRAIN_POLL_S)
        left = self.in_flight()
        log.info("drained" if not left else "drain_timeout", in_flight=left)
        return not left


def _only_error(exc: BaseException) -> LlamactorError | None:
    """The one llamactor error inside (nested) exception groups, if that is all there is."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, LlamactorError) and exc is not None else None
