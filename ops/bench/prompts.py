"""Deterministic, pairwise-distinct prompts given as exact token ids (pure).

Every request of a run gets its own random id sequence, so no server can answer one from its
prompt cache; a fixed seed gives the same prompts to both servers of a ``--vs`` pair, and a
different seed per pair and sweep point keeps a server from ever seeing a prompt twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_DRAWS_PER_PROMPT = 100  # a duplicate is astronomically rare; this only bounds the loop


def run_seed(seed: int, point: int, pair: int) -> int:
    """The prompt seed of one run: sweep point ``point``, repetition ``pair``."""
    return int(np.random.SeedSequence([seed, point, pair]).generate_state(1)[0])


class PromptSource:
    """Draws prompts of a given length from ``ids``; never returns the same prompt twice.

    Called once per request, in a fixed order, before the measured phase starts.
    """

    def __init__(self, ids: Sequence[int], seed: int) -> None:
        if not ids:
            raise ValueError("no token ids to build prompts from")
        self._ids = np.asarray(ids, dtype=np.int64)
        self._rng = np.random.default_rng(seed)
        self._seen: set[tuple[int, ...]] = set()

    def take(self, n_tokens: int) -> list[int]:
        if n_tokens < 1:
            raise ValueError(f"a prompt needs at least one token, got {n_tokens}")
        for _ in range(MAX_DRAWS_PER_PROMPT):
            prompt = tuple(int(t) for t in self._rng.choice(self._ids, size=n_tokens))
            if prompt not in self._seen:
                self._seen.add(prompt)
                return list(prompt)
        raise RuntimeError(f"could not draw a new distinct prompt of {n_tokens} tokens")


__all__ = ["PromptSource", "run_seed"]
