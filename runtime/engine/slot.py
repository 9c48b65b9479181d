"""One slot: a sequence id in a group's context and the request choice it serves.

A slot is owned by exactly one GroupActor. Its fields are read and written by that group's
event-loop task between steps and by the group's worker thread during a step, never both at
once (the loop awaits the step). Nothing else touches a slot.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import numpy as np

from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.protocol.messages import Task
from llamactor.runtime.engine.speculative import SpecState
from llamactor.runtime.engine.textstream import TextStream

EMPTY_TOKENS = np.zeros(0, dtype=np.int32)


class Phase(enum.Enum):
    """Where a slot is in a request's life. The phase coordinator plans on these.

    The state machine exists so that a batch can be built from slots of one phase only
    (never prompt and generated tokens together) and so that a finished prompt never samples
    before its cohort is released.
    """

    IDLE = "idle"  # free; its KV may still hold a cached prompt for reuse
    PREFILL = "prefill"  # prompt tokens left to decode
    READY = "ready"  # prompt done, first-token logits kept; waits for the cohort's barrier
    GENERATE = "generate"  # one sampled token per step


class LastRequest(NamedTuple):
    """The request a slot served last, and its counters when it ended."""

    task: Task
    n_prompt: int
    n_prompt_cached: int
    n_decoded: int


class Slot:
    __slots__ = (
        "argmax",
        "cache",
        "children",
        "finished",
        "follows",
        "id",
        "index",
        "kept_logits",
        "last",
        "local",
        "lora",
        "n_cached",
        "n_decoded",
        "n_past",
        "next_token",
        "order",
        "parent",
        "phase",
        "prompt",
        "replay",
        "sampler",
        "share_upto",
        "spec",
        "stream",
        "t_last",
        "t_prompt_begin",
        "t_prompt_done",
        "t_start",
        "task",
        "truncated",
    )

    def __init__(self, slot_id: int, local: int) -> None:
        self.id = slot_id  # global id, as shown by /slots and used by id_slot
        self.local = local  # sequence id inside the group's context
        self.cache: list[int] = []  # token ids whose KV this sequence holds, in order
        self.lora: LoraSet = NO_LORA  # the LoRA set ``cache``'s KV was computed under
        # speculation of the request it serves; None when it does not speculate. Set by
        # Context.start, kept by reset(): /slots shows the last request's draft counters.
        self.spec: SpecState | None = None
        self.last: LastRequest | None = None  # the request it served last (kept by reset())
        self.task: Task | None = None
        self.reset()

    def reset(self) -> None:
        """Back to IDLE. Keeps ``cache`` and ``lora`` (the KV is still there for prefix reuse),
        and the request it served with its counters in ``last`` (``/slots`` shows an idle
        slot's last request, as llama-server does)."""
        if self.task is not None:
            self.last = LastRequest(self.task, len(self.prompt), self.n_cached, self.n_decoded)
        self.phase = Phase.IDLE
        self.task = None
        self.index = 0
        self.children: list[Slot] = []
        self.parent: Slot | None = None
        self.prompt: np.ndarray = EMPTY_TOKENS
        self.n_past = 0
        self.sampler: Any = None
        # a greedy chain of biases only: its biases; the token is then numpy's arg-max
        # (``sampling.argmax_biases``), not the chain's
        self.argmax: tuple[np.ndarray, np.ndarray] | None = None
        self.next_token = -1
        self.n_decoded: int = 0
        self.stream: TextStream | None = None
        self.n_cached: int = 0
        # t_start: the request took the slot; t_prompt_begin: its prompt first went into a batch
        # (where llama-server's prompt time starts: a prompt waiting for room is not counted)
        self.t_start = self.t_prompt_begin = self.t_prompt_done = self.t_last = 0.0
        self.order = 0
        self.kept_logits: np.ndarray | None = None
        self.finished = False
        self.truncated = False  # its context was shifted (--context-shift)
        # prefix sharing: a prompt that waits for another slot of the group to prefill their common
        # prefix (its first ``share_upto`` tokens), then copies that KV instead of prefilling it
        self.follows: Slot | None = None
        self.share_upto = 0
        self.replay: list[int] = []  # delivered tokens still to replay after a resume, last first

    @property
    def prompt_ms(self) -> float:
        """The prompt's time as llama-server counts it (``timings.prompt_ms``, the metrics'
        prompt seconds): from the step that first held it to its end. Waiting for room in a batch
        does not count; a prompt with no step of its own (all cached, a shared prefix) counts
        from the slot's start."""
        return (self.t_prompt_done - (self.t_prompt_begin or self.t_start)) * 1e3

    @property
    def prompt_left(self) -> int:
        return len(self.prompt) - self.n_past if self.phase is Phase.PREFILL else 0

    @property
    def busy(self) -> bool:
        return self.phase is not Phase.IDLE
