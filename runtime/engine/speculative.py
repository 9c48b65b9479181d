"""Speculative decoding per group: draft tokens for a slot's next step.

A slot that speculates contributes ``1 + k`` rows to its next decode step: the token it
sampled last and ``k`` drafted tokens that may follow it, logits for all. The slot's own
sampler chain then samples row after row and accepts while the sampled token equals the
draft (``step.DecodeStep._verify``); the KV cells of the rejected drafts are removed again. Greedy
output is the same as without speculation, up to the numerics of a multi-token batch
(tests/test_speculative.py measures how far it stays bit-identical).

Draft sources, named as llama-server names them (``--spec-type``):

- ``ngram-simple``: prompt lookup, no draft model. The last ``size_n`` tokens of the slot's
  history (prompt and generated tokens) are looked up earlier in that history; the tokens that
  followed their latest earlier occurrence are the draft (llama.cpp's
  ``common_ngram_simple_draft``, here in numpy: one comparison over the history and one
  gather over the candidate positions per slot and step, no Python loop over tokens).
- ``draft-simple``: a draft model with the target's vocabulary (``-md``) proposes greedily,
  one draft context per group (``runtime.engine.draftmodel``).
- ``ngram-mod``: a hash table of every ``size_n``-token window seen and the token after it,
  shared by the group's slots; drafts roll forward through it (``runtime.engine.ngrammod``).
- ``ngram-cache``: lookup decoding from n-gram caches: the slot's own, a dynamic one that
  earlier requests fill (``-lcd``) and a static one (``-lcs``) (``runtime.engine.ngramcache``).

Drafts are cut so that a step never exceeds ``n_batch`` nor, because of drafts, one ubatch
(the room left after the plan's prompt and generate rows, see ``step.DecodeStep.run``), the slot's
context (``n_ctx - n_past - 2``, as llama-server's
``get_n_draft_max``) and the request's remaining tokens (``n_predict - n_decoded - 1``).

Everything here runs in the group's worker thread during its step, and touches only the
slots the step was given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

SPEC_NONE = "none"
SPEC_NGRAM = "ngram-simple"
SPEC_DRAFT = "draft-simple"
SPEC_CACHE = "ngram-cache"
SPEC_MOD = "ngram-mod"
SPEC_TYPES = (SPEC_NONE, SPEC_NGRAM, SPEC_DRAFT, SPEC_CACHE, SPEC_MOD)
HISTORY_MAX_TOKENS = 1 << 16  # a longer history keeps its last half (context shift can run forever)
_EMPTY = np.zeros(0, dtype=np.int32)
_RAMP = np.arange(1024, dtype=np.int64)  # column offsets of the n-gram gather (size_n <= 1024)


@dataclass(frozen=True)
class SpecOptions:
    """A group's draft source (``None`` in ``ContextOptions``: off, and free). A request's draft
    limits are not here: admission resolves them over the server's (``Task.speculation``)."""

    kind: str  # SPEC_NGRAM, SPEC_MOD, SPEC_CACHE or SPEC_DRAFT
    size_n: int = 12  # ngram-simple: tokens looked up; ngram-mod: the window (n_match)
    draft_model: Any = None  # draft-simple: the loaded draft ``Model`` (shared by every group)
    static_cache: Any = None  # ngram-cache: the static n-gram cache (-lcs), read only
    dynamic_cache: Any = None  # ngram-cache: the dynamic one (-lcd), ``ngramcache.DynamicCache``, shared
    n_ctx_draft: int = 0  # draft-simple: KV cells of each group's draft context (0: the target's)


class SpecSlot(Protocol):
    """What speculation reads of a ``runtime.engine.slot.Slot`` (which imports this module)."""

    local: int
    task: Any
    spec: SpecState | None
    cache: list[int]
    n_past: int
    n_decoded: int
    next_token: int


class SpecState:
    """One slot's speculation for the request it serves: its token history (a numpy buffer
    grown by the tokens sampled since the last draft), its limits and its counters.

    Made by ``Context.start`` when the request speculates; kept after the request ends, so
    that ``/slots`` shows the last request's counters (llama-server shows its previous task).
    """

    __slots__ = (
        "hist",
        "n",
        "n_accepted",
        "n_draft",
        "n_drafts",
        "n_max",
        "n_min",
        "n_prompt",
        "n_seen",
        "p_min",
    )

    def __init__(self, prompt: np.ndarray, n_max: int, n_min: int, p_min: float) -> None:
        self.n_prompt = len(prompt)
        self.hist = np.empty(len(prompt) + 256, dtype=np.int32)
        self.hist[: len(prompt)] = prompt
        self.n = len(prompt)  # tokens in ``hist``
        self.n_seen = len(prompt)  # tokens ever pushed (prompt + sampled), even when trimmed
        self.n_max = n_max
        self.n_min = max(min(n_min, n_max), 1)  # as older llama-server clamped speculative.n_min
        self.p_min = p_min
        self.n_draft = 0  # drafted tokens sent to verification
        self.n_accepted = 0  # of those, accepted
        self.n_drafts = 0  # verification steps

    def history(self, s: SpecSlot) -> np.ndarray:
        """The slot's prompt and every token sampled so far (the one not yet decoded last).

        Between two drafts the slot sampled ``1 + accepted`` tokens: the KV's tail
        (``s.cache``) holds all but the last, which is ``s.next_token``."""
        missing = self.n_prompt + s.n_decoded - self.n_seen
        if missing > 0:
            tail = s.cache[len(s.cache) - (missing - 1) :] if missing > 1 else []
            tail.append(s.next_token)
            self._push(tail)
        return self.hist[: self.n]

    def _push(self, tokens: list[int]) -> None:
        k = len(tokens)
        if self.n + k > len(self.hist):
            if self.n + k > HISTORY_MAX_TOKENS:
                keep = HISTORY_MAX_TOKENS // 2
                self.hist[:keep] = self.hist[self.n - keep : self.n]
                self.n = keep
            if self.n + k > len(self.hist):
                grown = np.empty(max(2 * len(self.hist), self.n + k), dtype=np.int32)
                grown[: self.n] = self.hist[: self.n]
                self.hist = grown
        self.hist[self.n : self.n + k] = tokens
        self.n += k
        self.n_seen += k

    def record(self, drafted: int, accepted: int) -> None:
        self.n_draft += drafted
        self.n_accepted += accepted
        self.n_drafts += 1


def draft_room(s: SpecSlot, n_ctx_seq: int) -> int:
    """The most draft tokens ``s`` may have verified in its next step (before the batch cut)."""
    spec = s.spec
    task = s.task
    assert spec is not None and task is not None
    return min(spec.n_max, n_ctx_seq - s.n_past - 2, task.n_predict - s.n_decoded - 1)


def ngram_draft(hist: np.ndarray, size_n: int, n_max: int) -> np.ndarray:
    """The up to ``n_max`` tokens that followed the latest earlier occurrence of ``hist``'s
    last ``size_n`` tokens (empty if there is none)."""
    n = len(hist)
    if n_max <= 0 or n <= size_n:
        return _EMPTY
    pattern = hist[n - size_n :]
    starts = np.flatnonzero(hist[: n - size_n] == pattern[0])  # earlier starts only
    if size_n > 1 and len(starts):
        window = hist[starts[:, None] + _RAMP[:size_n]]
        starts = starts[(window == pattern).all(axis=1)]
    if not len(starts):
        return _EMPTY
    j = int(starts[-1]) + size_n
    return hist[j : j + n_max]


class Drafter(Protocol):
    """Proposes drafts for the generating slots of one step (in the group's thread)."""

    def propose(self, slots: Sequence[SpecSlot], room: int, n_ctx_seq: int) -> dict[int, np.ndarray]:
        """Drafts by slot ``local`` id, at most ``room`` tokens together; slots without ``spec``
        (or whose draft came out shorter than their ``n_min``) get none."""
        ...

    def close(self) -> None: ...


class NgramDrafter:
    """``--spec-type ngram-simple``: prompt lookup in each slot's own history."""

    def __init__(self, size_n: int) -> None:
        self.size_n = size_n

    def propose(self, slots: Sequence[SpecSlot], room: int, n_ctx_seq: int) -> dict[int, np.ndarray]:
        out: dict[int, np.ndarray] = {}
        for s in slots:
            spec = s.spec
            if spec is None or room < 1:
                continue
            k = min(draft_room(s, n_ctx_seq), room)
            if k < spec.n_min:
                continue
            draft = ngram_draft(spec.history(s), self.size_n, k)
            if len(draft) >= spec.n_min:
                out[s.local] = draft
                room -= len(draft)
        return out

    def close(self) -> None:
        pass
