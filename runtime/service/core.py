"""``RuntimeCore``: the embedding API (SPEC section 7) over the actors — its lifecycle.

    async with Runtime.open(RuntimeConfig(model=path, parallel=8)) as rt:
        out = await rt.complete("Hello", max_tokens=16)
        async for event in rt.stream(prompt="Hello"):
            ...
        app = rt.asgi_app()

A runtime owns its model, actors, metrics and registry: no global state, so two runtimes can
live in one event loop. Requests are validated and tokenized by ``Admission``, then handed to
the supervisor; their tokens come straight back from the serving group on a bounded stream
(``RequestHandle``). ``llamactor.runtime.Runtime`` is this class plus ``asgi_app()``.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import llama_cpp
import structlog

from llamactor.actors.coordinator import PhaseCoordinator
from llamactor.actors.group import GroupActor
from llamactor.actors.recorder import TraceRecorder
from llamactor.actors import policies
from llamactor.actors.supervisor import Supervisor
from llamactor.protocol.events import Done, Progress, Token
from llamactor.protocol.messages import Cancel, SlotRequest, Submit
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime.service.chat import ChatTemplate
from llamactor.runtime.service.config import CACHE_TYPES, RuntimeConfig
from llamactor.runtime.engine.context import ContextOptions
from llamactor.runtime.engine.draftmodel import check_compatible
from llamactor.runtime.engine.speculative import SPEC_DRAFT, SPEC_NGRAM, SpecOptions
from llamactor.protocol.errors import (
    Closed, ConfigError, LlamactorError, Unavailable,
)
from llamactor.runtime.kernel.actor import open_actor_scope
from llamactor.runtime.service.metrics import Metrics
from llamactor.runtime.engine.model import GRAPH_REUSE_ENV, LoadOptions, Model, graph_reuse_user_setting
from llamactor.runtime.engine.hooks import GroupHooks
from llamactor.runtime.engine.promptcache import PromptCache
from llamactor.runtime.service.admission import Admission
from llamactor.runtime.service.lora import LoraAdapters
from llamactor.runtime.service.handles import Completion, RequestHandle, collect
from llamactor.runtime.service.admission import sampling_params
from llamactor.runtime.service.chatturn import ChatResult, ChatTurn, parse_completion, prepare_chat
from llamactor.runtime.service import live
from llamactor.protocol.live import LiveSnapshot
from llamactor.actors.embedder import EmbeddingActor
from llamactor.runtime.engine.embedding import EmbeddingOptions
from llamactor.runtime.service.embeddings import EmbeddingService, Embeddings, Input, Ranked
from llamactor.runtime.service.infill import infill_tokens

log = structlog.get_logger("llamactor.runtime")

_SUBMIT_ARGS = frozenset({"max_tokens", "n", "stop", "id_slot", "cache_prompt", "ignore_eos", "add_special", "lora"})
TOKENIZE_IN_THREAD_CHARS = 4096  # longer prompts are tokenized off the event loop
SLOT_ACTION_TIMEOUT_S = 60.0
DRAIN_POLL_S = 0.05  # how often a drain looks whether the last request has finished


class RuntimeState(enum.Enum):
    """Lifecycle of a runtime; misuse (submit before open, after close) raises a clear error."""

    CREATED = "created"  # constructed, nothing loaded
    LOADING = "loading"  # model loading, actors starting
    READY = "ready"  # serving
    STOPPING = "stopping"  # actors stopping, requests failing with Closed
    CLOSED = "closed"  # everything released




class RuntimeCore:
    """Everything of the embedding API but the HTTP app (``llamactor.runtime.Runtime`` adds it)."""

    def __init__(self, config: RuntimeConfig, *, hooks: GroupHooks | None = None) -> None:
        self.config = config
        self.hooks = hooks  # injected into every group (tests, chaos): see runtime.hooks
        self.prompt_cache: PromptCache | None = None  # host-memory prompt cache (EN-5), shared by the groups
        self.recorder: TraceRecorder | None = None  # --record-trace (BE-5), shared by the groups
        self.state = RuntimeState.CREATED
        self.model: Model | None = None
        self.chat_template: ChatTemplate | None = None
        self.supervisor: Supervisor | None = None
        self.coordinator: PhaseCoordinator | None = None
        self.metrics: Metrics | None = None
        self.started_at = 0.0
        self.draining = False  # drain(): no new requests, the ones in flight finish
        self.admission: Admission | None = None
        self.embeddings: EmbeddingService | None = None  # embed/rerank admission (API-10, API-11)
        self.adapters = LoraAdapters()  # LoRA adapters and their global scales (EN-1)
        self._stack: AsyncExitStack | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig, *, hooks: GroupHooks | None = None) -> AsyncIterator[RuntimeCore]:
        rt = cls(config, hooks=hooks)
        async with rt:
            yield rt

    async def __aenter__(self) -> RuntimeCore:
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
        assert cfg.model is not None  # validated() refuses a config without a model
        model = await anyio.to_thread.run_sync(Model, cfg.model, load_options(cfg))
        self.model = model
        self._stack.callback(model.close)
        for path, _ in cfg.lora:  # once per model, before any context exists (EN-1)
            await anyio.to_thread.run_sync(model.load_adapter, path)
        self.adapters = LoraAdapters(cfg.lora, init_without_apply=cfg.lora_init_without_apply)
        spec = await self._speculation(cfg, model)
        self.admission = Admission(model, cfg, self.tokenize, self.adapters)
        await self.admission.check_defaults()  # --temp, --grammar, -l ...: ConfigError before serving
        self.chat_template = ChatTemplate(
            chat_template_source(cfg, model), bos_token=model.token_text(model.bos), eos_token=model.token_text(model.eos)
        )
        policy_cls = policies.resolve_policy(cfg.scheduler)
        n = cfg.pipeline_groups
        policy_options = {
            "prefill_budget": cfg.prefill_budget,
            "target_itl_ms": cfg.target_itl_ms,
            "target_ttft_ms": cfg.target_ttft_ms,
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
            type_k=CACHE_TYPES[cfg.cache_type_k],
            type_v=CACHE_TYPES[cfg.cache_type_v],
            context_shift=cfg.context_shift,
            spec=spec,
        )
        metrics = self.metrics = Metrics(n, queue_depth=lambda: sup.snapshot().queue_depth)

        prompt_cache = self.prompt_cache = PromptCache(cfg.cache_ram_mib, cfg.cache_idle_slots) if cfg.cache_ram_mib else None
        recorder = self.recorder = await self._start_recorder(cfg, policy_cls.name, policy_options)

        def make_group(g: int) -> GroupActor:
            policy = policy_cls(g, **policy_options)
            coord.replace_policy(g, policy)  # a restarted group starts with fresh phase state
            if recorder is not None:
                recorder.idle(g)  # a restarted group's first step follows no step of its own
            return GroupActor(
                g, model, ctx_opts, cfg.group_slots(g), policy,
                supervisor=sup, coordinator=coord, metrics=metrics, profile=cfg.profile,
                profile_interval_s=cfg.profile_interval_s, trace=cfg.trace_steps, hooks=self.hooks,
                prompt_cache=prompt_cache, recorder=recorder,
            )

        coord = self.coordinator = PhaseCoordinator([policy_cls(g, **policy_options) for g in range(n)],
                                                    lambda g: sup.group(g), metrics)
        metrics.prompt_cache = prompt_cache.statistics if prompt_cache is not None else None
        metrics.phase_of = lambda g: coord.status(g).phase
        metrics.waiting_of = lambda g: coord.status(g).waiting
        metrics.restarts_of = lambda g: sup.snapshot().restarts[g]
        metrics.down_of = lambda g: g in sup.snapshot().groups_down
        sup = self.supervisor = Supervisor(
            n, cfg.slots_per_group, make_group,
            queue_size=cfg.queue_size, max_restarts=cfg.max_restarts, restart_window_s=cfg.restart_window_s,
        )
        scope = await self._stack.enter_async_context(open_actor_scope())
        await scope.start(coord)
        await scope.start(sup)
        embedder = None
        if cfg.embedding:  # its own context over the same weights, beside the groups (API-10)
            embedder = EmbeddingActor(model, EmbeddingOptions(
                n_batch=cfg.n_ubatch, n_seq_max=cfg.embedding_parallel, n_threads=cfg.threads_batch,
                pooling=cfg.pooling, flash_attn=FLASH_ATTN_CODES[cfg.flash_attn]))
            await scope.start(embedder)
        self.embeddings = EmbeddingService(model, embedder, normalize=cfg.embd_normalize)
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

    async def _speculation(self, cfg: RuntimeConfig, model: Model) -> SpecOptions | None:
        """EN-2: the groups' speculation settings; a draft model is loaded once here (each group
        makes its own draft context over it, PG-11) and refused unless its vocabulary is the
        target's (ConfigError: exit 2 from the command line)."""
        if cfg.spec_type == SPEC_NGRAM:
            return SpecOptions(SPEC_NGRAM, n_max=cfg.spec_ngram_size_m, n_min=cfg.spec_draft_n_min,
                               size_n=cfg.spec_ngram_size_n)
        if cfg.spec_type != SPEC_DRAFT:
            return None
        assert self._stack is not None and cfg.spec_draft_model is not None
        draft = await anyio.to_thread.run_sync(Model, cfg.spec_draft_model, draft_load_options(cfg))
        self._stack.callback(draft.close)
        await anyio.to_thread.run_sync(check_compatible, model, draft, cfg.spec_draft_model)
        return SpecOptions(SPEC_DRAFT, n_max=cfg.spec_draft_n_max, n_min=cfg.spec_draft_n_min,
                           p_min=cfg.spec_draft_p_min, draft_model=draft)

    async def _start_recorder(self, cfg: RuntimeConfig, policy: str,
                              options: dict[str, float]) -> TraceRecorder | None:
        """--record-trace (BE-5): open the trace before any request; it is closed (and its last
        records written) after the actors stopped, since exit callbacks run in reverse."""
        if not cfg.record_trace:
            return None
        assert self._stack is not None and cfg.model is not None
        recorder = TraceRecorder(cfg.record_trace, {
            "model": Path(cfg.model).name, "groups": cfg.pipeline_groups, "n_slots": cfg.slots_per_group,
            "n_batch": cfg.n_batch, "n_ubatch": cfg.n_ubatch, "n_ctx_slot": cfg.ctx_per_request,
            "kv_unified": cfg.kv_unified, "threads": cfg.threads, "policy": cfg.scheduler,
            "policy_name": policy, "policy_options": options,
        })
        await anyio.to_thread.run_sync(recorder.start)
        self._stack.push_async_callback(anyio.to_thread.run_sync, recorder.close)
        return recorder

    def _require_ready(self) -> None:
        if self.state is RuntimeState.LOADING or self.state is RuntimeState.CREATED:
            raise Unavailable("Loading model")
        if self.state is not RuntimeState.READY:
            raise Closed("the runtime is shutting down")

    def health(self) -> str:
        """"loading", "ok", "unhealthy", "draining" or "closed" (API-1)."""
        if self.state in (RuntimeState.CREATED, RuntimeState.LOADING):
            return "loading"
        if self.state is not RuntimeState.READY:
            return "closed"
        if self.draining:
            return "draining"
        assert self.supervisor is not None
        return "ok" if self.supervisor.snapshot().healthy else "unhealthy"

    def engine_status(self) -> dict[str, Any]:
        """Where the engine runs and how it is (``/props``' ``engine``): here, in this process."""
        return {"isolated": False, "state": "up" if self.state is RuntimeState.READY else self.state.value}

    # ---- graceful drain (issue 14) ------------------------------------------------------

    def in_flight(self) -> int:
        """Requests queued or holding slots (0 when nothing is left to finish)."""
        if self.supervisor is None or self.state is not RuntimeState.READY:
            return 0
        snap = self.supervisor.snapshot()
        return snap.queue_depth + sum(snap.busy)

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

    def _require_admitting(self) -> None:
        self._require_ready()
        if self.draining:
            raise Unavailable("the server is shutting down: it finishes the requests it has and takes no new ones")

    # ---- requests ----------------------------------------------------------------------

    async def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._require_ready()
        assert self.model is not None
        model = self.model
        if len(text) > TOKENIZE_IN_THREAD_CHARS:
            return await anyio.to_thread.run_sync(
                lambda: model.tokenize(text, add_special=add_special, parse_special=parse_special)
            )
        return model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._require_ready()
        assert self.model is not None
        self.model.check_tokens(tokens)
        return self.model.detokenize(tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        self._require_ready()
        assert self.chat_template is not None
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         **self.config.chat_template_kwargs)  # --chat-template-kwargs

    def prepare_chat(self, messages: Sequence[Mapping[str, Any]], *, reasoning_format: str | None = None,
                     **options: Any) -> ChatTurn:
        """Render a chat request and choose its call grammar (API-8, API-9); see ``chatturn``.

        ``options``: tools, tool_choice, parallel_tool_calls, reasoning_effort,
        chat_template_kwargs, add_generation_prompt. Raises RequestError naming the field.
        """
        self._require_ready()
        assert self.chat_template is not None
        if reasoning_format is None:
            reasoning_format = self.config.reasoning_format
        if self.config.chat_template_kwargs:  # the server's (--chat-template-kwargs) under the request's
            options["chat_template_kwargs"] = {**self.config.chat_template_kwargs,
                                               **(options.get("chat_template_kwargs") or {})}
        return prepare_chat(self.chat_template, messages, reasoning_format=reasoning_format, **options)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        reasoning_format: str | None = None,
        reasoning_effort: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """One chat turn run to the end: OpenAI-shaped ``messages`` (and ``tools``) in, the parsed
        assistant message of each choice out (``result.message.content``, ``.reasoning_content``,
        ``.tool_calls``; ``result.finish_reason`` is "tool_calls" when it called one).

        ``kwargs`` are ``submit``'s (max_tokens, n, stop, params or sampling fields, ...).
        """
        turn = self.prepare_chat(
            messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
            reasoning_format=reasoning_format, reasoning_effort=reasoning_effort,
            chat_template_kwargs=chat_template_kwargs,
        )
        submit_args = {k: kwargs.pop(k) for k in list(kwargs) if k in _SUBMIT_ARGS}
        params = kwargs.pop("params", None) or sampling_params(kwargs, self.config.sampling)
        handle = await self.submit(turn.prompt, params=turn.sampling(params), **submit_args)
        return parse_completion(turn, await collect(handle))

    async def submit(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = -1,
        n: int = 1,
        stop: Sequence[str] | None = None,
        id_slot: int = -1,
        cache_prompt: bool | None = None,
        ignore_eos: bool | None = None,
        add_special: bool = True,
        params: SamplingParams | None = None,
        n_keep: int | None = None,
        n_discard: int = 0,
        return_progress: bool = False,
        lora: Sequence[Any] | None = None,
        **sampling: Any,
    ) -> RequestHandle:
        """Validate, tokenize and queue one request; return its event stream.

        ``lora``: LoRA adapters for this request, ``[{"id": 0, "scale": 1.0}, ...]`` (adapters
        not listed: scale 0); None uses the global scales (EN-1, ``set_lora_adapters``).

        Raises RequestError for bad input (nothing else is affected) and Overloaded when the
        supervisor's mailbox is full. Later failures (queue full, engine error) arrive as the
        stream's first event; ``RequestHandle.first`` turns them into exceptions.
        """
        self._require_admitting()
        assert self.admission is not None and self.supervisor is not None
        task, recv = await self.admission.admit(
            prompt, max_tokens=max_tokens, n=n, stop=stop, id_slot=id_slot, cache_prompt=cache_prompt,
            ignore_eos=ignore_eos, add_special=add_special, params=params, sampling=sampling,
            n_keep=n_keep, n_discard=n_discard, return_progress=return_progress, lora=lora,
        )
        if task.n_predict == 0:
            task.sink.close()  # nothing to generate: the handle ends at once
            return RequestHandle(task, recv, self._cancel)
        try:
            self.supervisor.try_tell(Submit(task))
        except LlamactorError:
            recv.close()
            task.sink.close()
            raise
        return RequestHandle(task, recv, self._cancel)

    def _cancel(self, task_id: int) -> None:
        if self.supervisor is not None and self.state is RuntimeState.READY:
            try:
                self.supervisor.try_tell(Cancel(task_id))
            except LlamactorError:
                pass  # a full or closed supervisor will drop the stream on its own

    async def stream(self, prompt: str | Sequence[int], **kwargs: Any) -> AsyncIterator[Token | Done | Progress]:
        """Yield token events (and one ``Done`` per choice) of one request; with
        ``return_progress=True`` also ``Progress`` events while the prompt is processed."""
        handle = await self.submit(prompt, **kwargs)
        async with handle:
            async for event in handle:
                yield event

    async def complete(self, prompt: str | Sequence[int], **kwargs: Any) -> Completion:
        """Run one request to the end and return every choice."""
        handle = await self.submit(prompt, **kwargs)
        return await collect(handle)

    def infill_prompt(self, input_prefix: str | Sequence[Any], input_suffix: str | Sequence[Any],
                      input_extra: Sequence[Any] = (), prompt: str = "") -> list[int]:
        """The fill-in-the-middle prompt tokens (API-12), as llama-server's /infill builds them.

        Raises NotSupported (501) for a model without FIM tokens, RequestError naming the field.
        """
        self._require_ready()
        assert self.model is not None
        cfg = self.config
        return infill_tokens(self.model, input_prefix, input_suffix, input_extra, prompt,
                             n_batch=cfg.n_batch, n_predict=cfg.n_predict_max, n_ctx=cfg.ctx_per_request)

    async def infill(self, input_prefix: str | Sequence[Any], input_suffix: str | Sequence[Any], *,
                     input_extra: Sequence[Any] = (), prompt: str = "", **kwargs: Any) -> Completion:
        """Fill in the middle between ``input_prefix`` and ``input_suffix`` (API-12) and run it to
        the end; ``input_extra`` is a list of {"filename", "text"} chunks of other files, and
        ``kwargs`` are ``submit``'s (max_tokens, stop, sampling fields, ...)."""
        tokens = self.infill_prompt(input_prefix, input_suffix, input_extra, prompt)
        return await collect(await self.submit(tokens, **kwargs))

    # ---- LoRA adapters (EN-1) ------------------------------------------------------------

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapters with their global scales (``GET /lora-adapters``)."""
        self._require_ready()
        return self.adapters.rows()

    def set_lora_adapters(self, entries: Sequence[Any]) -> None:
        """Set the global scales, ``[{"id": 0, "scale": 0.5}, ...]``; adapters not listed get 0
        (``POST /lora-adapters``). Requests already admitted keep the set they got."""
        self._require_ready()
        self.adapters.set_scales(entries)

    # ---- slots, metrics, app -------------------------------------------------------------

    def slots(self) -> list[dict[str, Any]]:
        self._require_ready()
        assert self.supervisor is not None
        return self.supervisor.slot_rows()

    async def fetch_slots(self) -> list[dict[str, Any]]:
        """``slots()``, also when the engine runs in a child process (the HTTP app uses this)."""
        return self.slots()

    async def slot_action(self, slot: int, action: str, path: str = "") -> dict[str, Any]:
        self._require_ready()
        assert self.supervisor is not None
        return await self.supervisor.ask(lambda r: SlotRequest(action, slot, path, r), SLOT_ACTION_TIMEOUT_S)

    # ---- embeddings and rerank (API-10, API-11) -------------------------------------------

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

    def metrics_text(self) -> bytes:
        assert self.metrics is not None
        return self.metrics.render()

    async def fetch_metrics(self) -> bytes:
        """``metrics_text()``, also when the engine runs in a child process (the HTTP app uses this)."""
        return self.metrics_text()

    def live_snapshot(self) -> LiveSnapshot:
        """Groups, slots, phases, queue and counters as one frozen snapshot (API-17).

        Never raises: a runtime that is loading or stopping reports its state and no groups.
        Cheap (reads frozen reports only); ``/live`` calls it once per tick for all its clients.
        """
        sup, coord, metrics = self.supervisor, self.coordinator, self.metrics
        if self.state is not RuntimeState.READY or sup is None or coord is None or metrics is None:
            return live.idle_snapshot(self.config, self.state.value)
        return live.build_snapshot(self.config, self.state.value, self.started_at, sup, coord, metrics)


def chat_template_source(cfg: RuntimeConfig, model: Model) -> str | None:
    """--chat-template (Jinja source, or "chatml" as llama-server names it), else
    --chat-template-file, else the GGUF's own; None means ChatML."""
    if cfg.chat_template is not None:
        return None if cfg.chat_template == "chatml" else cfg.chat_template
    if cfg.chat_template_file is not None:
        try:
            with open(cfg.chat_template_file, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read --chat-template-file {cfg.chat_template_file}: {exc.strerror}") from None
    return model.chat_template()


def load_options(cfg: RuntimeConfig) -> LoadOptions:
    """Weights placement from the config: local, or split over ggml-rpc workers (SPEC 5)."""
    devices = None
    if cfg.rpc_servers or cfg.devices:
        from llamactor.runtime.engine import rpc

        added = rpc.add_servers(list(cfg.rpc_servers))
        names = list(cfg.devices) or [*added, "CPU"]  # default: workers first, the local CPU last
        devices = rpc.device_array(names)
        log.info("layer_split", devices=names, tensor_split=list(cfg.tensor_split), split_mode=cfg.split_mode)
    concurrent = concurrent_rpc_contexts(cfg)
    if concurrent:
        user = graph_reuse_user_setting()
        if user:
            log.warning("graph_reuse", enabled=True, why=f"{GRAPH_REUSE_ENV}={os.environ[GRAPH_REUSE_ENV]!r} "
                        "is set: contexts decoding at once on a ggml-rpc device may repeat a token")
        else:
            log.info("graph_reuse", enabled=False, why="contexts decoding at once on a ggml-rpc device")
    return LoadOptions(
        n_gpu_layers=cfg.n_gpu_layers,
        use_mmap=cfg.use_mmap,
        split_mode=SPLIT_MODE_CODES[cfg.split_mode],
        tensor_split=cfg.tensor_split,
        devices=devices,
        graph_reuse=not concurrent,
    )


def concurrent_rpc_contexts(cfg: RuntimeConfig) -> bool:
    """Whether contexts over the model may decode at once on a ggml-rpc device (pipeline groups,
    or the embedding context beside a group): then they need graph reuse off (open_context)."""
    return bool(cfg.rpc_servers) and (cfg.pipeline_groups > 1 or cfg.embedding)


def draft_load_options(cfg: RuntimeConfig) -> LoadOptions:
    """The draft model's placement: -ngld (default: as -ngl) on -devd's devices (default: local)."""
    devices = None
    if cfg.spec_draft_devices:
        from llamactor.runtime.engine import rpc

        devices = rpc.device_array(list(cfg.spec_draft_devices))
    n_gpu_layers = cfg.n_gpu_layers if cfg.spec_draft_n_gpu_layers is None else cfg.spec_draft_n_gpu_layers
    # the groups' draft contexts decode at once too (open_context)
    graph_reuse = not (devices is not None and cfg.rpc_servers and cfg.pipeline_groups > 1)
    return LoadOptions(n_gpu_layers=n_gpu_layers, use_mmap=cfg.use_mmap, devices=devices, graph_reuse=graph_reuse)


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
