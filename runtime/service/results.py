"""What a finished generation request returns: its choices, usage and timings."""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass

from llamactor.protocol.events import Done, Progress, Token


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
    truncated: bool = False  # a context shift dropped tokens
    n_draft: int = 0  # draft tokens verified by speculative decoding, all choices
    n_draft_accepted: int = 0  # of those, accepted

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason


async def collect_events(events: AsyncIterable[Token | Done | Progress], n_prompt: int) -> Completion:
    """Drain a request's events into a ``Completion``."""
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[Token]] = {}
    done: dict[int, Done] = {}
    async for event in events:
        if isinstance(event, Token):
            tokens.setdefault(event.index, []).append(event.token)
            if event.logprob is not None:
                logprobs.setdefault(event.index, []).append(event)
        elif isinstance(event, Done):
            done[event.index] = event
    if not done:
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
