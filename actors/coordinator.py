"""PhaseCoordinator: hosts one scheduling policy per group and relays its grants.

It is not on the per-step path. Groups tell it phase transitions (``PhaseEvent``: arrived,
prefill_done, finished, cancelled); it passes each to the group's policy and, only when the
policy's grant changes, tells the group. A group plans every step from its latest grant, so
the cost is a few messages per request, not one per step.

It also keeps the phase observability (/slots, /metrics): cohort sizes and barrier wait times, and the
timers that a bounded GENERATE phase needs (``--cohort-max-generate-ms``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio

from llamactor.actors.observe import CoordinatorMetrics
from llamactor.actors.policy import Policy, PolicyStatus
from llamactor.protocol.errors import Closed, Overloaded
from llamactor.protocol.messages import CoordinatorMsg, Grant, PhaseEvent, PhaseKind
from llamactor.runtime.kernel.actor import Actor


class PhaseCoordinator(Actor[CoordinatorMsg]):
    name = "phase-coordinator"

    def __init__(
        self,
        policies: list[Policy],
        group_of: Callable[[int], Actor[Any] | None],
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        super().__init__()
        self.policies = policies
        self._group_of = group_of
        self.metrics = metrics
        self.grants: list[Grant | None] = [None] * len(policies)
        self._sealed_at: list[float] = [0.0] * len(policies)
        self._tick_for: list[float] = [0.0] * len(policies)  # the deadline a tick was scheduled for
        self._tg: Any = None

    def policy(self, group: int) -> Policy:
        return self.policies[group]

    def status(self, group: int) -> PolicyStatus:
        """The frozen phase report of one group's policy (for /metrics and /slots)."""
        return self.policies[group].status()

    def replace_policy(self, group: int, policy: Policy) -> None:
        """A restarted group gets a fresh policy (the old state named the dead group's slots)."""
        self.policies[group] = policy
        self.grants[group] = None

    async def loop(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await super().loop()
            tg.cancel_scope.cancel()

    async def handle(self, msg: CoordinatorMsg) -> None:
        match msg:
            case PhaseEvent(group=g):
                policy = self.policies[g]
                before = policy.status()
                grant = policy.on_event(msg)
                after = policy.status()
                self._observe(g, before, after, msg)
                if grant is not None and grant != self.grants[g]:
                    self.grants[g] = grant
                    group = self._group_of(g)
                    if group is not None:
                        try:
                            group.try_tell(grant)
                        except Closed:
                            pass  # the group is restarting; its successor starts from no grant
                        except Overloaded:
                            self._tg.start_soon(self._send_latest_grant, g, group)
                self._schedule_tick(g, after)

    async def _send_latest_grant(self, g: int, group: Actor[Any]) -> None:
        """A full group mailbox: wait for room, then send the newest grant (grants replace whole)."""
        grant = self.grants[g]
        if grant is not None:
            try:
                await group.tell(grant)
            except Closed:
                pass

    def _observe(self, g: int, before: PolicyStatus, after: PolicyStatus, event: PhaseEvent) -> None:
        if after.phase == before.phase or self.metrics is None:
            return
        if after.phase == "prefill_sealed":
            self._sealed_at[g] = event.at
        if after.phase == "generate" and before.phase.startswith("prefill"):
            self.metrics.cohort_released(g, after.released, event.at - (self._sealed_at[g] or event.at))

    def _schedule_tick(self, g: int, status: PolicyStatus) -> None:
        """A bounded GENERATE phase: one "tick" event at its deadline, once per deadline (a tick
        that finds nobody queued leaves the deadline as it was: an arrival hands over itself)."""
        if not status.generate_deadline or self._tick_for[g] == status.generate_deadline or self._tg is None:
            return
        self._tick_for[g] = status.generate_deadline
        self._tg.start_soon(self._tick_at, g, status.generate_deadline)

    async def _tick_at(self, g: int, due: float) -> None:
        await anyio.sleep(max(0.0, due - time.perf_counter()))
        try:
            self.try_tell(PhaseEvent(g, PhaseKind.TICK, at=time.perf_counter()))
        except Closed:
            pass
