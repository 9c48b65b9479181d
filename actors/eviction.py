"""Making room in an overcommitted unified KV cache (``--kv-unified``: every slot may use all C
cells, so together they can run out). The group asks these when llama_decode finds no room."""

from __future__ import annotations

from collections.abc import Sequence

from llamactor.runtime.engine.slot import Slot


def idle_caches(slots: Sequence[Slot]) -> list[Slot]:
    """Idle slots whose KV still holds a cached prompt: dropped first, nobody is served by them."""
    return [s for s in slots if not s.busy and s.cache]


def victim(slots: Sequence[Slot]) -> Slot:
    """The request (its parent slot) holding the most cells: stopped so that the others go on."""
    busy = [s for s in slots if s.task is not None and s.parent is None]
    return max(busy, key=lambda s: s.n_past)
