"""``stall-free`` (after Sarathi-Serve): generation first, then a bounded prompt chunk.

Each step every generating slot contributes one token; prompt tokens are added only up to a
per-step budget, so a long prompt arriving never stalls running streams for a whole n_batch
of prefill. The budget is ``prefill_budget`` tokens, or, with ``target_itl_ms``, as many
prompt tokens as fit in the target inter-token gap by the group's measured step costs.
"""

from __future__ import annotations

from llamactor.actors.policy import GroupView, Policy, StepPlan, fill_prefill, generating
from llamactor.protocol.messages import Grant

DEFAULT_PREFILL_BUDGET = 128  # best of 64/128/256 in the benchmark's mixed workload (README)
MIN_PREFILL_CHUNK = 16  # never starve prompts completely, whatever the measured costs


class StallFreePolicy(Policy):
    name = "stall-free"

    def __init__(self, group: int = 0, **options: float) -> None:
        super().__init__(group, **options)
        self.budget = int(options.get("prefill_budget") or DEFAULT_PREFILL_BUDGET)
        self.target_itl_ms = float(options.get("target_itl_ms") or 0.0)

    def prompt_budget(self, view: GroupView, n_generating: int) -> int:
        if not n_generating:
            return view.n_batch  # nobody to stall: prefill at full speed
        if self.target_itl_ms > 0 and view.ms_per_prompt_token > 0:
            spare_ms = self.target_itl_ms - view.ms_per_step
            return max(MIN_PREFILL_CHUNK, int(spare_ms / view.ms_per_prompt_token))
        return self.budget

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        generate = generating(view)
        budget = min(self.prompt_budget(view, len(generate)), view.n_batch - len(generate))
        return StepPlan(prefill=fill_prefill(view.slots, budget), generate=generate)
