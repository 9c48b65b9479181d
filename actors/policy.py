"""The public scheduling-policy interface (SPEC section 4).

A policy decides, for one group, which slots prefill how many prompt tokens and which slots
generate in the next decode step. It has two entry points, both called on the event loop and
never concurrently:

- ``on_event(event) -> Grant | None``: called by the PhaseCoordinator once per phase event of
  the group (a request arrived, finished its prompt, finished, was cancelled; or a timer
  tick). Stateful policies (cohorts) keep their state here and return a new ``Grant`` when
  what the group may do changes. Stateless policies return None.
- ``plan(view, grant) -> StepPlan``: called by the group once per decode step with a plain
  snapshot of its busy slots and its latest grant. Must be cheap and pure: no I/O, no ctypes,
  no clock except ``view.now``; so every policy can be tested with a fake engine.

To write your own, subclass ``Policy`` and start the server with ``--scheduler module:Class``;
``examples/custom_policy.py`` has one. Set ``holds_ready = True`` if a prompt that finishes
prefill must wait (phase "ready", its logits kept) until a grant releases it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from protocol.messages import Grant, PhaseEvent


class SlotView(NamedTuple):
    """What a policy may know about one busy slot."""

    local: int  # the slot's id inside its group (sequence id)
    phase: str  # "prefill" | "ready" | "generate"
    prompt_left: int  # prompt tokens not yet decoded (0 unless prefilling)
    order: int  # the request's arrival order in the group (its identity; n > 1 choices share it)
    parent: int  # local id of the n > 1 parent slot, or -1 for a parent/single slot


class GroupView(NamedTuple):
    group: int
    n_batch: int  # max tokens in one decode step
    slots: tuple[SlotView, ...]  # busy slots only, in arrival order
    now: float = 0.0  # perf_counter seconds at the snapshot
    ms_per_prompt_token: float = 0.0  # measured cost of one prompt token in a step (EMA)
    ms_per_step: float = 0.0  # measured fixed cost of one generation step (EMA)


class StepPlan(NamedTuple):
    """One decode step: ``prefill`` is (local slot, n prompt tokens); ``generate`` one token each.

    ``release`` lists READY slots whose kept logits are sampled this step (no decode for them).
    """

    prefill: tuple[tuple[int, int], ...] = ()
    generate: tuple[int, ...] = ()
    release: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.generate or self.release)


IDLE_PLAN = StepPlan()


class Policy:
    """Base class of scheduling policies (one instance per group)."""

    name = "base"
    holds_ready = False  # True: finished prompts wait in "ready" until released by a grant

    def __init__(self, group: int = 0, **options: float) -> None:
        self.group = group
        self.options = options

    def on_event(self, event: PhaseEvent) -> Grant | None:  # noqa: ARG002
        return None

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:  # pragma: no cover - abstract
        raise NotImplementedError

    # ---- observability (PH-9) ---------------------------------------------------------

    @property
    def phase(self) -> str:
        """The group's phase as this policy sees it (shown in /metrics); stateless policies: their name."""
        return self.name

    def cohort_of(self, order: int) -> int:  # noqa: ARG002
        """The cohort of the request with this arrival order (0 when the policy has none)."""
        return 0

    def waiting(self) -> int:
        """Requests in the group that wait for a phase (not granted anything yet)."""
        return 0


def generating(view: GroupView, allowed: Iterable[int] | None = None) -> tuple[int, ...]:
    """Slots in phase "generate" (optionally only those of requests whose order is ``allowed``)."""
    if allowed is None:
        return tuple(s.local for s in view.slots if s.phase == "generate")
    allow = set(allowed)
    return tuple(s.local for s in view.slots if s.phase == "generate" and s.order in allow)


def fill_prefill(slots: Iterable[SlotView], budget: int) -> tuple[tuple[int, int], ...]:
    """Hand ``budget`` prompt tokens to prefilling slots in arrival order (first come, first fed)."""
    out: list[tuple[int, int]] = []
    for s in slots:
        if budget <= 0:
            break
        if s.prompt_left > 0:
            k = min(s.prompt_left, budget)
            out.append((s.local, k))
            budget -= k
    return tuple(out)


def fair_share(slots: list[SlotView], budget: int, rotate: int) -> tuple[tuple[int, int], ...]:
    """Split ``budget`` equally among prefilling slots (PH-2); the remainder rotates by ``rotate``.

    A slot needing less than its share gets what it needs; the rest is shared again.
    """
    need = {s.local: s.prompt_left for s in slots if s.prompt_left > 0}
    order = [s.local for s in slots if s.prompt_left > 0]
    if not order:
        return ()
    k = rotate % len(order)
    order = order[k:] + order[:k]
    give = dict.fromkeys(order, 0)
    left = budget
    while left > 0:
        hungry = [x for x in order if give[x] < need[x]]
        if not hungry:
            break
        share, extra = divmod(left, len(hungry))
        for i, x in enumerate(hungry):
            add = min(share + (1 if i < extra else 0), need[x] - give[x])
            give[x] += add
            left -= add
    return tuple((x, give[x]) for x in order if give[x] > 0)
