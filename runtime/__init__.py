"""llamactor's embedding API.

    from llamactor.runtime import Runtime, RuntimeConfig
    async with Runtime.open(RuntimeConfig(model=path, parallel=8)) as rt:
        out = await rt.complete("Hello", max_tokens=16)

The names below are loaded on first use (PEP 562), so importing a lower layer that lives under
``llamactor.runtime`` (the actor kernel, the engine bindings) never drags in the layers above
it: every module can be imported on its own, in any order.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "ChatResult",
    "Choice",
    "Closed",
    "Completion",
    "ConfigError",
    "Done",
    "EmbeddingResult",
    "EngineError",
    "EngineStatus",
    "EventStream",
    "ExceedContextSize",
    "GenerationRequest",
    "InfillChunk",
    "InfillParts",
    "LlamactorError",
    "LoraScale",
    "NotFound",
    "NotSupported",
    "Overloaded",
    "Progress",
    "Ranked",
    "RequestError",
    "RequestHandle",
    "Runtime",
    "RuntimeConfig",
    "RuntimeState",
    "SlotActionResult",
    "SlotBusy",
    "SlotState",
    "Token",
    "Unauthorized",
    "Unavailable",
]

_ERRORS = "llamactor.protocol.errors"
_WHERE = {
    "Runtime": "llamactor.runtime.api",
    "RuntimeConfig": "llamactor.runtime.service.config",
    "ChatResult": "llamactor.runtime.service.chatturn",
    "Ranked": "llamactor.runtime.service.embeddings",
    "RuntimeState": "llamactor.runtime.service.lifecycle",
    "EngineStatus": "llamactor.runtime.service.engine",
    "Choice": "llamactor.runtime.service.results",
    "Completion": "llamactor.runtime.service.results",
    "RequestHandle": "llamactor.runtime.service.handles",
    "EventStream": "llamactor.runtime.service.handles",
    "GenerationRequest": "llamactor.protocol.request",
    "InfillParts": "llamactor.protocol.request",
    "InfillChunk": "llamactor.protocol.request",
    "LoraScale": "llamactor.protocol.lora",
    "SlotState": "llamactor.protocol.slots",
    "SlotActionResult": "llamactor.protocol.slots",
    **dict.fromkeys(("Token", "Done", "Progress"), "llamactor.protocol.events"),
    **dict.fromkeys(
        (
            "Closed",
            "ConfigError",
            "EngineError",
            "ExceedContextSize",
            "LlamactorError",
            "NotFound",
            "NotSupported",
            "Overloaded",
            "RequestError",
            "SlotBusy",
            "Unauthorized",
            "Unavailable",
        ),
        _ERRORS,
    ),
}


_RENAMED = {"EmbeddingResult": ("llamactor.runtime.service.embeddings", "Embeddings")}


def __getattr__(name: str) -> Any:
    module, attr = _RENAMED.get(name, (_WHERE.get(name), name))
    if module is None:
        raise AttributeError(f"module 'llamactor.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from llamactor.protocol.errors import (
        Closed,
        ConfigError,
        EngineError,
        ExceedContextSize,
        LlamactorError,
        NotFound,
        NotSupported,
        Overloaded,
        RequestError,
        SlotBusy,
        Unauthorized,
        Unavailable,
    )
    from llamactor.protocol.events import Done, Progress, Token
    from llamactor.protocol.lora import LoraScale
    from llamactor.protocol.request import GenerationRequest, InfillChunk, InfillParts
    from llamactor.protocol.slots import SlotActionResult, SlotState
    from llamactor.runtime.api import Runtime
    from llamactor.runtime.service.chatturn import ChatResult
    from llamactor.runtime.service.config import RuntimeConfig
    from llamactor.runtime.service.embeddings import Embeddings as EmbeddingResult
    from llamactor.runtime.service.embeddings import Ranked
    from llamactor.runtime.service.engine import EngineStatus
    from llamactor.runtime.service.handles import EventStream, RequestHandle
    from llamactor.runtime.service.lifecycle import RuntimeState
    from llamactor.runtime.service.results import Choice, Completion
