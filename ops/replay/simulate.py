"""The replay simulator: a recorded trace's arrivals against any policy, offline.

A discrete-event simulation of the runtime's scheduling path with a fake engine:

- **supervisor**: a request is submitted at its recorded time and takes free slots by the
  supervisor's own rule (``actors.scheduling.choose_slots``: the longest reusable cached
  prefix, then the group with the fewest busy slots, then the lowest slot id; n > 1 needs n
  slots of one group). A trace records how many prompt tokens a request reused and in which
  group, not the tokens: the simulated table says that every slot of that group holds that
  prefix (``_prompt_of``), so the supervisor's rule sends the request back there when the
  prefix covers enough of its prompt (``PREFIX_SIMILARITY``). When no slot fits, it waits in a
  FCFS queue, started in order as slots free up; as live, the group that freed a slot has
  started its next step before the supervisor hears of it, so the queued request joins at the
  step after;
- **group**: at each step boundary it takes its new requests (a policy ``ARRIVED`` event),
  asks its policy for a plan from a ``GroupView`` (built by ``actors.scheduling.group_view``,
  as the live group builds it; the real ``plan(view, grant)``), checks
  the plan and runs it on the fake engine: its tokens are sent after ``CostModel.decode_ms``
  and the next step starts after ``CostModel.ms`` (decode + the loop's own time), both of
  (prompt tokens, tokens sampled, KV cells). A prompt whose last chunk
  ran samples its first token at once, or waits in "ready" with ``holds_ready`` until a grant
  releases it (``PREFILL_DONE``); a request ends after the tokens it generated in the
  recording (``FINISHED``, or ``CANCELLED`` when it was cancelled or failed there);
- **coordinator**: events reach ``on_event`` as the real PhaseCoordinator's do: those a
  group emits at a boundary take effect from its next boundary (the group plans before the
  coordinator answers), unless the group has nothing to run, in which case it waits for the
  answer; bounded GENERATE phases get their ``tick`` at the deadline.

The prompt to decode is the recorded prompt minus the recorded cached prefix. Everything is
ordered by (time, kind, sequence number): the same trace and policy give the same numbers.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping

import numpy as np
from msgspec.structs import replace

from llamactor.actors.policy import GroupView, Policy, StepPlan
from llamactor.actors.scheduling import SlotEntry, SlotSnapshot, choose_slots, group_view
from llamactor.ops.replay.costfit import CostModel
from llamactor.ops.replay.simgroup import SimChoice, SimGroup, SimRequest, check_plan
from llamactor.ops.replay.simresult import Outcome, SimResult
from llamactor.ops.replay.tracefile import Request, Trace
from llamactor.protocol.messages import PhaseEvent, PhaseKind
from llamactor.runtime.engine.context import StepResult

# Event kinds, in the order they are handled at one instant: a step's end frees slots
# before a tick or an arrival at the same time is looked at.
_STEP_END, _TICK, _ARRIVAL = 0, 1, 2


class Simulation:
    """Replay ``trace`` against one policy class; ``run`` once."""

    def __init__(
        self,
        trace: Trace,
        policy_cls: type[Policy],
        cost: CostModel,
        options: Mapping[str, float] | None = None,
        after: Mapping[int, int] | None = None,
    ) -> None:
        h = trace.header
        opts = dict(h.policy_options if options is None else options)
        self.trace = trace
        # Closed loops and later turns: request i is sent once request after[i] has ended, at
        # its recorded time or then, whichever is later (its ``submitted`` moves with it).
        self.requests = list(trace.requests)
        self._after = dict(after or {})
        self._waiting: dict[int, list[int]] = {}
        for i, j in self._after.items():
            if not 0 <= j < len(self.requests) or j == i:
                raise ValueError(f"request {i} waits for request {j}, which is not another request of the trace")
            self._waiting.setdefault(j, []).append(i)
        self.cost = cost
        self.name = getattr(policy_cls, "name", policy_cls.__name__)
        self.slot_choice = getattr(policy_cls, "slot_choice", "lowest")
        self._releases = 0
        # The supervisor's slot table. What a slot of group g holds is the prefix the recorded
        # requests of group g reused (token g, as long as the longest prompt; see ``_prompt_of``).
        longest = max((r.prompt for r in trace.requests), default=0)
        held = [np.full(longest, g, dtype=np.int32) for g in range(h.groups)]
        self.table = [
            SlotEntry(g * h.n_slots + i, g, i, cached=held[g]) for g in range(h.groups) for i in range(h.n_slots)
        ]
        self.groups = [
            SimGroup(g, policy_cls(g, **opts), h.n_slots, h.n_batch, self.table[g * h.n_slots : (g + 1) * h.n_slots])
            for g in range(h.groups)
        ]
        self._warm_costs()
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._queue: deque[int] = deque()
        self._prompts: dict[int, np.ndarray] = {}  # stand-in prompts of queued requests
        self._outcomes: dict[int, Outcome] = {}
        self._live: dict[int, SimRequest] = {}
        self.steps = 0
        self.prompt_tokens = 0

    def _warm_costs(self) -> None:
        """Start each group's learned step costs where the server's were when the first replayed
        request arrived: learned from the recorded steps before it (a warm-up the replay leaves
        out, or the traffic before a cut), as the live group learned them."""
        first = min((r.submitted for r in self.trace.requests), default=0.0)
        for step in self.trace.steps:
            if step.start < first and 0 <= step.group < len(self.groups):
                self.groups[step.group].costs.learn(
                    StepResult(n_prompt=step.prompt, n_generated=step.generated, n_rows=step.slots), step.ms
                )

    # ---- the event loop ------------------------------------------------------------------

    def run(self) -> SimResult:
        for i, r in enumerate(self.requests):
            if i not in self._after:
                self._push(r.submitted, _ARRIVAL, i)
        while self._heap:
            t, kind, _, x = heapq.heappop(self._heap)
            if kind == _STEP_END:
                # The group goes on at once: the supervisor hears of the slots it freed only
                # while the next step runs, so a queued request joins one step later.
                self._end_step(self.groups[x], t)
                self._boundary(self.groups[x], t)
            elif kind == _TICK:
                self._tick(self.groups[x], t)
            else:
                self._queue.append(x)
            self._schedule()
            for g in self.groups:
                if not g.running and g.wake:
                    self._boundary(g, t)
        for i, r in enumerate(self.requests):  # a policy that stalled leaves these (and what waits on them)
            if i not in self._outcomes:
                live = self._live.get(i)
                first = live.first_token if live is not None else None
                self._outcomes[i] = Outcome(
                    False,
                    False,
                    r.submitted,
                    None,
                    None if first is None else first - r.submitted,
                    (),
                    sum(c.generated for c in live.choices) if live else 0,
                )
        return SimResult(
            self.name, tuple(self._outcomes[i] for i in range(len(self.requests))), self.steps, self.prompt_tokens
        )

    def _push(self, t: float, kind: int, x: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, x))

    # ---- supervisor: slots and the queue ---------------------------------------------------

    def _schedule(self) -> None:
        for i in list(self._queue):
            rec = self.requests[i]
            prompt = self._prompts.get(i)
            if prompt is None:
                prompt = self._prompts[i] = self._prompt_of(rec)
            ids = self.choose(rec, prompt)
            if ids is None:
                continue
            self._queue.remove(i)
            del self._prompts[i]
            g = self.groups[self.table[ids[0]].group]
            locals_ = tuple(self.table[sid].local for sid in ids)
            for local in locals_:
                g.entries[local].busy = True
            targets = rec.per_choice
            choices = [
                SimChoice(local, targets[k], -1 if k == 0 else locals_[0], "prefill" if k == 0 else "ready")
                for k, local in enumerate(locals_)
            ]
            live = SimRequest(i, rec, 0, rec.prompt - rec.cached, choices)
            choices[0].n_past = rec.cached
            self._live[i] = live
            g.inbox.append((live, locals_))
            g.wake = True

    def choose(self, rec: Request, prompt: np.ndarray | None = None) -> tuple[int, ...] | None:
        """The slot ids (parent first) the supervisor's rule gives ``rec`` over the table now,
        or None when it must wait."""
        return choose_slots(
            self.table, self._prompt_of(rec) if prompt is None else prompt, n=rec.n, prefer=self.slot_choice
        )

    @staticmethod
    def _prompt_of(rec: Request) -> np.ndarray:
        """Stand-in tokens for ``rec``'s prompt: its reused prefix is its group's token (what that
        group's slots hold in the table), the rest a token no slot holds."""
        prompt = np.full(rec.prompt, -1, dtype=np.int32)
        prompt[: rec.cached] = rec.group
        return prompt

    # ---- a group's step boundary ---------------------------------------------------------

    def _boundary(self, g: SimGroup, t: float) -> None:
        g.wake = False
        for live, locals_ in g.inbox:
            g.order += 1
            live.order = g.order
            for c in live.choices:
                g.slots[c.local] = (live, c)
            g.pending.append(PhaseEvent(g.index, PhaseKind.ARRIVED, locals_[0], live.prompt_left, t, live.order))
        g.inbox.clear()
        plan = g.policy.plan(self._view(g, t), g.grant)
        if self._deliver(g, t) and plan.empty:
            plan = g.policy.plan(self._view(g, t), g.grant)  # the group waited for the coordinator's answer
        if plan.empty:
            return  # idle until an assignment, a grant or a tick wakes it
        self._start_step(g, plan, t)

    def _view(self, g: SimGroup, t: float) -> GroupView:
        busy = (
            SlotSnapshot(
                local,
                c.phase,
                live.prompt_left,
                live.order,
                c.parent,
                live.rec.submitted,
                live.rec.prompt,
                c.generated,
                live.prompt_done,
                c.done and c.phase == "generate",  # a finished choice waits for its siblings
                n_remaining=max(c.target - c.generated, 0),
            )
            for local, (live, c) in g.slots.items()
        )
        c = g.costs
        return group_view(g.index, g.n_batch, busy, t, c.ms_per_prompt_token, c.ms_per_step, c.ms_single_step)

    def _deliver(self, g: SimGroup, t: float) -> bool:
        """The coordinator handles the group's events: True if the grant changed."""
        events, g.pending = g.pending, []
        changed = False
        for e in events:
            changed |= self._on_event(g, e, t)
        return changed

    def _on_event(self, g: SimGroup, e: PhaseEvent, t: float) -> bool:
        grant = g.policy.on_event(e)
        changed = grant is not None and grant != g.grant
        if changed:
            g.grant = grant
        status = g.policy.status()
        armed = (status.cohort, status.generate_deadline)
        if status.generate_deadline and g.tick_for != armed:
            # One tick per deadline. (The live coordinator re-arms a tick for the same cohort
            # after it fired; with nobody queued that repeats at once: here it would never end.)
            g.tick_for = armed
            self._push(max(status.generate_deadline, t), _TICK, g.index)
        return changed

    def _tick(self, g: SimGroup, t: float) -> None:
        if self._on_event(g, PhaseEvent(g.index, PhaseKind.TICK, at=t), t):
            g.wake = True

    # ---- the fake engine -----------------------------------------------------------------

    def _start_step(self, g: SimGroup, plan: StepPlan, t: float) -> None:
        """Apply ``plan`` now (nothing looks at the group before the step ends) and schedule
        its end; its tokens carry the end time, its events and ended requests wait for it."""
        check_plan(g, plan, self.name)
        holds = g.policy.holds_ready
        emitted: list[tuple[SimRequest, SimChoice]] = []
        n_prompt = 0
        prompts_done: list[SimRequest] = []
        for local, k in plan.prefill:
            live, c = g.slots[local]
            live.prompt_left -= k
            c.n_past += k
            n_prompt += k
            if live.prompt_left == 0:
                prompts_done.append(live)
                for child in live.choices[1:]:
                    child.n_past = c.n_past
                if not any(ch.target for ch in live.choices):
                    g.ending.append(live)  # cancelled before its first token: ends with its prompt
                elif holds:
                    c.phase = "ready"
                    g.ready.append(live)
                else:
                    for ch in live.choices:
                        ch.phase = "generate"
                        emitted.append((live, ch))
        for local in plan.release:
            live, _ = g.slots[local]
            for ch in live.choices:
                ch.phase = "generate"
                emitted.append((live, ch))
        for local in plan.generate:
            live, c = g.slots[local]
            c.n_past += 1
            emitted.append((live, c))
        emitted = [(live, c) for live, c in emitted if not c.done]
        kv = sum(g.slots[local][1].n_past for local, _ in plan.prefill)
        kv += sum(g.slots[local][1].n_past for local in plan.generate)
        decode_ms = self.cost.decode_ms(n_prompt, len(emitted), kv)
        decoded_t = t + decode_ms / 1e3  # the tokens are sent right after the decode
        end_t = t + self.cost.ms(n_prompt, len(emitted), kv) / 1e3  # then the loop's own time
        for live in prompts_done:
            live.prompt_done = decoded_t
        g.costs.learn(
            StepResult(n_prompt=n_prompt, n_generated=len(emitted), n_rows=len(plan.prefill) + len(plan.generate)),
            decode_ms,
        )
        for live, c in emitted:
            self._token(live, c, decoded_t)
            if all(ch.done for ch in live.choices) and live not in g.ending:
                g.ending.append(live)
        self.steps += 1
        self.prompt_tokens += n_prompt
        g.running = True
        self._push(end_t, _STEP_END, g.index)

    def _token(self, live: SimRequest, c: SimChoice, at: float) -> None:
        c.generated += 1
        if c.last_token is not None:
            c.gaps.append(at - c.last_token)
        c.last_token = at
        if live.first_token is None:
            live.first_token = at

    def _end_step(self, g: SimGroup, t: float) -> None:
        g.running = False
        g.wake = True
        for live in g.ready:
            g.pending.append(PhaseEvent(g.index, PhaseKind.PREFILL_DONE, live.parent.local, 0, t, live.order))
        g.ready = []
        for live in g.ending:
            rec = live.rec
            finished = rec.ok and all(c.done for c in live.choices)
            kind = PhaseKind.FINISHED if finished else PhaseKind.CANCELLED
            g.pending.append(PhaseEvent(g.index, kind, live.parent.local, 0, t, live.order))
            self._releases += 1
            for c in live.choices:
                g.slots.pop(c.local, None)
                g.entries[c.local].busy = False
                g.entries[c.local].released = self._releases
            first = live.first_token
            self._outcomes[live.index] = Outcome(
                True,
                finished,
                rec.submitted,
                t,
                None if first is None else first - rec.submitted,
                tuple(gap for c in live.choices for gap in c.gaps),
                sum(c.generated for c in live.choices),
            )
            for i in self._waiting.pop(live.index, ()):
                self.requests[i] = replace(self.requests[i], submitted=max(self.requests[i].submitted, t))
                self._push(self.requests[i].submitted, _ARRIVAL, i)
        g.ending = []


def simulate(
    trace: Trace,
    policy_cls: type[Policy],
    cost: CostModel,
    options: Mapping[str, float] | None = None,
    after: Mapping[int, int] | None = None,
) -> SimResult:
    """Replay every request of ``trace`` against ``policy_cls`` (options: the recorded ones);
    ``after`` maps a request to the one whose end it is sent at (closed loops, later turns)."""
    return Simulation(trace, policy_cls, cost, options, after).run()


__all__ = ["Simulation", "simulate"]
