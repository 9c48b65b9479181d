"""llamactor's runtime: the embedding API.

    from runtime import Runtime, RuntimeConfig
    async with Runtime.open(RuntimeConfig(model=path, parallel=8)) as rt:
        out = await rt.complete("Hello", max_tokens=16)
"""

from runtime.config import RuntimeConfig
from runtime.errors import (
    Closed,
    ConfigError,
    EngineError,
    LlamactorError,
    NotFound,
    Overloaded,
    RequestError,
    SlotBusy,
    Unauthorized,
    Unavailable,
)
from runtime.facade import Choice, Completion, RequestHandle, Runtime, RuntimeState

__all__ = [
    "Choice",
    "Closed",
    "Completion",
    "ConfigError",
    "EngineError",
    "LlamactorError",
    "NotFound",
    "Overloaded",
    "RequestError",
    "RequestHandle",
    "Runtime",
    "RuntimeConfig",
    "RuntimeState",
    "SlotBusy",
    "Unauthorized",
    "Unavailable",
]
