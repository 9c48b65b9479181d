"""What a group does with a step's outcome: the step's events go to the requests' streams
and the requests that ended end (``_deliver``); a full unified KV cache makes room; a policy
that failed fails the request its plan got wrong.

``GroupOutcomes`` is one part of ``GroupActor`` (``actors.group``), kept apart by concept; the
decode loop calls it after a step, on the group's own task.
"""

from __future__ import annotations

import time

import structlog

from llamactor.actors import eviction
from llamactor.actors.delivery import failure, send_step
from llamactor.actors.groupslots import GroupSlots
from llamactor.actors.policies.guard import PolicyFailed
from llamactor.protocol.events import Failed
from llamactor.protocol.messages import PhaseKind, SlotCached
from llamactor.runtime.engine.context import StepResult

log = structlog.get_logger("llamactor.group")


class GroupOutcomes(GroupSlots):
    """A step's outcome, applied to the group's requests (a base of ``GroupActor``)."""

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

    # ---- a step that could not run ----------------------------------------------------

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
