"""``InProcessEngine``: the model, the groups, the coordinator and the supervisor in this process.

It is the ``EngineClient`` of a runtime opened with ``isolate=False``, and what the engine
process runs for an isolated one (``runtime.service.engineproc``). ``open`` loads the model
(and its LoRA adapters and draft model), starts the coordinator, the supervisor with its
groups, and the embedding actor, each ready before the next starts; leaving it stops them in
reverse order and frees the model.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import llama_cpp
import numpy as np
import structlog

from llamactor.actors import policies
from llamactor.actors.coordinator import PhaseCoordinator
from llamactor.actors.embedder import EmbeddingActor
from llamactor.actors.group import GroupActor
from llamactor.actors.policies.guard import GuardedPolicy
from llamactor.actors.policy import Policy
from llamactor.actors.recorder import TraceRecorder
from llamactor.actors.supervisor import Supervisor
from llamactor.protocol.build import BuildInfo
from llamactor.protocol.embedding import Embedded, EmbedderInfo, EmbedJob
from llamactor.protocol.errors import EngineError, LlamactorError, error_from
from llamactor.protocol.events import Failed
from llamactor.protocol.live import LiveSnapshot
from llamactor.protocol.messages import Cancel, SlotRequest, Submit, Task
from llamactor.protocol.slots import SlotActionResult, SlotState
from llamactor.runtime.engine import backends
from llamactor.runtime.engine.context import ContextOptions
from llamactor.runtime.engine.controlvector import ControlVector, control_vector_for
from llamactor.runtime.engine.draftmodel import check_compatible
from llamactor.runtime.engine.embedding import EmbeddingOptions
from llamactor.runtime.engine.hooks import GroupHooks
from llamactor.runtime.engine.model import GRAPH_REUSE_ENV, LoadOptions, Model, graph_reuse_user_setting
from llamactor.runtime.engine.overrides import ROPE_SCALING_TYPES, RopeOptions
from llamactor.runtime.engine.promptcache import PromptCache
from llamactor.runtime.engine.speculative import SPEC_CACHE, SPEC_DRAFT, SPEC_MOD, SPEC_NGRAM, SpecOptions
from llamactor.runtime.engine.vision import Vision
from llamactor.runtime.kernel.actor import open_actor_scope
from llamactor.runtime.service import live
from llamactor.runtime.service.config import CACHE_TYPES, RuntimeConfig
from llamactor.runtime.service.engine import EngineStatus
from llamactor.runtime.service.metrics import Metrics, ServingLoad, adapter_names

log = structlog.get_logger("llamactor.engine")

SLOT_ACTION_TIMEOUT_S = 60.0


class LocalEmbedder:
    """The embedding actor of this process, behind the ``Embedder`` interface."""

    def __init__(self, actor: EmbeddingActor) -> None:
        self.actor = actor
        self.info = EmbedderInfo(actor.pooling, actor.n_embd, actor.max_input_tokens)
        self._ids = 0

    async def embed(self, inputs: list[list[int]], normalize: int) -> Embedded:
        """Queue one job and wait for its answer; leaving early (cancellation) drops the job."""
        self._ids += 1
        send, recv = anyio.create_memory_object_stream[Any](1)
        job = EmbedJob(self._ids, tuple(np.asarray(t, dtype=np.int32) for t in inputs), normalize, send)
        with recv:
            try:
                self.actor.try_tell(job)
            except BaseException:
                send.close()
                raise
            try:
                event = await recv.receive()
            except anyio.EndOfStream:
                raise EngineError("the embedder dropped the request") from None
        if isinstance(event, Failed):
            raise error_from(event.error, event.message)
        assert isinstance(event, Embedded)
        return event


class InProcessEngine:
    """The engine in this process; see the module docstring. Made by ``open``."""

    def __init__(
        self,
        config: RuntimeConfig,
        model: Model,
        supervisor: Supervisor,
        coordinator: PhaseCoordinator,
        metrics: Metrics,
        embedder: LocalEmbedder | None,
        prompt_cache: PromptCache | None,
    ) -> None:
        self.config = config
        self.model = model
        self.supervisor = supervisor
        self.coordinator = coordinator
        self.metrics = metrics
        self.embedder = embedder
        self.prompt_cache = prompt_cache  # the host-memory prompt cache the groups share (--cache-ram)
        self.vision: Vision | None = None  # --mmproj: the projector the groups decode images with
        self.build: BuildInfo | None = None  # the llama.cpp build and its devices, read at open
        self.started_at = time.time()

    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig, *, hooks: GroupHooks | None = None) -> AsyncIterator[InProcessEngine]:
        """Load and start everything for ``config`` (validated); stop it all on the way out."""
        cfg = config
        async with AsyncExitStack() as stack:
            assert cfg.model is not None
            model = await anyio.to_thread.run_sync(Model, cfg.model, load_options(cfg))
            stack.callback(model.close)
            build = backends.summary()
            log.info(
                "engine_build",
                backend=build.backend,
                cpu_features=list(build.cpu_features),
                devices=[f"{d.name} ({d.description}, {d.memory_total / 2**30:.1f} GiB)" for d in build.devices],
                gpu_layers=cfg.n_gpu_layers if backends.gpus() else 0,
            )
            if cfg.tensor_overrides:  # -ot and friends: which tensors their patterns placed, where
                log.info("tensor_overrides", tensors=dict(model.overridden))
            for path, _ in cfg.lora:  # once per model, before any context exists
                await anyio.to_thread.run_sync(model.load_adapter, path)
            spec = await _speculation(cfg, model, stack)
            vision = await anyio.to_thread.run_sync(load_vision, cfg, model)
            if vision is not None:
                stack.callback(vision.close)  # after the groups stop (they are stopped before)
            rope = rope_options(cfg)
            cvec = await anyio.to_thread.run_sync(control_vector, cfg, model)
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
                vision=vision,
                spec=spec,
                rope=rope,
                control_vector=cvec,
                offload_kqv=cfg.kv_offload,
                op_offload=cfg.op_offload,
                warmup=cfg.warmup,
            )
            n = cfg.pipeline_groups
            make_inner = policies.policy_factory(cfg.scheduler, policy_options(cfg))

            def make_policy(g: int) -> Policy:
                """The policy of group ``g``, every plan checked (``GuardedPolicy``)."""
                return GuardedPolicy(make_inner(g), first_slot=cfg.group_slots(g).start)

            metrics = Metrics(
                n,
                queue_depth=lambda: sup.snapshot().queue_depth,
                kv_cells_total=cfg.total_kv_cells,
                lora_names=adapter_names(path for path, _ in cfg.lora),
            )
            prompt_cache = PromptCache(cfg.cache_ram_mib, cfg.cache_idle_slots) if cfg.cache_ram_mib else None
            recorder = await _start_recorder(cfg, policies.resolve_policy(cfg.scheduler).name, stack)
            fresh = [True] * n  # the coordinator's first policy of a group is the group's first

            def make_group(g: int) -> GroupActor:
                if fresh[g]:
                    fresh[g] = False
                    policy = coord.policy(g)
                else:  # a restarted group starts with fresh phase state
                    policy = make_policy(g)
                    coord.replace_policy(g, policy)
                if recorder is not None:
                    recorder.idle(g)  # a restarted group's first step follows no step of its own
                return GroupActor(
                    g,
                    model,
                    ctx_opts,
                    cfg.group_slots(g),
                    policy,
                    supervisor=sup,
                    coordinator=coord,
                    metrics=metrics,
                    profile=cfg.profile,
                    profile_interval_s=cfg.profile_interval_s,
                    trace=cfg.trace_steps,
                    hooks=hooks,
                    prompt_cache=prompt_cache,
                    recorder=recorder,
                )

            coord = PhaseCoordinator([make_policy(g) for g in range(n)], lambda g: sup.group(g), metrics)
            metrics.prompt_cache = prompt_cache.statistics if prompt_cache is not None else None
            metrics.phase_of = lambda g: coord.status(g).phase
            metrics.waiting_of = lambda g: coord.status(g).waiting
            metrics.restarts_of = lambda g: sup.snapshot().restarts[g]
            metrics.down_of = lambda g: g in sup.snapshot().groups_down
            metrics.load = lambda: serving_load(sup, cfg.ctx_per_context)
            sup = Supervisor(
                n,
                cfg.slots_per_group,
                make_group,
                queue_size=cfg.queue_size,
                max_restarts=cfg.max_restarts,
                restart_window_s=cfg.restart_window_s,
                slot_choice=policies.resolve_policy(cfg.scheduler).slot_choice,
            )
            scope = await stack.enter_async_context(open_actor_scope())
            await scope.start(coord)
            await scope.start(sup)
            embedder = None
            if cfg.embedding:  # its own context over the same weights, beside the groups
                actor = EmbeddingActor(
                    model,
                    EmbeddingOptions(
                        n_batch=cfg.n_ubatch,
                        n_seq_max=cfg.embedding_parallel,
                        n_threads=cfg.threads_batch,
                        pooling=cfg.pooling,
                        flash_attn=FLASH_ATTN_CODES[cfg.flash_attn],
                        rope=rope,
                        control_vector=cvec,
                    ),
                )
                await scope.start(actor)
                embedder = LocalEmbedder(actor)
                metrics.embedding_work = lambda: (actor.statistics().tokens_done, actor.statistics().steps)
            log.info("engine_loaded", model=str(cfg.model), groups=n, pid=os.getpid())
            engine = cls(cfg, model, sup, coord, metrics, embedder, prompt_cache)
            engine.vision = vision
            engine.build = build
            yield engine

    # ---- EngineClient ---------------------------------------------------------------------

    def submit(self, task: Task) -> None:
        self.supervisor.try_tell(Submit(task))

    def cancel(self, task_id: int) -> None:
        try:
            self.supervisor.try_tell(Cancel(task_id))
        except LlamactorError:
            pass  # a full or closed supervisor drops the stream on its own

    async def slots(self) -> list[SlotState]:
        return self.slot_states()

    def slot_states(self) -> list[SlotState]:
        return self.supervisor.slot_states()

    async def slot_action(self, slot: int, action: str, path: str = "") -> SlotActionResult:
        return await self.supervisor.ask(lambda r: SlotRequest(action, slot, path, r), SLOT_ACTION_TIMEOUT_S)

    async def metrics_text(self) -> bytes:
        return self.metrics.render()

    def live_snapshot(self) -> LiveSnapshot:
        return live.build_snapshot(
            self.config, "ready", self.started_at, self.supervisor, self.coordinator, self.metrics
        )

    async def read_live(self) -> LiveSnapshot:
        return self.live_snapshot()

    def health(self) -> str:
        return "ok" if self.supervisor.snapshot().healthy else "unhealthy"

    def in_flight(self) -> int:
        snap = self.supervisor.snapshot()
        return snap.queue_depth + sum(snap.busy)

    def status(self) -> EngineStatus:
        return EngineStatus(
            isolated=False,
            state="up" if self.health() == "ok" else "down",
            pid=os.getpid(),
            requests_in_flight=self.in_flight(),
            build=self.build,
        )

    async def restart(self) -> None:
        await self.supervisor.restart_down()

    def held_prompts(self) -> list[np.ndarray]:
        """Token ids whose KV this engine holds: each slot's, then each RAM prompt cache entry's
        (what a replica reports for routing by cache)."""
        held = [e.cached for e in self.supervisor.table if len(e.cached)]
        if self.prompt_cache is not None:
            held += self.prompt_cache.held()
        return held

    def steps(self) -> int:
        """Decode steps so far, all groups (the engine process's heartbeat reports them)."""
        return sum(c.n_decode for c in self.metrics.groups)

    def step_started(self) -> list[float]:
        """Per group, the perf_counter time its running decode step started (0.0: none)."""
        return [group.step_started if group is not None else 0.0 for group in self.supervisor.groups]


def serving_load(sup: Supervisor, cells_per_group: int) -> ServingLoad:
    """The gateway series' reading (``runtime.service.metrics``), one pass over the slots.

    Running requests are the supervisor's (assigned a slot, the group may not have taken them
    yet); the KV cells used are those the busy slots hold (``slot.cache``: what /slots shows as
    ``n_cached``), at most a group's cells per group: with ``--kv-unified`` a prefix that slots
    share is one set of cells counted once per slot. Idle slots' cached prompts do not count:
    they are dropped first when room is needed (``actors.eviction``), as vLLM counts cached blocks
    no request holds as free.
    """
    used = 0
    running: set[int] = set()
    for group in sup.groups:
        if group is None:
            continue
        cells = 0
        for s in group.slots:
            if not s.busy:
                continue
            cells += len(s.cache)
            task = s.task
            if task is not None:
                running.update(i for i, _ in task.lora)
        used += min(cells, cells_per_group)
    waiting = {i for task in sup.queue for i, _ in task.lora}
    return ServingLoad(
        queued=len(sup.queue),
        running=len(sup.running),
        kv_cells_used=used,
        running_lora=tuple(sorted(running)),
        waiting_lora=tuple(sorted(waiting)),
    )


def policy_options(cfg: RuntimeConfig) -> dict[str, Any]:
    """The options every policy gets: the built-in targets, then ``scheduler_options``."""
    return {
        "prefill_budget": cfg.prefill_budget,
        "target_itl_ms": cfg.target_itl_ms,
        "target_ttft_ms": cfg.target_ttft_ms,
        "cohort_max_generate_ms": cfg.cohort_max_generate_ms,
        "slo_ttft_ms": cfg.slo_ttft_ms,
        "slo_itl_ms": cfg.slo_itl_ms,
        "slo_itl_pct": cfg.slo_itl_pct,
        **cfg.scheduler_options,
    }


async def _speculation(cfg: RuntimeConfig, model: Model, stack: AsyncExitStack) -> SpecOptions | None:
    """The groups' speculation settings; a draft model is loaded once here (each group makes its
    own draft context over it) and refused unless its vocabulary is the target's (ConfigError:
    exit 2 from the command line)."""
    if cfg.spec_type == SPEC_NGRAM:
        return SpecOptions(
            SPEC_NGRAM, n_max=cfg.spec_ngram_size_m, n_min=cfg.spec_draft_n_min, size_n=cfg.spec_ngram_size_n
        )
    if cfg.spec_type == SPEC_MOD:
        return SpecOptions(
            SPEC_MOD, n_max=cfg.spec_ngram_mod_n_max, n_min=cfg.spec_ngram_mod_n_min, size_n=cfg.spec_ngram_mod_n_match
        )
    if cfg.spec_type == SPEC_CACHE:
        from llamactor.runtime.engine import ngramcache

        static = (
            await anyio.to_thread.run_sync(ngramcache.load, cfg.lookup_cache_static) if cfg.lookup_cache_static else {}
        )
        dynamic = await anyio.to_thread.run_sync(ngramcache.DynamicCache, cfg.lookup_cache_dynamic)
        log.info("lookup_caches", static_ngrams=len(static), dynamic_ngrams=len(dynamic.cache))
        return SpecOptions(
            SPEC_CACHE, n_max=ngramcache.N_DRAFT, n_min=cfg.spec_draft_n_min, static_cache=static, dynamic_cache=dynamic
        )
    if cfg.spec_type != SPEC_DRAFT:
        return None
    assert cfg.spec_draft_model is not None
    draft = await anyio.to_thread.run_sync(Model, cfg.spec_draft_model, draft_load_options(cfg))
    stack.callback(draft.close)
    await anyio.to_thread.run_sync(check_compatible, model, draft, cfg.spec_draft_model)
    return SpecOptions(
        SPEC_DRAFT,
        n_max=cfg.spec_draft_n_max,
        n_min=cfg.spec_draft_n_min,
        p_min=cfg.spec_draft_p_min,
        draft_model=draft,
    )


async def _start_recorder(cfg: RuntimeConfig, policy: str, stack: AsyncExitStack) -> TraceRecorder | None:
    """--record-trace: open the trace before any request; it is closed (and its last records
    written) after the actors stopped, since exit callbacks run in reverse."""
    if not cfg.record_trace:
        return None
    assert cfg.model is not None
    recorder = TraceRecorder(
        cfg.record_trace,
        {
            "model": Path(cfg.model).name,
            "groups": cfg.pipeline_groups,
            "n_slots": cfg.slots_per_group,
            "n_batch": cfg.n_batch,
            "n_ubatch": cfg.n_ubatch,
            "n_ctx_slot": cfg.ctx_per_request,
            "kv_unified": cfg.kv_unified,
            "threads": cfg.threads,
            "policy": policies.policy_name(cfg.scheduler),
            "policy_name": policy,
            "policy_options": policy_options(cfg),
        },
    )
    await anyio.to_thread.run_sync(recorder.start)
    stack.push_async_callback(anyio.to_thread.run_sync, recorder.close)
    return recorder


def load_options(cfg: RuntimeConfig) -> LoadOptions:
    """Weights placement from the config: local, or split over ggml-rpc workers."""
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
            log.warning(
                "graph_reuse",
                enabled=True,
                why=f"{GRAPH_REUSE_ENV}={os.environ[GRAPH_REUSE_ENV]!r} is set: contexts decoding at once "
                "on a ggml-rpc device may repeat a token",
            )
        else:
            log.info("graph_reuse", enabled=False, why="contexts decoding at once on a ggml-rpc device")
    if cfg.tensor_overrides:
        from llamactor.runtime.engine import placement

        placement.check_buffer_types(cfg.tensor_overrides)  # a ggml-rpc worker's are known by now
    return LoadOptions(
        n_gpu_layers=cfg.n_gpu_layers,
        main_gpu=cfg.main_gpu,
        use_extra_bufts=cfg.repack,
        no_host=cfg.no_host,
        load_mode=cfg.model_load_mode,
        lazy_mode=cfg.lazy_mode,
        tensor_overrides=cfg.tensor_overrides,
        special=cfg.special,
        split_mode=SPLIT_MODE_CODES[cfg.split_mode],
        tensor_split=cfg.tensor_split,
        devices=devices,
        graph_reuse=not concurrent,
        kv_overrides=cfg.kv_overrides,
    )


def rope_options(cfg: RuntimeConfig) -> RopeOptions:
    """The RoPE/YaRN settings of every context (--rope-*, --yarn-*; the model's own by default)."""
    return RopeOptions(
        scaling_type=ROPE_SCALING_TYPES.get(cfg.rope_scaling, llama_cpp.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED),
        freq_base=cfg.rope_freq_base,
        freq_scale=cfg.rope_freq_scale,
        yarn_orig_ctx=cfg.yarn_orig_ctx,
        yarn_ext_factor=cfg.yarn_ext_factor,
        yarn_attn_factor=cfg.yarn_attn_factor,
        yarn_beta_slow=cfg.yarn_beta_slow,
        yarn_beta_fast=cfg.yarn_beta_fast,
    )


def control_vector(cfg: RuntimeConfig, model: Model) -> ControlVector | None:
    """--control-vector: the files' directions summed for ``model`` (ConfigError: exit 2), or None."""
    if not cfg.control_vectors:
        return None
    cvec = control_vector_for(
        cfg.control_vectors,
        cfg.control_vector_layers,
        llama_cpp.llama_model_n_embd(model.ptr),
        llama_cpp.llama_model_n_layer(model.ptr),
    )
    log.info(
        "control_vector",
        files=[path for path, _ in cfg.control_vectors],
        layers=[cvec.layer_start, cvec.layer_end],
    )
    return cvec


def load_vision(cfg: RuntimeConfig, model: Model) -> Vision | None:
    """--mmproj: the projector next to ``model`` (ConfigError, exit 2, when it does not fit it)."""
    if cfg.mmproj is None:
        return None
    vision = Vision(
        cfg.mmproj,
        model,
        use_gpu=cfg.mmproj_offload,
        n_threads=cfg.threads_batch or cfg.threads,
        image_min_tokens=cfg.image_min_tokens,
        image_max_tokens=cfg.image_max_tokens,
        batch_max_tokens=cfg.mtmd_batch_max_tokens,
    )
    log.info("mmproj", path=str(cfg.mmproj), vision=vision.vision, audio=vision.audio, marker=vision.marker)
    return vision


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
    return LoadOptions(
        n_gpu_layers=n_gpu_layers,
        load_mode=cfg.model_load_mode,  # as llama-server loads its draft: the same load and lazy modes
        lazy_mode=cfg.lazy_mode,
        devices=devices,
        graph_reuse=graph_reuse,
        kv_overrides=cfg.kv_overrides,  # as llama-server loads its draft: with the same overrides
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
