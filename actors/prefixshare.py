"""Prefix sharing across the slots of a group: which slot's KV a new prompt borrows.

When many concurrent requests start with the same long text (a system prompt), only one of
them should prefill it per group. At assignment the group asks ``choose`` for the best donor:

- a slot whose KV already holds a longer prefix of the prompt than the new slot keeps (an idle
  slot's cached prompt, a slot generating, a prompt partly prefilled): the prefix is copied
  now (``Context.share_prefix``);
- a slot still prefilling a prompt that shares a longer prefix than anyone holds yet: the new
  prompt *follows* it, hidden from the policy, until the leader has prefilled that prefix; then
  it copies it (``settle``). A leader that ends before it gets there lends what it has.

A gain under ``MIN_SHARE`` tokens is not worth a copy (with split KV llama.cpp copies the
leader's whole stream). Pure functions over the group's slots: called on the event loop
between steps only, like everything that touches a slot's KV outside a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llamactor.protocol.lora import LoraSet
from llamactor.runtime.engine.promptcache import common_prefix
from llamactor.runtime.engine.slot import Phase, Slot

MIN_SHARE = 32  # tokens a share must save over what the slot keeps of its own KV


def choose(
    slot: Slot,
    prompt: np.ndarray,
    keep: int,
    slots: Sequence[Slot],
    lora: LoraSet,
) -> tuple[Slot | None, int, bool]:
    """(donor, tokens, wait): the slot to borrow from, how many prompt tokens it gives, and
    whether it must first prefill them (``wait``). (None, 0, False) when no share saves
    ``MIN_SHARE`` tokens over ``keep``. At most ``len(prompt) - 1`` tokens are ever borrowed:
    the last prompt token is decoded again for its logits."""
    head = prompt[: len(prompt) - 1]
    best: tuple[Slot | None, int] = (None, keep)
    lead: tuple[Slot | None, int] = (None, keep)
    for d in slots:
        if d is slot or d.lora != lora or d.follows is not None or d.parent is not None:
            continue  # n > 1 children hold no prompt of their own until it is done
        held = common_prefix(np.asarray(d.cache, dtype=np.int32), head) if d.cache else 0
        if held > best[1]:
            best = (d, held)
        if d.phase is Phase.PREFILL and d.task is not None and d.n_past < len(d.prompt):
            will = common_prefix(d.prompt, head)
            if will > lead[1]:
                lead = (d, will)
    if lead[0] is not None and lead[1] - best[1] >= MIN_SHARE:
        return lead[0], lead[1], True
    if best[0] is not None and best[1] - keep >= MIN_SHARE:
        return best[0], best[1], False
    return None, 0, False


def ready(follower: Slot) -> bool:
    """True when a following slot can copy now: its leader prefilled the shared prefix, or the
    leader stopped prefilling (finished, cancelled, failed) and lends what it has."""
    leader = follower.follows
    assert leader is not None
    return leader.phase is not Phase.PREFILL or leader.n_past >= follower.share_upto


def lendable(follower: Slot) -> int:
    """Tokens of the follower's prompt that its leader's KV holds now (at most ``share_upto``)."""
    leader = follower.follows
    assert leader is not None
    n = min(follower.share_upto, len(leader.cache))
    return common_prefix(np.asarray(leader.cache[:n], dtype=np.int32), follower.prompt[:n])
