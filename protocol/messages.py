"""Mailbox messages: one frozen, tagged Struct union per actor.

Who sends what:

    Runtime ──Submit/Cancel/SlotRequest──► Supervisor
    Supervisor ──Assign/Revoke/SlotCommand──► GroupActor(g)
    GroupActor(g) ──Released/SlotCached──► Supervisor
    GroupActor(g) ──PhaseEvent──► PhaseCoordinator ──Grant──► GroupActor(g)

Every ``ask`` carries its reply channel (``reply``) inside the message and is always made
with a deadline by the caller (``runtime.kernel.Actor.ask``).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from llamactor.protocol.sampling import SamplingParams


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """One validated, tokenized generation request. Created once by the Runtime facade.

    ``sink`` is the send end of the request's bounded result stream (anyio); the group that
    serves the task is the only writer. ``n`` choices share one prompt prefill (PG-10).
    """

    id: int
    prompt: npt.NDArray[np.int32]  # token ids
    params: SamplingParams
    n_predict: int
    stop: tuple[str, ...] = ()
    n: int = 1
    id_slot: int = -1
    cache_prompt: bool = True
    ignore_eos: bool = False
    sink: Any = None
    arrived: float = 0.0  # time.perf_counter() at submit


# ---- Supervisor mailbox ---------------------------------------------------------------


class Submit(msgspec.Struct, frozen=True, tag=True):
    task: Task


class Cancel(msgspec.Struct, frozen=True, tag=True):
    task_id: int


class Released(msgspec.Struct, frozen=True, tag=True):
    """Group → supervisor: these slots are free again; ``cached`` is what each slot's KV holds."""

    group: int
    slots: tuple[int, ...]
    cached: tuple[tuple[int, ...], ...]
    task_id: int = -1  # the task these slots served; -1 after a slot command


class SlotCached(msgspec.Struct, frozen=True, tag=True):
    """Group → supervisor: an idle slot's KV now holds ``cached`` (after erase/restore)."""

    group: int
    slot: int
    cached: tuple[int, ...]


class SlotRequest(msgspec.Struct, frozen=True, tag=True):
    """Erase/save/restore one slot (API-5); answered on ``reply`` once the owning group did it."""

    action: str  # "erase" | "save" | "restore"
    slot: int
    path: str = ""
    reply: Any = None


SupervisorMsg = Submit | Cancel | Released | SlotCached | SlotRequest


# ---- GroupActor mailbox ---------------------------------------------------------------


class Assign(msgspec.Struct, frozen=True, tag=True):
    """Serve ``task`` on these group-local slots: the first is the parent, the rest its n-1 children."""

    task: Task
    slots: tuple[int, ...]


class Revoke(msgspec.Struct, frozen=True, tag=True):
    """Stop serving ``task_id`` (cancel or disconnect) and free its slots at once."""

    task_id: int


class SlotCommand(msgspec.Struct, frozen=True, tag=True):
    """Erase/save/restore one idle local slot; runs between decode steps of this group only (PG-4, PG-5)."""

    action: str
    slot: int
    path: str = ""
    reply: Any = None


class Grant(msgspec.Struct, frozen=True, tag=True):
    """Coordinator → group: the group's phase and which of its slots may do what.

    ``prefill``: requests that may decode prompt tokens; ``generate``: requests that may
    generate; ``release``: READY requests whose kept logits may now be sampled (the cohort
    barrier opened). Requests are named by their arrival ``order`` in the group, not by slot:
    a slot is reused, and a grant still in flight must not apply to the slot's next request.
    A group plans every step from its latest grant; a grant replaces the previous one whole.
    """

    phase: str
    cohort: int
    prefill: frozenset[int] = frozenset()
    generate: frozenset[int] = frozenset()
    release: frozenset[int] = frozenset()


GroupMsg = Assign | Revoke | SlotCommand | Grant


# ---- PhaseCoordinator mailbox ---------------------------------------------------------


class PhaseEvent(msgspec.Struct, frozen=True, tag=True):
    """A request on ``slot`` (its parent slot) of ``group`` changed phase.

    ``kind``: "arrived", "prefill_done", "finished" (all its choices ended) or "cancelled";
    "tick" is the coordinator's own timer (``--cohort-max-generate-ms``).
    """

    group: int
    kind: str
    slot: int = -1
    prompt_left: int = 0
    at: float = 0.0  # time.perf_counter() when it happened
    order: int = 0  # the request's arrival order in the group: its identity for the policy


CoordinatorMsg = PhaseEvent
