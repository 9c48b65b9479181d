"""``continuous``: llama-server's default continuous batching.

Each step every generating slot contributes one token, then pending prompt chunks fill the
rest of n_batch in arrival order. A prompt that finishes samples its first token at once.
"""

from __future__ import annotations

from actors.policy import GroupView, Policy, StepPlan, fill_prefill


class ContinuousPolicy(Policy):
    name = "continuous"

    def plan(self, view: GroupView) -> StepPlan:
        generate = tuple(s.local for s in view.slots if s.phase == "generate")
        prefill = fill_prefill(view.slots, view.n_batch - len(generate))
        return StepPlan(prefill=prefill, generate=generate)
