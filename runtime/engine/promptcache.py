"""A prompt cache in host memory, beyond the slots (llama-server's ``--cache-ram``).

When a slot is taken by another conversation, the KV state of what it held is copied out of
the context (``llama_state_seq_get_data``) into this cache; a later prompt that extends a
cached one restores that state into whichever slot it gets, in any group
(``llama_state_seq_set_data``), instead of prefilling it again. The restored state is the
evicted one, byte for byte, so the continuation is exactly what it would have been had the
conversation kept its slot.

The rules are llama-server's (server_prompt_cache): a prompt already contained in an entry is
not stored again; storing a prompt drops entries it contains; the oldest entries go first when
the byte limit is reached; a cached prompt is only restored when it keeps at least a quarter
of itself and shares more of the new prompt than the slot does. Entries are keyed by the LoRA
set their KV was computed under: only a prompt with the same set may restore one.

On a sliding-window model an entry keeps the slot's context checkpoints with its state (as
llama-server's cache keeps them with its prompts): a restored state's window is the one its
last position sees, so a prompt that leaves its tokens earlier goes back to the newest
checkpoint before that point instead of being prefilled whole. They count in the byte limit
(an entry keeps the newest that fit beside its state).

Used by the groups on the event loop, between their steps (never during a decode), so it needs
no lock. One instance per runtime, shared by all groups.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from dataclasses import dataclass

import llama_cpp
import numpy as np

from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.protocol.media import NO_TOKEN
from llamactor.runtime.engine.checkpoints import Checkpoint

MIB = 1024 * 1024
MIN_KEEP_FRACTION = 0.25  # a cached prompt is restored only if the new prompt keeps this much of it
SAVE_BELOW_FRACTION = 0.5  # --no-cache-idle-slots: a slot's KV is saved when a new prompt keeps less than this


@dataclass
class Entry:
    tokens: np.ndarray  # int32 token ids whose KV ``state`` holds
    state: bytes  # llama_state_seq_get_data of one sequence
    lora: LoraSet = NO_LORA  # the adapters the KV was computed under
    checkpoints: tuple[Checkpoint, ...] = ()  # a sliding-window model's: the slot's, oldest first

    @property
    def size(self) -> int:
        return len(self.state) + sum(len(c.state) for c in self.checkpoints)


@dataclass(frozen=True)
class PromptCacheStats:
    entries: int
    tokens: int
    bytes_held: int
    limit_bytes: int
    saves: int
    hits: int  # restores
    tokens_reused: int  # prompt tokens not prefilled thanks to restores


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def media_floor(tokens: np.ndarray, n: int) -> int:
    """``n`` tokens of ``tokens``, or fewer: a prefix that ends inside an image (a run of one
    stand-in token, ``protocol.media``) ends at the image's start instead, since an image's
    KV is decoded whole. Two copies of one image side by side read as one run: the cut goes
    before both (safe, one image decoded again)."""
    if 0 < n < len(tokens):
        t = tokens[n]
        if t < NO_TOKEN and tokens[n - 1] == t:
            while n > 0 and tokens[n - 1] == t:
                n -= 1
    return n


class PromptCache:
    def __init__(self, limit_mib: int, save_idle: bool = True) -> None:
        """``limit_mib``: the byte budget in MiB (llama-server's -cram); -1 means no limit.
        ``save_idle``: llama-server's ``--cache-idle-slots`` (see ``worth_saving``)."""
        self.limit_bytes = 0 if limit_mib < 0 else limit_mib * MIB
        self.save_idle = save_idle
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # oldest first
        self._next = 0
        self._bytes = 0
        self.saves = self.hits = self.tokens_reused = 0

    def statistics(self) -> PromptCacheStats:
        return PromptCacheStats(
            len(self._entries),
            sum(len(e.tokens) for e in self._entries.values()),
            self._bytes,
            self.limit_bytes,
            self.saves,
            self.hits,
            self.tokens_reused,
        )

    def held(self) -> list[np.ndarray]:
        """The token ids of every entry, oldest first."""
        return [e.tokens for e in list(self._entries.values())]

    # ---- the two operations a group calls around a slot's reuse -------------------------

    def worth_saving(self, n_held: int, n_kept: int) -> bool:
        """Whether a slot holding ``n_held`` tokens, of which a new prompt keeps ``n_kept``,
        is saved first. With ``--cache-idle-slots`` (llama-server's default, which saves every
        idle slot when a task starts): whenever anything would be lost, so a conversation
        whose slot went to another one that shares its system text still finds its history
        here. Without: only when less than half is kept (llama-server's ``f_keep < 0.5``)."""
        if self.save_idle:
            return n_kept < n_held
        return n_kept < SAVE_BELOW_FRACTION * n_held

    def save(
        self,
        ctx: ctypes.c_void_p,
        seq: int,
        tokens: np.ndarray,
        lora: LoraSet = NO_LORA,
        checkpoints: tuple[Checkpoint, ...] = (),
    ) -> bool:
        """Copy sequence ``seq``'s KV (holding ``tokens``, computed under ``lora``) into the
        cache, with the slot's ``checkpoints``; False if not stored."""
        if len(tokens) == 0 or any(
            e.lora == lora and common_prefix(e.tokens, tokens) == len(tokens) for e in self._entries.values()
        ):
            return False  # nothing, or already contained in an entry
        n_state = llama_cpp.llama_state_seq_get_size(ctx, seq)
        if n_state == 0 or (self.limit_bytes and n_state > self.limit_bytes):
            return False
        # the newest checkpoints that fit beside the state (the older ones go first)
        while checkpoints and self.limit_bytes and n_state + sum(len(c.state) for c in checkpoints) > self.limit_bytes:
            checkpoints = checkpoints[1:]
        size = n_state + sum(len(c.state) for c in checkpoints)
        for key in [
            k for k, e in self._entries.items() if e.lora == lora and common_prefix(e.tokens, tokens) == len(e.tokens)
        ]:
            self._drop(key)  # entries the new one contains
        while self._entries and self.limit_bytes and self._bytes + size > self.limit_bytes:
            self._drop(next(iter(self._entries)))
        buf = (ctypes.c_ubyte * n_state)()
        if llama_cpp.llama_state_seq_get_data(ctx, buf, n_state, seq) != n_state:
            return False
        self._entries[self._next] = Entry(np.array(tokens, dtype=np.int32), bytes(buf), lora, checkpoints)
        self._next += 1
        self._bytes += size
        self.saves += 1
        return True

    def restore(
        self, ctx: ctypes.c_void_p, seq: int, prompt: np.ndarray, slot_tokens: np.ndarray, lora: LoraSet = NO_LORA
    ) -> Entry | None:
        """Restore into ``seq`` the entry (computed under ``lora``) that serves ``prompt`` better
        than what the slot holds (``slot_tokens``, empty when the slot's KV is of another set);
        return it (its ``tokens`` are what the slot holds now, its ``checkpoints`` the slot's;
        an entry of no tokens if the restore failed), or None when no entry is better (the
        slot is unchanged)."""
        lcp_best = common_prefix(slot_tokens, prompt)
        keep_best = lcp_best / len(slot_tokens) if len(slot_tokens) else -1.0
        sim_best = lcp_best / max(len(prompt), 1)
        best: int | None = None
        for key, e in self._entries.items():
            if e.lora != lora:
                continue
            lcp = common_prefix(e.tokens, prompt)
            keep, sim = lcp / len(e.tokens), lcp / max(len(prompt), 1)
            if keep >= MIN_KEEP_FRACTION and keep > keep_best and sim > sim_best:
                best, keep_best, sim_best = key, keep, sim
        if best is None:
            return None
        entry = self._entries[best]
        data = (ctypes.c_ubyte * len(entry.state)).from_buffer_copy(entry.state)
        memory = llama_cpp.llama_get_memory(ctx)
        llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
        if llama_cpp.llama_state_seq_set_data(ctx, data, len(entry.state), seq) != len(entry.state):
            llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
            return Entry(np.zeros(0, dtype=np.int32), b"")  # the slot holds nothing now
        self._entries.move_to_end(best)  # recently used
        self.hits += 1
        self.tokens_reused += min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
        return entry

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.size
