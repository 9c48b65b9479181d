"""What a step costs, learned from the steps a group ran (offered to policies in the view).

Exponential moving averages, updated once per step by the group: the cost of a
generation-only step, the extra cost of one prompt token in a step that prefills, and the cost
of a generation step of one stream alone (a token's unloaded time, the ``slo`` policy's yardstick).
Stall-free's ``--target-itl-ms`` turns these into a prompt-token budget.
"""

from __future__ import annotations

from llamactor.runtime.engine.context import StepResult

EMA_WEIGHT = 0.1


class StepCosts:
    __slots__ = ("ms_per_prompt_token", "ms_per_step", "ms_single_step")

    def __init__(self) -> None:
        self.ms_per_step = 0.0  # a generation-only step
        self.ms_per_prompt_token = 0.0  # the extra cost of one prompt token
        self.ms_single_step = 0.0  # a generation-only step of one stream: a token's unloaded time

    def learn(self, res: StepResult, step_ms: float) -> None:
        """The step's cost starts at its first sample (from 0, ten samples would pass before it
        came within a third of the true cost, and ``take_split`` would see a step as nearly
        free). The prompt token's cost still starts from 0: its first sample, taken before any
        generation-only step, counts the whole step against its prompt tokens."""
        if res.n_prompt:
            extra = max(step_ms - self.ms_per_step, 0.0) / res.n_prompt
            self.ms_per_prompt_token += EMA_WEIGHT * (extra - self.ms_per_prompt_token)
        elif res.n_rows:
            w = EMA_WEIGHT if self.ms_per_step else 1.0
            self.ms_per_step += w * (step_ms - self.ms_per_step)
            if res.n_rows == 1:
                w = EMA_WEIGHT if self.ms_single_step else 1.0
                self.ms_single_step += w * (step_ms - self.ms_single_step)
