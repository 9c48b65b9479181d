"""Which request the engine process was serving when it died (resume after an engine death, made fair).

An abort inside llama.cpp ends the engine process with no chance to say why. Every request in
it counts that death toward ``--resume-max``, so one request that aborts the engine on each
try would take the requests beside it down with it. The engine therefore writes, per group,
what its worker thread is inside right now into a small file the API process maps too (the
writes survive the process: they sit in the page cache):

- ``SAMPLE task`` while a token of ``task`` is sampled (its sampler chain: grammar, DRY, ...),
- ``START task`` while a task's sampler chain is built in the group,
- ``DECODE`` while ``llama_decode`` runs (any request of the batch may be the cause),
- ``WARMUP`` while a new context's warm-up decode runs (no request: the build or the machine),
- ``IDLE`` otherwise.

After a death the API process reads it (``suspects``): a death inside sampling or a start
points at those tasks alone; one inside a decode, or anywhere else, at every request that was
in the engine, as before. The file is two int64 per group; a write is two stores.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

IDLE, DECODE, SAMPLE, START, WARMUP = 0, 1, 2, 3, 4
MAX_GROUPS = 256
ENV = "LLAMACTOR_BLACKBOX"  # set by the API process for the engine process it starts


class Blackbox:
    def __init__(self, path: str | os.PathLike[str], *, create: bool) -> None:
        self.path = Path(path)
        if create or not self.path.exists():
            self.path.write_bytes(bytes(MAX_GROUPS * 2 * 8))
        self.rows = np.memmap(self.path, dtype=np.int64, mode="r+", shape=(MAX_GROUPS, 2))
        self._words = memoryview(self.rows.data).cast("B").cast("q")  # the hot path's stores (~0.1 us)

    def enter(self, group: int, state: int, task_id: int = -1) -> None:
        i = 2 * (group % MAX_GROUPS)
        self._words[i + 1] = task_id
        self._words[i] = state

    def leave(self, group: int) -> None:
        self._words[2 * (group % MAX_GROUPS)] = IDLE

    def suspects(self) -> set[int] | None:
        """The tasks a death inside sampling or a start points at; None when it cannot point
        (a decode was running, or no group was inside llama.cpp for one request)."""
        states, ids = self.rows[:, 0], self.rows[:, 1]
        if (states == DECODE).any():
            return None
        marked = (states == SAMPLE) | (states == START)
        return {int(t) for t in ids[marked]} or None

    def in_warmup(self) -> bool:
        """Whether a group was inside its warm-up decode (a death there is no request's doing)."""
        return bool((self.rows[:, 0] == WARMUP).any())

    def clear(self) -> None:
        self.rows[:] = 0


_engine_box: Blackbox | None = None


def engine_blackbox() -> Blackbox | None:
    """The engine process's box (``ENV`` names its file), made once; None elsewhere."""
    global _engine_box
    path = os.environ.get(ENV)
    if path and (_engine_box is None or str(_engine_box.path) != path):
        _engine_box = Blackbox(path, create=False)
    return _engine_box if path else None
