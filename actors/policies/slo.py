"""``slo`` (the default): continuous batching steered by the user's service-level objective.

Its inputs are the objective a request is judged by: a first token within ``slo_ttft_ms``, or
``TTFT_SCALE`` times what the prompt costs alone where that is longer, and its
inter-token gaps within ``slo_itl_ms`` at the ``slo_itl_pct`` percentile of the request's own
gaps (0: its mean gap, the serving papers' time per output token; 50, 90 (the default), 99).
Unset, ``slo_itl_ms`` is ``ITL_SCALE`` times what a token costs one stream alone on this
machine, as measured: an objective relative to the hardware, as serving papers set their SLOs.
Its aim is goodput: the share of requests that meet both. Every step, as llama-server, each
generating slot contributes one token and prompt chunks fill the rest of n_batch; what this
policy decides is whose prompts go first and how many prompt tokens a step takes.

- Whose prompts: the ones that can still get their first token in time first, shortest
  remaining first (the most first tokens soonest), then the others, also shortest first and
  then in slot order, as llama-server feeds them; once a prompt has waited ``STARVE_FACTOR``
  first-token targets, the ones that can still make theirs lose their precedence.
  Each step's prompt tokens go to the first prompts in that order until each is through, so
  prompts are never processor-shared: equal prompts get their first tokens one after another,
  as with llama-server, not all together at the end. A step that finishes a prompt ends there
  when the prompt tokens after it would delay that first token by more than one more step
  delays the prompts still waiting (``take_split``): a short prompt that arrives with a long
  one gets its first token after its own tokens, not after the long one's.
- How many, at the mean: each stream that can still meet its mean gap (its first
  token was in time, and its remaining gaps at the plain step time would leave its mean within
  target) pays for prompt tokens from its slack, ``SLACK_SHARE`` of it spread evenly over its
  remaining gaps. A step with more prompt tokens than a stream can pay loses that stream; one
  with fewer than a waiting prompt needs to make its first-token target loses that prompt. Of
  the budgets the streams can pay and the whole room, the step takes the one that loses the
  fewest requests, the larger on a tie (first tokens sooner).
- How many, at a percentile: a step longer than ``slo_itl_ms`` by the group's measured step
  costs is a long gap for every stream in it, and a stream may have ``(1 - pct) * gaps`` of
  them; the policy counts the long steps it planned for each stream. When a stream still
  meeting its objective cannot afford one more, the step takes only the prompt tokens that fit
  in ``slo_itl_ms`` (at least ``MIN_PREFILL_CHUNK``), unless prompts that can still make their
  first-token target would miss it at that pace, as many as the streams it would save.
- Once a waiting prompt has waited ``OVERLOAD_FACTOR`` times its first-token target, the
  server is overloaded: every step takes the whole room, as llama-server's do, and the streams'
  gaps pay for the first tokens. Short steps there cost a step's overhead per chunk (8 % more
  time for a burst of 64 long prompts) and only push every later first token further back.
- Streams that already missed their objective, and prompts that no longer can, are never
  protected at the cost of the others. Neither are streams on a machine (or at a load) where a
  step with no prompt at all is already longer than ``slo_itl_ms``: short steps would only
  delay first tokens.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from llamactor.actors.policy import GroupView, Policy, SlotView, StepPlan, fill_prefill, generating, take_split
from llamactor.protocol.messages import Grant

DEFAULT_SLO_TTFT_MS = 2000.0  # the first-token target until a prompt token's cost was measured
ITL_SCALE = 4.0
DEFAULT_SLO_ITL_MS = 150.0  # the gap target until a step was measured
DEFAULT_SLO_ITL_PCT = 90.0  # that percentile of the request's own gaps (50, 90, 99); 0: the mean gap
MIN_PREFILL_CHUNK = 32  # prompt tokens a short step still takes while prompts wait
STARVE_FACTOR = 10.0  # a prompt waiting this many first-token targets ends the feasible ones' precedence
OVERLOAD_FACTOR = 2.0  # a prompt waiting this many first-token targets: whole steps, streams unprotected
# the objective, unset: a first token within TTFT_SCALE times what the prompt costs alone, and a
# mean gap within ITL_SCALE times a token's unloaded time: serving papers set SLOs as a scale
# (commonly 5) times the unloaded latency; 4 leaves a margin for the steps' noise
TTFT_SCALE = 4.0
SLACK_SHARE = 0.9  # of a stream's slack, what prompts may spend: steps cost more than measured at times
COLD_BUDGET = 128  # prompt tokens a step takes beside streams before its costs are measured


def _option(options: dict[str, Any], name: str, default: float) -> float:
    """A target in ms: ``default`` when not given, 0 (relative to the machine) when given as 0."""
    value = options.get(name)
    return default if value is None else max(float(value), 0.0)


class SloPolicy(Policy):
    name = "slo"

    def __init__(self, group: int = 0, **options: Any) -> None:
        super().__init__(group, **options)
        # 0: relative to the machine (TTFT_SCALE x the prompt's own cost, ITL_SCALE x a token's)
        self.slo_ttft_ms = _option(options, "slo_ttft_ms", DEFAULT_SLO_TTFT_MS)
        self.fixed_itl_ms = _option(options, "slo_itl_ms", DEFAULT_SLO_ITL_MS)
        self.slo_itl_ms = self.fixed_itl_ms or DEFAULT_SLO_ITL_MS  # this step's gap target
        pct = options.get("slo_itl_pct")
        self.slo_itl_pct = DEFAULT_SLO_ITL_PCT if pct is None else float(pct)  # 0: the mean
        self.long_gaps: dict[int, int] = {}  # per request (arrival order): long steps it was in

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        if not self.fixed_itl_ms:
            unloaded = view.ms_single_step or view.ms_per_step
            self.slo_itl_ms = ITL_SCALE * unloaded if unloaded > 0 else DEFAULT_SLO_ITL_MS
        generate = generating(view)
        streams = [s for s in view.slots if s.phase == "generate"]
        self._forget(view)
        waiting = [s for s in view.slots if s.phase == "prefill" and s.prompt_left > 0 and s.parent < 0]
        if not waiting:
            return StepPlan(generate=generate)
        room = view.n_batch - len(generate)
        order = self.order(view, waiting)
        budget = room if not generate else self.budget(view, streams, order, room)
        prefill = self.take(view, order, budget)
        if generate and self.long(view, sum(k for _, k in prefill)):
            for s in streams:
                self.long_gaps[s.order] = self.long_gaps.get(s.order, 0) + 1
        return StepPlan(prefill=prefill, generate=generate)

    def take(self, view: GroupView, order: list[SlotView], budget: int) -> tuple[tuple[int, int], ...]:
        """The step's prompt chunks: ``budget`` tokens in ``order``, ending after a prompt that
        finishes when the rest would cost its first token more than a step costs the others; a
        prompt that can no longer make its target always takes what is left."""
        if view.ms_per_step <= 0 or view.ms_per_prompt_token <= 0:
            return fill_prefill(order, budget)
        late = frozenset(s.local for s in order if not self.feasible(view, s))
        return take_split(order, budget, view.ms_per_step, view.ms_per_prompt_token, late)

    # ---- how many prompt tokens ------------------------------------------------------------

    def budget(self, view: GroupView, streams: list[SlotView], order: list[SlotView], room: int) -> int:
        """The step's prompt tokens: all the room, unless a stream that meets its objective
        cannot afford a long gap and no prompt's first token is worth more."""
        if self.overloaded(view, order):
            return room
        per_token, per_step = view.ms_per_prompt_token, view.ms_per_step
        if per_token <= 0 or per_step <= 0:
            return min(room, COLD_BUDGET)
        if per_step >= self.slo_itl_ms:
            return room  # a step with no prompt at all is already a long gap: no stream to save
        if self.slo_itl_pct <= 0:
            return self.mean_budget(view, streams, order, room)
        short = max(MIN_PREFILL_CHUNK, int((self.slo_itl_ms - per_step) / per_token))
        if short >= room:
            return room
        fragile = [s for s in streams if self.meeting(view, s) and not self.affords_long_gap(s)]
        if not fragile:
            return room
        at_risk = self.first_tokens_lost(view, order, short, room)
        return room if at_risk >= len({s.order for s in fragile}) else short

    def mean_budget(self, view: GroupView, streams: list[SlotView], order: list[SlotView], room: int) -> int:
        """At the mean: the prompt tokens that lose the fewest requests. Each stream that can
        still meet its mean gap pays for prompt tokens from its slack, spread over its remaining
        gaps; a step with more tokens than a stream can pay loses that stream, a step with fewer
        than a waiting prompt needs to make its first-token target loses that prompt. Of the
        budgets each stream can pay (and the whole room), the one losing fewest, the larger on
        a tie (first tokens sooner)."""
        protected = [s for s in streams if self.meeting(view, s)]
        if not protected:
            return room
        payable = sorted(min(room, max(0, int(self.spare_ms(view, s) / view.ms_per_prompt_token))) for s in protected)
        best, best_lost = room, None
        for budget in sorted({*payable, room}, reverse=True):
            lost = bisect.bisect_left(payable, budget) + self.first_tokens_lost(view, order, budget, room)
            if best_lost is None or lost < best_lost:
                best, best_lost = budget, lost
        return best

    def overloaded(self, view: GroupView, order: list[SlotView]) -> bool:
        """A waiting prompt has waited ``OVERLOAD_FACTOR`` first-token targets: the queue grows
        faster than short steps drain it."""
        if view.ms_per_prompt_token <= 0:
            return False
        return any(self.waited_ms(view, s) > OVERLOAD_FACTOR * self.ttft_target_ms(view, s) for s in order)

    def slack_ms(self, view: GroupView, s: SlotView) -> float:
        """What a stream can still spend and meet its mean gap: its target over all its gaps,
        less the time its gaps took so far and its remaining ones at the generation step time
        (negative: it cannot meet it any more)."""
        remaining = max(s.n_remaining, 0)
        elapsed = (view.now - s.first_token_at) * 1e3
        return self.slo_itl_ms * (s.n_generated - 1 + remaining) - elapsed - remaining * view.ms_per_step

    def spare_ms(self, view: GroupView, s: SlotView) -> float:
        """What each of a stream's remaining gaps may add to a step (``SLACK_SHARE`` of its slack)."""
        return SLACK_SHARE * max(self.slack_ms(view, s), 0.0) / max(s.n_remaining, 1)

    def long(self, view: GroupView, n_prompt: int) -> bool:
        """Whether a step with ``n_prompt`` prompt tokens is a long gap for its streams."""
        if view.ms_per_prompt_token <= 0 or view.ms_per_step <= 0:
            return n_prompt > COLD_BUDGET
        return view.ms_per_step + n_prompt * view.ms_per_prompt_token > self.slo_itl_ms

    def meeting(self, view: GroupView, s: SlotView) -> bool:
        """A stream still meeting its objective: first token in time, gaps within target."""
        if s.n_generated < 1 or (s.first_token_at - s.arrived) * 1e3 > self.ttft_target_ms(view, s):
            return False
        if self.slo_itl_pct <= 0:
            # the mean: one long gap early in a stream is won back by the short ones after it
            return s.n_generated - 1 + max(s.n_remaining, 0) < 1 or self.slack_ms(view, s) >= 0
        return self.long_gaps.get(s.order, 0) <= self.allowed_long_gaps(s)

    def allowed_long_gaps(self, s: SlotView) -> int:
        """Long gaps a stream may have and still meet its percentile objective."""
        gaps = s.n_generated + s.n_remaining - 1
        return math.floor(max(gaps, 0) * (100.0 - self.slo_itl_pct) / 100.0 + 1e-9)

    def affords_long_gap(self, s: SlotView) -> bool:
        """At a percentile: one more long gap leaves the stream within its allowance."""
        return self.long_gaps.get(s.order, 0) + 1 <= self.allowed_long_gaps(s)

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
            target = self.ttft_target_ms(view, s)
            lost += full <= target < slow
        return lost

    @staticmethod
    def finish_ms(view: GroupView, tokens: int, per_step: int) -> float:
        steps = math.ceil(tokens / max(per_step, 1))
        return steps * view.ms_per_step + tokens * view.ms_per_prompt_token

    # ---- whose prompts ---------------------------------------------------------------------

    def order(self, view: GroupView, waiting: list[SlotView]) -> list[SlotView]:

        # Prompts that can still make their first-token target go first, unless one has waited
        # too long: then every prompt is in the order below (no prompt waits forever behind a
        # stream of short ones).
        starved = any(self.waited_ms(view, s) > STARVE_FACTOR * self.ttft_target_ms(view, s) for s in waiting)

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
        finish = self.waited_ms(view, s) + self.finish_ms(view, s.prompt_left, view.n_batch)
        return finish <= self.ttft_target_ms(view, s)

    def ttft_target_ms(self, view: GroupView, s: SlotView) -> float:
        """A request's first-token target: ``slo_ttft_ms``, or ``TTFT_SCALE`` times what its
        prompt costs alone on this machine (its tokens and one step, by the measured costs)
        where that is longer (0: that alone; before any cost is measured,
        ``DEFAULT_SLO_TTFT_MS``). A long prompt is not written off for missing a target its own
        prefill can hardly meet: its stream is still protected once it generates."""
        if view.ms_per_prompt_token <= 0:
            return self.slo_ttft_ms or DEFAULT_SLO_TTFT_MS
        alone = s.n_prompt * view.ms_per_prompt_token + (view.ms_single_step or view.ms_per_step)
        return max(self.slo_ttft_ms, TTFT_SCALE * alone)

    @staticmethod
    def waited_ms(view: GroupView, s: SlotView) -> float:
        return max(view.now - s.arrived, 0.0) * 1e3

    def _forget(self, view: GroupView) -> None:
        """Drop the counts of requests no longer in the group."""
        if len(self.long_gaps) > len(view.slots):
            present = {s.order for s in view.slots}
            self.long_gaps = {order: n for order, n in self.long_gaps.items() if order in present}
