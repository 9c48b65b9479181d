"""LoRA adapter sets: which adapters, at which scales, one decode step applies.

A ``LoraSet`` is the canonical form of a request's effective adapters: ``(adapter id, scale)``
pairs in id order, scales rounded to float32 (what llama.cpp stores and compares) and
adapters at scale 0 left out (llama.cpp drops them too: ``llama_set_adapters_lora``). So two
requests can share a batch, or a KV cache, exactly when their sets are equal, and the empty
set is the base model.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import msgspec
import numpy as np

LoraSet = tuple[tuple[int, float], ...]


class LoraScale(msgspec.Struct, frozen=True, kw_only=True):
    """One adapter of a request's ``lora`` or of ``POST /lora-adapters``, as llama-server reads
    it: adapters not listed get scale 0, and a missing scale is 0."""

    id: int
    scale: float = 0.0


NO_LORA: LoraSet = ()
FLOAT32_MAX = float(np.finfo(np.float32).max)  # llama.cpp holds scales as float


def lora_set(scales: Iterable[float]) -> LoraSet:
    """The canonical set of per-adapter ``scales`` (index = adapter id)."""
    out = []
    for i, scale in enumerate(scales):
        s = float(np.float32(scale))
        if s != 0.0:
            out.append((i, s))
    return tuple(out)


def finite_scale(value: object) -> float | None:
    """``value`` as a finite scale, or None when it is not a number (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    scale = float(value)
    return scale if math.isfinite(scale) and abs(scale) <= FLOAT32_MAX else None
