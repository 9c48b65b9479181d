"""One LoRA set per decode step, for every policy.

llama.cpp applies a context's adapters to the whole batch, so requests with different LoRA
sets must never share a step (llama-server's ``can_batch_with``). Policies do not know about
adapters: each plans from its view as usual, and the group narrows the plan to the slots of
one set with ``LoraTurns.narrow``. When a plan holds several sets they take turns, step by
step, in a fixed order (round robin: the next set after the one served last), so none
starves; the slots left out keep their state and are planned again next step.

Why narrowing the plan keeps every policy correct: it only removes rows, never adds any, so
whatever a policy forbids (mixing phases, prefilling during a cohort's generation, more than
n_batch tokens) stays forbidden; and READY slots released from a cohort's barrier are sampled
from their kept logits without a decode, so ``release`` is kept whole in any step. A cohort
whose members have different sets prefills them in alternating steps, seals, releases them
together and generates them in alternating steps (the barrier still holds).

A group with no adapter loaded never calls this (``GroupActor`` holds None): zero cost.
"""

from __future__ import annotations

from collections.abc import Callable

from llamactor.protocol.lora import LoraSet
from llamactor.protocol.plan import StepPlan


class LoraTurns:
    """Per group: which LoRA set the last step decoded under, and the narrowing."""

    def __init__(self) -> None:
        self.last: LoraSet | None = None

    def narrow(self, plan: StepPlan, lora_of: Callable[[int], LoraSet]) -> StepPlan:
        """``plan`` with only the prefill/generate rows of one LoRA set, and ``plan.lora`` set.

        Called once per step by the group, before the step; ``lora_of(local)`` is the set of
        the request on that slot. A plan without decode rows (only releases) is returned as is.
        """
        sets = {lora_of(local) for local, _ in plan.prefill}
        sets.update(lora_of(local) for local in plan.generate)
        if not sets:
            return plan
        if len(sets) == 1:
            (pick,) = sets
            self.last = pick
            return plan if pick == plan.lora else plan._replace(lora=pick)
        ordered = sorted(sets)
        last = self.last
        pick = next((s for s in ordered if last is not None and s > last), ordered[0])
        self.last = pick
        return StepPlan(
            prefill=tuple(row for row in plan.prefill if lora_of(row[0]) == pick),
            generate=tuple(local for local in plan.generate if lora_of(local) == pick),
            release=plan.release,
            lora=pick,
        )
