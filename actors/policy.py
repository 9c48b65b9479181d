"""The public scheduling-policy interface (SPEC section 4).

A policy decides, for one group, which slots prefill how many prompt tokens and which slots
generate in the next decode step. It sees a plain snapshot (``GroupView``) and returns a
``StepPlan``; it does no I/O, touches no ctypes and reads no clock except through the
snapshot, so every policy can be tested with a fake engine and no model.

Called by the group's decode loop once per step (``plan``) and by the phase coordinator once
per phase event (``on_event``); both on the event loop, never concurrently.

To write your own, subclass ``Policy`` (or implement the same two methods) and start the
server with ``--scheduler module:Class``; ``examples/custom_policy.py`` has one.
"""

from __future__ import annotations

from typing import NamedTuple

from protocol.messages import Grant, PhaseEvent


class SlotView(NamedTuple):
    """What a policy may know about one busy slot."""

    local: int  # the slot's id inside its group (sequence id)
    phase: str  # "prefill" | "ready" | "generate"
    prompt_left: int  # prompt tokens not yet decoded (0 unless prefilling)
    order: int  # arrival order within the group: smaller came first
    cohort: int  # cohort id (0 when the policy does not use cohorts)
    parent: int  # local id of the n > 1 parent slot, or -1


class GroupView(NamedTuple):
    group: int
    n_batch: int  # max tokens in one decode step
    slots: tuple[SlotView, ...]  # busy slots only, in arrival order


class StepPlan(NamedTuple):
    """One decode step: ``prefill`` is (local slot, n prompt tokens); ``generate`` one token each.

    ``release`` lists READY slots whose kept logits may now be sampled (cohort barrier opened).
    """

    prefill: tuple[tuple[int, int], ...] = ()
    generate: tuple[int, ...] = ()
    release: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.generate or self.release)


IDLE_PLAN = StepPlan()


class Policy:
    """Base policy: override ``plan``; ``on_event`` may return a new ``Grant`` for the group."""

    name = "base"
    # True when a prompt that finishes prefill must wait (READY) instead of sampling at once.
    holds_ready = False

    def __init__(self, group: int = 0) -> None:
        self.group = group

    def on_event(self, event: PhaseEvent) -> Grant | None:  # noqa: ARG002
        return None

    def plan(self, view: GroupView) -> StepPlan:  # pragma: no cover - abstract
        raise NotImplementedError


def fill_prefill(
    slots: list[SlotView] | tuple[SlotView, ...], budget: int
) -> tuple[tuple[int, int], ...]:
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
