"""``slo`` (the default): continuous batching steered by the user's service-level objective.

Its inputs are the objective a request is judged by: a first token within ``slo_ttft_ms``, and
its inter-token gaps within ``slo_itl_ms`` at the ``slo_itl_pct`` percentile of the request's
own gaps (50, 90, 99; 0: its mean gap). Its aim is goodput: the share of requests that meet
both. Every step, as llama-server, each generating slot contributes one token and prompt
chunks fill the rest of n_batch; what this policy decides is whose prompts go first and when a
step must stay short.

- Whose prompts: the ones that can still get their first token in time first, shortest
  remaining first (the most first tokens soonest), then the others, also shortest first and
  then in slot order, as llama-server feeds them; once a prompt has waited ``STARVE_FACTOR``
  first-token targets, the ones that can still make theirs lose their precedence.
  Each step's prompt tokens go to the first prompts in that order until each is through, so
  prompts are never processor-shared: equal prompts get their first tokens one after another,
  as with llama-server, not all together at the end.
- When a step stays short: only when a stream still meeting its objective (its first token
  was in time, and its gaps so far leave it within target) cannot afford one more long gap.
  A step longer than ``slo_itl_ms`` by the group's measured step costs is a long gap for every
  stream in it; at a percentile, a stream may have ``(1 - pct) * gaps`` of them, and the
  policy counts the long steps it planned for each stream; at the mean, a long gap must leave
  the stream's mean within target once its remaining gaps are counted at the plain step time.
  Then the step takes only the prompt tokens that fit in ``slo_itl_ms`` (at least
  ``MIN_PREFILL_CHUNK``), unless prompts that can still make their first-token target would
  miss it at that pace, as many as the streams it would save: then the step is long (one
  request lost either way, and the first tokens come sooner).
  Streams that already missed their objective, and prompts that no longer can, are never
  protected at the cost of the others: the step is then as long as llama-server's. Neither
  are streams on a machine (or at a load) where a step with no prompt at all is already
  longer than ``slo_itl_ms``: short steps would only delay first tokens.
"""

from __future__ import annotations

import math
from typing import Any

from llamactor.actors.policy import GroupView, Policy, SlotView, StepPlan, fill_prefill, generating
from llamactor.protocol.messages import Grant

DEFAULT_SLO_TTFT_MS = 2000.0  # the benchmark's goodput objective (ops/slo.py): first token within 2 s
DEFAULT_SLO_ITL_MS = 150.0  # ... and inter-token gaps within 150 ms
DEFAULT_SLO_ITL_PCT = 90.0  # ... at the request's own 90th percentile gap
MIN_PREFILL_CHUNK = 32  # prompt tokens a short step still takes while prompts wait
STARVE_FACTOR = 10.0  # a prompt waiting this many first-token targets ends the feasible ones' precedence
COLD_BUDGET = 128  # prompt tokens a step takes beside streams before its costs are measured


class SloPolicy(Policy):
    name = "slo"

    def __init__(self, group: int = 0, **options: Any) -> None:
        super().__init__(group, **options)
        self.slo_ttft_ms = float(options.get("slo_ttft_ms") or DEFAULT_SLO_TTFT_MS)
        self.slo_itl_ms = float(options.get("slo_itl_ms") or DEFAULT_SLO_ITL_MS)
        pct = options.get("slo_itl_pct")
        self.slo_itl_pct = DEFAULT_SLO_ITL_PCT if pct is None else float(pct)  # 0: the mean
        self.long_gaps: dict[int, int] = {}  # per request (arrival order): long steps it was in

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        generate = generating(view)
        streams = [s for s in view.slots if s.phase == "generate"]
        self._forget(view)
        waiting = [s for s in view.slots if s.phase == "prefill" and s.prompt_left > 0 and s.parent < 0]
        if not waiting:
            return StepPlan(generate=generate)
        room = view.n_batch - len(generate)
        order = self.order(view, waiting)
        budget = room if not generate else self.budget(view, streams, order, room)
        prefill = fill_prefill(order, budget)
        if generate and self.long(view, sum(k for _, k in prefill)):
            for s in streams:
                self.long_gaps[s.order] = self.long_gaps.get(s.order, 0) + 1
        return StepPlan(prefill=prefill, generate=generate)

    # ---- how many prompt tokens ------------------------------------------------------------

    def budget(self, view: GroupView, streams: list[SlotView], order: list[SlotView], room: int) -> int:
        """The step's prompt tokens: all the room, unless a stream that meets its objective
        cannot afford a long gap and no prompt's first token is worth more."""
        per_token, per_step = view.ms_per_prompt_token, view.ms_per_step
        if per_token <= 0 or per_step <= 0:
            return min(room, COLD_BUDGET)
        if per_step >= self.slo_itl_ms:
            return room  # a step with no prompt at all is already a long gap: no stream to save
        short = max(MIN_PREFILL_CHUNK, int((self.slo_itl_ms - per_step) / per_token))
        if short >= room:
            return room
        fragile = [s for s in streams if self.meeting(view, s) and not self.affords_long_gap(view, s, room)]
        if not fragile:
            return room
        at_risk = self.first_tokens_lost(view, order, short, room)
        return room if at_risk >= len({s.order for s in fragile}) else short

    def long(self, view: GroupView, n_prompt: int) -> bool:
        """Whether a step with ``n_prompt`` prompt tokens is a long gap for its streams."""
        if view.ms_per_prompt_token <= 0 or view.ms_per_step <= 0:
            return n_prompt > COLD_BUDGET
        return view.ms_per_step + n_prompt * view.ms_per_prompt_token > self.slo_itl_ms

    def meeting(self, view: GroupView, s: SlotView) -> bool:
        """A stream still meeting its objective: first token in time, gaps within target."""
        if s.n_generated < 1 or (s.first_token_at - s.arrived) * 1e3 > self.slo_ttft_ms:
            return False
        if self.slo_itl_pct <= 0:
            gaps = s.n_generated - 1
            return gaps < 1 or (view.now - s.first_token_at) * 1e3 / gaps <= self.slo_itl_ms
        return self.long_gaps.get(s.order, 0) <= self.allowed_long_gaps(s)

    def allowed_long_gaps(self, s: SlotView) -> int:
        """Long gaps a stream may have and still meet its percentile objective."""
        gaps = s.n_generated + s.n_remaining - 1
        return math.floor(max(gaps, 0) * (100.0 - self.slo_itl_pct) / 100.0 + 1e-9)

    def affords_long_gap(self, view: GroupView, s: SlotView, n_prompt: int) -> bool:
        if self.slo_itl_pct > 0:
            return self.long_gaps.get(s.order, 0) + 1 <= self.allowed_long_gaps(s)
        # the mean: elapsed + this step + its remaining gaps at the generation step time
        step_ms = view.ms_per_step + n_prompt * view.ms_per_prompt_token
        elapsed = (view.now - s.first_token_at) * 1e3
        gaps = s.n_generated - 1 + max(s.n_remaining, 1)
        return elapsed + step_ms + (max(s.n_remaining, 1) - 1) * view.ms_per_step <= self.slo_itl_ms * gaps

    def first_tokens_lost(self, view: GroupView, order: list[SlotView], short: int, room: int) -> int:
        """Prompts that would make their first-token target with full steps but not with short ones."""
        lost, ahead = 0, 0
        for s in order:
            if not self.feasible(view, s):
                break  # the rest cannot make it either way (feasible ones come first)
            ahead += s.prompt_left
            waited = self.waited_ms(view, s)
            full = waited + self.finish_ms(view, ahead, room)
            slow = waited + self.finish_ms(view, ahead, short)
            lost += full <= self.slo_ttft_ms < slow
        return lost

    @staticmethod
    def finish_ms(view: GroupView, tokens: int, per_step: int) -> float:
        steps = math.ceil(tokens / max(per_step, 1))
        return steps * view.ms_per_step + tokens * view.ms_per_prompt_token

    # ---- whose prompts ---------------------------------------------------------------------

    def order(self, view: GroupView, waiting: list[SlotView]) -> list[SlotView]:
        starve_ms = STARVE_FACTOR * self.slo_ttft_ms

        # Prompts that can still make their first-token target go first, unless one has waited
        # too long: then every prompt is in the order below (no prompt waits forever behind a
        # stream of short ones).
        starved = any(self.waited_ms(view, s) > starve_ms for s in waiting)

        def key(s: SlotView) -> tuple[int, float, float, int]:
            if not starved and self.feasible(view, s):
                return (1, s.prompt_left, s.arrived, s.order)
            # Shortest first, then in llama-server's order (by slot): in a burst, later
            # arrivals in low slots get first tokens soon instead of every prompt waiting
            # behind all older ones (the median's worst order for equal prompts).
            return (2, s.prompt_left, 0.0, s.local)

        return sorted(waiting, key=key)

    def feasible(self, view: GroupView, s: SlotView) -> bool:
        """Could this prompt still get its first token in time with whole steps from now on?"""
        per_token = view.ms_per_prompt_token
        if per_token <= 0:
            return True
        return self.waited_ms(view, s) + self.finish_ms(view, s.prompt_left, view.n_batch) <= self.slo_ttft_ms

    @staticmethod
    def waited_ms(view: GroupView, s: SlotView) -> float:
        return max(view.now - s.arrived, 0.0) * 1e3

    def _forget(self, view: GroupView) -> None:
        """Drop the counts of requests no longer in the group."""
        if len(self.long_gaps) > len(view.slots):
            present = {s.order for s in view.slots}
            self.long_gaps = {order: n for order, n in self.long_gaps.items() if order in present}
