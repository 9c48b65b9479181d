"""The public scheduling-policy interface.

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
from typing import Any, NamedTuple

from llamactor.protocol.messages import Grant, PhaseEvent
from llamactor.protocol.plan import IDLE_PLAN, GroupView, PolicyStatus, SlotView, StepPlan

__all__ = [
    "IDLE_PLAN",
    "Grant",
    "GroupView",
    "PhaseEvent",
    "PlanProblem",
    "Policy",
    "PolicyStatus",
    "SlotView",
    "StepPlan",
    "check_plan",
    "fair_share",
    "fill_prefill",
    "generating",
]


class Policy:
    """Base class of scheduling policies (one instance per group)."""

    name = "base"
    holds_ready = False  # True: finished prompts wait in "ready" until released by a grant
    # Which free slot a new request gets when no slot holds its prefix: "lowest" (the lowest id,
    # compact ids for split KV) or "lru" (llama-server's: least recently used, ties to the
    # highest id). Read once, from the policy class, by the supervisor.
    slot_choice = "lowest"

    def __init__(self, group: int = 0, **options: Any) -> None:
        self.group = group
        self.options = options  # every option given (``--scheduler-option``), the policy's own included

    def on_event(self, event: PhaseEvent) -> Grant | None:
        return None

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:  # pragma: no cover - abstract
        raise NotImplementedError

    # ---- observability (/slots, /metrics) -----------------------------------------------

    @property
    def phase(self) -> str:
        """The group's phase as this policy sees it (shown in /metrics); stateless policies: their name."""
        return self.name

    def cohort_of(self, order: int) -> int:
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
    """Hand ``budget`` prompt tokens to prefilling slots in the order given (each takes what it
    needs before the next gets any: no prompt is processor-shared)."""
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
    """Split ``budget`` equally among prefilling slots; the remainder rotates by ``rotate``.

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


def take_split(
    slots: list[SlotView], budget: int, step_ms: float, token_ms: float, urgent: frozenset[int] = frozenset()
) -> tuple[tuple[int, int], ...]:
    """``fill_prefill``, ending the step early when that gives first tokens sooner on the whole.

    Prompts that finish in this step all get their first token when it ends. One more prompt
    finished in it delays the ``done`` ones before it by its own cost; left to the next step,
    it and every prompt after it wait one more step (``step_ms``: the streams' tokens and the
    fixed cost) instead. So a whole prompt joins while ``done * its cost <= (waiting - done) *
    step_ms``: only while that lowers the waiting prompts' summed time to first token. A chunk
    of a prompt that does not finish joins while fewer prompts finish in this step than wait
    after them (its tokens delay the first and bring the second closer), and always when it
    is ``urgent`` (a prompt past its first-token target, or one that would miss it otherwise:
    it takes what is left, so a stream of shorter prompts cannot hold it back). The streams get their
    tokens either way (a step more now is a generation-only step less later); what an early
    end costs is one more step's fixed cost, and prompts that arrive together no longer stay
    in lockstep (docs/policies.md).
    """
    out: list[tuple[int, int]] = []
    done, n = 0, len(slots)
    for s in slots:
        if budget <= 0:
            break
        k = min(s.prompt_left, budget)
        finishes = k == s.prompt_left
        if done and (
            done * k * token_ms > (n - done) * step_ms if finishes else done >= n - done and s.local not in urgent
        ):
            break
        out.append((s.local, k))
        budget -= k
        done += finishes
    return tuple(out)


class PlanProblem(NamedTuple):
    """Why a plan cannot run: the group-local slot it is about (-1: the whole plan) and why."""

    slot: int
    why: str

    def describe(self, slot_name: str = "") -> str:
        """``slot_name`` (default "slot <local id>"): why, as a sentence."""
        if self.slot < 0:
            return self.why
        return f"{slot_name or f'slot {self.slot}'} {self.why}"


def check_plan(view: GroupView, plan: StepPlan) -> PlanProblem | None:
    """Why ``plan`` cannot run on the group ``view`` shows, or None when it can.

    The rules the group (and the replay simulator) hold every plan to: a prefill names a
    prefilling parent slot and gives it 1 to ``prompt_left`` tokens; a generate names a
    generating slot; a release names a ready parent slot; no slot appears twice; the step holds
    at most ``n_batch`` tokens. Policy authors can call it in their own tests.
    """
    slots = {s.local: s for s in view.slots}
    seen: set[int] = set()
    for local, k in plan.prefill:
        s = slots.get(local)
        if s is None or s.phase != "prefill" or s.parent >= 0:
            return PlanProblem(local, f"is not prefilling, but the plan gives it {k} prompt tokens")
        if not 0 < k <= s.prompt_left:
            return PlanProblem(local, f"has {s.prompt_left} prompt tokens left, but the plan gives it {k}")
        if local in seen:
            return PlanProblem(local, "appears twice in the plan")
        seen.add(local)
    for local in plan.generate:
        s = slots.get(local)
        if s is None or s.phase != "generate":
            return PlanProblem(local, "is not generating, but the plan has it generate")
        if local in seen:
            return PlanProblem(local, "appears twice in the plan")
        seen.add(local)
    for local in plan.release:
        s = slots.get(local)
        if s is None or s.phase != "ready" or s.parent >= 0:
            return PlanProblem(local, "is not a ready prompt, but the plan releases it")
        if local in seen:
            return PlanProblem(local, "appears twice in the plan")
        seen.add(local)
    n = sum(k for _, k in plan.prefill) + len(plan.generate)
    if n > view.n_batch:
        return PlanProblem(-1, f"the plan holds {n} tokens, more than n_batch ({view.n_batch})")
    return None
