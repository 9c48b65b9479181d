"""A simulated group's state: its requests, their choices, and the check of a plan against them.

ops/replay/simulate.py's event loop moves these along; the check is the fake engine's refusal of a
plan the real one could not run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamactor.actors.costs import StepCosts
from llamactor.actors.policy import Policy, StepPlan
from llamactor.actors.scheduling import SlotEntry
from llamactor.ops.replay.tracefile import Request
from llamactor.protocol.messages import Grant, PhaseEvent


class SimulationError(Exception):
    """The policy made a plan the engine could not run (the message says what and why)."""


@dataclass(eq=False)
class SimChoice:
    local: int
    target: int  # tokens this choice generates (as recorded)
    parent: int = -1  # the parent's local slot for n > 1 children
    phase: str = "prefill"
    n_past: int = 0
    generated: int = 0
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.generated >= self.target


@dataclass(eq=False)
class SimRequest:
    """A request in a group: its choices (parent first) and its prompt still to decode."""

    index: int  # in trace.requests
    rec: Request
    order: int
    prompt_left: int
    choices: list[SimChoice]
    first_token: float | None = None
    prompt_done: float = 0.0  # when its prompt was decoded (the view's ``first_token_at``, as live)

    @property
    def parent(self) -> SimChoice:
        return self.choices[0]


class SimGroup:
    """One group as the simulation runs it: its policy and grant, its slots, and what waits for its next boundary."""

    def __init__(self, index: int, policy: Policy, n_slots: int, n_batch: int, entries: list[SlotEntry]) -> None:
        self.index = index
        self.policy = policy
        self.n_slots = n_slots
        self.n_batch = n_batch
        self.costs = StepCosts()
        self.grant: Grant | None = None
        self.slots: dict[int, tuple[SimRequest, SimChoice]] = {}  # local -> its request and choice
        self.entries = entries  # its rows of the supervisor's table, by local id (busy: given away)
        self.inbox: list[tuple[SimRequest, tuple[int, ...]]] = []  # assigned, not yet taken by the group
        self.pending: list[PhaseEvent] = []  # events not yet seen by the coordinator
        self.running = False  # a step is in flight
        self.wake = False  # something arrived that an idle group must look at
        self.ending: list[SimRequest] = []  # requests that end with the step in flight
        self.ready: list[SimRequest] = []  # prompts that finished in it and wait (PREFILL_DONE)
        self.tick_for: tuple[int, float] = (0, 0.0)  # the deadline a tick is armed for
        self.order = 0


def check_plan(g: SimGroup, plan: StepPlan, policy: str) -> None:
    """Raise SimulationError unless the fake engine can run ``plan`` on ``g``'s slots now."""

    def bad(why: str) -> SimulationError:
        return SimulationError(f"policy {policy!r} planned {plan} for group {g.index}: {why}")

    seen: set[int] = set()
    for local, k in plan.prefill:
        entry = g.slots.get(local)
        if entry is None or entry[1].phase != "prefill" or entry[1].parent >= 0:
            raise bad(f"slot {local} is not prefilling")
        if not 0 < k <= entry[0].prompt_left:
            raise bad(f"slot {local} has {entry[0].prompt_left} prompt tokens left, the plan gives {k}")
        if local in seen:
            raise bad(f"slot {local} appears twice")
        seen.add(local)
    for local in plan.generate:
        entry = g.slots.get(local)
        if entry is None or entry[1].phase != "generate" or entry[1].done or local in seen:
            raise bad(f"slot {local} is not generating (or appears twice)")
        seen.add(local)
    for local in plan.release:
        entry = g.slots.get(local)
        if entry is None or entry[1].phase != "ready" or entry[1].parent >= 0 or local in seen:
            raise bad(f"slot {local} is not a ready prompt")
        seen.add(local)
    if sum(k for _, k in plan.prefill) + len(plan.generate) > g.n_batch:
        raise bad(f"more than n_batch ({g.n_batch}) tokens")
