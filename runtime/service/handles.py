"""Request handles: the receive end of one request's event stream, and its collected result.

A handle yields ``Token`` and ``Done`` events and raises the request's error; closing it (or
leaving its ``async with``) cancels the request, which frees its slot at once (API-6).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from llamactor.protocol.errors import EngineError, LlamactorError, Overloaded, RequestError, Unavailable
from llamactor.protocol.events import Done, Failed, Progress, Token
from llamactor.protocol.messages import Task


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str
    tokens: tuple[int, ...]
    logprobs: tuple[Token, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A finished request: one ``Choice`` per n, plus usage and timings."""

    choices: tuple[Choice, ...]
    n_prompt: int
    n_cached: int
    n_predicted: int
    prompt_ms: float
    predicted_ms: float
    slot: int
    stopping_word: str = ""
    truncated: bool = False  # a context shift dropped tokens (EN-4)
    n_draft: int = 0  # draft tokens verified, all choices (EN-2)
    n_draft_accepted: int = 0  # of those, accepted

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason


@dataclass
class RequestHandle:
    """The receive end of one request: iterate for events; closing it cancels the request."""

    task: Task
    events: Any  # anyio MemoryObjectReceiveStream[Event]
    cancel: Callable[[int], None]  # asks the runtime to stop the task (by id)
    _closed: bool = field(default=False, repr=False)

    def __aiter__(self) -> AsyncIterator[Token | Done | Progress]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Token | Done | Progress]:
        try:
            async for event in self.events:
                if isinstance(event, Failed):
                    raise error_of(event)
                yield event
        finally:
            self.close()

    async def first(self) -> Token | Done | Progress | None:
        """Wait for the first event (raises the request's error): lets HTTP pick a status.

        None when the request ends without any event (nothing to generate: max_tokens 0).
        """
        try:
            event = await self.events.receive()
        except anyio.EndOfStream:
            self.close()
            return None
        if isinstance(event, Failed):
            self.close()
            raise error_of(event)
        return event

    def close(self) -> None:
        """Cancel (if still running) and drop the stream; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self.events.close()
        self.cancel(self.task.id)

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def nothing_generated(task: Task) -> Done:
    """The final event of a request that generates nothing (n_predict 0): its prompt was
    accepted, no token follows, the choice ends with "length"."""
    return Done(index=0, finish_reason="length", text="", stopping_word="", n_prompt=len(task.prompt),
                n_cached=0, n_predicted=0, prompt_ms=0.0, predicted_ms=0.0, slot=-1)


async def collect(handle: RequestHandle) -> Completion:
    """Drain a request's events into a ``Completion``."""
    async with handle:
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list[Token]] = {}
        done: dict[int, Done] = {}
        async for event in handle:
            if isinstance(event, Token):
                tokens.setdefault(event.index, []).append(event.token)
                if event.logprob is not None:
                    logprobs.setdefault(event.index, []).append(event)
            elif isinstance(event, Done):
                done[event.index] = event
    if not done:
        n_prompt = len(handle.task.prompt)
        return Completion((Choice(0, "", "length", ()),), n_prompt, 0, 0, 0.0, 0.0, -1)
    choices = tuple(
        Choice(i, d.text, d.finish_reason, tuple(tokens.get(i, ())), tuple(logprobs.get(i, ())))
        for i, d in sorted(done.items())
    )
    first = done[min(done)]
    return Completion(
        choices,
        n_prompt=first.n_prompt,
        n_cached=first.n_cached,
        n_predicted=sum(d.n_predicted for d in done.values()),
        prompt_ms=first.prompt_ms,
        predicted_ms=max(d.predicted_ms for d in done.values()),
        slot=first.slot,
        stopping_word=first.stopping_word,
        truncated=any(d.truncated for d in done.values()),
        n_draft=sum(d.n_draft for d in done.values()),
        n_draft_accepted=sum(d.n_draft_accepted for d in done.values()),
    )


def error_of(event: Failed) -> LlamactorError:
    if event.kind == "overloaded":
        return Overloaded(event.message)
    if event.kind == "invalid_request_error":
        return RequestError(event.message)
    if event.kind == "unavailable_error":
        return Unavailable(event.message)
    return EngineError(event.message)
