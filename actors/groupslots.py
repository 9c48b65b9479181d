"""The requests on a group's slots: how one starts (``_assign``, with prefix sharing between
the group's slots), how one ends (``_end_task``: its stream closed, its slots back to the
supervisor's table, its end logged) and the slot commands (erase/save/restore).

``GroupSlots`` is one part of ``GroupActor`` (``actors.group``), kept apart by concept; like
the rest of the actor it runs on the group's own task only, between steps, so it touches the
slots without locks. ``GroupActor.__init__`` sets the attributes declared here.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from llamactor.actors import prefixshare
from llamactor.actors.delivery import Send, failure, send_final
from llamactor.actors.observe import GroupMetrics
from llamactor.actors.policy import Policy
from llamactor.actors.recorder import TraceRecorder
from llamactor.protocol.errors import Closed, RequestError, SlotBusy
from llamactor.protocol.events import Failed, Progress
from llamactor.protocol.messages import PhaseEvent, PhaseKind, Released, SlotCached, SlotCommand, Task
from llamactor.protocol.slots import SlotActionResult
from llamactor.runtime.engine.context import Context
from llamactor.runtime.engine.hooks import GroupHooks
from llamactor.runtime.engine.profiler import GroupProfile
from llamactor.runtime.engine.promptcache import PromptCache
from llamactor.runtime.engine.slot import Phase, Slot
from llamactor.runtime.kernel.actor import Actor

log = structlog.get_logger("llamactor.group")


class GroupSlots:
    """Starting and ending the requests on a group's slots (a base of ``GroupActor``)."""

    group: int
    slots: list[Slot]
    policy: Policy
    supervisor: Actor[Any]
    coordinator: Actor[Any] | None
    metrics: GroupMetrics
    engine: Context | None
    hooks: GroupHooks | None
    prompt_cache: PromptCache | None
    recorder: TraceRecorder | None
    profile: GroupProfile | None
    _order: int
    _tasks: dict[int, list[Slot]]  # task id -> its slots (parent first)
    _send: Send

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
                timed = task.timings_per_token
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
            # a prefix export (a replica set's pull) reads a busy slot's KV between steps; nothing else
            # touches a busy slot, and no client reads another request's KV
            if s.busy and not (cmd.action == "export" and cmd.kv is not None):
                raise SlotBusy(f"slot {s.id} is processing a request")
            t0 = time.perf_counter()
            kv = None
            if cmd.action == "erase":
                n = len(s.cache)
                self.engine.erase(s)
            elif cmd.action == "save":
                n = self.engine.save_slot(s, cmd.path)
            elif cmd.action == "export":
                kv = self.engine.export_slot(s, cmd.kv.tokens if cmd.kv is not None else ())
                n = len(kv.tokens)
            elif cmd.action == "import":
                if cmd.kv is None:
                    raise RequestError("import needs the slot's state")
                n = self.engine.import_slot(s, cmd.kv)
            else:
                n = self.engine.restore_slot(s, cmd.path)
            ms = (time.perf_counter() - t0) * 1e3
            result = SlotActionResult(slot=s.id, action=cmd.action, n_tokens=n, ms=ms, kv=kv)
        except Exception as exc:
            if cmd.action in ("restore", "import"):  # a refused restore or import has emptied the slot
                self._report(SlotCached(self.group, s.local, tuple(s.cache), s.lora))
            cmd.reply.fail(exc)
            return
        if cmd.action != "export":  # an export leaves the slot as it was
            self._report(SlotCached(self.group, s.local, tuple(s.cache), s.lora))
        cmd.reply.send(result)

    # ---- the end of a request --------------------------------------------------------

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
