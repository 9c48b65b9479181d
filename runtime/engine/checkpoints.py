"""Context checkpoints: the sliding-window layers' cells of a sequence, saved as its prompt goes in.

A sliding-window (SWA) layer keeps the cells of the last ``n_swa`` positions a sequence
decoded; llama.cpp reuses the older ones. A kept prefix that ends before that window
(another question after the same system prompt, a turn whose previous answer is rendered
otherwise) is then of no use: the first token after it would attend to cells that are gone,
and the prompt is prefilled whole. llama-server keeps "context checkpoints" for this: copies
of the window layers' cells (``llama_state_seq_get_data_ext`` with the partial-only flag; the
full-attention layers keep every position anyway) taken while a prompt is prefilled. A new
prompt that leaves the slot's tokens at ``keep`` gets the newest checkpoint taken at or
before ``keep`` put back, and is prefilled from there.

Taken where llama-server takes them, ``4 + n_ubatch`` and 4 tokens before a prompt's end
(a prefill chunk that crosses one has its tokens up to it decoded first: ``cut``,
``DecodeStep``), and after a prompt's first chunk past the window or any chunk that ends
``min_step`` tokens (``--checkpoint-min-step``, 8,192) past the slot's previous checkpoint; at
most ``limit`` a slot (the oldest go). A
checkpoint holds the tokens it was taken after and the LoRA set: it is used only while the
slot still holds those tokens under those adapters, so nothing else has to forget it. One
costs the window's cells, the same for any position (gemma3-270m: 7.7 MB, 512 positions
of 15 layers).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from llamactor.protocol.lora import LoraSet
from llamactor.runtime.engine.slot import Slot

PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY  # the sliding-window (and recurrent) part only


@dataclass(frozen=True)
class Checkpoint:
    """A slot's window cells after its first ``n_tokens`` tokens went in."""

    n_tokens: int
    tokens: np.ndarray  # those tokens: the checkpoint serves a slot that still holds them
    lora: LoraSet
    state: bytes

    def serves(self, cache: np.ndarray, lora: LoraSet, keep: int) -> bool:
        """It can stand for the window of a slot holding ``cache`` under ``lora``, cut to
        ``keep`` tokens or fewer."""
        n = self.n_tokens
        return n <= min(keep, len(cache)) and self.lora == lora and bool(np.array_equal(cache[:n], self.tokens))


class Checkpoints:
    """The checkpoints of one context's slots (``limit`` 0: none are taken)."""

    def __init__(
        self, ctx: Any, memory: Any, *, n_swa: int, limit: int, min_step: int, n_batch: int, n_ubatch: int
    ) -> None:
        self.ctx = ctx
        self.memory = memory
        self.n_swa = n_swa
        self.limit = limit if n_swa > 0 else 0  # nothing to keep without a sliding window
        self.min_step = min_step
        self.before_end = (min(n_batch, 4 + n_ubatch), min(n_batch, 4))  # llama-server's checkpoint offsets
        self._by_slot: dict[int, list[Checkpoint]] = {}

    def of(self, slot: Slot) -> list[Checkpoint]:
        return self._by_slot.get(slot.local, [])

    def cut(self, slot: Slot, k: int) -> int:
        """The tokens of a prefill chunk of ``k`` from ``slot.n_past`` up to the first
        checkpoint point inside it (``k``: none inside)."""
        start, n_prompt = slot.n_past, len(slot.prompt)
        for offset in self.before_end:
            at = n_prompt - offset
            if start < at < start + k and at > self.n_swa:
                return at - start
        return k

    def after_chunk(self, slot: Slot) -> None:
        """A prefill chunk of ``slot`` went in: take a checkpoint at a checkpoint point or
        ``min_step`` past the previous one (a prefix inside one window needs none)."""
        n = len(slot.cache)
        if not self.limit or n <= self.n_swa:
            return
        held = self._by_slot.setdefault(slot.local, [])
        cache = np.asarray(slot.cache, dtype=np.int32)
        while held and not held[-1].serves(cache, slot.lora, n):  # taken for tokens the slot no longer holds
            held.pop()
        point = any(slot.n_past == len(slot.prompt) - offset for offset in self.before_end)
        if held and (held[-1].n_tokens == n or (not point and n < held[-1].n_tokens + self.min_step)):
            return
        state = self.read(slot)
        if not state:  # llama.cpp could not write it: no checkpoint rather than a hollow one
            return
        held.append(Checkpoint(n, cache, slot.lora, state))
        if len(held) > self.limit:
            del held[0]

    def read(self, slot: Slot) -> bytes:
        """The window layers' cells of ``slot``'s sequence, as llama.cpp writes them."""
        size = llama_cpp.llama_state_seq_get_size_ext(self.ctx, slot.local, PARTIAL)
        buf = (ctypes.c_ubyte * size)()
        if llama_cpp.llama_state_seq_get_data_ext(self.ctx, buf, size, slot.local, PARTIAL) != size:
            return b""
        return bytes(buf)

    def best(self, slot: Slot, keep: int) -> Checkpoint | None:
        """The newest checkpoint that serves ``slot`` cut to ``keep`` tokens, if any."""
        cache = np.asarray(slot.cache, dtype=np.int32)  # once, not once a checkpoint
        return next((c for c in reversed(self.of(slot)) if c.serves(cache, slot.lora, keep)), None)

    def restore(self, slot: Slot, keep: int) -> int:
        """Cut ``slot``'s sequence back to the newest checkpoint at or before ``keep`` and put
        its window back; return the tokens kept (0: no checkpoint serves, nothing changed).
        ``slot.cache`` is the caller's to cut."""
        cp = self.best(slot, keep)
        if cp is None or not self.write(slot, cp.n_tokens, cp.state):
            return 0
        self._by_slot[slot.local] = [c for c in self.of(slot) if c.n_tokens <= cp.n_tokens]
        return cp.n_tokens

    def write(self, slot: Slot, n_tokens: int, state: bytes) -> bool:
        """Cut the sequence to ``n_tokens`` and write ``state`` (a ``read`` taken after those
        tokens) as its window; False, with the sequence cut, when llama.cpp refuses it."""
        llama_cpp.llama_memory_seq_rm(self.memory, slot.local, n_tokens, -1)
        if not state:
            return False
        data = (ctypes.c_ubyte * len(state)).from_buffer_copy(state)
        ok = llama_cpp.llama_state_seq_set_data_ext(self.ctx, data, len(state), slot.local, PARTIAL) == len(state)
        if not ok or llama_cpp.llama_memory_seq_pos_max(self.memory, slot.local) != n_tokens - 1:
            return False
        # the window the first token after ``n_tokens`` attends to is all there
        pos_min = llama_cpp.llama_memory_seq_pos_min(self.memory, slot.local)
        return 0 <= pos_min <= max(0, n_tokens - self.n_swa + 1)

    def adopt(self, slot: Slot, checkpoints: tuple[Checkpoint, ...]) -> None:
        """``checkpoints`` are the slot's now (its state was replaced by one they were taken with)."""
        self._by_slot[slot.local] = list(checkpoints)

    def forget(self, slot: Slot) -> None:
        self._by_slot.pop(slot.local, None)
