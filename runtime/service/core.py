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
Opening, draining and closing it: ``service.lifecycle``.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import anyio

from llamactor.protocol.chat import ChatMessage
from llamactor.protocol.errors import NotFound, RequestError
from llamactor.protocol.live import LiveSnapshot
from llamactor.protocol.request import GenerationRequest, InfillParts, validated
from llamactor.protocol.slots import SlotActionResult, SlotState
from llamactor.runtime.service import live, slottransfer
from llamactor.runtime.service.admission import media_names
from llamactor.runtime.service.chatturn import ChatResult, ChatTurn, parse_completion
from llamactor.runtime.service.configfields import default_model_path
from llamactor.runtime.service.embeddings import Embeddings, Input, Ranked
from llamactor.runtime.service.handles import EventStream, RequestHandle, collect
from llamactor.runtime.service.lifecycle import RuntimeLifecycle, RuntimeState
from llamactor.runtime.service.results import Completion

P = ParamSpec("P")
S = TypeVar("S")
R = TypeVar("R")
A = TypeVar("A")


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


def _messages(messages: Sequence[ChatMessage | Mapping[str, Any]]) -> dict[str, Any]:
    """A chat's messages: typed, or OpenAI-shaped dicts (``validated`` decodes them)."""
    return {"messages": messages}


def _infill(parts: InfillParts) -> dict[str, Any]:
    return {"infill": parts}


class RuntimeCore(RuntimeLifecycle):
    """Everything of the embedding API but the HTTP app (``llamactor.runtime.Runtime`` adds it)."""

    _identity: slottransfer.Identity | None = None  # what exported slots depend on (read once)

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
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **fields: Any,
    ) -> str:
        """The prompt a chat renders to (with its tools and options, as a chat request would)."""
        return self.chat_turn(GenerationRequest(**_messages(messages), **fields), add_generation_prompt).prompt

    def chat_turn(self, request: GenerationRequest, add_generation_prompt: bool = True) -> ChatTurn:
        """A chat request rendered, with its call grammar: what admission does with its messages
        (its fields' types checked first, as admission checks them: ``validated``)."""
        self.require_ready()
        assert self.admission is not None
        if request.messages is None:
            raise RequestError("messages: a chat needs messages")
        return self.admission.chat_turn(validated(request), add_generation_prompt=add_generation_prompt)

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

    async def drain_replica(self, replica: str) -> dict[str, Any]:
        """A replica set's replica gets no new requests, and each stream it serves moves to
        another replica with its KV (``ReplicaRequests.drain``); what moved, as a dict."""
        drain = getattr(self._ready_engine(), "drain", None)
        if drain is None:
            raise NotFound("this server runs no replicas (--replicas)")
        result: dict[str, Any] = await drain(replica)
        return result

    async def scale_replicas(self, n: int) -> dict[str, Any]:
        """Ask for ``n`` replicas of a fixed-size replica set; a replica stopped moves its
        streams to the others with their KV first (``ReplicaSet.scale``)."""
        scale = getattr(self._ready_engine(), "scale", None)
        if scale is None:
            raise NotFound("this server runs no replicas (--replicas)")
        result: dict[str, Any] = await scale(n)
        return result

    async def export_slot(self, slot: int) -> bytes:
        """One idle slot's KV state, its tokens and what computed it, as bytes that
        ``import_slot`` of a server of the same model, KV types and adapters reads
        (``service.slottransfer``)."""
        result = await self._ready_engine().slot_action(slot, "export")
        assert result.kv is not None
        return await anyio.to_thread.run_sync(slottransfer.pack, result.kv, await self._slot_identity())

    async def import_slot(self, slot: int, data: bytes | bytearray) -> SlotActionResult:
        """Replace one idle slot's KV with an ``export_slot``'s (``RequestError`` when it came
        from another model, other KV types or adapters this server lacks)."""
        kv = await anyio.to_thread.run_sync(slottransfer.unpack, data, await self._slot_identity())
        return await self._ready_engine().slot_action(slot, "import", kv=kv)

    async def _slot_identity(self) -> slottransfer.Identity:
        if self._identity is None:
            cfg = self.config
            model = cfg.model if cfg.model else default_model_path()
            adapters = [path for path, _ in cfg.lora]
            rope = (
                cfg.rope_scaling,
                cfg.rope_freq_base,
                cfg.rope_freq_scale,
                cfg.yarn_orig_ctx,
                cfg.yarn_ext_factor,
                cfg.yarn_attn_factor,
                cfg.yarn_beta_slow,
                cfg.yarn_beta_fast,
                cfg.control_vector_layers,
            )
            self._identity = await anyio.to_thread.run_sync(
                slottransfer.identity, model, cfg.cache_type_k, cfg.cache_type_v, adapters, rope, cfg.control_vectors
            )
        return self._identity

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
