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

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.protocol.media import MediaChunk
from llamactor.protocol.sampling import SamplingParams
from llamactor.protocol.slots import SlotActionResult, SlotKV

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


class ReplyChannel(Protocol[T_contra]):
    """The one-shot answer channel an ``ask`` carries inside its message (runtime.kernel.Reply)."""

    def send(self, value: T_contra) -> None: ...

    def fail(self, error: BaseException) -> None: ...


if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream

    from llamactor.protocol.events import Event

    EventSink = MemoryObjectSendStream[Event]
else:
    EventSink = Any


class Speculation(msgspec.Struct, frozen=True):
    """A request's speculative decoding, resolved at admission: its ``speculative.*`` fields over
    the server's draft settings (``None`` in a task: it does not speculate)."""

    n_max: int  # the longest draft, in tokens (a task's is at least 1)
    n_min: int  # a shorter draft is not verified (the engine clamps it to 1..n_max)
    p_min: float  # a draft model stops drafting once its top token's probability is below this


class TaskSpec(msgspec.Struct, frozen=True, kw_only=True):
    """An admitted request as the engine serves it, without its prompt tokens and its stream:
    the part that is journaled and crosses the link to an engine process (``WireTask``).

    Every field is a value admission resolved from the request and the server's defaults: the
    engine reads nothing else, and nothing here has a second name elsewhere in the task.
    """

    id: int
    params: SamplingParams  # the request's sampling over the server's defaults
    n_predict: int  # tokens it may generate (0: none; bounded by the slot unless the context shifts)
    n: int = 1  # choices; they share one prompt prefill and live in one group
    id_slot: int = -1  # the slot it is pinned to (-1: any)
    stop: tuple[str, ...] = ()
    cache_prompt: bool = True
    ignore_eos: bool = False
    n_keep: int = 0  # context shift: prompt tokens kept at the start (-1: the whole prompt)
    n_discard: int = 0  # context shift: tokens dropped per shift (0: half of what is not kept)
    n_cache_reuse: int = 0  # cache reuse: min chunk of the slot's cache moved into place past the prefix (0: off)
    lora: LoraSet = NO_LORA  # the adapters its decode steps apply
    return_progress: bool = False  # Progress events while its prompt is processed
    timings_per_token: bool = False  # every Token event carries its timings so far
    post_sampling_probs: bool = False  # token probabilities after the sampler chain (shown in its settings)
    priority: int = 0  # lower first, under the priority policy
    tags: Mapping[str, str] = {}  # free-form labels a scheduling policy may read
    # its draft settings where the server speculates; None: it does not (the server does not,
    # or the request's speculative.n_max is 0)
    speculation: Speculation | None = None
    # --mmproj: the prompt's images, by position (their positions in the prompt hold stand-in
    # tokens, ``protocol.media``); each is decoded when the slot's prefill reaches it
    media: tuple[MediaChunk, ...] = ()
    # Resume after an engine restart: per choice, the tokens already delivered. The group
    # replays them after the prompt one decode step at a time (teacher forcing: the same
    # numerics as the run that produced them), sampling nothing and sending no Token event.
    replay: tuple[tuple[int, ...], ...] = ()
    # ``--resume fast``: the delivered tokens were appended to the prompt (prefilled at once,
    # numerically not bit-identical); the group only primes the sampler and text stream with them
    replay_in_prompt: bool = False
    # prefill and decode apart: the prefill replica's part of a request; its Done carries the
    # slot's KV state, read before the slot can serve anyone else
    hand_over: bool = False


class Task(TaskSpec, frozen=True, kw_only=True):
    """One validated, tokenized generation request in the engine's mailboxes.

    ``sink`` is the send end of the request's bounded result stream (anyio); the group that
    serves the task is the only writer.
    """

    prompt: npt.NDArray[np.int32]  # token ids
    sink: EventSink  # the send end of the request's bounded result stream
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
    lora: tuple[LoraSet, ...] = ()  # per slot: the LoRA set its cached KV was computed under


class SlotCached(msgspec.Struct, frozen=True, tag=True):
    """Group → supervisor: an idle slot's KV now holds ``cached``, computed under ``lora``
    (after erase, restore or import)."""

    group: int
    slot: int
    cached: tuple[int, ...]
    lora: LoraSet = NO_LORA


PREFIX_HOLDER = -1  # the ``slot`` of an export that takes the slot holding most of ``kv.tokens``


class SlotRequest(msgspec.Struct, frozen=True, tag=True):
    """Erase/save/restore/export/import one slot (POST /slots/{id}); answered on ``reply`` once
    the owning group did it."""

    action: str  # "erase" | "save" | "restore" | "export" | "import"
    slot: int
    path: str  # save and restore only
    reply: ReplyChannel[SlotActionResult]
    # import: the state to write into the slot; an export of slot ``PREFIX_HOLDER``: the tokens
    # whose longest prefix a slot holds (that slot is exported, busy or not)
    kv: SlotKV | None = None


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
    """Erase/save/restore/export/import one idle local slot; runs between decode steps of this
    group only."""

    action: str
    slot: int
    path: str  # save and restore only
    reply: ReplyChannel[SlotActionResult]
    kv: SlotKV | None = None  # import: the state to write into the slot


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


class PhaseKind(enum.StrEnum):
    """What happened to a request, as the coordinator's policies see it."""

    ARRIVED = "arrived"  # assigned to a slot of the group
    PREFILL_DONE = "prefill_done"  # its prompt is decoded (it waits in READY if the policy holds it)
    FINISHED = "finished"  # all its choices ended
    CANCELLED = "cancelled"  # ended before finishing (client left, error)
    TICK = "tick"  # the coordinator's own timer (``--cohort-max-generate-ms``), no request


class PhaseEvent(msgspec.Struct, frozen=True, tag=True):
    """A request on ``slot`` (its parent slot) of ``group`` changed phase (see ``PhaseKind``)."""

    group: int
    kind: PhaseKind
    slot: int = -1
    prompt_left: int = 0
    at: float = 0.0  # time.perf_counter() when it happened
    order: int = 0  # the request's arrival order in the group: its identity for the policy


CoordinatorMsg = PhaseEvent
