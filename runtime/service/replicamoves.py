"""``ReplicaMoves``: KV state that moves between the replicas of a set, instead of prefill.

- **Drain** (``POST /replicas/{id}/drain``): the replica gets no new request, and each stream
  it serves moves to another replica with its KV: the stream ends there (its slot keeps prompt
  and answer so far), the slot's state is exported, imported into a free slot elsewhere, and the
  stream is resubmitted pinned to that slot, its delivered tokens part of its prompt: one token
  is decoded and it goes on. What cannot move so is resumed by replay, as after a death.
- **Pull**: a new request that the router sends away from the replica caching most of its
  prompt (that one is full) gets that replica's slot state imported into a free slot where it
  goes, when copying costs less than the prefill it saves (``--replica-pull``).

Both ride on the slots' export and import (``service.slottransfer``'s ``SlotKV``), through the
replicas' call channel; the replicas of a set share one configuration, so their states fit.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import anyio
import numpy as np
import structlog

from llamactor.protocol import enginelink as link
from llamactor.protocol.errors import NotFound
from llamactor.protocol.messages import PREFIX_HOLDER, Task
from llamactor.protocol.slots import SlotKV
from llamactor.runtime.engine.promptcache import common_prefix
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.raycluster import first_line
from llamactor.runtime.service.remote import metrics_text
from llamactor.runtime.service.replicacalls import slot_action_call
from llamactor.runtime.service.replicarequests import Move, ReplicaRequests, _Sub
from llamactor.runtime.service.routing import BLOCK, Route

log = structlog.get_logger("llamactor.replicas")

MOVE_WAIT_S = 5.0  # a drained replica ends a moving stream within this (else it is replayed)
PULL_MIN_BLOCKS = 4  # a prefix pulled from another replica: at least this many blocks (64 tokens)
PULL_COST_WEIGHT = 0.3  # weight of the newest pull in the learned cost of a pull per token
PULL_MIN_DEADLINE_S = 1.0  # a pull gives up after this, or after the prefill it saves if longer


class ReplicaMoves(ReplicaRequests):
    """Drains and pulls: streams and prefixes whose KV moves between replicas."""

    def __init__(self, config: RuntimeConfig, handle: Any, app: str) -> None:
        super().__init__(config, handle, app)
        self._importing = anyio.Lock()  # one pick of a free slot at a time: two never pick one slot
        self._pull_ms_per_token = 0.0  # a pull's measured cost per token (0 until the first pull)
        self.pulls = 0  # prefixes pulled from another replica
        self.handovers = 0  # requests handed from a prefill replica to a decode replica
        self._seen_off: set[str] = set()  # replicas Ray Serve stopped, drained here (``ReplicaSet._see_off``)
        self.moved_with_kv = 0  # streams moved off a drained or stopped replica with their KV
        self.moves_replayed = 0  # ... and those that could not move so (resumed by replay)
        self.stopped_drains: list[dict[str, Any]] = []  # their drains' reports, oldest first

    async def drain(self, replica: str) -> dict[str, Any]:
        """Send ``replica`` no more requests, and move each stream it serves to another replica
        with its KV: the stream ends there (its slot keeps prompt and answer so far), the slot's
        state is exported and imported into a free slot elsewhere, and the stream goes on in
        that slot from its next token (nothing prefilled again). A stream that cannot move so
        (several choices, images, no free slot, an export that fails) is resumed as after a
        death, by replay; a request not yet started there starts there."""
        router = self._router()
        if router is None or replica not in self._replica_ids():
            raise NotFound(f"no replica {replica!r}: GET /props lists them (engine.replicas)")
        router.draining.add(replica)
        subs = [
            s
            for s in self._subs.values()
            if s.replica == replica and not s.ended.is_set() and s.entry.task.id not in self._moves  # not moving yet
        ]
        moves = [self._moves.setdefault(s.entry.task.id, Move()) for s in subs]
        try:
            async with anyio.create_task_group() as tg:
                for sub, move in zip(subs, moves):
                    tg.start_soon(self._move, sub, move, replica)
        finally:
            for s in subs:  # one that ended before its move: nothing more to send
                if s.entry.task.id not in self.journal:
                    self._moves.pop(s.entry.task.id, None)
        with_kv = [m for m in moves if m.replica]
        self.moved_with_kv += len(with_kv)
        self.moves_replayed += len(moves) - len(with_kv)
        log.info("replica_drained", replica=replica, streams=len(moves), with_kv=len(with_kv))
        return {
            "replica": replica,
            "streams": len(moves),
            "moved_with_kv": len(with_kv),
            "replayed": len(moves) - len(with_kv),
            "history_tokens_moved": sum(m.n_tokens for m in with_kv),
        }

    def own_metrics(self) -> bytes:
        return super().own_metrics() + metrics_text(
            [
                ("llamactor:kv_pulls_total", "counter", "Prompt prefixes pulled from another replica", self.pulls),
                ("llamactor:kv_handovers_total", "counter", "Requests handed from prefill to decode", self.handovers),
                (
                    "llamactor:streams_moved_total",
                    "counter",
                    "Streams moved off a replica with their KV",
                    self.moved_with_kv,
                ),
                (
                    "llamactor:moves_replayed_total",
                    "counter",
                    "Streams off a replica resumed by replay",
                    self.moves_replayed,
                ),
            ]
        )

    async def _move(self, sub: _Sub, move: Move, source: str) -> None:
        task = sub.entry.task
        try:
            sub.lost = "its replica is drained"
            sub.scope.cancel()  # the replica ends it; its slot keeps the KV
            if task.n != 1 or task.media or task.id not in self.journal:
                return
            kv = await self._served_state(source, sub.sid)
            if kv is not None and kv.tokens:
                placed = await self._import_elsewhere(kv, source)
                if placed is not None:
                    move.replica, move.slot = placed
                    move.n_tokens = len(kv.tokens)
        except Exception as exc:  # the move is an optimisation: the replay path stays
            log.warning("stream_move_failed", task=task.id, error=first_line(exc))
        finally:
            move.done.set()

    # ---- prefill and decode apart --------------------------------------------------------

    def _roles(self) -> tuple[list[str], list[str]]:
        """(prefill replicas, decode replicas): the first ``--prefill-replicas`` of the replica
        ids in order, and the others; every replica decodes when the split is off."""
        ids = self._replica_ids()
        n = self.config.prefill_replicas
        return (ids[:n], ids[n:]) if n and len(ids) > n else ([], ids)

    def _prefill_replica(self, task: Task) -> str:
        """The prefill replica with the fewest requests in flight, for a request a decode
        replica can take over after its first token (one choice, no images, more than one token)."""
        prefill, _ = self._roles()
        router = self._router()
        if router is not None:
            prefill = [rid for rid in prefill if rid not in router.draining]  # (a drained or leaving one)
        if not prefill or task.n != 1 or task.media or task.n_predict == 1 or router is None:
            return ""
        loads = getattr(router, "loads", {})
        return min(prefill, key=lambda rid: (loads[rid].in_flight if rid in loads else 0, rid))

    def _hand_over(self, sub: _Sub, replica: str) -> None:
        """A prefill replica's part of a request ended at its first token: its slot's KV goes to a
        decode replica's free slot, and the request goes on there (``_place``, as a moved stream)."""
        move = self._moves.setdefault(sub.entry.task.id, Move())
        sub.lost = "handed to a decode replica"
        assert self._tg is not None
        self._tg.start_soon(self._carry, sub, move, replica)

    async def _carry(self, sub: _Sub, move: Move, source: str) -> None:
        try:
            kv = sub.kv  # read by the prefill replica as the request ended there
            if kv is not None and kv.tokens and sub.entry.task.id in self.journal:
                _, decode = self._roles()
                placed = await self._import_elsewhere(kv, source, among=set(decode))
                if placed is not None:
                    move.replica, move.slot = placed
                    move.n_tokens = len(kv.tokens)
                    self.handovers += 1
        except Exception as exc:  # the request is resumed by replay instead
            log.warning("handover_failed", task=sub.entry.task.id, error=first_line(exc))
        finally:
            move.done.set()

    async def _served_state(self, replica: str, sid: int) -> SlotKV | None:
        """The KV state of the slot that served submission ``sid``, once it has ended there."""
        with anyio.move_on_after(MOVE_WAIT_S):
            while True:
                slots = (await self.call(link.GetSlots, link.Slots, replica)).slots
                held = [s for s in slots if s.task == sid]
                if not held:
                    return None
                if not held[0].busy:
                    make = partial(slot_action_call, slot=held[0].id, action="export", path="", kv=None)
                    return (await self.call(make, link.SlotDone, replica)).result.kv
                await anyio.sleep(0.01)
        return None

    async def _import_elsewhere(self, kv: SlotKV, source: str, among: set[str] | None = None) -> tuple[str, int] | None:
        """Import ``kv`` into a free slot of a replica other than ``source`` (of ``among`` when
        given; the one with the most free slots, its emptiest slot): (replica, slot), or None
        when none is free. The pick and its reservation are one at a time; the imports (a
        drain's streams, several handovers) go on side by side."""
        router = self._router()
        draining = router.draining if router is not None else set()
        async with self._importing:
            free: list[tuple[int, str, list[int]]] = []
            for rid in self._replica_ids():
                if rid != source and rid not in draining and (among is None or rid in among):
                    idle = await self._idle_slots(rid)
                    if idle:
                        free.append((len(idle), rid, idle))
            if not free:
                return None
            _, rid, ids = max(free)
            self._reserved.add((rid, ids[0]))
        return await self._import_into(kv, rid, ids[0])

    async def _import_into(self, kv: SlotKV, replica: str, slot: int) -> tuple[str, int]:
        """Import ``kv`` into that slot, reserved (no other import goes there; the caller
        reserved it as it picked it) until the request pinned to it ends
        (``ReplicaRequests._place``); a failed import frees it."""
        try:
            await self.call(
                partial(slot_action_call, slot=slot, action="import", path="", kv=kv), link.SlotDone, replica
            )
        except BaseException:
            self._reserved.discard((replica, slot))
            raise
        return replica, slot

    async def _idle_slots(self, replica: str) -> list[int]:
        """The replica's free slots not reserved for an import, the emptiest first (its own numbering)."""
        slots = (await self.call(link.GetSlots, link.Slots, replica)).slots
        idle = (s for s in slots if not s.busy and s.phase == "idle" and (replica, s.id) not in self._reserved)
        return [s.id for s in sorted(idle, key=lambda s: s.n_cached)]

    # ---- a prefix pulled from the replica that holds it -----------------------------------

    async def _pull(self, task: Task, route: Route, prompt: np.ndarray) -> tuple[str, int] | None:
        """When the router sends a new request where less of its prompt is cached than on
        another replica (busy: else it would go there), and copying that replica's KV costs
        less than prefilling it (``--replica-pull auto``: the pulls' measured cost per token
        against the target's measured prefill cost), export the holder's slot, import it into a
        free slot of the target and return (target, slot) to pin the request to."""
        mode = self.config.replica_pull
        plan_pull = getattr(self._router(), "plan_pull", None)  # only the cache router knows the caches
        if (
            mode == "off"
            or self.config.prefill_replicas  # prefill replicas compute the prompts
            or plan_pull is None
            or not task.cache_prompt
            or task.media
            or task.n != 1
            or task.id_slot >= 0
        ):
            return None
        pull = plan_pull(route, PULL_MIN_BLOCKS)
        if pull is None:
            return None
        tokens = pull.blocks * BLOCK
        prefill_ms = tokens * pull.prefill_ms_per_token
        if mode == "auto" and not self._pull_ms_per_token < pull.prefill_ms_per_token:
            return None
        t0 = time.perf_counter()
        placed: tuple[str, int] | None = None
        kv: SlotKV | None = None
        try:
            # no longer than the prefill it saves: a slow or dead holder costs the request that much at most
            with anyio.move_on_after(max(PULL_MIN_DEADLINE_S, prefill_ms / 1e3)):
                want = SlotKV(tokens=tuple(prompt.tolist()), lora=task.lora)
                make = partial(slot_action_call, slot=PREFIX_HOLDER, action="export", path="", kv=want)
                kv = (await self.call(make, link.SlotDone, pull.holder)).result.kv
                # the prefix the router saw there; a sliding-window holder's state serves up to
                # its checkpoint (``window_at``), which may end a little before it
                if kv is None or kv.lora != task.lora:
                    return None
                common = common_prefix(np.asarray(kv.tokens, np.int32), prompt)
                usable = min(common, kv.window_at) if kv.window_at else common
                if usable < (PULL_MIN_BLOCKS * BLOCK if kv.window_at else tokens):
                    return None
                async with self._importing:  # the pick and its reservation
                    idle = await self._idle_slots(pull.target)
                    if idle:
                        self._reserved.add((pull.target, idle[0]))
                if idle:
                    placed = await self._import_into(kv, pull.target, idle[0])
        except Exception as exc:  # a pull is an optimisation: the request prefills instead
            log.warning("kv_pull_failed", task=task.id, holder=pull.holder, error=first_line(exc))
            return None
        if placed is None or kv is None:
            return None
        ms = (time.perf_counter() - t0) * 1e3
        per_token = ms / max(1, len(kv.tokens))
        self._pull_ms_per_token += PULL_COST_WEIGHT * (per_token - self._pull_ms_per_token) if self.pulls else per_token
        self.pulls += 1
        log.info(
            "kv_pulled", task=task.id, holder=pull.holder, target=pull.target, tokens=len(kv.tokens), ms=round(ms, 1)
        )
        return placed
