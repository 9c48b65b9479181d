"""``continuous`` (llama-server's default) and ``no-cont-batching``."""

from __future__ import annotations

from llamactor.actors.policy import GroupView, Policy, StepPlan, fill_prefill, generating
from llamactor.protocol.messages import Grant


class ContinuousPolicy(Policy):
    """Each step every generating slot contributes one token, then pending prompt chunks fill
    the rest of n_batch in arrival order. A prompt that finishes samples at once."""

    name = "continuous"

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        generate = generating(view)
        return StepPlan(prefill=fill_prefill(view.slots, view.n_batch - len(generate)), generate=generate)


class NoContBatchingPolicy(Policy):
    """Prompts start only when no slot is generating; a step is all prompt or all generation."""

    name = "no-cont-batching"

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        generate = generating(view)
        if generate:
            return StepPlan(generate=generate)
        return StepPlan(prefill=fill_prefill(view.slots, view.n_batch))
