"""``--spec-type ngram-mod`` (and ``--spec-default``): llama.cpp's ``common/ngram-mod.cpp`` and its
speculation in ``common/speculative.cpp``, ported.

One hash table per group (4Mi int32 entries, 16 MiB, as llama.cpp's per server) maps the hash
of every ``n_match``-token window seen (prompts, and the slots' output in chunks of 32 tokens)
to the token that followed it; a later window with the same hash overwrites it. A draft rolls
forward from the slot's last ``n_match`` tokens: look up the next token, append it, look up
again, up to ``n_max`` tokens; it stops at an empty entry, and a draft shorter than ``n_min``
is dropped. As in llama.cpp the table is cleared when more than a quarter of it is used after a
prompt is added, and when a slot's drafts were accepted under a quarter of the time five
verifications in a row.

The window hash is llama.cpp's: ``h = h * 6364136223846793005 + token`` over the window,
modulo 2**64, then modulo the table size; the prompt's windows are hashed together in numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from llamactor.runtime.engine.speculative import draft_room

TABLE_SIZE = 4 * 1024 * 1024
EMPTY = -1
MULTIPLIER = 6364136223846793005
ADD_CHUNK = 32  # output windows are added once this many new tokens are there
MAX_OCCUPANCY = 0.25
LOW_ACCEPTANCE = 0.25
LOW_STREAK = 5
_MASK = (1 << 64) - 1


class NgramMod:
    """The hash table: ``n``-token windows to the token after them."""

    def __init__(self, n: int, size: int = TABLE_SIZE) -> None:
        self.n = n
        self.entries = np.full(size, EMPTY, dtype=np.int32)
        self.used = 0

    def reset(self) -> None:
        self.entries.fill(EMPTY)
        self.used = 0

    def index(self, window: Sequence[int]) -> int:
        h = 0
        for token in window:
            h = (h * MULTIPLIER + int(token)) & _MASK
        return h % len(self.entries)

    def add_all(self, tokens: np.ndarray, start: int, stop: int) -> None:
        """Add the windows starting at ``start`` .. ``stop - 1`` and the token after each."""
        if stop <= start:
            return
        starts = np.arange(start, stop)
        h = np.zeros(len(starts), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for j in range(self.n):
                h = h * np.uint64(MULTIPLIER) + tokens[starts + j].astype(np.uint64)
        idx = (h % np.uint64(len(self.entries))).astype(np.int64)
        # llama.cpp adds them in order, so a later window wins a shared entry: keep each index's last
        last = len(idx) - 1 - np.unique(idx[::-1], return_index=True)[1]
        idx, nxt = idx[last], tokens[starts[last] + self.n]
        self.used += int((self.entries[idx] == EMPTY).sum())
        self.entries[idx] = nxt

    def get(self, window: Sequence[int]) -> int:
        return int(self.entries[self.index(window)])

    @property
    def occupancy(self) -> float:
        return self.used / len(self.entries)


class _SlotState:
    __slots__ = ("drafts_seen", "i_last", "n_accepted_seen", "n_draft_seen", "n_low", "spec")

    def __init__(self, spec: Any) -> None:
        self.spec = spec  # the request's SpecState: a new one is a new request
        self.i_last = 0  # the windows starting before this index are in the table
        self.drafts_seen = 0  # the request's verification steps when last looked at
        self.n_draft_seen = 0
        self.n_accepted_seen = 0
        self.n_low = 0  # verifications in a row that accepted under a quarter of their draft


class NgramModDrafter:
    """The ``Drafter`` for ngram-mod, one per group (its table shared by the group's slots)."""

    def __init__(self, n_match: int) -> None:
        self.mod = NgramMod(n_match)
        self.slots: dict[int, _SlotState] = {}

    def propose(self, slots: Sequence[Any], room: int, n_ctx_seq: int) -> dict[int, np.ndarray]:
        out: dict[int, np.ndarray] = {}
        n = self.mod.n
        for s in slots:
            spec = s.spec
            if spec is None:
                continue
            hist = spec.history(s)  # the slot's tokens, the last sampled one (not yet decoded) last
            state = self._state(s.local, spec, hist)
            self._acceptance(state, spec)
            if room < 1:
                continue
            k = min(draft_room(s, n_ctx_seq), room)
            cur = len(hist) - 1  # llama.cpp's prompt: the tokens before the last sampled one
            if k < spec.n_min or cur < n:
                continue
            if state.i_last + ADD_CHUNK < cur:
                self.mod.add_all(hist, state.i_last, cur - n)
                state.i_last = cur - n
            window = [int(t) for t in hist[len(hist) - n :]]
            draft: list[int] = []
            while len(draft) < k:
                token = self.mod.get(window[len(draft) :])
                if token == EMPTY:
                    break
                draft.append(token)
                window.append(token)
            if len(draft) >= spec.n_min:
                out[s.local] = np.asarray(draft, dtype=np.int32)
                room -= len(draft)
        return out

    def _state(self, local: int, spec: Any, hist: np.ndarray) -> _SlotState:
        state = self.slots.get(local)
        if state is None or state.spec is not spec:  # a new request: its prompt's windows go in
            state = self.slots[local] = _SlotState(spec)
            n_prompt = spec.n_prompt
            if n_prompt >= self.mod.n and len(hist) >= n_prompt:
                self.mod.add_all(hist, 0, n_prompt - self.mod.n)
                state.i_last = n_prompt - self.mod.n
                if self.mod.occupancy > MAX_OCCUPANCY:
                    self.mod.reset()
        return state

    def _acceptance(self, state: _SlotState, spec: Any) -> None:
        """llama.cpp's reset after a streak of poorly accepted drafts."""
        if spec.n_drafts == state.drafts_seen:
            return
        drafted = spec.n_draft - state.n_draft_seen
        accepted = spec.n_accepted - state.n_accepted_seen
        state.drafts_seen, state.n_draft_seen, state.n_accepted_seen = spec.n_drafts, spec.n_draft, spec.n_accepted
        if drafted <= 0:
            return
        if accepted / drafted < LOW_ACCEPTANCE:
            state.n_low += 1
            if state.n_low >= LOW_STREAK:
                self.mod.reset()
                state.n_low = 0
                state.i_last = 0
        else:
            state.n_low = 0

    def close(self) -> None:
        self.slots.clear()
