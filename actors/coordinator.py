"""PhaseCoordinator: hosts one scheduling policy per group and relays its grants.

It is not on the per-step path. Groups tell it phase transitions (``PhaseEvent``: arrived,
prefill_done, finished, cancelled); it passes each to the group's policy and, only when the
policy returns a new ``Grant``, tells the group. A group plans every step from its policy and
its latest grant, so the cost is a few messages per request, not one per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actors.policy import Policy
from protocol.messages import CoordinatorMsg, PhaseEvent
from runtime.kernel import Actor


class PhaseCoordinator(Actor[CoordinatorMsg]):
    name = "phase-coordinator"

    def __init__(self, policies: list[Policy], group_of: Callable[[int], Actor[Any]]) -> None:
        super().__init__()
        self.policies = policies
        self._group_of = group_of
        self.events_seen = 0

    def policy(self, group: int) -> Policy:
        return self.policies[group]

    async def handle(self, msg: CoordinatorMsg) -> None:
        match msg:
            case PhaseEvent(group=g):
                self.events_seen += 1
                grant = self.policies[g].on_event(msg)
                if grant is not None:
                    self._group_of(g).try_tell(grant)
