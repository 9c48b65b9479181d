"""A fake engine for policies: simulates one group's slots and the coordinator, no model.

Each ``step()``: deliver pending phase events to the policy (optionally one step late, as the
real coordinator's message hop may be), ask for a plan, apply it (prompt tokens consumed,
tokens generated), and record it. Used by the property-based test of every policy.
A request takes its slot by the supervisor's rule and the policy's view is built as the live
group builds it (``actors.scheduling``: ``choose_slots``, ``group_view``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llamactor.actors.policy import GroupView, Policy, StepPlan
from llamactor.actors.scheduling import SlotEntry, SlotSnapshot, choose_slots, group_view
from llamactor.actors.trace import StepRecord
from llamactor.protocol.messages import Grant, PhaseEvent, PhaseKind

_NO_TOKENS = np.zeros(0, dtype=np.int32)


@dataclass
class SimSlot:
    local: int
    order: int
    prompt_left: int
    to_generate: int
    phase: str = "prefill"
    generated: int = 0
    arrived: float = 0.0
    n_prompt: int = 0
    first_token_at: float = 0.0


@dataclass
class GroupSim:
    policy: Policy
    n_slots: int
    n_batch: int
    lag: bool = False  # deliver events one step late
    slots: dict[int, SimSlot] = field(default_factory=dict)
    grant: Grant | None = None
    pending: list[PhaseEvent] = field(default_factory=list)
    trace: list[StepRecord] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # orders
    cancelled: list[int] = field(default_factory=list)
    _order: int = 0

    def free_slot(self) -> int | None:
        """The slot the supervisor's rule gives a new request (no cached prompts here)."""
        table = [SlotEntry(i, 0, i, busy=i in self.slots) for i in range(self.n_slots)]
        ids = choose_slots(table, _NO_TOKENS)
        return None if ids is None else ids[0]

    def arrive(self, prompt: int, generate: int) -> bool:
        local = self.free_slot()
        if local is None:
            return False
        self._order += 1
        self.slots[local] = SimSlot(
            local, self._order, prompt, generate, arrived=float(len(self.trace)), n_prompt=prompt
        )
        self._event(PhaseKind.ARRIVED, local, self._order)
        return True

    def cancel(self, local: int) -> None:
        s = self.slots.pop(local)
        self.cancelled.append(s.order)
        self._event(PhaseKind.CANCELLED, local, s.order)

    def _event(self, kind: PhaseKind, local: int, order: int) -> None:
        self.pending.append(PhaseEvent(0, kind, local, 0, float(len(self.trace)), order))

    def _deliver(self) -> None:
        events, self.pending = self.pending, []
        for e in events:
            g = self.policy.on_event(e)
            if g is not None:
                self.grant = g

    def view(self) -> GroupView:
        busy = (
            SlotSnapshot(
                s.local, s.phase, s.prompt_left, s.order, -1, s.arrived, s.n_prompt, s.generated, s.first_token_at
            )
            for s in self.slots.values()
        )
        return group_view(0, self.n_batch, busy, float(len(self.trace)), 0.01, 1.0)

    def step(self) -> StepPlan:
        if not self.lag:
            self._deliver()
        plan = self.policy.plan(self.view(), self.grant)
        if self.lag:
            self._deliver()
        prefill = tuple(local for local, _ in plan.prefill)
        cohorts = {
            local: self.policy.cohort_of(self.slots[local].order) for local in (*prefill, *plan.generate, *plan.release)
        }
        self.trace.append(StepRecord(0, len(self.trace), prefill, plan.generate, plan.release, cohorts))
        assert sum(k for _, k in plan.prefill) + len(plan.generate) <= self.n_batch
        for local, k in plan.prefill:
            s = self.slots[local]
            assert s.phase == "prefill" and 0 < k <= s.prompt_left
            s.prompt_left -= k
            if s.prompt_left == 0:
                if self.policy.holds_ready:
                    s.phase = "ready"
                    self._event(PhaseKind.PREFILL_DONE, local, s.order)
                else:
                    s.phase = "generate"
                    self._token(s)
        for local in plan.release:
            s = self.slots[local]
            assert s.phase == "ready"
            s.phase = "generate"
            self._token(s)
        for local in plan.generate:
            s = self.slots[local]
            assert s.phase == "generate"
            self._token(s)
        return plan

    def _token(self, s: SimSlot) -> None:
        if not s.generated:
            s.first_token_at = float(len(self.trace))
        s.generated += 1
        if s.generated >= s.to_generate:
            del self.slots[s.local]
            self.finished.append(s.order)
            self._event(PhaseKind.FINISHED, s.local, s.order)
