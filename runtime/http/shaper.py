"""What every API's answer shaper is: one interface for a whole body and for a stream.

An API (native /completion, OpenAI completions and chat, Responses, Anthropic Messages,
transcriptions) turns the runtime's events into its own shape with a ``Shaper``: ``body`` for a
whole answer; for a stream, ``stream`` for each token or end of a choice, ``progress`` for each
prompt-progress event (llama-server's ``return_progress``), ``tail`` once after the last event,
each item framed by ``frame`` (a ``data:`` line, or ``event:`` and ``data:`` lines), then
``data: [DONE]`` where the API ends so (``done``); an error after the stream started is sent as
``error_frame``. The HTTP layer's one streaming loop drives them all.
"""

from __future__ import annotations

from typing import Any, ClassVar

from llamactor.protocol import sse
from llamactor.protocol.events import Done, Progress, Token
from llamactor.runtime.http.errors import error_body
from llamactor.runtime.service.results import Completion


class Shaper:
    done: ClassVar[bool] = False  # the stream ends with ``data: [DONE]`` (OpenAI's APIs)

    def body(self, c: Completion) -> Any:
        raise NotImplementedError

    def stream(self, ev: Token | Done) -> list[Any]:
        raise NotImplementedError

    def progress(self, ev: Progress) -> list[Any]:
        return []  # an API without a progress shape skips them

    def tail(self) -> Any | None:
        return None

    def frame(self, item: Any) -> bytes:
        return sse.frame(item)

    def error_frame(self, exc: BaseException) -> bytes:
        return sse.frame(error_body(exc))


class NamedEvents(Shaper):
    """A stream of named events (Responses, Anthropic): each item is ``(name, data)`` or a list
    of them, framed as ``event: <name>`` + ``data: <json>``."""

    def frame(self, item: tuple[str, Any] | list[tuple[str, Any]]) -> bytes:
        return named_frame(item)


def named_frame(events: tuple[str, Any] | list[tuple[str, Any]]) -> bytes:
    """``event: <name>`` + ``data: <json>`` frames (Responses and Anthropic streams)."""
    if isinstance(events, tuple):
        events = [events]
    return b"".join(sse.named_frame(name, data) for name, data in events)
