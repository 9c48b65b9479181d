"""LoRA adapters of a runtime: their global scales and a request's effective set.

The semantics are llama-server's (``construct_lora_list``, ``parse_lora_request``):

- ``--lora FILE`` loads an adapter at global scale 1, ``--lora-scaled FILE:SCALE`` at SCALE,
  ``--lora-init-without-apply`` loads them all at scale 0; ids follow the command line.
- ``POST /lora-adapters`` with ``[{"id": 0, "scale": 0.5}, ...]`` sets the global scales:
  listed adapters get their scale, adapters not listed get 0.
- A request's ``lora`` (same shape) replaces the global scales for that request, again with 0
  for adapters it does not list; a request without ``lora`` (or with an empty list) uses the
  global scales as they are when it is admitted.

Unlike llama-server (which skips them), an id that does not exist and a scale that is not a
finite number are refused with a RequestError naming the field. Used on the event loop only.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from llamactor.protocol.errors import RequestError
from llamactor.protocol.lora import LoraSet, finite_scale, lora_set


@dataclass
class Adapter:
    path: str
    scale: float  # global scale, for requests that send no ``lora``


class LoraAdapters:
    def __init__(self, adapters: Iterable[tuple[str, float]] = (), *, init_without_apply: bool = False) -> None:
        self.adapters = [Adapter(str(path), 0.0 if init_without_apply else float(scale)) for path, scale in adapters]

    def __len__(self) -> int:
        return len(self.adapters)

    def rows(self) -> list[dict[str, Any]]:
        """``GET /lora-adapters``: one row per adapter, as llama-server lists them."""
        return [
            {"id": i, "path": a.path, "scale": a.scale, "task_name": "", "prompt_prefix": ""}
            for i, a in enumerate(self.adapters)
        ]

    def set_scales(self, entries: Sequence[Any], field: str = "body") -> None:
        """``POST /lora-adapters``: set every global scale (adapters not listed: 0)."""
        scales = self.scales(entries, field)
        for adapter, scale in zip(self.adapters, scales):
            adapter.scale = scale

    def resolve(self, entries: Sequence[Any] | None) -> LoraSet:
        """A request's effective LoRA set: its ``lora`` over the adapters, or the global scales."""
        if not entries:
            return lora_set(a.scale for a in self.adapters)
        return lora_set(self.scales(entries, "lora"))

    def scales(self, entries: Sequence[Any], field: str) -> list[float]:
        """Per-adapter scales from ``[{"id", "scale"}, ...]`` (dicts, ``(id, scale)`` pairs or
        objects with ``id``/``scale``); adapters not listed get 0, a repeated id the last one."""
        if isinstance(entries, (str, bytes, dict)) or not isinstance(entries, Sequence):
            raise RequestError(f"{field} must be a list of objects with 'id' and 'scale' fields")
        scales = [0.0] * len(self.adapters)
        for n, entry in enumerate(entries):
            if isinstance(entry, dict):
                if "id" not in entry:
                    raise RequestError(f"{field}[{n}] needs an 'id' field")
                adapter_id, raw = entry["id"], entry.get("scale", 0.0)
            elif isinstance(entry, (tuple, list)) and len(entry) == 2:
                adapter_id, raw = entry
            elif hasattr(entry, "id") and hasattr(entry, "scale"):
                adapter_id, raw = entry.id, entry.scale
            else:
                raise RequestError(f"{field}[{n}] must be an object with 'id' and 'scale' fields, got {entry!r}")
            if (
                isinstance(adapter_id, bool)
                or not isinstance(adapter_id, numbers.Integral)
                or not 0 <= int(adapter_id) < len(scales)
            ):
                loaded = f"ids 0..{len(scales) - 1}" if scales else "no adapter is loaded (start with --lora)"
                raise RequestError(f"{field}[{n}].id: LoRA adapter {adapter_id!r} does not exist; {loaded}")
            scale = finite_scale(raw)
            if scale is None:
                raise RequestError(f"{field}[{n}].scale must be a finite number, got {raw!r}")
            scales[int(adapter_id)] = scale
        return scales
