"""The journal of an engine that runs in another process: its state and its resume rules, no I/O.

The API process keeps, for every request in flight, its task (prompt tokens, resolved
settings, budget) and per choice the tokens already delivered to the client. When the engine
process dies, nothing in flight fails: after the restart each journaled request is submitted
again with ``replay`` (the delivered tokens, which the group feeds after the prompt one decode
step at a time, teacher forcing, without sending them again), so the client's stream only
pauses and a greedy stream continues byte for byte. With ``fast`` resume (one choice only) the
delivered tokens are appended to the prompt instead: one prefill, numerically not identical.

The rules, each decided here and driven by ``ProcessEngine``'s I/O:
- what reaches the client: a choice that had finished before a death sends nothing more; a
  resumed request sends no progress events and reports its original prompt length;
- a seeded sampling request continues with a seed derived from its seed and what it delivered
  (the replay does not advance the sampler's random state);
- a death counts toward ``resume_max`` for the requests the engine died inside (the
  blackbox's suspects) or, when it cannot tell, for every request it held; a request past the
  limit fails alone, whether or not it had started (one that aborts the engine before its first
  token would otherwise come back after every restart until the engine stays down for everyone).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np

from llamactor.protocol.enginelink import Events, WireTask
from llamactor.protocol.events import Done, Event, Failed, Progress, Token
from llamactor.protocol.messages import Task, TaskSpec
from llamactor.protocol.sampling import DEFAULT_SEED

SEED_STEP = 1_000_003  # a resumed seed: seed * SEED_STEP + delivered tokens (mod 2**32)


@dataclass
class Entry:
    """One request in flight."""

    task: Task  # with this process's stream
    delivered: list[list[int]]  # per choice: token ids sent to the client
    done: set[int] = field(default_factory=set)  # choices whose Done was sent
    resumes: int = 0  # times it was submitted again after it had started
    deaths: int = 0  # engine processes that died (counted) while this request was in them
    sent: bool = False  # submitted to the current engine process
    lost_at: float = 0.0  # when its engine died: its next token ends the pause (0: not paused)

    @property
    def started(self) -> bool:
        return any(self.delivered) or bool(self.done)


@dataclass(frozen=True)
class Resumed:
    """A resumed request's first new token: how long its stream paused."""

    task_id: int
    resumes: int
    replayed: int  # tokens replayed
    pause_s: float


class Journal:
    def __init__(self, *, resume_max: int, fast: bool = False) -> None:
        self.resume_max = resume_max
        self.fast = fast
        self.entries: dict[int, Entry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, task_id: int) -> bool:
        return task_id in self.entries

    def add(self, task: Task) -> Entry:
        entry = self.entries[task.id] = Entry(task, [[] for _ in range(task.n)])
        return entry

    def pop(self, task_id: int) -> Entry | None:
        return self.entries.pop(task_id, None)

    def waiting(self) -> int:
        """Requests not submitted to an engine (it is restarting)."""
        return sum(1 for e in self.entries.values() if not e.sent)

    # ---- events from the engine -----------------------------------------------------------

    def deliver(self, msg: Events, now: float) -> tuple[list[tuple[Entry, Event]], list[Resumed]]:
        """One engine step's events, journaled: what to send to each request's stream (in order),
        and the resumed requests whose stream this step ended a pause of. Streams of
        ``msg.ended`` are for the caller to close (``end``)."""
        out: list[tuple[Entry, Event]] = []
        resumed: list[Resumed] = []
        for task_id, event in msg.events:
            entry = self.entries.get(task_id)
            if entry is None:
                continue  # cancelled meanwhile
            if isinstance(event, Token):
                if event.index in entry.done:
                    continue  # a resumed choice that had finished (n > 1) sends nothing more
                entry.delivered[event.index].append(event.token)
                if entry.lost_at:
                    resumed.append(
                        Resumed(task_id, entry.resumes, sum(map(len, entry.delivered)) - 1, now - entry.lost_at)
                    )
                    entry.lost_at = 0.0
            elif isinstance(event, Done):
                if event.index in entry.done:
                    continue  # a resumed choice that had finished ends again: sent once already
                entry.done.add(event.index)
                if entry.resumes and event.n_prompt != len(entry.task.prompt):  # fast resume
                    event = msgspec.structs.replace(event, n_prompt=len(entry.task.prompt))
            elif isinstance(event, Progress) and entry.resumes:
                continue
            out.append((entry, event))
        return out, resumed

    # ---- engine deaths and resubmission ---------------------------------------------------

    def lost(self, suspects: set[int] | None, now: float) -> None:
        """The engine died: what was sent to it is unsent now. The death counts for
        ``suspects`` (what it died inside), or for every request it held when None."""
        for task_id, entry in self.entries.items():
            entry.deaths += entry.sent and (suspects is None or task_id in suspects)
            entry.sent = False
            if any(entry.delivered) and not entry.lost_at:
                entry.lost_at = now  # its stream pauses from here until its next token

    def lost_one(self, entry: Entry, now: float) -> None:
        """The engine (a replica) serving ``entry`` died: the death counts for it alone."""
        entry.deaths += entry.sent
        entry.sent = False
        if any(entry.delivered) and not entry.lost_at:
            entry.lost_at = now

    def unsent(self) -> Iterator[tuple[Entry, WireTask | Failed]]:
        """Each request to send to a new engine, in arrival order: its wire task (a resume if it
        had started), or the failure that ends it (past ``resume_max`` deaths: drop it first)."""
        for entry in list(self.entries.values()):
            if entry.sent or entry.task.id not in self.entries:
                continue
            yield entry, self.next_send(entry)

    def next_send(
        self, entry: Entry, what: str = "the engine process", *, fast: bool | None = None
    ) -> WireTask | Failed:
        """What to send for ``entry`` now: its wire task (a resume if it had started), or the
        failure that ends it (past ``resume_max`` deaths of ``what`` served it). ``fast``
        overrides the journal's resume mode (a stream moved with its KV: its history is in the
        slot it goes to, nothing is replayed)."""
        if entry.deaths > self.resume_max:
            return Failed(
                f"{what} died {entry.deaths} times while serving this request; it is not resumed again", "EngineError"
            )
        resumes = entry.resumes + 1 if entry.started else entry.resumes
        return wire(entry.task, entry.delivered, resumes, self.fast if fast is None else fast)

    def submitted(self, entry: Entry, task: WireTask) -> bool:
        """``task`` reached the engine; True when it was a resume."""
        entry.sent = True
        resumed = bool(task.replay) or task.replay_in_prompt
        if resumed:
            entry.resumes += 1
        return resumed

    def ends(self) -> Iterable[Entry]:
        """Every entry, removed (the runtime closes, or the engine is down for good)."""
        entries, self.entries = self.entries, {}
        return entries.values()


def wire(task: Task, delivered: list[list[int]], resumes: int, fast: bool = False) -> WireTask:
    """The task as the engine gets it; a resumed one (``resumes`` > 0) replays what was
    delivered (``fast``, one choice only: as part of its prompt)."""
    spec = {name: getattr(task, name) for name in TaskSpec.__struct_fields__}
    prompt = task.prompt
    if resumes:
        params = task.params
        if params.seed != DEFAULT_SEED and not params.greedy:
            # seeded sampling goes on with a seed of its own: the replay does not advance the RNG
            spec["params"] = msgspec.structs.replace(
                params, seed=(params.seed * SEED_STEP + sum(map(len, delivered))) % 2**32
            )
        spec["return_progress"] = False
        spec["replay"] = tuple(tuple(d) for d in delivered)  # fast or exact, the group primes its sampler with them
        if fast and task.n == 1:
            prompt = np.concatenate([prompt, np.asarray(delivered[0], dtype=np.int32)])
            spec["replay_in_prompt"] = True
    return WireTask(prompt=np.ascontiguousarray(prompt, dtype=np.int32).tobytes(), **spec)
