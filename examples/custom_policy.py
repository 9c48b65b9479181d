"""A custom scheduling policy: shortest prompt first.

Like llama-server's continuous batching, but prompt chunks go to the prefilling slots with
the fewest prompt tokens left, so short requests are not stuck behind long ones.

    llamactor serve --scheduler examples.custom_policy:ShortestPromptFirst
    (run from the repository root, or put this file on PYTHONPATH as custom_policy)
"""

from __future__ import annotations

from llamactor.actors.policy import GroupView, Policy, StepPlan, fill_prefill, generating
from llamactor.protocol.messages import Grant


class ShortestPromptFirst(Policy):
    name = "shortest-prompt-first"

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        generate = generating(view)
        waiting = sorted((s for s in view.slots if s.prompt_left > 0), key=lambda s: (s.prompt_left, s.order))
        return StepPlan(prefill=fill_prefill(waiting, view.n_batch - len(generate)), generate=generate)
