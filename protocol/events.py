"""What a group sends down one request's result stream.

A request's stream carries, per choice ``index`` (0 … n-1), zero or more ``Token`` events and
then exactly one ``Done``; or a single ``Failed`` that ends the whole request. Tokens go from
the group straight to this stream, never through the supervisor.
"""

from __future__ import annotations

import msgspec

from llamactor.protocol.errors import ERRORS
from llamactor.protocol.slots import SlotKV


class TopProb(msgspec.Struct, frozen=True, array_like=True):
    token: int
    piece: str
    logprob: float


class Token(msgspec.Struct, frozen=True, tag=True):
    """New text for choice ``index``. ``text`` may be empty while bytes or a stop string are held back."""

    index: int
    text: str
    token: int
    logprob: float | None = None
    top: tuple[TopProb, ...] = ()
    # timings_per_token: the choice's timings so far, as ``Done`` counts them:
    # (n_prompt, n_cached, n_predicted, prompt_ms, predicted_ms); None when not asked
    clock: tuple[int, int, int, float, float] | None = None
    slot: int = -1  # the slot that generated it (the native stream's id_slot)
    # on a choice's first token: how many of its prompt tokens came from the cache (Anthropic's
    # message_start reports them before anything else is known); -1 on every later token
    n_cached: int = -1


class Done(msgspec.Struct, frozen=True, tag=True):
    """Choice ``index`` finished. ``finish_reason`` is "stop" (EOS or stop string) or "length"."""

    index: int
    finish_reason: str
    text: str  # the whole generated text of this choice (stop string excluded)
    stopping_word: str
    n_prompt: int
    n_cached: int
    n_predicted: int
    prompt_ms: float
    predicted_ms: float
    slot: int
    truncated: bool = False  # the context was shifted: old tokens were dropped
    n_draft: int = 0  # draft tokens verified for this choice (speculative decoding; timings.draft_n)
    n_draft_accepted: int = 0  # of those, accepted (timings.draft_n_accepted)
    kv: SlotKV | None = None  # a task handed over after its first token (``hand_over``): its slot's state


class Progress(msgspec.Struct, frozen=True, tag=True):
    """Prompt processing progress (llama-server's ``return_progress``), sent only when asked:
    ``processed`` of ``total`` prompt tokens are in the KV, ``cache`` of them were reused."""

    index: int
    total: int
    cache: int
    processed: int
    time_ms: float
    timed: bool = False  # timings_per_token: the chunk shows timings (these counts as prompt timings)


class Failed(msgspec.Struct, frozen=True, tag=True):
    """The request failed as a whole (engine error, shutdown). ``error`` names the class in
    ``protocol.errors`` (``errors.error_from`` makes it again, with its HTTP status)."""

    message: str
    error: str = "EngineError"

    @classmethod
    def of(cls, exc: BaseException) -> Failed:
        """The event for ``exc``: its class name if it is one of ours, else an engine error."""
        name = type(exc).__name__
        return cls(str(exc), name if name in ERRORS else "EngineError")


Event = Token | Done | Progress | Failed
