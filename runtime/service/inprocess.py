"""``InProcessEngine``: the model, the groups, the coordinator and the supervisor in this process.

It is the ``EngineClient`` of a runtime opened with ``isolate=False``, and what the engine
process runs for an isolated one (``runtime.service.engineproc``). ``open`` loads the model
(and its LoRA adapters and draft model), starts the coordinator, the supervisor with its
groups, and the embedding actor, each ready before the next starts; leaving it stops them in
reverse order and frees the model. What the config says of the weights, contexts and policies
is read in ``runtime.service.engineoptions``.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
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
from llamactor.protocol.slots import SlotActionResult, SlotKV, SlotState
from llamactor.runtime.engine import backends
from llamactor.runtime.engine.context import ContextOptions
from llamactor.runtime.engine.embedding import EmbeddingOptions
from llamactor.runtime.engine.hooks import GroupHooks
from llamactor.runtime.engine.model import Model
from llamactor.runtime.engine.promptcache import PromptCache
from llamactor.runtime.engine.vision import Vision
from llamactor.runtime.kernel.actor import open_actor_scope
from llamactor.runtime.service import live
from llamactor.runtime.service.config import CACHE_TYPES, RuntimeConfig
from llamactor.runtime.service.engine import EngineStatus
from llamactor.runtime.service.engineoptions import (
    FLASH_ATTN_CODES,
    control_vector,
    load_options,
    load_vision,
    policy_options,
    rope_options,
    speculation_options,
)
from llamactor.runtime.service.gatewaymetrics import ServingLoad, adapter_names
from llamactor.runtime.service.metrics import Metrics

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
            spec = await speculation_options(cfg, model, stack)
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
                swa_full=cfg.swa_full,
                ctx_checkpoints=cfg.ctx_checkpoints,
                checkpoint_min_step=cfg.checkpoint_min_step,
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

    async def slot_action(self, slot: int, action: str, path: str = "", kv: SlotKV | None = None) -> SlotActionResult:
        return await self.supervisor.ask(lambda r: SlotRequest(action, slot, path, r, kv), SLOT_ACTION_TIMEOUT_S)

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
    """The gateway series' reading (``runtime.service.gatewaymetrics``), one pass over the slots.

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
