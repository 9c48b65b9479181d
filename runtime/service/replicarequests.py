"""``ReplicaRequests``: requests on the replica set, journaled here and placed on a replica each.

A request is submitted to the replica the router picks (``run``: it answers when the request
ended there); its events come on that replica's one events stream (``_listen``), several
requests' in one frame per decode step. When a replica dies mid-stream or its events stream
ends or falls silent past ``SILENCE_S``, each request it carried is resumed on another replica
from the journal, by exact replay of the tokens already delivered; one whose replicas died
``resume_max`` times fails alone.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import numpy as np
import structlog
from anyio.abc import TaskGroup

from llamactor.protocol import enginelink as link
from llamactor.protocol.errors import LlamactorError, Unavailable
from llamactor.protocol.events import Done, Event, Failed
from llamactor.protocol.messages import Task
from llamactor.protocol.slots import SlotKV
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.engine import served_by
from llamactor.runtime.service.journal import Entry
from llamactor.runtime.service.raycluster import first_line, replica_lost
from llamactor.runtime.service.replicacalls import ReplicaCalls
from llamactor.runtime.service.routing import Placed, Route, Served, block_hashes

log = structlog.get_logger("llamactor.replicas")

SILENCE_S = 10.0  # a replica sends a frame every second; this long without one: it is gone

_frames = msgspec.msgpack.Decoder(Placed | link.Events)
_served = msgspec.msgpack.Decoder(Served)
_encoder = msgspec.msgpack.Encoder()


@dataclass
class _Sub:
    """One submission of a request to a replica (a resumed request is submitted anew)."""

    sid: int
    entry: Entry
    replica: str = ""  # known from its first event (or the replica's answer)
    epoch: int = -1  # of the replica's events stream that carries its events
    lost: str = ""  # why its replica was given up on
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ended: anyio.Event = field(default_factory=anyio.Event)  # its last events were delivered
    handover: bool = False  # a prefill replica's part: its first token, then a decode replica's
    handed: bool = False  # ... which ended at its first token: the request goes on elsewhere
    kv: SlotKV | None = None  # ... and the prefill replica's slot state it ended with


@dataclass
class Move:
    """A stream leaving a drained replica: where its KV went (``ReplicaMoves.drain``)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    replica: str = ""  # the replica whose slot holds its history now ("": replayed where the router says)
    slot: int = -1  # that slot, the replica's own numbering
    n_tokens: int = 0  # tokens of history it holds


class ReplicaRequests(ReplicaCalls):
    """Each request's submissions to the replicas, and the replicas' events streams that carry them."""

    def __init__(self, config: RuntimeConfig, handle: Any, app: str) -> None:
        super().__init__(config, handle, app)
        self.stream = handle.options(stream=True)
        self._tg: TaskGroup | None = None
        self._subs: dict[int, _Sub] = {}  # submission id -> the request submitted under it
        self._sid_of: dict[int, int] = {}  # task id -> its current submission id
        self._sids = itertools.count(1)
        self._epochs: dict[str, int] = {}  # replica -> the epoch of its events stream listened to
        self._placements: dict[int, list[str]] = {}
        self._moves: dict[int, Move] = {}  # task id -> its move off a drained replica (``ReplicaMoves``)
        # (replica, slot) holding an import for a request not yet ended there: no other import goes there
        self._reserved: set[tuple[str, int]] = set()
        # replica -> the scope its events stream is read in ("watch:" + replica: its routing stats)
        self._streams: dict[str, anyio.CancelScope] = {}

    def submit(self, task: Task) -> None:
        if self._tg is None:
            raise Unavailable("the replica set is not open")
        entry = self.journal.add(task)
        placement = served_by.get()
        if placement is not None:
            self._placements[task.id] = placement
        self._tg.start_soon(self._place, entry)

    def cancel(self, task_id: int) -> None:
        entry = self.journal.pop(task_id)
        self._placements.pop(task_id, None)
        sub = self._subs.pop(self._sid_of.pop(task_id, 0), None)
        if sub is not None:
            sub.scope.cancel()  # leaving the replica's ``run`` call cancels the request there
        if entry is not None:
            entry.task.sink.close()

    async def _place(self, entry: Entry) -> None:
        """Serve ``entry`` on the replica the router picks (again, after a replica's death)."""
        task = entry.task
        while task.id in self.journal:
            move = self._moves.pop(task.id, None)
            prompt = np.concatenate([task.prompt, *(np.asarray(d, dtype=np.int32) for d in entry.delivered[:1])])
            blocks = tuple(block_hashes(prompt))
            to, slot = (move.replica, move.slot) if move is not None and move.replica else ("", -1)
            if move is None and not entry.started and not entry.resumes:  # a new request: pull its prefix?
                pulled = await self._pull(task, Route(0, blocks, lora=task.lora), prompt)
                if task.id not in self.journal:
                    return  # the client left meanwhile
                if pulled is not None:
                    to, slot = pulled
            handover = False
            if move is None and not to and not entry.started and not entry.resumes:
                to = self._prefill_replica(task)  # prefill and decode apart: its prompt goes to a prefill replica
                handover = bool(to)
            if to and to not in self._replica_ids():  # the slot's replica went away meanwhile
                self._reserved.discard((to, slot))
                to, slot = "", -1
            fast = True if move is not None and to else None  # a moved history is in its slot: nothing replayed
            what = self.journal.next_send(entry, "the replicas serving it", fast=fast)
            if isinstance(what, Failed):
                self.end(task.id, what)
                return
            if slot >= 0:  # its prefix (a pull) or its history (a move) is in that slot: it goes on from there
                what = msgspec.structs.replace(what, id_slot=slot, cache_prompt=True)
            if handover and to:  # the prefill replica generates its first token only, then hands over
                what = msgspec.structs.replace(what, n_predict=1, hand_over=True)
            sid = next(self._sids)
            sub = self._subs[sid] = _Sub(sid, entry, handover=handover and bool(to))
            self._sid_of[task.id] = sid
            resumed = self.journal.submitted(entry, what)  # before its first event can arrive
            self.counters.resumed += resumed
            route = Route(sid, blocks, _text(prompt, self.config.replica_router), to, task.lora)
            wire = _encoder.encode(msgspec.structs.replace(what, id=sid))
            lost = ""
            with sub.scope:
                try:
                    served = _served.decode(await _answer(self.handle.run.remote(wire, route)))
                    if not sub.replica:  # it ended before its events came (they are on their way)
                        self._placed(sub, served.replica, served.epoch)
                    gone = self._epochs.get(served.replica, 0) > served.epoch and not sub.ended.is_set()
                    if not served.delivered or gone:
                        lost = "the replica's events stream ended"
                    else:
                        await sub.ended.wait()  # its last events are on their way (the events stream)
                        lost = sub.lost
                except Exception as exc:
                    if not replica_lost(exc):
                        self.end(
                            task.id, Failed.of(exc) if isinstance(exc, LlamactorError) else Failed(first_line(exc))
                        )
                        return
                    lost = first_line(exc)
            self._finished(sid)  # (its Ray call ended too: the router's own count agrees)
            self._reserved.discard((to, slot))  # the slot it was pinned to is anyone's again
            if sub.scope.cancel_called:
                lost = sub.lost  # the replica's events stream was lost (else: the client left)
            if not lost:
                return
            self._subs.pop(sid, None)
            moving = self._moves.get(task.id)
            if moving is not None:  # moved off a drained replica: not a death
                await moving.done.wait()
                entry.sent = False
                if any(entry.delivered) and not entry.lost_at:
                    entry.lost_at = time.perf_counter()
            elif task.id in self.journal:
                log.warning("replica_lost", task=task.id, error=lost, delivered=sum(map(len, entry.delivered)))
                self.journal.lost_one(entry, time.perf_counter())

    async def _pull(self, task: Task, route: Route, prompt: np.ndarray) -> tuple[str, int] | None:
        """Where a new request's prefix was copied to, to pin it there (``ReplicaMoves``)."""
        return None

    def _prefill_replica(self, task: Task) -> str:
        """With prefill and decode apart, the prefill replica a new request goes to ("": none)."""
        return ""

    def _hand_over(self, sub: _Sub, replica: str) -> None:
        """A prefill replica's part of a request ended at its first token: move it on (``ReplicaMoves``)."""

    async def _listen(self, rid: str) -> None:
        """Follow one replica's events stream; when it ends or falls silent, the requests it
        carried are resumed on other replicas."""
        gen = self.stream.events.remote(Route(0, replica=rid))
        iterator = gen.__aiter__()
        epoch = -1
        why = "the replica's events stream ended"
        try:
            scope = self._streams[rid] = anyio.CancelScope()  # cancelled: the ingress closes it (a replica leaving)
            with scope:
                while True:
                    with anyio.fail_after(SILENCE_S):
                        data = await iterator.__anext__()
                    frame = _frames.decode(data)
                    if isinstance(frame, Placed):
                        epoch = frame.epoch
                        self._epochs[rid] = epoch
                        self._pids[rid] = frame.pid
                        continue
                    self._deliver(rid, frame)
            why = "the replica is stopping"  # (only a cancel of ``scope`` ends the loop so)
        except StopAsyncIteration:
            pass
        except TimeoutError:
            why = f"no word from the replica for {SILENCE_S:g} s"
        except Exception as exc:
            if not replica_lost(exc):
                raise
            why = first_line(exc)
        finally:
            self._streams.pop(rid, None)
            gen.cancel()
        self._epochs[rid] = max(self._epochs.get(rid, 0), epoch + 1)
        lost = [s for s in self._subs.values() if s.replica == rid and s.epoch <= epoch]
        if lost:
            self.counters.deaths += 1
        for sub in lost:
            sub.lost = why
            sub.scope.cancel()

    def _finished(self, sid: int) -> None:
        """The router counts submission ``sid`` as ended (its slot is free for the next turn)."""
        finished = getattr(self._router(), "finished", None)
        if finished is not None:
            finished(sid)

    def _placed(self, sub: _Sub, replica: str, epoch: int) -> None:
        """Where ``sub`` is served, known (the response header names it)."""
        sub.replica, sub.epoch = replica, epoch
        placement = self._placements.pop(sub.entry.task.id, None)
        if placement is not None:
            placement.append(replica)

    def _deliver(self, rid: str, msg: link.Events) -> None:
        """One replica step's events, of every request it serves for this ingress."""
        events: list[tuple[int, Event]] = []
        for sid, event in msg.events:
            sub = self._subs.get(sid)
            if sub is None:
                continue  # cancelled, or resumed elsewhere since
            if not sub.replica:  # its first event
                self._placed(sub, rid, self._epochs.get(rid, 0))
            if sub.handover and isinstance(event, Done) and event.finish_reason == "length":
                sub.handed, sub.kv = True, event.kv  # its first token only: it goes on on a decode replica
                continue
            events.append((sub.entry.task.id, event))
        ended: list[int] = []
        for sid in msg.ended:
            sub = self._subs.pop(sid, None)
            if sub is not None:
                self._finished(sid)
                if sub.handed:
                    self._hand_over(sub, rid)
                    sub.ended.set()
                    continue
                sub.ended.set()
                ended.append(sub.entry.task.id)
                self._sid_of.pop(sub.entry.task.id, None)
        self.pass_on(link.Events(tuple(events)), ended)

    def end(self, task_id: int, failed: Failed) -> None:
        self._placements.pop(task_id, None)
        self._subs.pop(self._sid_of.pop(task_id, 0), None)
        super().end(task_id, failed)


def _text(prompt: np.ndarray, router: str) -> str:
    """The prompt as text for Ray's prefix-tree router (which matches characters); '' otherwise."""
    return " ".join(map(str, prompt.tolist())) if router == "prefix-tree" else ""


async def _answer(response: Any) -> Any:
    """A Ray Serve call's answer; leaving early cancels the call there (Ray would let it run)."""
    try:
        return await response
    except anyio.get_cancelled_exc_class():
        response.cancel()
        raise
