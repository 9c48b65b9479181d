"""A policy as the server runs it: every plan checked, a failing policy replaced.

``GuardedPolicy`` wraps the policy of one group. Each plan is held to ``check_plan`` (the rules
the replay simulator applies too); a policy that raises, in ``plan`` or in ``on_event``, or
plans a step that cannot run is logged with its traceback and replaced, for that group, by
``FallbackPolicy`` (continuous batching that also releases prompts a cohort held back). ``plan``
then raises ``PolicyFailed`` once, naming the slot it got wrong, so the group can fail that
request with a message saying why and plan the step again; the group keeps serving.
"""

from __future__ import annotations

import sys

import structlog

from llamactor.actors.policies.continuous import ContinuousPolicy
from llamactor.actors.policy import GroupView, Policy, PolicyStatus, check_plan
from llamactor.protocol.messages import Grant, PhaseEvent
from llamactor.protocol.plan import StepPlan

log = structlog.get_logger("llamactor.policy")


class PolicyFailed(Exception):
    """The policy failed this step; ``slot`` is the group-local slot it got wrong (-1: none)."""

    def __init__(self, message: str, slot: int = -1) -> None:
        super().__init__(message)
        self.slot = slot


class FallbackPolicy(ContinuousPolicy):
    """Continuous batching, releasing any prompt a failed cohort policy held back."""

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        plan = super().plan(view, grant)
        ready = tuple(s.local for s in view.slots if s.phase == "ready" and s.parent < 0)
        return plan._replace(release=ready) if ready else plan


class GuardedPolicy(Policy):
    def __init__(self, inner: Policy, first_slot: int = 0) -> None:
        super().__init__(inner.group, **inner.options)
        self.inner = inner
        self.first_slot = first_slot  # the server-wide id of the group's slot 0
        self.failed = ""  # why the inner policy was replaced ("" while it serves)
        self.name = inner.name
        self.holds_ready = inner.holds_ready

    def on_event(self, event: PhaseEvent) -> Grant | None:
        try:
            return self.inner.on_event(event)
        except Exception as exc:
            self._replace(f"raised {type(exc).__name__}: {exc} (on a {event.kind.value} event)")
            return None

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        try:
            plan = self.inner.plan(view, grant)
        except Exception as exc:
            raise PolicyFailed(self._replace(f"raised {type(exc).__name__}: {exc}")) from None
        problem = check_plan(view, plan)
        if problem is not None:
            where = problem.describe(f"slot {self.first_slot + problem.slot}")
            raise PolicyFailed(self._replace(f"planned a step that cannot run: {where}"), problem.slot)
        return plan

    def _replace(self, why: str) -> str:
        failing = self.inner
        message = (
            f"the scheduling policy {failing.name!r} of group {self.group} {why}; "
            f"the group goes on with {FallbackPolicy.name} batching"
        )
        log.error(
            "policy_failed", group=self.group, policy=failing.name, why=why, exc_info=sys.exc_info()[0] is not None
        )
        self.failed = message
        self.inner = FallbackPolicy(self.group)
        self.name = self.inner.name
        self.holds_ready = self.inner.holds_ready
        return message

    @property
    def phase(self) -> str:
        return self.inner.phase

    def cohort_of(self, order: int) -> int:
        return self.inner.cohort_of(order)

    def waiting(self) -> int:
        return self.inner.waiting()

    def status(self) -> PolicyStatus:
        return self.inner.status()
