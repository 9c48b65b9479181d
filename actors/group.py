"""GroupActor: owns one llama_context, its slots and its decode loop.

Per iteration the loop (1) drains its mailbox without waiting, so new work joins the next
step; (2) asks its policy for a plan from a plain snapshot; (3) runs the step in a worker
thread (``llama_decode`` releases the GIL, so other groups decode meanwhile); (4) sends the
step's events straight to each request's result stream. When nothing is runnable it waits
on the mailbox, so an idle group costs no CPU.

Slot-touching commands (erase/save/restore) run between this group's steps only, never during its
decode; other groups keep decoding.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from llamactor.actors import eviction, prefixshare
from llamactor.actors.costs import StepCosts
from llamactor.actors.delivery import failure, hooked_send, send_event, send_final, send_step
from llamactor.actors.loraturns import LoraTurns
from llamactor.actors.observe import GroupMetrics
from llamactor.actors.policies.guard import PolicyFailed
from llamactor.actors.policy import GroupView, Policy, StepPlan
from llamactor.actors.recorder import TraceRecorder
from llamactor.actors.scheduling import SlotSnapshot, group_view
from llamactor.actors.trace import StepRecord
from llamactor.protocol.errors import Closed, EngineError, SlotBusy
from llamactor.protocol.events import Failed, Progress
from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.protocol.messages import (
    Assign,
    Grant,
    GroupMsg,
    PhaseEvent,
    PhaseKind,
    Released,
    Revoke,
    SlotCached,
    SlotCommand,
    Task,
)
from llamactor.protocol.plan import NO_TAGS
from llamactor.protocol.slots import SlotActionResult, SlotState
from llamactor.runtime.engine.context import Context, ContextOptions, KvCacheFull, StepResult
from llamactor.runtime.engine.hooks import GroupHooks
from llamactor.runtime.engine.profiler import REPORT_INTERVAL_S, GroupProfile
from llamactor.runtime.engine.promptcache import PromptCache
from llamactor.runtime.engine.slot import Phase, Slot
from llamactor.runtime.kernel.actor import Actor

if TYPE_CHECKING:
    from llamactor.runtime.engine.model import Model

log = structlog.get_logger("llamactor.group")


class GroupActor(Actor[GroupMsg]):
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

    def _policy_failed(self, exc: PolicyFailed) -> None:
        """The policy was replaced (``GuardedPolicy``): the request on the slot its plan got
        wrong fails with the reason; the others go on under the fallback policy."""
        assert self.engine is not None
        self.engine.holds_ready = self.policy.holds_ready
        slot = self.slots[exc.slot] if 0 <= exc.slot < len(self.slots) else None
        if slot is not None and slot.task is not None and slot.task.id in self._tasks:
            self.metrics.groups[self.group].requests_failed += 1
            self._end_task(slot.task.id, Failed(str(exc), "EngineError"))

    def _make_room(self) -> None:
        """Unified KV overcommitted: drop the cached prompts of idle slots; if there are none,
        stop the request holding the most cells, so the others go on. No restart: the group
        itself is healthy."""
        assert self.engine is not None
        idle = eviction.idle_caches(self.slots)
        for s in idle:
            self.engine.erase(s)
            self._report(SlotCached(self.group, s.local, ()))
        if idle:
            return
        victim = eviction.victim(self.slots)
        assert victim.task is not None
        members = [victim, *victim.children]
        log.warning("kv_cache_full", group=self.group, task=victim.task.id, cells=victim.n_past)
        self._end_task(
            victim.task.id,
            Failed(
                f"the shared KV cache is full ({victim.n_past} cells held by this request); it was stopped "
                f"to make room",
                "EngineError",
            ),
        )
        for s in members:
            self.engine.erase(s)
            self._report(SlotCached(self.group, s.local, ()))

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
                s.task.request.priority if s.task is not None else 0,
                s.task.request.tags if s.task is not None else NO_TAGS,
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

    # ---- assignment and release --------------------------------------------------------

    def _assign(self, task: Task, locals_: tuple[int, ...]) -> None:
        """Start serving ``task`` on these slots. Anything that fails here (sampler chains,
        grammar, a hook) fails this request alone: its slots go back, the group goes on."""
        assert self.engine is not None
        prompt = task.prompt
        parent = self.slots[locals_[0]]
        members = [self.slots[i] for i in locals_]
        self._order += 1
        now = time.perf_counter()
        try:
            if self.hooks is not None:
                self.hooks.on_assign(self.group, task)
            for index, s in enumerate(members):
                s.task, s.index, s.order, s.t_start = task, index, self._order, now
                s.prompt = prompt
                s.phase = Phase.PREFILL if s is parent else Phase.READY
                s.parent = None if s is parent else parent
                self.engine.start(s)
        except Exception as exc:
            self._refuse(task, members, exc)
            return
        parent.children = members[1:]
        keep = self.engine.reuse_prefix(
            parent, prompt, task.cache_prompt, self.prompt_cache, task.lora, task.n_cache_reuse, self.slots
        )
        if task.cache_prompt:
            keep = self._share(parent, keep)
        parent.n_past = parent.n_cached = keep
        self._tasks[task.id] = members
        counters = self.metrics.groups[self.group]
        counters.requests_processing += 1
        counters.prompt_cached += keep
        self.metrics.queue_time(self.group, now - task.arrived)
        if task.return_progress:  # llama-server's first progress chunk: the request has started
            try:
                timed = task.request.timings_per_token
                self._send(task, Progress(0, len(prompt), parent.n_cached, parent.n_past, 0.0, timed))
            except Exception:
                pass
        self._tell_coordinator(PhaseKind.ARRIVED, parent)

    # ---- prefix sharing across slots -----------------------------------------------------

    def _share(self, s: Slot, keep: int) -> int:
        """Borrow a longer prefix of ``s``'s prompt from another slot of the group: now if one
        holds it, or (``s`` follows it) once the slot that is prefilling it got there."""
        assert s.task is not None
        donor, n, wait = prefixshare.choose(s, s.prompt, keep, self.slots, s.task.lora)
        if donor is None:
            return keep
        if wait:
            s.follows, s.share_upto = donor, n
            return keep
        return self._copy_prefix(s, donor, n)

    def _settle(self, leader: Slot | None = None) -> None:
        """Copy the shared prefix into every follower whose leader got there (or, with
        ``leader``, into that slot's followers now: the leader's request is ending)."""
        for s in self.slots:
            if s.follows is None or (leader is not None and s.follows is not leader):
                continue
            if leader is None and not prefixshare.ready(s):
                continue
            n = prefixshare.lendable(s)
            donor, s.follows = s.follows, None
            if n > s.n_past:
                s.n_past = s.n_cached = self._copy_prefix(s, donor, n)

    def _copy_prefix(self, s: Slot, donor: Slot, n: int) -> int:
        assert self.engine is not None
        got = self.engine.share_prefix(s, donor, n)
        counters = self.metrics.groups[self.group]
        counters.prefix_shares += 1
        counters.prefix_tokens_shared += got
        return got

    def _refuse(self, task: Task, members: list[Slot], exc: Exception) -> None:
        """A request failed before it started: error event, slots back to the table."""
        assert self.engine is not None
        log.warning("request_failed", task=task.id, group=self.group, at="assign", error=str(exc))
        self.metrics.groups[self.group].requests_failed += 1
        send_final(task.sink, failure(exc, "the request could not start"))
        for s in members:
            self.engine.release(s)
            s.reset()
        self._report(
            Released(
                self.group,
                tuple(s.local for s in members),
                tuple(tuple(s.cache) for s in members),
                task.id,
                tuple(s.lora for s in members),
            )
        )

    def _end_task(self, task_id: int, final: Failed | None, *, report: bool = True) -> list[int]:
        """Free every slot of a task; send ``final`` (if any) and close its stream."""
        members = self._tasks.pop(task_id)
        self.metrics.groups[self.group].requests_processing -= 1
        sink = members[0].task.sink if members[0].task else None
        cancelled = any(not s.finished for s in members)
        if final is not None and sink is not None:
            send_final(sink, final)
        elif sink is not None:
            sink.close()
        if cancelled and final is None and members[0].task is not None:  # the client left (a failure logs its own)
            self._log_end(members, time.perf_counter(), "cancelled")
        self._tell_coordinator(PhaseKind.CANCELLED if cancelled else PhaseKind.FINISHED, members[0])
        if self.recorder is not None:
            self.recorder.request(self.group, members, failed=final is not None, cancelled=cancelled)
        for s in members:
            # An unfinished prompt's KV is still a valid prefix (``cache`` says what it holds):
            # prompts that wait for this one's prefix copy what it has now.
            if self.engine is not None:
                self._settle(leader=s)
                self.engine.release(s)
            s.reset()
        ids = [s.id for s in members]
        if report:
            self._report(
                Released(
                    self.group,
                    tuple(s.local for s in members),
                    tuple(tuple(s.cache) for s in members),
                    task_id,
                    tuple(s.lora for s in members),
                )
            )
        return ids

    def _report(self, msg: Released | SlotCached) -> None:
        try:
            self.supervisor.try_tell(msg)
        except Closed:
            pass  # the supervisor is stopping: the slot table goes with it

    def _slot_command(self, cmd: SlotCommand) -> None:
        assert self.engine is not None
        s = self.slots[cmd.slot]
        try:
            if s.busy:
                raise SlotBusy(f"slot {s.id} is processing a request")
            t0 = time.perf_counter()
            if cmd.action == "erase":
                n = len(s.cache)
                self.engine.erase(s)
            elif cmd.action == "save":
                n = self.engine.save_slot(s, cmd.path)
            else:
                n = self.engine.restore_slot(s, cmd.path)
            result = SlotActionResult(slot=s.id, action=cmd.action, n_tokens=n, ms=(time.perf_counter() - t0) * 1e3)
        except Exception as exc:
            if cmd.action == "restore":  # a refused restore has emptied the slot
                self._report(SlotCached(self.group, s.local, tuple(s.cache)))
            cmd.reply.fail(exc)
            return
        self._report(SlotCached(self.group, s.local, tuple(s.cache)))
        cmd.reply.send(result)

    # ---- delivery ----------------------------------------------------------------------

    def _deliver(self, res: StepResult) -> None:
        """Send the step's events (``delivery``), then end what ended: requests that failed
        alone in the step (error event), whose client left, or whose choices all finished."""
        self.metrics.step(self.group, res)
        ts = time.perf_counter()
        out = send_step(res, self._send)
        now = time.perf_counter()
        if self.profile is not None:
            self.profile.send += now - ts
        for task_id, error in out.failed.items():
            if task_id in self._tasks:
                log.warning("request_failed", task=task_id, group=self.group, at="step", error=str(error))
                self.metrics.groups[self.group].requests_failed += 1
                self._end_task(task_id, failure(error, "the request failed while generating"))
        for s in res.ready:
            if s.task is not None and s.task.id in self._tasks:
                self._tell_coordinator(PhaseKind.PREFILL_DONE, s)
        for s in res.first:  # time to first token, observed when it comes (not when the request ends)
            if s.task is not None:
                self.metrics.ttft(self.group, s.t_last - s.task.arrived)
        done_tasks: set[int] = set()
        for s in res.finished:
            if s.task is None or s.task.id not in self._tasks:
                continue
            done_tasks.add(s.task.id)
        for task_id in done_tasks:
            members = self._tasks.get(task_id)
            if members and all(m.finished for m in members):
                self._log_end(members, now)
                self._end_task(task_id, None)
        for task_id in out.gone:
            if task_id in self._tasks:
                self._end_task(task_id, None)
        if self.hooks is not None:
            self.hooks.after_step(self, res)

    def _log_end(self, members: list[Slot], now: float, reason: str = "finished") -> None:
        """The one event a request logs when it ends (a failure logs ``request_failed``);
        a finished one's timings also go to the metrics."""
        s = members[0]
        assert s.task is not None
        timings = {}
        if reason == "finished":
            self.metrics.request_done(
                self.group,
                s.prompt_ms / 1e3,
                max(m.t_last for m in members) - s.t_prompt_done,
                max(m.n_past for m in members),
            )
            timings = {
                "queue_ms": round((s.t_start - s.task.arrived) * 1e3, 2),
                "wait_ms": round(((s.t_prompt_begin or s.t_start) - s.t_start) * 1e3, 2),  # for room in a batch
                "prompt_ms": round(s.prompt_ms, 2),
            }
        log.info(
            "request_done",
            task=s.task.id,
            group=self.group,
            slot=s.id,
            reason=reason,
            n_prompt=len(s.prompt),
            n_cached=s.n_cached,
            n_predicted=sum(m.n_decoded for m in members),
            **timings,
            total_ms=round((now - s.task.arrived) * 1e3, 2),
        )

    def _tell_coordinator(self, kind: PhaseKind, s: Slot) -> None:
        if self.coordinator is not None:
            try:
                self.coordinator.try_tell(
                    PhaseEvent(self.group, kind, s.local, s.prompt_left, time.perf_counter(), s.order)
                )
            except Closed:
                pass  # stopping

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
                    priority=0 if ref is None else ref.request.priority,
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
