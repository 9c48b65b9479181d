"""The plain data a scheduling policy, a group and the engine share .

A group hands its policy a ``GroupView`` (a snapshot of its busy slots) and gets back a
``StepPlan`` (who prefills how many prompt tokens, who generates); the engine decodes exactly
that plan. A policy reports its own state to the coordinator as a frozen ``PolicyStatus``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from llamactor.protocol.lora import NO_LORA, LoraSet

NO_TAGS: Mapping[str, str] = MappingProxyType({})


class SlotView(NamedTuple):
    """What a policy may know about one busy slot."""

    local: int  # the slot's id inside its group (sequence id)
    phase: str  # "prefill" | "ready" | "generate"
    prompt_left: int  # prompt tokens not yet decoded (0 unless prefilling)
    order: int  # the request's arrival order in the group (its identity; n > 1 choices share it)
    parent: int  # local id of the n > 1 parent slot, or -1 for a parent/single slot
    arrived: float = 0.0  # perf_counter seconds when the request was submitted (aging, deadlines)
    n_prompt: int = 0  # the request's whole prompt, in tokens (cached prefix included)
    n_generated: int = 0  # tokens sampled so far (0 while prefilling)
    first_token_at: float = 0.0  # perf_counter seconds of its first token (0.0: none yet)
    priority: int = 0  # the request's priority (lower first, under the priority policy)
    tags: Mapping[str, str] = NO_TAGS  # the request's free-form labels
    n_remaining: int = 0  # tokens it may still generate (its budget left; EOS may end it sooner)


class GroupView(NamedTuple):
    group: int
    n_batch: int  # max tokens in one decode step
    slots: tuple[SlotView, ...]  # busy slots only, in arrival order
    now: float = 0.0  # perf_counter seconds at the snapshot
    ms_per_prompt_token: float = 0.0  # measured cost of one prompt token in a step (EMA)
    ms_per_step: float = 0.0  # measured fixed cost of one generation step (EMA)
    ms_single_step: float = 0.0  # measured generation step of one stream alone (EMA; 0: none yet)


class StepPlan(NamedTuple):
    """One decode step: ``prefill`` is (local slot, n prompt tokens); ``generate`` one token each.

    ``release`` lists READY slots whose kept logits are sampled this step (no decode for them).
    ``lora`` is the LoRA set the step decodes under: every slot in ``prefill`` and
    ``generate`` has it. Policies leave it out; the group sets it (``actors.loraturns``).
    """

    prefill: tuple[tuple[int, int], ...] = ()
    generate: tuple[int, ...] = ()
    release: tuple[int, ...] = ()
    lora: LoraSet = NO_LORA

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.generate or self.release)


IDLE_PLAN = StepPlan()


class PolicyStatus(NamedTuple):
    """What a policy says of itself to the coordinator (read after each event, never its fields).

    ``released``: members of the cohort released to generation by the last event;
    ``generate_deadline``: perf_counter time at which the coordinator must send a "tick"
    event (a bounded GENERATE phase, ``--cohort-max-generate-ms``), or 0 for none.
    """

    phase: str
    cohort: int = 0
    released: int = 0
    generate_deadline: float = 0.0
    waiting: int = 0  # requests of the group that wait for a phase grant
