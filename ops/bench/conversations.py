"""A conversation book: every request of a run by index, later turns built as their previous turns end.

Shared by the chat workload (``ops.bench.chatload``) and the random workloads
(``ops.bench.random.randomrun``). A request is a ``Turn``: its own user message, and either the
system message its conversation starts with or the index of the earlier request it ``follows``.
Its prompt is a ``Dialogue`` (``ops.bench.apis``): a first turn's is the system and user
messages; a later turn's is its previous turn's messages, that turn's answer (the ids streamed
back by the native dialect, the text by the others) and its own user message, so as token ids
it is the conversation's whole history in order. A later turn can only be built once its
previous turn has ended, so a job asking for it waits (``Conversations.request``).

What a failed previous turn does to a later one is the workload's choice (``AfterFailure``):
the chat workload skips the rest of the conversation, the random workloads send the later
turn without the missing answer.

Jobs take the requests through ``TurnFeed``s (``phase.Feed``), each over a list of indices in
the order it sends them: one feed shared by every worker of a run (chat), or one per job (a
closed-loop user's requests, an open-loop arrival).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import cast

import anyio

from llamactor.ops.bench.apis import Dialogue, Message, TextRecord
from llamactor.ops.bench.phase import Request
from llamactor.ops.bench.stats import RequestRecord


class AfterFailure(Enum):
    """What becomes of a later turn whose previous turn failed (or was itself skipped)."""

    SKIP = "skip"  # not sent, and so neither are the turns after it (counted in ``skipped``)
    WITHOUT_ANSWER = "without answer"  # sent with the history it has, the answer left out (``broken``)


@dataclass(frozen=True)
class Turn:
    """One request of a book: its new user message, and where its conversation stands."""

    text: tuple[int, ...]  # the ids of its own user message
    ntg: int
    follows: int | None = None  # the request whose answer it continues (a later turn), or None
    system: tuple[int, ...] | None = None  # a first turn's system message, if its conversation has one


class Conversations:
    """Every request of one run by index; a later turn built once its previous turn has ended.

    ``request`` is called once per index by the job that sends it, ``done`` once when that
    request has ended; the records and counts are read after the phase. ``keep_all`` keeps
    every answer's ids, not only those a later turn needs.
    """

    def __init__(self, turns: Sequence[Turn], after_failure: AfterFailure, *, keep_all: bool = False) -> None:
        self.turns = turns
        self.after_failure = after_failure
        followed = {t.follows for t in turns if t.follows is not None}
        self.keep = [keep_all or i in followed for i in range(len(turns))]  # its answer is kept
        self.prompts: list[Dialogue | None] = [
            None if t.follows is not None else Dialogue([*_system(t), Message("user", t.text)]) for t in turns
        ]  # a later turn's is built from its previous turn's answer
        self.ended = [anyio.Event() for _ in turns]  # set when the request has ended or was skipped
        self.records: dict[int, RequestRecord] = {}
        self.skipped = 0  # later turns not sent (``AfterFailure.SKIP``)
        self.broken = 0  # later turns sent without their previous answer (``AfterFailure.WITHOUT_ANSWER``)
        self.short_replies = 0  # kept ids fewer than the server generated (a token ending inside UTF-8)

    async def request(self, i: int) -> Request | None:
        """The request of index ``i``, once its previous turn has ended; ``None``: skipped."""
        turn = self.turns[i]
        prompt = self.prompts[i]
        if prompt is None:
            assert turn.follows is not None  # only later turns are built here
            await self.ended[turn.follows].wait()
            previous = self.prompts[turn.follows]
            record = self.records.get(turn.follows)  # None: it was skipped
            answer: list[Message] = []
            if record is not None and record.ok:
                answer.append(_answer_of(record))
            elif self.after_failure is AfterFailure.SKIP:
                self.skipped += 1
                self.ended[i].set()  # a turn after this one is skipped in turn
                return None
            else:
                self.broken += 1
            assert previous is not None  # sent (never skipped) under this policy
            prompt = self.prompts[i] = Dialogue([*previous.messages, *answer, Message("user", turn.text)])
        return Request(prompt, turn.ntg, cache_prompt=True, keep_ids=self.keep[i], tag=i)

    def done(self, i: int, record: RequestRecord) -> None:
        self.records[i] = record
        ids = record.token_ids
        if record.ok and ids is not None and len(ids) < record.n_generated:
            self.short_replies += 1
        self.ended[i].set()


def _system(turn: Turn) -> list[Message]:
    return [Message("system", turn.system)] if turn.system is not None else []


def _answer_of(record: RequestRecord) -> Message:
    """The answer of a completed request as the next turn's assistant message."""
    if isinstance(record, TextRecord):
        return Message("assistant", text="".join(record.text))
    return Message("assistant", tuple(record.token_ids or ()))


def conversation_notes(*, skipped: int = 0, broken: int = 0, short_replies: int = 0) -> list[str]:
    """A result's notes on a book's counts (``Conversations.skipped`` and the others); none for 0."""
    out = []
    if skipped:
        out.append(f"{skipped} turn(s) not sent: an earlier turn of their conversation failed")
    if broken:
        out.append(f"{broken} later turn(s) sent without their previous answer (it failed)")
    if short_replies:
        out.append(
            f"{short_replies} repl(ies) streamed fewer token ids than the server generated "
            "(a token ending inside a UTF-8 sequence); those conversations' histories lack them"
        )
    return out


class TurnFeed:
    """The requests of a book at ``indices``, in that order (``phase.Feed``); a skipped one is
    passed over. Held by one job (its own requests) or shared by several (a run's order)."""

    def __init__(self, book: Conversations, indices: Sequence[int]) -> None:
        self.book = book
        self.indices = indices
        self._next = 0

    async def take(self) -> Request | None:
        while self._next < len(self.indices):
            # taken before waiting, so a job sharing this feed goes on to the next index meanwhile
            i = self.indices[self._next]
            self._next += 1
            request = await self.book.request(i)
            if request is not None:
                return request
        return None

    def done(self, request: Request, record: RequestRecord) -> None:
        self.book.done(cast(int, request.tag), record)


__all__ = ["AfterFailure", "Conversations", "Turn", "TurnFeed", "conversation_notes"]
