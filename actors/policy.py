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

from llamactor.protocol.messages import Grant, PhaseEvent
from llamactor.protocol.plan import IDLE_PLAN, GroupView, PolicyStatus, SlotView, StepPlan

__all__ = [
    "IDLE_PLAN",
    "Grant",
    "GroupView",
    "PhaseEvent",
    "Policy",
    "PolicyStatus",
    "SlotView",
    "StepPlan",
    "fair_share",
    "fill_prefill",
    "generating",
]


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

    def status(self) -> PolicyStatus:
        """A frozen report for the coordinator; stateful policies add their cohort and timers."""
        return PolicyStatus(self.phase, waiting=self.waiting())


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
