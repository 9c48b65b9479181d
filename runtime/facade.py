"""The ``Runtime`` facade: the embedding API (SPEC section 7) over the actors.

    async with Runtime.open(RuntimeConfig(model=path, parallel=8)) as rt:
        out = await rt.complete("Hello", max_tokens=16)
        async for event in rt.stream(prompt="Hello"):
            ...
        app = rt.asgi_app()

A runtime owns its model, actors, metrics and registry: no global state, so two runtimes can
live in one event loop. Requests are validated and tokenized here, then handed to the
supervisor; their tokens come straight back from the serving group on a bounded stream.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import llama_cpp
import numpy as np
import structlog

from actors.coordinator import PhaseCoordinator
from actors.group import GroupActor
from actors import policies
from actors.supervisor import Supervisor
from protocol.events import Done, Failed, Token
from protocol.messages import Cancel, SlotRequest, Submit, Task
from protocol.sampling import ParamError, SamplingParams, check_sampling, check_stop, sampler_names
from runtime.chat import ChatTemplate
from runtime.config import RuntimeConfig
from runtime.engine import ContextOptions
from runtime.errors import (
    Closed, EngineError, LlamactorError, NotFound, Overloaded, RequestError, Unavailable,
)
from runtime.kernel import open_actor_scope
from runtime.metrics import Metrics
from runtime.model import LoadOptions, Model
from runtime.hooks import GroupHooks
from runtime.sampling import check_chain

log = structlog.get_logger("llamactor.runtime")

TOKENIZE_IN_THREAD_CHARS = 4096  # longer prompts are tokenized off the event loop
MAX_N_PREDICT = 1 << 24
SLOT_ACTION_TIMEOUT_S = 60.0
EVENT_HEADROOM = 8  # result-stream buffer beyond one event per token


class RuntimeState(enum.Enum):
    """Lifecycle of a runtime; misuse (submit before open, after close) raises a clear error."""

    CREATED = "created"  # constructed, nothing loaded
    LOADING = "loading"  # model loading, actors starting
    READY = "ready"  # serving
    STOPPING = "stopping"  # actors stopping, requests failing with Closed
    CLOSED = "closed"  # everything released


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str
    tokens: tuple[int, ...]
    logprobs: tuple[Token, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A finished request: one ``Choice`` per n, plus usage and timings."""

    choices: tuple[Choice, ...]
    n_prompt: int
    n_cached: int
    n_predicted: int
    prompt_ms: float
    predicted_ms: float
    slot: int
    stopping_word: str = ""

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason


@dataclass
class RequestHandle:
    """The receive end of one request: iterate for events; closing it cancels the request."""

    task: Task
    events: Any  # anyio MemoryObjectReceiveStream[Event]
    runtime: Runtime
    _closed: bool = field(default=False, repr=False)

    def __aiter__(self) -> AsyncIterator[Token | Done]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Token | Done]:
        try:
            async for event in self.events:
                if isinstance(event, Failed):
                    raise _error_of(event)
                yield event
        finally:
            self.close()

    async def first(self) -> Token | Done | None:
        """Wait for the first event (raises the request's error): lets HTTP pick a status.

        None when the request ends without any event (nothing to generate: max_tokens 0).
        """
        try:
            event = await self.events.receive()
        except anyio.EndOfStream:
            self.close()
            return None
        if isinstance(event, Failed):
            self.close()
            raise _error_of(event)
        return event

    def close(self) -> None:
        """Cancel (if still running) and drop the stream; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self.events.close()
        self.runtime._cancel(self.task.id)

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Runtime:
    def __init__(self, config: RuntimeConfig, *, hooks: GroupHooks | None = None) -> None:
        self.config = config
        self.hooks = hooks  # injected into every group (tests, chaos): see runtime.hooks
        self.state = RuntimeState.CREATED
        self.model: Model | None = None
        self.chat_template: ChatTemplate | None = None
        self.supervisor: Supervisor | None = None
        self.coordinator: PhaseCoordinator | None = None
        self.metrics: Metrics | None = None
        self.started_at = 0.0
        self._ids = itertools.count(1)
        self._stack: AsyncExitStack | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig, *, hooks: GroupHooks | None = None) -> AsyncIterator[Runtime]:
        rt = cls(config, hooks=hooks)
        async with rt:
            yield rt

    async def __aenter__(self) -> Runtime:
        if self.state is not RuntimeState.CREATED:
            raise RuntimeError(f"a Runtime can be opened once; this one is {self.state.value}")
        self.state = RuntimeState.LOADING
        try:
            await self._start()
        except BaseException:
            await self._close_stack()
            self.state = RuntimeState.CLOSED
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
        self._stack = AsyncExitStack()
        model = await anyio.to_thread.run_sync(Model, cfg.model, load_options(cfg))
        self.model = model
        self._stack.callback(model.close)
        self.chat_template = ChatTemplate(
            model.chat_template(), bos_token=model.token_text(model.bos), eos_token=model.token_text(model.eos)
        )
        policy_cls = policies.resolve_policy(cfg.scheduler)
        n = cfg.pipeline_groups
        policy_options = {
            "prefill_budget": cfg.prefill_budget,
            "target_itl_ms": cfg.target_itl_ms,
            "cohort_max_generate_ms": cfg.cohort_max_generate_ms,
        }
        ctx_opts = ContextOptions(
            n_ctx=cfg.ctx_per_context,
            n_batch=cfg.n_batch,
            n_ubatch=cfg.n_ubatch,
            n_seq_max=cfg.slots_per_group,
            n_threads=cfg.threads,
            n_threads_batch=cfg.threads_batch,
            kv_unified=cfg.kv_unified,
            flash_attn=FLASH_ATTN_CODES[cfg.flash_attn],
        )
        metrics = self.metrics = Metrics(n, queue_depth=lambda: len(sup.queue))

        def make_group(g: int) -> GroupActor:
            policy = policy_cls(g, **policy_options)
            coord.replace_policy(g, policy)  # a restarted group starts with fresh phase state
            return GroupActor(
                g, model, ctx_opts, cfg.group_slots(g), policy,
                supervisor=sup, coordinator=coord, metrics=metrics, profile=cfg.profile,
                profile_interval_s=cfg.profile_interval_s, trace=cfg.trace_steps, hooks=self.hooks,
            )

        coord = self.coordinator = PhaseCoordinator([policy_cls(g, **policy_options) for g in range(n)],
                                                    lambda g: sup.group(g), metrics)
        metrics.phase_of = lambda g: coord.policies[g].phase
        metrics.waiting_of = lambda g: coord.policies[g].waiting()
        metrics.restarts_of = lambda g: sup.restarts[g]
        metrics.down_of = lambda g: g in sup.down
        sup = self.supervisor = Supervisor(
            n, cfg.slots_per_group, make_group,
            queue_size=cfg.queue_size, max_restarts=cfg.max_restarts, restart_window_s=cfg.restart_window_s,
        )
        scope = await self._stack.enter_async_context(open_actor_scope())
        await scope.start(coord)
        await scope.start(sup)
        self.started_at = time.time()
        log.info(
            "runtime_ready",
            model=str(cfg.model),
            groups=n,
            slots=cfg.parallel,
            kv="unified" if cfg.kv_unified else "split",
            ctx_per_request=cfg.ctx_per_request,
            total_kv_cells=cfg.total_kv_cells,
            scheduler=cfg.scheduler,
        )

    def _require_ready(self) -> None:
        if self.state is RuntimeState.LOADING or self.state is RuntimeState.CREATED:
            raise Unavailable("Loading model")
        if self.state is not RuntimeState.READY:
            raise Closed("the runtime is shutting down")

    def health(self) -> str:
        """"loading", "ok", "unhealthy" or "closed" (API-1)."""
        if self.state in (RuntimeState.CREATED, RuntimeState.LOADING):
            return "loading"
        if self.state is not RuntimeState.READY:
            return "closed"
        assert self.supervisor is not None
        return "ok" if self.supervisor.healthy else "unhealthy"

    # ---- requests ----------------------------------------------------------------------

    async def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._require_ready()
        assert self.model is not None
        if len(text) > TOKENIZE_IN_THREAD_CHARS:
            return await anyio.to_thread.run_sync(
                lambda: self.model.tokenize(text, add_special=add_special, parse_special=parse_special)
            )
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._require_ready()
        assert self.model is not None
        self.model.check_tokens(tokens)
        return self.model.detokenize(tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        self._require_ready()
        assert self.chat_template is not None
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    async def submit(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = -1,
        n: int = 1,
        stop: Sequence[str] = (),
        id_slot: int = -1,
        cache_prompt: bool = True,
        ignore_eos: bool = False,
        add_special: bool = True,
        params: SamplingParams | None = None,
        **sampling: Any,
    ) -> RequestHandle:
        """Validate, tokenize and queue one request; return its event stream.

        Raises RequestError for bad input (nothing else is affected) and Overloaded when the
        supervisor's mailbox is full. Later failures (queue full, engine error) arrive as the
        stream's first event; ``RequestHandle.first`` turns them into exceptions.
        """
        self._require_ready()
        model, cfg, sup = self.model, self.config, self.supervisor
        assert model is not None and sup is not None
        try:
            if "samplers" in sampling:
                sampling["samplers"] = sampler_names(sampling["samplers"])
            for name in ("dry_sequence_breakers", "logit_bias"):
                if name in sampling:
                    sampling[name] = _as_tuple(sampling[name])
            params = params or SamplingParams(**sampling)
        except ParamError as exc:
            raise RequestError(str(exc)) from None
        except TypeError as exc:
            raise RequestError(str(exc)) from None
        stop = tuple(stop)
        try:
            check_sampling(params, model.n_vocab)
            check_stop(stop)
        except ParamError as exc:
            raise RequestError(str(exc)) from None
        # Every sampler of the chain is built once here, so that settings llama.cpp refuses
        # fail this request alone (400), never a group. Grammars and DRY breakers scan the
        # vocabulary: off the event loop.
        if params.grammar or params.dry_on:
            await anyio.to_thread.run_sync(check_chain, model, params, cfg.ctx_per_request)
        else:
            check_chain(model, params, cfg.ctx_per_request)
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty")
            tokens = await self.tokenize(prompt, add_special=add_special)
        else:
            tokens = list(prompt)
            model.check_tokens(tokens)
        if not tokens:
            raise RequestError("the prompt is empty")
        limit = cfg.ctx_per_request
        if len(tokens) >= limit:
            raise RequestError(
                f"the prompt has {len(tokens)} tokens but the slot context is {limit} tokens "
                f"(prompt + generation must fit)"
            )
        if max_tokens < -1:
            raise RequestError(f"n_predict/max_tokens must be -1 (unlimited) or >= 0, got {max_tokens}")
        if max_tokens > MAX_N_PREDICT:
            raise RequestError(f"n_predict/max_tokens must be at most {MAX_N_PREDICT}, got {max_tokens}")
        room = limit - len(tokens)
        n_predict = room if max_tokens < 0 else min(max_tokens, room)
        if cfg.n_predict_max > 0:
            n_predict = min(n_predict, cfg.n_predict_max)
        if not 1 <= n <= cfg.slots_per_group:
            raise RequestError(f"n must be between 1 and the slots of one group ({cfg.slots_per_group}), got {n}")
        if id_slot >= cfg.parallel or id_slot < -1:
            raise NotFound(f"slot {id_slot} does not exist (0..{cfg.parallel - 1})")
        send, recv = anyio.create_memory_object_stream(n * (max(n_predict, 0) + 2) + EVENT_HEADROOM)
        task = Task(
            id=next(self._ids),
            prompt=np.asarray(tokens, dtype=np.int32),
            params=params,
            n_predict=n_predict,
            stop=stop,
            n=n,
            id_slot=id_slot,
            cache_prompt=cache_prompt,
            ignore_eos=ignore_eos,
            sink=send,
            arrived=time.perf_counter(),
        )
        if n_predict == 0:
            send.close()  # nothing to generate: the handle ends at once
            return RequestHandle(task, recv, self)
        try:
            sup.try_tell(Submit(task))
        except LlamactorError:
            recv.close()
            send.close()
            raise
        return RequestHandle(task, recv, self)

    def _cancel(self, task_id: int) -> None:
        if self.supervisor is not None and self.state is RuntimeState.READY:
            try:
                self.supervisor.try_tell(Cancel(task_id))
            except LlamactorError:
                pass  # a full or closed supervisor will drop the stream on its own

    async def stream(self, prompt: str | Sequence[int], **kwargs: Any) -> AsyncIterator[Token | Done]:
        """Yield token events (and one ``Done`` per choice) of one request."""
        handle = await self.submit(prompt, **kwargs)
        async with handle:
            async for event in handle:
                yield event

    async def complete(self, prompt: str | Sequence[int], **kwargs: Any) -> Completion:
        """Run one request to the end and return every choice."""
        handle = await self.submit(prompt, **kwargs)
        return await collect(handle)

    # ---- slots, metrics, app -------------------------------------------------------------

    def slots(self) -> list[dict[str, Any]]:
        self._require_ready()
        assert self.supervisor is not None
        rows: list[dict[str, Any]] = []
        for g, group in enumerate(self.supervisor.groups):
            if group is not None:
                rows += group.slot_rows()
            else:
                rows += [
                    {"id": i, "group": g, "is_processing": False, "phase": "down"}
                    for i in self.config.group_slots(g)
                ]
        return rows

    async def slot_action(self, slot: int, action: str, path: str = "") -> dict[str, Any]:
        self._require_ready()
        assert self.supervisor is not None
        return await self.supervisor.ask(lambda r: SlotRequest(action, slot, path, r), SLOT_ACTION_TIMEOUT_S)

    def metrics_text(self) -> bytes:
        assert self.metrics is not None
        return self.metrics.render()

    def asgi_app(self) -> Any:
        """A Starlette app serving this runtime (mount it, or run it with any ASGI server)."""
        from runtime.http import build_app

        return build_app(self)


async def collect(handle: RequestHandle) -> Completion:
    """Drain a request's events into a ``Completion``."""
    async with handle:
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list[Token]] = {}
        done: dict[int, Done] = {}
        async for event in handle:
            if isinstance(event, Token):
                tokens.setdefault(event.index, []).append(event.token)
                if event.logprob is not None:
                    logprobs.setdefault(event.index, []).append(event)
            else:
                done[event.index] = event
    if not done:
        n_prompt = len(handle.task.prompt)
        return Completion((Choice(0, "", "length", ()),), n_prompt, 0, 0, 0.0, 0.0, -1)
    choices = tuple(
        Choice(i, d.text, d.finish_reason, tuple(tokens.get(i, ())), tuple(logprobs.get(i, ())))
        for i, d in sorted(done.items())
    )
    first = done[min(done)]
    return Completion(
        choices,
        n_prompt=first.n_prompt,
        n_cached=first.n_cached,
        n_predicted=sum(d.n_predicted for d in done.values()),
        prompt_ms=first.prompt_ms,
        predicted_ms=max(d.predicted_ms for d in done.values()),
        slot=first.slot,
        stopping_word=first.stopping_word,
    )


def load_options(cfg: RuntimeConfig) -> LoadOptions:
    """Weights placement from the config: local, or split over ggml-rpc workers (SPEC 5)."""
    devices = None
    if cfg.rpc_servers or cfg.devices:
        from runtime import rpc

        added = rpc.add_servers(list(cfg.rpc_servers))
        names = list(cfg.devices) or [*added, "CPU"]  # default: workers first, the local CPU last
        devices = rpc.device_array(names)
        log.info("layer_split", devices=names, tensor_split=list(cfg.tensor_split), split_mode=cfg.split_mode)
    return LoadOptions(
        n_gpu_layers=cfg.n_gpu_layers,
        use_mmap=cfg.use_mmap,
        split_mode=SPLIT_MODE_CODES[cfg.split_mode],
        tensor_split=cfg.tensor_split,
        devices=devices,
    )


FLASH_ATTN_CODES = {
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
}

SPLIT_MODE_CODES = {
    "none": llama_cpp.LLAMA_SPLIT_MODE_NONE,
    "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
    "row": llama_cpp.LLAMA_SPLIT_MODE_ROW,
}


def _as_tuple(value: Any) -> Any:
    """Lists (and dicts of logit bias) from keyword arguments as the tuples SamplingParams holds."""
    if isinstance(value, dict):
        return tuple((int(k), float(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(_as_tuple(v) if isinstance(v, list) else v for v in value)
    return value


def _error_of(event: Failed) -> LlamactorError:
    if event.kind == "overloaded":
        return Overloaded(event.message)
    if event.kind == "invalid_request_error":
        return RequestError(event.message)
    if event.kind == "unavailable_error":
        return Unavailable(event.message)
    return EngineError(event.message)
