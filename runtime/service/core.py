"""``RuntimeCore``: the embedding API over one engine, wherever the engine runs.

    async with Runtime.open(RuntimeConfig(model=path, parallel=8)) as rt:
        out = await rt.complete("Hello", max_tokens=16)
        async for event in rt.stream("Hello", max_tokens=16):
            ...
        app = rt.asgi_app()

A runtime owns its model (the whole model, or only its vocabulary when the engine runs in a
child process), admission, chat template and engine (``EngineClient``: in this process, or in
a child process that may die without losing a request); no global state, so two runtimes can
live in one event loop. Every request is one ``GenerationRequest``: ``complete``, ``stream``,
``submit`` and ``chat`` take its fields as typed keyword arguments, ``submit_request`` takes
it whole (the HTTP app does). ``llamactor.runtime.Runtime`` is this class plus ``asgi_app()``.
"""

from __future__ import annotations

import enum
import functools
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

import anyio
import structlog

from llamactor.actors.policies import policy_name
from llamactor.protocol.errors import Closed, ConfigError, LlamactorError, RequestError, Unavailable
from llamactor.protocol.live import LiveSnapshot
from llamactor.protocol.request import GenerationRequest, InfillParts
from llamactor.protocol.slots import SlotActionResult, SlotState
from llamactor.runtime.engine.builtin_templates import builtin_template_names
from llamactor.runtime.engine.hooks import GroupHooks
from llamactor.runtime.engine.model import LoadOptions, Model
from llamactor.runtime.service import live
from llamactor.runtime.service.admission import Admission, media_names
from llamactor.runtime.service.chat import ChatTemplate
from llamactor.runtime.service.chatturn import ChatResult, ChatTurn, parse_completion
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.embeddings import Embeddings, EmbeddingService, Input, Ranked
from llamactor.runtime.service.engine import EngineClient, EngineStatus
from llamactor.runtime.service.handles import EventStream, RequestHandle, collect
from llamactor.runtime.service.inprocess import InProcessEngine
from llamactor.runtime.service.lora import LoraAdapters
from llamactor.runtime.service.mediaproc import InThread, MediaProcess, MediaTokenizer
from llamactor.runtime.service.processengine import ProcessEngine
from llamactor.runtime.service.results import Completion

log = structlog.get_logger("llamactor.runtime")

DRAIN_POLL_S = 0.05  # how often a drain looks whether the last request has finished
NOT_OPEN = "the runtime is not open: use 'async with Runtime.open(config) as rt:' (or 'async with rt:')"

P = ParamSpec("P")
S = TypeVar("S")
R = TypeVar("R")
A = TypeVar("A")


class RuntimeState(enum.Enum):
    """Lifecycle of a runtime; using it when it is not READY raises an error saying why."""

    CREATED = "created"  # constructed, nothing loaded
    LOADING = "loading"  # model loading, engine starting
    READY = "ready"  # serving
    STOPPING = "stopping"  # engine stopping, requests failing with Closed
    CLOSED = "closed"  # everything released; it may be opened again


def _request_fields(
    ctor: Callable[P, GenerationRequest], first: Callable[[A], dict[str, Any]]
) -> Callable[[Callable[[S, GenerationRequest], R]], Callable[Concatenate[S, A, P], R]]:
    """Give a method taking a ``GenerationRequest`` the request's fields as typed keyword
    arguments (its first argument fills the field ``first`` names): a type checker flags a
    misspelled or mistyped field, and the fields are written once, in the Struct."""

    def decorate(method: Callable[[S, GenerationRequest], R]) -> Callable[Concatenate[S, A, P], R]:
        @functools.wraps(method)
        def with_fields(self: S, arg: A, /, *args: P.args, **kwargs: P.kwargs) -> R:
            try:
                request = ctor(*args, **first(arg), **kwargs)
            except TypeError as exc:  # a misspelled keyword, or more than one positional argument
                why = str(exc)
                if why.startswith("Extra positional"):
                    why = f"{method.__name__}() takes one positional argument ({name}); give the other fields by name"
                raise RequestError(why) from None
            return method(self, request)

        params = list(inspect.signature(ctor).parameters.values())
        own = inspect.signature(method).parameters["self"].replace(kind=inspect.Parameter.POSITIONAL_ONLY)
        [name] = first(None).keys()  # type: ignore[arg-type]
        lead = next(p for p in params if p.name == name).replace(kind=inspect.Parameter.POSITIONAL_ONLY)
        rest = [p for p in params if p.name != name]
        with_fields.__signature__ = inspect.Signature([own, lead, *rest])  # type: ignore[attr-defined]
        return with_fields

    return decorate


def _prompt(prompt: str | Sequence[int]) -> dict[str, Any]:
    return {"prompt": prompt}


def _messages(messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"messages": messages}


def _infill(parts: InfillParts) -> dict[str, Any]:
    return {"infill": parts}


class RuntimeCore:
    """Everything of the embedding API but the HTTP app (``llamactor.runtime.Runtime`` adds it)."""

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

    # ---- text ------------------------------------------------------------------------------

    async def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self.require_ready()
        assert self.admission is not None
        return await self.admission.tokenize(text, add_special=add_special, parse_special=parse_special)

    async def count_prompt(self, turn: ChatTurn) -> int:
        """The prompt tokens of a rendered chat (an image counts the positions it takes)."""
        self.require_ready()
        assert self.admission is not None
        vision = self.admission.vision
        if turn.media and vision is not None:
            files = await self.admission.fetcher.fetch_images(turn.media)  # images named by URL
            tokens, _ = await vision.tokenize(turn.prompt, files, names=media_names(turn.media, turn.media_where))
            return len(tokens)
        return len(await self.tokenize(turn.prompt))

    def detokenize(self, tokens: Sequence[int]) -> str:
        self.require_ready()
        assert self.model is not None
        self.model.check_tokens(tokens)
        return self.model.detokenize(tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **fields: Any
    ) -> str:
        """The prompt a chat renders to (with its tools and options, as a chat request would)."""
        return self.chat_turn(GenerationRequest(messages=messages, **fields), add_generation_prompt).prompt

    def chat_turn(self, request: GenerationRequest, add_generation_prompt: bool = True) -> ChatTurn:
        """A chat request rendered, with its call grammar: what admission does with its messages."""
        self.require_ready()
        assert self.admission is not None
        if request.messages is None:
            raise RequestError("messages: a chat needs messages")
        return self.admission.chat_turn(request, add_generation_prompt=add_generation_prompt)

    @_request_fields(GenerationRequest, _messages)
    def prepare_chat(self, request: GenerationRequest) -> ChatTurn:
        """A chat rendered as a chat request with these fields would be (prompt, call grammar)."""
        return self.chat_turn(request)

    # ---- requests ----------------------------------------------------------------------------

    async def submit_request(self, request: GenerationRequest) -> RequestHandle:
        """Validate, resolve, tokenize and queue one request; return its event stream.

        Raises ``RequestError`` (400: the message names the field) for bad input, nothing else
        affected; ``Overloaded`` or ``Unavailable`` (503) when the engine cannot take it now.
        Later failures (queue full, engine error) come as the stream's error; ``first()``
        raises them before any event.
        """
        self._require_admitting()
        assert self.admission is not None
        admitted = await self.admission.admit(request)
        task = admitted.task
        handle = RequestHandle(task, admitted.events, self._cancel, admitted.turn)
        try:
            engine = self._ready_engine()  # again: the runtime may have closed during admission
            self._require_admitting()
            engine.submit(task)
        except BaseException:
            task.sink.close()
            handle.close()
            raise
        return handle

    def _cancel(self, task_id: int) -> None:
        if self.engine is not None and self.state is RuntimeState.READY:
            self.engine.cancel(task_id)

    @_request_fields(GenerationRequest, _prompt)
    def submit(self, request: GenerationRequest) -> Awaitable[RequestHandle]:
        """``submit_request`` with the request's fields as keyword arguments."""
        return self.submit_request(request)

    @_request_fields(GenerationRequest, _prompt)
    def stream(self, request: GenerationRequest) -> EventStream:
        """The request's events: ``Token`` events, one ``Done`` per choice, and with
        ``return_progress=True`` ``Progress`` events while the prompt is processed.

        ``events = await rt.stream(...)`` raises request errors before any event (then
        ``async with events: async for ev in events``); ``async for ev in rt.stream(...)``
        raises them at the first iteration. Leaving the loop early cancels the request."""
        return EventStream(lambda: self.submit_request(request))

    @_request_fields(GenerationRequest, _prompt)
    async def complete(self, request: GenerationRequest) -> Completion:
        """Run one request to the end and return every choice."""
        return await collect(await self.submit_request(request))

    @_request_fields(GenerationRequest, _messages)
    async def chat(self, request: GenerationRequest) -> ChatResult:
        """One chat turn run to the end: OpenAI-shaped messages (and ``tools``) in, the parsed
        assistant message of each choice out (``result.message.content``,
        ``.reasoning_content``, ``.tool_calls``; ``result.finish_reason`` is "tool_calls" when
        it called one)."""
        handle = await self.submit_request(request)
        assert handle.turn is not None
        return parse_completion(handle.turn, await collect(handle))

    @_request_fields(GenerationRequest, _infill)
    async def infill(self, request: GenerationRequest) -> Completion:
        """Fill in the middle between ``parts.input_prefix`` and ``parts.input_suffix`` (the
        model's FIM tokens; ``prompt`` is the middle's start) and run it to the end."""
        return await collect(await self.submit_request(request))

    # ---- LoRA adapters ---------------------------------------------------------------------

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapters with their global scales (``GET /lora-adapters``)."""
        self.require_ready()
        return self.adapters.rows()

    def set_lora_adapters(self, entries: Sequence[Any]) -> None:
        """Set the global scales, ``[{"id": 0, "scale": 0.5}, ...]``; adapters not listed get 0
        (``POST /lora-adapters``). Requests already admitted keep the set they got."""
        self.require_ready()
        self.adapters.set_scales(entries)

    # ---- slots, metrics, the live view ----------------------------------------------------

    async def slots(self) -> list[SlotState]:
        """Every slot of every group, as it is now."""
        return await self._ready_engine().slots()

    async def slot_action(self, slot: int, action: str, path: str = "") -> SlotActionResult:
        """Erase, save (to ``path``) or restore (from ``path``) one idle slot."""
        return await self._ready_engine().slot_action(slot, action, path)

    async def metrics_text(self) -> bytes:
        """The Prometheus exposition text of the engine (and of its process, when isolated)."""
        return await self._ready_engine().metrics_text()

    def live_snapshot(self) -> LiveSnapshot:
        """Groups, slots, phases, queue and counters as one frozen snapshot (the live view).

        Never raises: a runtime that is loading, stopping or restarting its engine reports its
        state and no groups. Cheap; ``/live`` calls it once per tick for all its clients.
        """
        snap = self.engine.live_snapshot() if self.engine is not None and self.state is RuntimeState.READY else None
        return self._idle_snapshot() if snap is None else snap

    async def read_live(self) -> LiveSnapshot:
        """``live_snapshot()`` read now: an engine in its own process is asked (the live view's
        tick), so the snapshot is never older than the call. Never raises."""
        snap = await self.engine.read_live() if self.engine is not None and self.state is RuntimeState.READY else None
        return self._idle_snapshot() if snap is None else snap

    def _idle_snapshot(self) -> LiveSnapshot:
        ready = self.state is RuntimeState.READY and self.engine is not None
        health = self.health()
        if ready and health == "ok" and self.engine_status().state == "sleeping":
            health = "sleeping"  # --sleep-idle-seconds: healthy, its engine process stopped until a request
        return live.idle_snapshot(
            self.config,
            self.state.value if not ready else ("ready" if health == "ok" else health),
            healthy=ready and health in ("ok", "sleeping"),
            uptime_s=max(0.0, time.time() - self.started_at) if ready and self.started_at else 0.0,
        )

    # ---- embeddings and rerank -------------------------------------------------------------

    async def embed(self, inputs: Input | Sequence[Input], *, normalize: int | None = None) -> Embeddings:
        """Embed one input or a list of them (strings or token-id lists); vectors in input order.

        Needs a runtime opened with ``embedding=True``; ``normalize`` defaults to the config's
        ``embd_normalize`` (2: unit euclidean norm). Raises RequestError naming the bad input.
        """
        self._require_admitting()
        assert self.embeddings is not None
        return await self.embeddings.embed(inputs, normalize=normalize)

    async def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None) -> list[Ranked]:
        """Score ``documents`` against ``query`` (rank pooling only); best first, at most ``top_n``."""
        self._require_admitting()
        assert self.embeddings is not None
        return await self.embeddings.rerank(query, documents, top_n=top_n)


def _only_error(exc: BaseException) -> LlamactorError | None:
    """The one llamactor error inside (nested) exception groups, if that is all there is."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, LlamactorError) and exc is not None else None


def load_chat_template(cfg: RuntimeConfig, model: Model) -> ChatTemplate:
    """The chat template, as llama-server chooses it: --chat-template (Jinja source; "chatml";
    with --no-jinja the name of a llama.cpp built-in template), else --chat-template-file,
    else the GGUF's own, else ChatML. Its ``origin`` says which."""
    source, builtin, origin = _chat_template_choice(cfg, model)
    return ChatTemplate(
        source,
        bos_token=model.token_text(model.bos),
        eos_token=model.token_text(model.eos),
        builtin=builtin,
        origin=origin,
    )


def _chat_template_choice(cfg: RuntimeConfig, model: Model) -> tuple[str | None, bool, str]:
    """(Jinja source or a built-in's name, whether it is a built-in, where it came from)."""
    given = cfg.chat_template
    if given is not None:
        if given in builtin_template_names():
            if not cfg.jinja:
                return given, True, "llama.cpp built-in (--chat-template --no-jinja)"
            if given != "chatml":  # "chatml" is ChatML with Jinja too, as in llama-server
                log.warning(
                    "chat_template_is_a_name",
                    template=given,
                    warning=f"--chat-template {given!r} names a llama.cpp built-in template, but with Jinja on "
                    "it is read as Jinja source (as llama-server does): add --no-jinja to use the built-in",
                )
        if given == "chatml":
            return None, False, "--chat-template chatml"
        return given, False, "--chat-template"
    if cfg.chat_template_file is not None:
        try:
            with open(cfg.chat_template_file, encoding="utf-8") as f:
                return f.read(), False, f"--chat-template-file {cfg.chat_template_file}"
        except OSError as exc:
            raise ConfigError(f"cannot read --chat-template-file {cfg.chat_template_file}: {exc.strerror}") from None
    source = model.chat_template()
    if source is None:
        return None, False, "fallback: the GGUF has no chat template"
    return source, False, "gguf (tokenizer.chat_template)"
