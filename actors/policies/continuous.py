"""``continuous`` (llama-server's default) and ``no-cont-batching``: llama-server's own batching.

A new request takes llama-server's slot too: the one holding the longest prefix of its prompt,
else the least recently used, ties to the highest id (``get_available_slot``); so a burst on
an idle server lands on the highest slots first and, fed in slot order, the last of the burst
is prefilled first. llama-server's ``update_slots`` builds each step in two passes over its
slots in slot order: first every generating slot adds its sampled token, then every slot with
prompt left adds prompt tokens until the step holds ``n_batch`` tokens; so prompts are fed in
slot order, not in arrival order, each as far as the room goes (a later slot waits until an
earlier one's prompt is in). With ``--no-cont-batching`` prompts join only a step without
generated tokens. (llama-server also cuts a prompt's last ``4 + n_ubatch`` and last 4 tokens
into steps of their own when it keeps context checkpoints; llamactor's step decodes such
a chunk's head in a decode of its own inside the planned step, ``engine.checkpoints``.)

tests/test_continuous_schedule.py checks the schedule against llama-server's, recorded.
"""

from __future__ import annotations

from llamactor.actors.policy import GroupView, Policy, StepPlan, fill_prefill, generating
from llamactor.actors.scheduling import LRU
from llamactor.protocol.messages import Grant
from llamactor.protocol.plan import SlotView


def in_slot_order(view: GroupView) -> list[SlotView]:
    """The group's busy slots as llama-server walks them: by slot id."""
    return sorted(view.slots, key=_slot_id)


def _slot_id(s: SlotView) -> int:
    return s.local


class ContinuousPolicy(Policy):
    """Each step every generating slot contributes one token, then pending prompt chunks fill
    the rest of n_batch in slot order. A prompt that finishes samples at once."""

    name = "continuous"
    slot_choice = LRU

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        generate = generating(view)
        return StepPlan(prefill=fill_prefill(in_slot_order(view), view.n_batch - len(generate)), generate=generate)


class NoContBatchingPolicy(Policy):
    """Prompts start only when no slot is generating; a step is all prompt or all generation."""

    name = "no-cont-batching"
    slot_choice = LRU

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        generate = generating(view)
        if generate:
            return StepPlan(generate=generate)
        return StepPlan(prefill=fill_prefill(in_slot_order(view), view.n_batch))
