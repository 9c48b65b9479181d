"""``cohort`` (phase exclusion: prefill cohorts and a barrier before generation) and ``serial-prefill``.

Why a state machine: a batch must never mix prompt and generated tokens, and prompts that
were admitted together must start generating together, so a group is always in exactly one
of these phases:

    IDLE ──arrival──► PREFILL (open) ──first member done──► PREFILL (sealed)
      ▲                                                        │ every member done
      └───────────── last member finished ◄──── GENERATE ◄─────┘

- open: arrivals join the cohort and share n_batch fairly;
- sealed: the first member finished its prompt; later arrivals wait for the next cohort;
  finished members keep their logits and sample nothing (the group holds them "ready");
- GENERATE: the whole cohort is released at once; no prefill runs; arrivals queue and
  the cohort drains. With ``max_generate_ms`` the engine may be handed to the next
  cohort's prefill after that long, pausing generation (still never mixing phases);
- a cancelled member simply leaves the barrier (no deadlock, no leaked slot).

State changes only in ``on_event`` (called by the PhaseCoordinator); ``plan`` reads it
through the latest grant.
"""

from __future__ import annotations

import enum

from llamactor.actors.policy import GroupView, Policy, PolicyStatus, SlotView, StepPlan, fair_share, generating
from llamactor.protocol.messages import Grant, PhaseEvent, PhaseKind


class CohortPhase(enum.Enum):
    IDLE = "idle"  # nothing admitted
    PREFILL_OPEN = "prefill_open"  # members prefill; arrivals may join
    PREFILL_SEALED = "prefill_sealed"  # a member finished its prompt; arrivals wait
    GENERATE = "generate"  # the cohort generates; no prefill


class CohortPolicy(Policy):
    name = "cohort"
    holds_ready = True

    def __init__(self, group: int = 0, **options: float) -> None:
        super().__init__(group, **options)
        self.max_generate_ms = float(options.get("cohort_max_generate_ms") or 0.0)
        self.state = CohortPhase.IDLE
        self.cohort = 0
        self.members: list[int] = []  # requests (arrival orders) of the current cohort
        self.ready: set[int] = set()  # members whose prompt is done (kept logits)
        self.released: set[int] = set()  # members allowed to generate
        self.paused: set[int] = set()  # an earlier cohort's generators, paused by the bound
        self.queue: list[int] = []  # arrivals waiting for a later cohort
        self.cohort_of_request: dict[int, int] = {}
        self.generate_since = 0.0
        self._rotate = 0

    # ---- observability -----------------------------------------------------------------

    @property
    def phase(self) -> str:
        return self.state.value

    def cohort_of(self, order: int) -> int:
        return self.cohort_of_request.get(order, 0)

    def waiting(self) -> int:
        return len(self.queue)

    def status(self) -> PolicyStatus:
        bounded = self.max_generate_ms > 0 and self.state is CohortPhase.GENERATE
        deadline = self.generate_since + self.max_generate_ms / 1e3 if bounded else 0.0
        return PolicyStatus(self.phase, self.cohort, len(self.released), deadline, len(self.queue))

    # ---- events (the coordinator calls these) -------------------------------------------

    def on_event(self, event: PhaseEvent) -> Grant | None:
        s = event.order  # requests, not slots: a slot is reused while old events are in flight
        match event.kind:
            case PhaseKind.ARRIVED:
                if self.state is CohortPhase.IDLE:
                    self._open([s])
                elif self.state is CohortPhase.PREFILL_OPEN:
                    self._join(s)
                else:
                    self.queue.append(s)
                    if self._may_hand_over(event.at):
                        self._hand_over()
            case PhaseKind.PREFILL_DONE:
                if s in self.members:
                    self.ready.add(s)
                    if self.state is CohortPhase.PREFILL_OPEN:
                        self.state = CohortPhase.PREFILL_SEALED
                    self._release_if_complete(event.at)
            case PhaseKind.FINISHED | PhaseKind.CANCELLED:
                self._forget(s)
                if self.state in (CohortPhase.PREFILL_OPEN, CohortPhase.PREFILL_SEALED):
                    self._release_if_complete(event.at)
                if not self.members and not self.paused:
                    self._next_cohort()
                elif not self.members and self.paused:
                    self._resume_paused(event.at)
            case PhaseKind.TICK:
                if self._may_hand_over(event.at):
                    self._hand_over()
        return self.grant()

    def grant(self) -> Grant:
        if self.state is CohortPhase.GENERATE:
            gen = frozenset(self.released)
            return Grant(self.state.value, self.cohort, generate=gen, release=gen & self.ready)
        if self.state is CohortPhase.IDLE:
            return Grant(self.state.value, self.cohort)
        return Grant(self.state.value, self.cohort, prefill=self._prefilling())

    def _prefilling(self) -> frozenset[int]:
        return frozenset(m for m in self.members if m not in self.ready)

    # ---- transitions --------------------------------------------------------------------

    def _open(self, slots: list[int]) -> None:
        self.cohort += 1
        self.state = CohortPhase.PREFILL_OPEN
        self.members, self.ready, self.released = [], set(), set()
        for s in slots:
            self._join(s)

    def _join(self, s: int) -> None:
        self.members.append(s)
        self.cohort_of_request[s] = self.cohort

    def _release_if_complete(self, now: float) -> None:
        if self.members and all(m in self.ready for m in self.members):
            # A cohort paused by the generate bound resumes together with this one.
            self.state = CohortPhase.GENERATE
            self.members += sorted(self.paused - set(self.members))
            self.released = set(self.members)
            self.paused = set()
            self.generate_since = now

    def _forget(self, s: int) -> None:
        if s in self.members:
            self.members.remove(s)
        for group in (self.ready, self.released, self.paused):
            group.discard(s)
        if s in self.queue:
            self.queue.remove(s)
        self.cohort_of_request.pop(s, None)

    def _next_cohort(self) -> None:
        waiting, self.queue = self.queue, []
        if waiting:
            self._open(waiting)
        else:
            self.state = CohortPhase.IDLE

    def _may_hand_over(self, now: float) -> bool:
        return (
            self.max_generate_ms > 0
            and self.state is CohortPhase.GENERATE
            and bool(self.queue)
            and (now - self.generate_since) * 1e3 >= self.max_generate_ms
        )

    def _hand_over(self) -> None:
        """The bound expired: pause the generating cohort and prefill the next one."""
        self.paused |= self.released
        self.released = set()
        self._next_cohort()

    def _resume_paused(self, now: float) -> None:
        self.state = CohortPhase.GENERATE
        self.members = sorted(self.paused)
        self.released, self.paused = set(self.paused), set()
        self.generate_since = now

    # ---- planning (the group calls this every step) ---------------------------------------

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        if grant is None:
            return StepPlan()
        if grant.prefill:
            members = [s for s in view.slots if s.order in grant.prefill and s.phase == "prefill"]
            self._rotate += 1
            return StepPlan(prefill=self.share(members, view.n_batch))
        release = tuple(s.local for s in view.slots if s.order in grant.release and s.phase == "ready" and s.parent < 0)
        return StepPlan(generate=generating(view, grant.generate), release=release)

    def share(self, members: list[SlotView], n_batch: int) -> tuple[tuple[int, int], ...]:
        return fair_share(members, n_batch, self._rotate)


class SerialPrefillPolicy(CohortPolicy):
    """Like ``cohort``, but one member at a time owns the prefill (in arrival order)."""

    name = "serial-prefill"

    def share(self, members: list[SlotView], n_batch: int) -> tuple[tuple[int, int], ...]:
        head = min(members, key=lambda s: s.order, default=None)
        return () if head is None else ((head.local, min(head.prompt_left, n_batch)),)
