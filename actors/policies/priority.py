"""``priority``: vLLM's request priority, lower first, ties by arrival."""

from __future__ import annotations

from llamactor.actors.policy import GroupView, Policy, StepPlan, fill_prefill, generating
from llamactor.protocol.messages import Grant


class PriorityPolicy(Policy):
    """Continuous batching in priority order: each step every generating slot contributes one
    token, then prompt chunks fill the rest of n_batch, the lowest ``priority`` value first
    (ties: the earlier arrival). A high-priority prompt is prefilled before lower-priority
    ones that arrived earlier, so it reaches its first token first. (Requests waiting for a
    slot are started in the same order by the supervisor, whatever the policy.)"""

    name = "priority"

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        generate = generating(view)
        waiting = sorted((s for s in view.slots if s.prompt_left > 0), key=lambda s: (s.priority, s.arrived, s.order))
        return StepPlan(prefill=fill_prefill(waiting, view.n_batch - len(generate)), generate=generate)
