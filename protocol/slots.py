"""What the groups report about their slots, as frozen data (``GET /slots``, the live view).

A group builds one ``SlotState`` per slot when asked (``Supervisor.slot_states``); a slot
command (erase, save, restore) answers with a ``SlotActionResult``. The HTTP layer shapes
them as llama-server does (``runtime.http.slots``); the live view reads them as they are.
"""

from __future__ import annotations

import msgspec

from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.protocol.sampling import SamplingParams


class SlotState(msgspec.Struct, frozen=True, kw_only=True):
    id: int  # global slot id
    group: int
    busy: bool  # serving a request
    phase: str  # "idle" | "prefill" | "ready" | "generate" | "down" (its group is down)
    n_ctx: int = 0  # the slot's context, in tokens
    speculative: bool = False  # the server drafts tokens (a draft model or n-grams)
    cohort: int = 0  # the policy's cohort id of its request (0: none)
    n_cached: int = 0  # tokens its KV cache holds
    task: int = -1  # the request it serves (or served last, when idle); -1 before any
    n_prompt: int = 0  # prompt tokens of the request
    n_prompt_cached: int = 0  # of those, reused from the cache
    n_decoded: int = 0  # tokens generated so far
    n_remain: int = 0  # tokens still allowed
    age_s: float = 0.0  # seconds since the request arrived
    priority: int = 0  # the request's priority
    # the request it serves, or served last when idle (llama-server's task_prev): its
    # sampling, generation limit and adapters (``/slots``' ``params``); None before any request
    params: SamplingParams | None = None
    n_predict: int = 0
    ignore_eos: bool = False
    lora: LoraSet = NO_LORA
    # speculative decoding of the current (or last) request; None without speculation
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    draft_n_steps: int | None = None


class SlotKV(msgspec.Struct, frozen=True, kw_only=True):
    """One slot's KV state as a value: what ``export`` reads out of a slot and ``import`` writes
    into one (``llama_state_seq_get_data`` / ``set_data`` of its sequence), with the tokens it
    holds and the LoRA set that computed it. Engine-local: adapter ids are this engine's own
    (``runtime.service.slottransfer`` names them by file when the state leaves the server)."""

    tokens: tuple[int, ...]
    lora: LoraSet = NO_LORA
    state: bytes = b""
    # a sliding-window model's state wanted for an earlier prefix (a pull): the importer cuts the
    # sequence to ``window_at`` tokens and writes ``window``, the holder's checkpoint taken there
    window_at: int = 0
    window: bytes = b""


class SlotActionResult(msgspec.Struct, frozen=True, kw_only=True):
    """An erase, save, restore, export or import done by the slot's group."""

    slot: int
    action: str  # "erase" | "save" | "restore" | "export" | "import"
    n_tokens: int  # tokens erased, saved, restored, exported or imported
    ms: float = 0.0  # time the action took
    kv: SlotKV | None = None  # export: the slot's state
