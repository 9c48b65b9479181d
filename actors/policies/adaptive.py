"""``adaptive``: continuous batching whose prompt budget follows the traffic.

Every step every generating slot contributes its token, as in ``continuous``; what varies is
how many prompt tokens join them, and whose. The policy judges requests as the goodput
benchmark does (ops/bench/slo.py): a prompt should get its first token within ``target_ttft_ms``,
and a stream should keep its time per output token under ``target_itl_ms``.

- A stream is *on track* while its mean gap so far is within ``target_itl_ms`` (a stream with
  one token is). A waiting prompt is *hopeless* when it would miss ``target_ttft_ms`` even if
  it had the whole n_batch from now on.
- Budget: the whole n_batch when nobody generates, or when hopeless prompts are at least as
  many as the streams on track (a burst: stalling streams costs less than queueing prompts;
  throughput and mean TTFT are what is left to win). Otherwise the prompt tokens that fit in
  ``target_itl_ms`` by the group's measured step costs, or the waiting prompts' share of
  n_batch against the streams if larger, raised to the whole n_batch when a prompt that can
  still make its target would miss it at that budget. With more than one request waiting,
  a step may also take as long as every stream on track can afford without its mean gap
  passing the target (its *slack*): each step a queue waits delays all of its requests, and
  a queue of several is what a wave of arrivals (a closed loop's next round) builds up.
- Order: prompts that can still make their target, shortest remaining first (the fewest late
  first tokens); then the hopeless ones, oldest first. A prompt that has waited
  ``STARVE_FACTOR`` times the target goes first whatever its length, so none starves.
- Where the step ends (``take_split``): within the budget, prompts join in that order only
  while that gives first tokens sooner on the whole; a prompt that would miss its target, or
  already has, still gets what is left of the step. Equal prompts that arrive together (a
  chat's next turns, a closed loop's next round) then finish a few at a time instead of all
  at the end of one long step, and their streams stay spread out afterwards.

Measured against ``continuous``, ``stall-free`` and llama-server on the burst, mixed,
shared-prefix, Poisson, closed-loop and chat workloads (README, "Scheduling policies").
"""

from __future__ import annotations

from llamactor.actors.policy import GroupView, Policy, SlotView, StepPlan, fill_prefill, generating, take_split
from llamactor.protocol.messages import Grant

DEFAULT_TARGET_ITL_MS = 200.0  # the longest step a stream on track should see (see README)
DEFAULT_TARGET_TTFT_MS = 2000.0  # the goodput benchmark's default first-token target
MIN_PREFILL_CHUNK = 32  # prompt tokens a step always has room for while prompts wait
COLD_BUDGET = 128  # before any step cost is measured
STARVE_FACTOR = 10.0  # a prompt waiting this many TTFT targets is served first
FUTURE_GAPS = 16  # generation steps a stream is counted on to win back slack spent now


class AdaptivePolicy(Policy):
    name = "adaptive"

    def __init__(self, group: int = 0, **options: float) -> None:
        super().__init__(group, **options)
        self.target_itl_ms = float(options.get("target_itl_ms") or DEFAULT_TARGET_ITL_MS)
        self.target_ttft_ms = float(options.get("target_ttft_ms") or DEFAULT_TARGET_TTFT_MS)
        self.fixed_budget = int(options.get("prefill_budget") or 0)

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        generate = generating(view)
        waiting = [s for s in view.slots if s.phase == "prefill" and s.prompt_left > 0]
        if not waiting:
            return StepPlan(generate=generate)
        room = view.n_batch - len(generate)
        budget, late = (room, frozenset[int]()) if not generate else self.budget(view, generate, waiting)
        order = self.order(view, waiting)
        if self.fixed_budget or view.ms_per_prompt_token <= 0 or view.ms_per_step <= 0:
            # no early end before the step costs are measured (a cold group's first steps all
            # prefill, so it has no generation-only step yet)
            return StepPlan(prefill=fill_prefill(order, min(room, budget)), generate=generate)
        urgent = late | {s.local for s in waiting if not self.feasible(view, s)}
        return StepPlan(
            prefill=take_split(order, min(room, budget), view.ms_per_step, view.ms_per_prompt_token, urgent),
            generate=generate,
        )

    # ---- how many prompt tokens ----------------------------------------------------------

    def budget(self, view: GroupView, generate: tuple[int, ...], waiting: list[SlotView]) -> tuple[int, frozenset[int]]:
        """Prompt tokens for the next step, and the prompts that would miss their target at the
        normal budget (the reason it was raised: ``take_split`` never leaves them out)."""
        room = view.n_batch - len(generate)
        none = frozenset[int]()
        if self.fixed_budget:
            return max(MIN_PREFILL_CHUNK, self.fixed_budget), none
        per_token, per_step = view.ms_per_prompt_token, view.ms_per_step
        if per_token <= 0:
            return COLD_BUDGET, none
        hopeless = sum(1 for s in waiting if not self.feasible(view, s))
        on_track = self.on_track(view)
        if hopeless >= on_track or 2 * on_track < len(generate):
            return room, none
        budget = max(
            MIN_PREFILL_CHUNK,
            int((self.target_itl_ms - per_step) / per_token),
            room * len(waiting) // (len(waiting) + len(generate)),
        )
        if budget < room and (late := self.late(view, waiting, budget)):
            return room, late
        if budget < room and len({s.order for s in waiting}) > 1:
            spend = (self.slack_ms(view, per_step) - per_step) / per_token
            if spend > budget:
                return (room if spend >= room else int(spend)), none
        return budget, none

    def slack_ms(self, view: GroupView, per_step: float) -> float:
        """The longest next step that keeps every stream on track within the inter-token target
        on average: ``target * n - elapsed`` for a stream with n tokens ``elapsed`` ms after its
        first, plus what it wins back in its next ``FUTURE_GAPS`` generation-only steps (``inf``
        with no stream on track)."""
        regain = max(self.target_itl_ms - per_step, 0.0) * FUTURE_GAPS
        slack = float("inf")
        for s in view.slots:
            if s.phase != "generate" or s.n_generated < 1:
                continue
            elapsed = (view.now - s.first_token_at) * 1e3
            if s.n_generated >= 2 and elapsed / (s.n_generated - 1) > self.target_itl_ms:
                continue  # already late: the burst rule above speaks for it
            slack = min(slack, self.target_itl_ms * s.n_generated - elapsed + regain)
        return slack

    def on_track(self, view: GroupView) -> int:
        """Streams whose mean gap so far is within the inter-token target."""
        n = 0
        for s in view.slots:
            if s.phase != "generate":
                continue
            if s.n_generated < 2 or (view.now - s.first_token_at) * 1e3 / (s.n_generated - 1) <= self.target_itl_ms:
                n += 1
        return n

    def feasible(self, view: GroupView, s: SlotView) -> bool:
        """Could this prompt still get its first token in time with the whole n_batch?"""
        return self.waited_ms(view, s) + s.prompt_left * view.ms_per_prompt_token <= self.target_ttft_ms

    def late(self, view: GroupView, waiting: list[SlotView], budget: int) -> frozenset[int]:
        """The prompts that can make their target but would miss it at ``budget`` tokens a step.
        Prompts finish in ``order``, each when the tokens ahead of it and its own are through."""
        step_ms = view.ms_per_step + budget * view.ms_per_prompt_token
        ahead, late = 0, set()
        for s in self.order(view, waiting):
            ahead += s.prompt_left
            if self.feasible(view, s) and self.waited_ms(view, s) + ahead / budget * step_ms > self.target_ttft_ms:
                late.add(s.local)
        return frozenset(late)

    # ---- whose ------------------------------------------------------------------------------

    def order(self, view: GroupView, waiting: list[SlotView]) -> list[SlotView]:
        starve_ms = STARVE_FACTOR * self.target_ttft_ms

        def key(s: SlotView) -> tuple[int, float, int]:
            waited = self.waited_ms(view, s)
            if waited > starve_ms:
                return (0, s.arrived, s.order)
            if self.feasible(view, s):
                return (1, s.prompt_left, s.order)
            return (2, s.arrived, s.order)

        return sorted(waiting, key=key)

    @staticmethod
    def waited_ms(view: GroupView, s: SlotView) -> float:
        return max(view.now - s.arrived, 0.0) * 1e3
