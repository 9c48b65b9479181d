"""GroupActor: owns one llama_context, its slots and its decode loop.

Per iteration the loop (1) drains its mailbox without waiting, so new work joins the next
step; (2) asks its policy for a plan from a plain snapshot; (3) runs the step in a worker
thread (``llama_decode`` releases the GIL, so other groups decode meanwhile); (4) sends the
step's events straight to each request's result stream. When nothing is runnable it waits
on the mailbox, so an idle group costs no CPU.

Slot-touching commands (erase/save/restore) run between this group's steps only, never during its
decode; other groups keep decoding.

The actor is three modules, one concept each: this one (lifecycle, mailbox, the decode loop
and the policy's snapshot), ``groupoutcomes`` (what a step's outcome does to the requests)
and ``groupslots`` (how a request starts and ends on the slots, and the slot commands).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from llamactor.actors.costs import StepCosts
from llamactor.actors.delivery import hooked_send, send_event, send_final
from llamactor.actors.groupoutcomes import GroupOutcomes
from llamactor.actors.loraturns import LoraTurns
from llamactor.actors.observe import GroupMetrics
from llamactor.actors.policies.guard import PolicyFailed
from llamactor.actors.policy import GroupView, Policy, StepPlan
from llamactor.actors.recorder import TraceRecorder
from llamactor.actors.scheduling import SlotSnapshot, group_view
from llamactor.actors.trace import StepRecord
from llamactor.protocol.errors import EngineError
from llamactor.protocol.events import Failed
from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.protocol.messages import Assign, Grant, GroupMsg, Revoke, SlotCommand
from llamactor.protocol.plan import NO_TAGS
from llamactor.protocol.slots import SlotState
from llamactor.runtime.engine.context import Context, ContextOptions, KvCacheFull
from llamactor.runtime.engine.hooks import GroupHooks
from llamactor.runtime.engine.profiler import REPORT_INTERVAL_S, GroupProfile
from llamactor.runtime.engine.promptcache import PromptCache
from llamactor.runtime.engine.slot import Phase, Slot
from llamactor.runtime.kernel.actor import Actor

if TYPE_CHECKING:
    from llamactor.runtime.engine.model import Model

log = structlog.get_logger("llamactor.group")


class GroupActor(GroupOutcomes, Actor[GroupMsg]):
    def __init__(
        self,
        group: int,
        model: Model,
        ctx_opts: ContextOptions,
        slot_ids: range,
        policy: Policy,
        *,
        supervisor: Actor[Any],
        coordinator: Actor[Any] | None,
        metrics: GroupMetrics,
        profile: bool = False,
        profile_interval_s: float = REPORT_INTERVAL_S,
        trace: bool = False,
        hooks: GroupHooks | None = None,
        prompt_cache: PromptCache | None = None,
        recorder: TraceRecorder | None = None,
    ) -> None:
        self.mailbox_size = 4 * len(slot_ids) + 64
        super().__init__()
        self.group = group
        self.name = f"group-{group}"
        self.model = model
        self.ctx_opts = ctx_opts
        self.slots = [Slot(sid, local) for local, sid in enumerate(slot_ids)]
        self.policy = policy
        self.supervisor = supervisor
        self.coordinator = coordinator
        self.metrics = metrics
        self.engine: Context | None = None
        self.grant: Grant | None = None
        self._order = 0
        self._steps = 0
        self.costs = StepCosts()
        self.trace: list[StepRecord] | None = [] if trace else None
        self._limiter = anyio.CapacityLimiter(1)
        self._tasks: dict[int, list[Slot]] = {}  # task id -> its slots (parent first)
        self.hooks = hooks
        self.prompt_cache = prompt_cache  # shared by every group of the runtime (host-memory prompt cache)
        self.recorder = recorder  # --record-trace (for replay): appends a tuple per step and per request
        self._send = send_event if hooks is None else hooked_send(hooks, group)
        self.profile_interval_s = profile_interval_s
        self.profile: GroupProfile | None = GroupProfile(started=time.perf_counter()) if profile else None
        self.lora_turns = LoraTurns() if model.adapters else None  # one LoRA set per step
        self.step_started = 0.0  # perf_counter() while a decode step runs, else 0 (the engine's watchdog)

    # ---- lifecycle -------------------------------------------------------------------

    async def setup(self) -> None:
        self.engine = await anyio.to_thread.run_sync(Context, self.model, self.ctx_opts, self.hooks, self.group)
        self.engine.holds_ready = self.policy.holds_ready
        if self.ctx_opts.warmup:
            await anyio.to_thread.run_sync(self.engine.warmup, limiter=self._limiter)

    async def teardown(self) -> None:
        self.fail_all("the runtime is shutting down", "Closed")
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await anyio.to_thread.run_sync(engine.close, limiter=self._limiter)

    def fail_all(self, message: str, error: str = "EngineError") -> list[int]:
        """Fail every request this group holds or has queued (supervision). Returns slot ids."""
        freed: list[int] = []
        for task_id in list(self._tasks):
            freed += self._end_task(task_id, Failed(message, error), report=False)
        while True:
            try:
                msg = self._inbox_recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if isinstance(msg, Assign):  # the request being admitted fails too: none waits
                send_final(msg.task.sink, Failed(message, error))
                freed += [self.slots[i].id for i in msg.slots]
            elif isinstance(msg, SlotCommand):
                msg.reply.fail(EngineError(message))
        return freed

    # ---- the loop --------------------------------------------------------------------

    async def loop(self) -> None:
        try:
            await self._decode_loop()
        except Exception as exc:
            # Fail everything now, while the mailbox is still open to drain pending Assigns.
            held = sorted(self._tasks)
            self.fail_all(f"group {self.group} failed: {exc}")
            log.error("group_step_failed", group=self.group, tasks=held, error=str(exc))
            raise

    async def _decode_loop(self) -> None:
        assert self.engine is not None
        while True:
            if not self._drain():
                return
            self._settle()
            try:
                plan = self.policy.plan(self._view(), self.grant)
            except PolicyFailed as exc:
                self._policy_failed(exc)
                continue
            if self.lora_turns is not None:
                plan = self.lora_turns.narrow(plan, self._lora_of)
            if plan.empty:
                if self.recorder is not None:
                    self.recorder.idle(self.group)
                try:
                    msg = await self._inbox_recv.receive()
                except (anyio.EndOfStream, anyio.ClosedResourceError):
                    return
                self._handle(msg)
                continue
            if self.trace is not None:
                self._record(plan)
            prof = self.profile
            t0 = time.perf_counter()
            if prof is not None:
                prof.started_step = t0
            self.step_started = t0
            try:
                res = await anyio.to_thread.run_sync(self.engine.step, plan, self.slots, prof, limiter=self._limiter)
            except KvCacheFull:
                self._make_room()
                continue
            finally:
                self.step_started = 0.0
            t1 = time.perf_counter()
            self.costs.learn(res, (t1 - t0) * 1e3)
            if self.recorder is not None:
                self.recorder.step(self.group, t0, t1, plan, res, self.slots)
            self._deliver(res)
            if prof is not None:
                prof.deliver += time.perf_counter() - t1
                prof.iterations += 1
                if t1 - prof.started >= self.profile_interval_s:
                    log.info("pipe_profile", group=self.group, window_s=round(t1 - prof.started, 3), **prof.report())
                    prof.started = t1

    # ---- the policy's input, the mailbox -----------------------------------------------

    def _record(self, plan: StepPlan) -> None:
        assert self.trace is not None
        self._steps += 1
        prefill = tuple(local for local, _ in plan.prefill)
        involved = (*prefill, *plan.generate, *plan.release)
        cohorts = {local: self.policy.cohort_of(self.slots[local].order) for local in involved}
        lora = {local: self._lora_of(local) for local in (*prefill, *plan.generate)}
        self.trace.append(StepRecord(self.group, self._steps, prefill, plan.generate, plan.release, cohorts, lora))

    def _lora_of(self, local: int) -> LoraSet:
        task = self.slots[local].task
        return task.lora if task is not None else NO_LORA

    def _drain(self) -> bool:
        """Handle every queued message without waiting; False once the mailbox is closed."""
        return self.drain_queued(self._handle)

    def _handle(self, msg: GroupMsg) -> None:
        match msg:
            case Assign(task=task, slots=locals_):
                self._assign(task, locals_)
            case Revoke(task_id=task_id):
                if task_id in self._tasks:
                    self._end_task(task_id, None)
            case SlotCommand():
                self._slot_command(msg)
            case Grant():
                self.grant = msg

    def _view(self) -> GroupView:
        """The policy's snapshot of this group (``scheduling.group_view``, as the simulator builds it)."""
        busy = (
            SlotSnapshot(
                s.local,
                s.phase.value,
                s.prompt_left,
                s.order,
                s.parent.local if s.parent is not None else -1,
                s.task.arrived if s.task is not None else 0.0,
                len(s.prompt),
                s.n_decoded,
                s.t_prompt_done,
                s.finished,
                s.follows is not None,  # a follower waits for its leader's prefix (prefix sharing)
                s.task.priority if s.task is not None else 0,
                s.task.tags if s.task is not None else NO_TAGS,
                s.task.n_predict - s.n_decoded if s.task is not None else 0,
            )
            for s in self.slots
            if s.phase is not Phase.IDLE
        )
        return group_view(
            self.group,
            self.engine.n_batch if self.engine else 0,
            busy,
            time.perf_counter(),
            self.costs.ms_per_prompt_token,
            self.costs.ms_per_step,
            self.costs.ms_single_step,
        )

    # ---- introspection -------------------------------------------------------------------

    def slot_states(self) -> list[SlotState]:
        """Every slot of the group, as it is now (``GET /slots``, the live view)."""
        n_ctx = self.engine.n_ctx_seq if self.engine else 0
        speculative = self.ctx_opts.spec is not None  # llama-server's can_speculate(): the server's setting
        now = time.perf_counter()
        states = []
        for s in self.slots:
            task = s.task
            # an idle slot reports the request it served last, with its counters when it ended
            if task is not None:
                ref, n_prompt, n_cached, n_decoded = task, len(s.prompt), s.n_cached, s.n_decoded
            elif s.last is not None:
                ref, n_prompt, n_cached, n_decoded = s.last
            else:
                ref, n_prompt, n_cached, n_decoded = None, 0, 0, 0
            states.append(
                SlotState(
                    id=s.id,
                    group=self.group,
                    busy=s.busy,
                    phase=s.phase.value,
                    n_ctx=n_ctx,
                    speculative=speculative,
                    cohort=self.policy.cohort_of(s.order) if s.busy else 0,
                    n_cached=len(s.cache),
                    task=-1 if ref is None else ref.id,
                    n_prompt=n_prompt,
                    n_prompt_cached=n_cached,
                    n_decoded=n_decoded,
                    n_remain=0 if task is None else task.n_predict - s.n_decoded,
                    age_s=0.0 if task is None else round(now - task.arrived, 3),
                    priority=0 if ref is None else ref.priority,
                    params=None if ref is None else ref.params,
                    n_predict=0 if ref is None else ref.n_predict,
                    ignore_eos=False if ref is None else ref.ignore_eos,
                    lora=NO_LORA if ref is None else ref.lora,
                    draft_n=None if s.spec is None else s.spec.n_draft,
                    draft_n_accepted=None if s.spec is None else s.spec.n_accepted,
                    draft_n_steps=None if s.spec is None else s.spec.n_drafts,
                )
            )
        return states
