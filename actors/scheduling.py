"""The scheduling path's two pure functions: which free slots a request gets, and what a
policy sees of its group each step.

Plain data in, plain data out: no actor, no I/O, no clock. The supervisor and the group actor
call them live; the replay simulator (``ops.replay.simulate``, behind ``llamactor replay``) and the
policy test harness (``tests/policy_sim.py``) call the very same functions, so a replay places
requests and shows policies their groups exactly as the server does.

``choose_slots`` is the supervisor's rule, over its slot table (``SlotEntry`` rows):

1. a pinned slot (``id_slot``) is taken when it is free and its group is up, else the request
   waits;
2. otherwise, over every free slot of every group that is up and has ``n`` free slots (the
   choices of one request never split across groups): the longest common prefix of the slot's
   cached tokens with the prompt (reuse of the slot's KV; it counts only when it covers at
   least ``PREFIX_SIMILARITY`` of the prompt, as llama-server's ``--slot-prompt-similarity``,
   and only when the KV was computed under the request's LoRA set), then the group with the
   fewest busy slots, then the lowest slot id. Lowest id, not least recently used: with split
   KV, llama.cpp attends over every sequence between the lowest and highest id in a batch, so
   busy slots spread over [0, P) made 8 users cost about as much as 30 (measured: TPOT 45 ms
   with slots 0-7, 80 ms with 8 slots spread over 8-20). A policy that asks for llama-server's
   own rule (``Policy.slot_choice = LRU``: ``continuous``, ``no-cont-batching``) gets the least
   recently used slot instead, ties to the highest id, as llama-server's ``get_available_slot``.
The chosen slot is the parent; the other ``n - 1`` are the group's next free slots in id order.

``group_view`` builds a policy's ``GroupView`` from its group's ``SlotSnapshot`` rows: busy slots
only, minus choices that already finished (they wait for their siblings) and prompts waiting
to copy another slot's prefix (prefix sharing); in arrival order, then slot order.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.protocol.plan import NO_TAGS, GroupView, SlotView
from llamactor.runtime.engine.promptcache import common_prefix

EMPTY = np.zeros(0, dtype=np.int32)
PREFIX_SIMILARITY = 0.1  # a cached prefix counts when it covers at least this share of the prompt
LOWEST = "lowest"  # among equal candidates, the lowest slot id (llamactor's: compact ids for split KV)
LRU = "lru"  # the least recently used, ties to the highest id (llama-server's get_available_slot)


@dataclass
class SlotEntry:
    """One row of the supervisor's slot table. In a table, ``table[i].id == i``."""

    id: int  # global slot id (as /slots shows it and ``id_slot`` pins it)
    group: int
    local: int  # the slot's sequence id inside its group
    busy: bool = False
    cached: np.ndarray = field(default_factory=lambda: EMPTY)  # token ids whose KV the slot holds
    lora: LoraSet = NO_LORA  # the LoRA set ``cached`` was computed under
    released: int = -1  # when it last finished a request (a counter; -1: never), for ``LRU``


def choose_slots(
    table: Sequence[SlotEntry],
    prompt: np.ndarray,
    *,
    n: int = 1,
    id_slot: int = -1,
    lora: LoraSet = NO_LORA,
    unavailable: Collection[int] = (),
    prefer: str = LOWEST,
) -> tuple[int, ...] | None:
    """The slot ids a request gets (its parent first, then ``n - 1`` more of the same group),
    or None when it must wait. ``unavailable``: groups that take no request (down or not
    running). Reads ``table``, changes nothing."""
    if id_slot >= 0:
        e = table[id_slot]
        if e.busy or e.group in unavailable:
            return None
        siblings = [s.id for s in table if s.group == e.group and not s.busy and s is not e]
        return (e.id, *siblings[: n - 1]) if len(siblings) >= n - 1 else None
    size: dict[int, int] = {}
    free: dict[int, list[SlotEntry]] = {}
    for e in table:
        size[e.group] = size.get(e.group, 0) + 1
        if not e.busy:
            free.setdefault(e.group, []).append(e)
    min_prefix = max(1, int(PREFIX_SIMILARITY * len(prompt)))
    best: tuple[int, ...] | None = None
    chosen: tuple[int, ...] | None = None
    for g, slots in free.items():
        if g in unavailable or len(slots) < n:
            continue
        n_busy = size[g] - len(slots)
        for e in slots:
            prefix = common_prefix(e.cached, prompt) if e.lora == lora else 0  # other adapters' KV: no reuse
            tie = (-e.released, e.id) if prefer == LRU else (-e.id,)
            reused = prefix if prefix >= min_prefix else 0
            # nothing to reuse: an empty slot before one whose cache would be lost (LRU has
            # this already: a slot never used is the least recently used)
            key = (reused, -n_busy, not reused and not len(e.cached), *tie)
            if best is None or key > best:
                best = key
                chosen = (e.id, *[f.id for f in slots if f is not e][: n - 1])
    return chosen


class SlotSnapshot(NamedTuple):
    """One slot of a group as whoever holds it knows it (a live ``Slot``, a simulated choice)."""

    local: int
    phase: str  # "idle" | "prefill" | "ready" | "generate"
    prompt_left: int  # prompt tokens not yet decoded (read only while prefilling)
    order: int  # the request's arrival order in the group
    parent: int = -1  # local id of the n > 1 parent slot, or -1
    arrived: float = 0.0  # perf_counter seconds when the request was submitted
    n_prompt: int = 0  # the request's whole prompt, in tokens
    n_generated: int = 0
    first_token_at: float = 0.0  # perf_counter seconds its prompt was done (0.0: not yet)
    finished: bool = False  # this choice ended; it waits for its siblings
    waiting: bool = False  # it waits to copy another slot's prefix (prefix sharing)
    priority: int = 0  # the request's priority
    tags: Mapping[str, str] = NO_TAGS  # the request's free-form labels
    n_remaining: int = 0  # tokens it may still generate


def group_view(
    group: int,
    n_batch: int,
    slots: Iterable[SlotSnapshot],
    now: float = 0.0,
    ms_per_prompt_token: float = 0.0,
    ms_per_step: float = 0.0,
    ms_single_step: float = 0.0,
) -> GroupView:
    """What a policy sees of its group before a step (once per step of the group)."""
    views = [
        SlotView(
            st.local,
            st.phase,
            st.prompt_left if st.phase == "prefill" else 0,
            st.order,
            st.parent,
            st.arrived,
            st.n_prompt,
            st.n_generated,
            st.first_token_at,
            st.priority,
            st.tags,
            st.n_remaining,
        )
        for st in slots
        if st.phase != "idle" and not st.finished and not st.waiting
    ]
    views.sort(key=_arrival)
    return GroupView(group, n_batch, tuple(views), now, ms_per_prompt_token, ms_per_step, ms_single_step)


def _arrival(v: SlotView) -> tuple[int, int]:
    return v.order, v.local


__all__ = ["EMPTY", "PREFIX_SIMILARITY", "SlotEntry", "SlotSnapshot", "choose_slots", "group_view"]
