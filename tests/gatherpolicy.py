"""A scheduling policy for tests that compare greedy output across runs: llama-server's schedule,
but no decode step until the group holds a multiple of 8 requests (or the oldest waited 3 s).

8 requests sent together, or resumed together on another replica after theirs died, then run
in the same batches however they arrived: llama.cpp's CPU kernels are not batch-invariant, so
a different batching could change a greedy token of the tiny random model. Loaded by path
(``scheduler="tests/gatherpolicy.py:GatherEight"``), also inside a replica.
"""

from __future__ import annotations

from llamactor.actors.policies.continuous import ContinuousPolicy
from llamactor.actors.policy import IDLE_PLAN, Grant, GroupView, StepPlan

WAIT_S = 3.0


class GatherEight(ContinuousPolicy):
    name = "gather-eight"

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        if view.slots and len(view.slots) % 8 and view.now - min(s.arrived for s in view.slots) < WAIT_S:
            return IDLE_PLAN
        return super().plan(view, grant)
